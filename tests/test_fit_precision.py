"""``bench.fit_precision``: the fit's tensor-core operands emulated and judged by the decoded-state
criterion. Each emulated product is checked against a float64 product on fresh random operands
(its error the size its operands allow), the fp32 ``product`` leaves the reference's checkpoint
as it was, and the study's rows and refusals."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import fit_precision as fp
from bench.kernel_checks import criterion_cases, reference_flush
from leapquant_jax import windowed
from leapquant_jax.state import LeapQuantConfig

from helpers import random_state, rel

CONFIG = LeapQuantConfig(bits=8, window=16)
EQ = "...kv,...kr->...vr"

# relative error of a product over 32 terms per operand format: twice the unit roundoff of its
# operands (two rounded factors per term; random errors over 32 terms of random signs stay below it)
BOUNDS = {"fp32": 1e-6, "tf32": 2 * 2.0 ** -11, "fp16": 2 * 2.0 ** -11, "fp16_bound": 2 * 2.0 ** -11,
          "bf16": 2 * 2.0 ** -8, "bf16_x3": 2 * 2.0 ** -16, "bf16_x6": 1e-6, "tf32_x3": 1e-6}


def operands(seed, scale=1.0):
    ka, kb = jax.random.split(jax.random.PRNGKey(seed))
    a = jax.random.normal(ka, (2, 3, 32, 32), jnp.float32) * scale
    b = jax.random.normal(kb, (2, 3, 32, 4), jnp.float32)
    return a, b


@pytest.mark.parametrize("name", fp.OPERANDS)
def test_each_operand_format_errs_as_its_rounding_allows(name):
    assert set(BOUNDS) == set(fp.OPERANDS)
    for seed, scale in ((0, 1.0), (1, 1e-20), (2, 1e12)):       # tiny and huge heads: fp16 scales per head
        a, b = operands(seed, scale)
        exact = np.einsum(EQ, np.asarray(a, np.float64), np.asarray(b, np.float64))
        # fp16_bound: S scaled by a bound 8 times its largest magnitude, as a loose bound would
        s_scale = None
        if name == "fp16_bound":
            s_scale = fp.MM_SCALE / (8 * jnp.max(jnp.abs(a), axis=(-2, -1), keepdims=True))
        got = np.asarray(fp.operand_product(name, s_scale)(EQ, a, b), np.float64)
        err = rel(got, exact)
        assert np.all(np.isfinite(got)) and err <= BOUNDS[name], (name, scale, err)
        if name in ("fp16", "fp16_bound", "bf16"):          # a reduced format must round: the emulation is not fp32
            assert err > 1e-6, (name, scale, err)


def test_fp32_products_leave_the_reference_flush_as_it_was():
    state = windowed.from_dense(CONFIG, random_state(jax.random.PRNGKey(4), 2, 3, 16, 16))
    state = state.replace(pos=jnp.full_like(state.pos, CONFIG.window))
    chex.assert_trees_all_equal(fp.flush_with(CONFIG, state, "fp32").checkpoint,
                                reference_flush(CONFIG, state).checkpoint)
    # another fit changes it, and U alone can be given its own operands
    assert not np.array_equal(np.asarray(fp.flush_with(CONFIG, state, "bf16").checkpoint.comp_u),
                              np.asarray(reference_flush(CONFIG, state).checkpoint.comp_u))
    u_only, ref = fp.flush_with(CONFIG, state, "fp32:bf16").checkpoint, reference_flush(CONFIG, state).checkpoint
    chex.assert_trees_all_equal(u_only.comp_k, ref.comp_k)
    assert not np.array_equal(np.asarray(u_only.comp_u), np.asarray(ref.comp_u))
    with pytest.raises(ValueError, match="knows the fit's products"):
        fp.fit_product("fp16")("ij,jk->ik", jnp.ones((2, 2)), jnp.ones((2, 2)))


def test_the_bound_holds_the_rebuilt_state():
    # state_bound is at least max |S| of the state the flush rebuilds, on every structured and
    # random head of the criterion (fp32 rounding aside), and not far above it on random heads
    for kda in (False, True):
        for case in criterion_cases(CONFIG, kda, batch=2, dk=16, dv=16):
            bound = np.asarray(fp.state_bound(CONFIG, case["state"]))[..., 0, 0]
            peak = np.abs(case["exact"]).max(axis=(-2, -1))
            assert np.all(bound >= peak * (1 - 1e-5)), (kda, case["inputs"], bound / peak)
            if case["inputs"] == "random":
                assert np.all(bound <= 100 * peak), (kda, bound / peak)
    with pytest.raises(ValueError, match="takes s_scale"):
        fp.operand_product("fp16_bound")
    with pytest.raises(ValueError, match="takes s_scale"):
        fp.operand_product("fp16", jnp.ones((1, 1, 1, 1)))


def test_study_rows_judge_each_fit_on_the_criterion_inputs():
    rows = fp.criterion_rows(CONFIG, False, ["fp32", "bf16", "fp16_bound:fp32"], batch=1, dim=16)
    inputs = ("structured", "second window", "random")
    assert [(r["impl"], r["inputs"]) for r in rows][:3] == [("fp32", i) for i in inputs]
    assert len(rows) == 9 and all(len(r["bound_over_max"]) == 3 for r in rows[6:])
    for r in rows[:3]:
        assert r["passed"] and r["worst_ratio"] == 1.0 and r["failures"] == []
    assert all(r["worst_ratio"] != 1.0 for r in rows[3:6])
    text = fp.markdown(rows, dict(date="d", jax="j", commit="c", command="cmd"))
    assert "| `fp32` | 1.0000 |" in text and "| `bf16` |" in text and "`state_bound` over" in text


@pytest.mark.parametrize("fit", ["fp8", "fp16:fp16:fp16", "", "fp16:"])
def test_unknown_operands_are_refused_by_name(fit):
    with pytest.raises(ValueError, match="OPERANDS"):
        fp.parse_fit(fit)
    with pytest.raises(SystemExit, match="bench.fit_precision: a fit is"):
        fp.main(["--fits", fit, "--bits", "8"])
