"""The flush's decoded-state criterion (``bench.kernel_checks.decoded_state_row``, after the
NVlabs/kda flush requests) on the CPU: its structured heads are the edge cases they name, the
reference passes against itself with ratio 1 exactly, the interpret-mode Triton flushes pass, and
flushes that round worse fail. The compiled flushes at 128 x 128: ``test_gpu_checks``."""

from __future__ import annotations

import functools

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from bench.inputs import FLUSH_HEAD_KINDS, random_flush_state, structured_flush_state
from bench.kernel_checks import (
    CRITERION_INPUTS, criterion_cases, decoded_state_failures, decoded_state_rows, exact_decode,
    reference_flush,
)
from bench.kernel_report import decoded_state_markdown
from leapquant_jax import windowed
from leapquant_jax.compensators import compensator_matrix
from leapquant_jax.quantizers import pack_codes, safe_divisor
from leapquant_jax.state import LeapQuantConfig

from helpers import FLUSHES, rel

pytestmark = pytest.mark.xdist_group("flush_criterion")

CONFIG = LeapQuantConfig(bits=8, window=16)
BATCH, DIM = 1, 16          # the smallest heads the kernels take: the interpreted flushes cost their tracing
MODES = pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])


@functools.cache
def cases(kda):
    return criterion_cases(CONFIG, kda, batch=BATCH, dk=DIM, dv=DIM)


def head(kind):
    return FLUSH_HEAD_KINDS.index(kind)


@MODES
def test_structured_heads_are_the_named_edge_cases(kda):
    case = cases(kda)[0]
    st, S = case["state"], case["exact"]
    assert st.shape == (BATCH, len(FLUSH_HEAD_KINDS), DIM, DIM) and np.all(np.asarray(st.pos) == CONFIG.window)
    # The fp64 rebuild is the reference's reconstruction up to fp32 rounding (the decayed head's
    # log-decays near -200 hold fewer fp32 digits), on every head.
    dense = np.asarray(windowed.reconstruct_reference(CONFIG, st), np.float64)
    for i, kind in enumerate(FLUSH_HEAD_KINDS):
        assert rel(dense[:, i], S[:, i]) <= 1e-5, kind
    assert np.all(S[:, head("zero")] == 0)
    sv = {k: np.linalg.svd(S[0, head(k)], compute_uv=False) for k in ("rank1", "rank2", "rank1_noise", "hot_column")}
    assert sv["rank1"][1] <= 1e-6 * sv["rank1"][0]
    assert sv["rank2"][2] <= 1e-6 * sv["rank2"][0] < sv["rank2"][1]
    assert 0 < sv["rank1_noise"][1] <= 1e-4 * sv["rank1_noise"][0]
    assert sv["hot_column"][8] > 1e-3 * sv["hot_column"][0]                     # full rank
    mag = np.abs(S).mean(axis=(0, 2, 3))
    assert mag[head("tiny")] < 0.02 * mag[head("hot_column")] and mag[head("huge")] > 100 * mag[head("hot_column")]
    g = np.asarray(st.buffer.g, np.float64)
    assert np.all(g[:, head("decayed")].sum(axis=1) <= -200)                    # the checkpoint's decay, every channel
    assert np.all(g[:, head("never_decays"), :, :DIM // 4] == 0) if kda else np.all(g[:, head("never_decays")] == 0)
    assert np.all(g <= 0)


def test_flush_inputs_are_seeded_and_refuse_what_they_cannot_hold():
    chex.assert_trees_all_equal(structured_flush_state(CONFIG, 3, 1, DIM, DIM, True),
                                structured_flush_state(CONFIG, 3, 1, DIM, DIM, True))
    a, b = (random_flush_state(CONFIG, s, 2, 3, DIM, DIM, False) for s in (3, 4))
    assert a.shape == (2, 3, DIM, DIM) and np.any(np.asarray(a.buffer.u) != np.asarray(b.buffer.u))
    with pytest.raises(ValueError, match="integer residuals"):
        structured_flush_state(LeapQuantConfig(residual_format="bf16"), 3, 1, DIM, DIM, False)
    with pytest.raises(ValueError, match="dk, dv >= 8"):
        random_flush_state(CONFIG, 3, 1, 2, 4, DIM, False)


@MODES
def test_reference_flush_meets_the_criterion_against_itself(kda):
    rows = decoded_state_rows(CONFIG, cases(kda), reference_flush, mode="x", impl="reference")
    assert [r["inputs"] for r in rows] == list(CRITERION_INPUTS)
    for row, kinds in zip(rows, (FLUSH_HEAD_KINDS, FLUSH_HEAD_KINDS, ("random",))):
        assert row["passed"] and not decoded_state_failures(row), row
        assert row["finite"] and row["codes_in_range"] and row["worst_ratio"] == 1.0
        assert tuple(row["kinds"]) == kinds
        assert all(k["ratio"] in (None, 1.0) and (k["cap"] is None or k["cap"] <= 1) for k in row["kinds"].values())
    # The risky heads decode finite and close, and are held relative to the reference (a real residual).
    kinds = rows[0]["kinds"]
    for kind in ("decayed", "huge", "never_decays", "hot_column"):
        assert kinds[kind]["ratio"] == 1.0 and 0 < kinds[kind]["ref_err"] < 1e-2, kind
    assert kinds["zero"]["cap"] == 0.0                                          # decodes to exact zeros
    assert np.all(np.isfinite(exact_decode(CONFIG, cases(kda)[0]["reference"].checkpoint)))


@pytest.mark.parametrize("impl, kda", [("split", False), ("fused", True)], ids=["split-gdn", "fused-kda"])
def test_interpret_flushes_meet_the_criterion(impl, kda):
    for row in decoded_state_rows(CONFIG, cases(kda), FLUSHES[impl], mode="x", impl=impl):
        assert row["passed"] and not decoded_state_failures(row), row
        assert row["worst_ratio"] <= 1.01


def requantized(rounding):
    """The reference flush with its codes made again from the reconstructed state by ``rounding``."""
    def flush(config, state):
        out = reference_flush(config, state)
        ck = out.checkpoint
        dense = windowed.reconstruct_reference(config, state)
        r = (dense - compensator_matrix(ck.comp_k, ck.comp_u)) / ck.smooth[..., None]
        q = config.format.qmax
        z = jnp.clip(rounding(r / safe_divisor(ck.residual.scale)[..., None, :]), -q, q)
        codes = pack_codes((z + q + 1).astype(jnp.int32), config.bits)
        return out.replace(checkpoint=ck.replace(residual=ck.residual.replace(codes=codes)))
    return flush


def state_rounded_to_bf16(config, state):
    """The reference's encoding of the reconstructed state rounded to bf16 first."""
    dense = windowed.reconstruct_reference(config, state).astype(jnp.bfloat16).astype(jnp.float32)
    return state.replace(checkpoint=windowed.encode_checkpoint(config, dense))


@MODES
def test_criterion_rejects_flushes_that_round_worse(kda):
    # The codes made again with the reference's own rounding: the same checkpoint, ratio 1.
    same = decoded_state_rows(CONFIG, cases(kda), requantized(jnp.round), mode="x", impl="again")
    assert all(r["passed"] and r["worst_ratio"] == 1.0 for r in same)
    # Rounded toward zero (about twice the error) and the state rounded to bf16 before compression
    # (the requests' failing rows): every input set fails, named head by head.
    trunc = decoded_state_rows(CONFIG, cases(kda), requantized(jnp.trunc), mode="x", impl="toward zero")
    bf16 = decoded_state_rows(CONFIG, cases(kda), state_rounded_to_bf16, mode="x", impl="bf16 state")
    for row in trunc + bf16:
        fails = decoded_state_failures(row)
        assert not row["passed"] and fails and row["worst_ratio"] > 1.01, row
        assert all(f.startswith(row["inputs"]) for f in fails)
    assert min(r["worst_ratio"] for r in trunc) > 1.8
    assert not trunc[0]["kinds"]["huge"]["ok"] and not bf16[2]["kinds"]["random"]["ok"]
    md = "\n".join(decoded_state_markdown(same + trunc))
    assert "| x | 8 | toward zero | structured | 1 | no |" in md and "zero cap 0.00" in md
