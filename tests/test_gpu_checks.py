"""The compiled kernels against the pure-JAX reference on a GPU: ``pytest -m gpu``.

The checks of ``bench.kernels`` (``bench.kernel_checks``, the same functions and inputs), with
their pass criteria: one step and one flush from the same state at ragged window positions (8, 6,
4 and 2 bits, every width the kernels take; on Hopper the Mosaic GPU step and flush where ``auto``
takes them; beside them the Mosaic GPU step with each of its code sums, ``dot``, and the Mosaic GPU
flush with each of its reconstructions, ``recon``, and an fp32 fit at every width), the Pallas dense steps over 8
tokens, and 64 tokens at ragged window positions through ``make_method("leapquant",
impl="pallas")`` against ``impl="reference"``, and the split,
fused and Mosaic GPU flushes under the decoded-state criterion (structured, second-window and
random heads at 8, 6, 4 and 2 bits; the Mosaic GPU flush with ``fit="wgmma"`` at 8 and 4 bits),
and ``fp32-w`` on its kernels (``-k fp32w``). The normal suite deselects them (``conftest``); selected without a
GPU, they are skipped.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from bench.kernel_checks import (
    check_decoded_state, check_fp32w, check_single_ops, correctness_inputs, decoded_state_failures, dense_failures,
    dense_step_rows, fp32w_failures, ragged_failures, ragged_method_row, single_op_failures,
)
from leapquant_jax import dispatch, windowed
from leapquant_jax.impls import Impl
from leapquant_jax.state import LeapQuantConfig
from pallas_kernels import mosaic_flush, mosaic_step

from helpers import check_flush, copy_tree, live_state, rel

pytestmark = pytest.mark.gpu

MODES = pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])


def mosaic_live_state(op, config, seed, pos, kda):
    """A live state of 8 sequences x 4 heads of 128 x 128 at window positions ``pos`` and its token;
    the test skipped where the Mosaic GPU ``op`` does not run."""
    st, tok = live_state(config, jax.random.PRNGKey(seed), 8, 4, 128, 128, kda, pos=pos)
    if not dispatch.takes(op, Impl.MOSAIC, config, st):
        pytest.skip(f"the Mosaic GPU {op} runs on Hopper GPUs only")
    return st, tok


@MODES
@pytest.mark.parametrize("bits", [8, 6, 4, 2])
def test_step_and_flush_kernels_match_reference(bits, kda):
    rows = check_single_ops(lambda row: None, (bits,), (kda,))
    assert rows
    for row in rows:
        assert not single_op_failures(row), row


@MODES
@pytest.mark.parametrize("bits", [8, 6, 4, 2])
def test_mosaic_step_code_sums_match_reference(bits, kda):
    # every dot the Mosaic GPU step has at this width (wgmma: 8 bits), compiled; below 8 bits the
    # default six Compensator Tokens (a last group of four that overlaps the first)
    config = LeapQuantConfig(bits=bits, window=16)
    st, tok = mosaic_live_state("step", config, 90 + bits + kda, [0, 5, 11, 15, 3, 8, 14, 1], kda)
    o_r, n_r = windowed.step_reference(config, st, tok)
    for dot in mosaic_step.DOTS if bits == 8 else ("rows", "fma"):
        o_k, n_k = mosaic_step.leapquant_step(config, copy_tree(st), tok, dot=dot)
        assert np.all(np.isfinite(o_k)), dot
        assert rel(o_k, o_r) < 1e-5, (dot, rel(o_k, o_r))
        np.testing.assert_array_equal(n_k.buffer.k, n_r.buffer.k)
        np.testing.assert_array_equal(n_k.buffer.g, n_r.buffer.g)
        assert rel(n_k.buffer.u, n_r.buffer.u) < 1e-3, dot


@MODES
@pytest.mark.parametrize("bits", [8, 6, 4, 2])
def test_mosaic_flush_matches_reference_compiled(bits, kda):
    # every reconstruction (the low-rank part on the tensor cores, the records' part alone there, or
    # the CUDA cores) with the fit in fp32, compiled, every sequence flushed or only the full windows
    # (both walks); below 8 bits the packed codes read and written in registers and the default six
    # Compensator Tokens (check_flush: stored codes within one step of the reference's, the decoded
    # state as close to the exact one)
    config = LeapQuantConfig(bits=bits, window=16)
    st, _ = mosaic_live_state("flush", config, 95 + bits + kda, [16, 5, 11, 16, 3, 16, 14, 0], kda)
    for recon in mosaic_flush.RECONS:
        for only_full, walk in ((False, "pipeline"), (True, "pipeline"), (True, "list")):
            flush = functools.partial(mosaic_flush.leapquant_flush, recon=recon, fit="fma", walk=walk)
            check_flush(config, st, only_full=only_full, flush=flush)


@MODES
def test_dense_step_kernels_match_reference(kda):
    seq, s0 = correctness_inputs(kda)
    for row in dense_step_rows(seq, s0, "KDA" if kda else "GDN"):
        assert not dense_failures(row), row


@pytest.mark.parametrize("bits, kda", [(8, False), (8, True), (6, True), (4, False), (2, True)],
                         ids=["gdn-int8", "kda-int8", "kda-int6", "gdn-int4", "kda-int2"])
def test_method_on_kernels_matches_reference_at_ragged_positions(bits, kda):
    seq, s0 = correctness_inputs(kda)
    row = ragged_method_row(seq, s0, "KDA" if kda else "GDN", bits)
    assert not ragged_failures(row), row


@MODES
@pytest.mark.parametrize("bits", [8, 6, 4, 2])
@pytest.mark.parametrize("impl", ["split", "fused", "mosaic"])
def test_flushes_meet_the_decoded_state_criterion(impl, bits, kda):
    rows = check_decoded_state(lambda row: None, (bits,), (kda,), (impl,))
    if rows[0].get("skipped"):
        pytest.skip(rows[0]["skipped"])
    assert len(rows) == 3
    for row in rows:
        assert row["passed"] and not decoded_state_failures(row), row


@MODES
@pytest.mark.parametrize("bits", [8, 4])
def test_mosaic_flush_fit_on_the_tensor_cores_meets_the_decoded_state_criterion(bits, kda):
    # fit="wgmma" (Y = S Z as TF32 products, the default where it runs): judged, as reduced-precision
    # flushes are, by the decoded-state criterion alone (TF32 moves the basis, so codes may move more
    # than a step); test_flushes_meet_the_decoded_state_criterion runs it where it is the default
    rows = check_decoded_state(lambda row: None, (bits,), (kda,), ({"impl": "mosaic", "fit": "wgmma"},))
    assert len(rows) == 3
    for row in rows:
        assert row["passed"] and not decoded_state_failures(row), row


@MODES
def test_fp32w_kernels_match_reference_and_the_fp32_state(kda):
    rows = check_fp32w(lambda row: None, (kda,))
    assert len(rows) == 1
    for row in rows:
        assert not fp32w_failures(row), row
