"""Fully decayed and never-decaying heads stay finite: the factorisation, the fit and long decodes.

On a GPU the Gram matrix of a fully decayed head's state (one outer product) rounds differently
than on a CPU (FMA contraction, summation order), and the margin that CholeskyQR2's diagonal
shift leaves for rounding could be eaten: a pivot below zero, then NaN through ``sqrt``. These
tests emulate that on the CPU by shrinking the shift until rounding exceeds it (and check that
the earlier factorisation, without clamped pivots, did fail there), and run the extreme heads
through the decode path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from leapquant_jax import compensators, windowed
from leapquant_jax.compensators import cholesky_qr2, gram_shift, unrolled_cholesky
from leapquant_jax.methods import make_method
from leapquant_jax.state import LeapQuantConfig
from leapquant_jax.studies.stability import extreme_decay_check
from leapquant_jax.synthetic import EXTREME_DECAYS, extreme_decay_log_decays, extreme_decay_sequence

# Its tests share compiled programs (the same shapes and configs): one xdist worker compiles
# them once (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("stability")

EMULATED_SHIFT = 1e-9   # below fp32 rounding of a Gram entry (~6e-8 relative): the margin a GPU can lose


@pytest.fixture
def lost_margin(monkeypatch):
    """CholeskyQR2 with its shift shrunk below rounding; traced functions are re-traced."""
    jax.clear_caches()
    monkeypatch.setattr(compensators, "CHOLESKY_SHIFT", EMULATED_SHIFT)
    yield
    jax.clear_caches()


def rank_deficient_columns(seed, n=512, dim=32, rank=1, cols=4):
    """``[n, dim, cols]`` columns spanning a random ``rank``-dimensional space (drawn in NumPy: no
    generator to compile)."""
    rng = np.random.default_rng(seed)
    basis = rng.standard_normal((n, dim, rank)).astype(np.float32)
    return jnp.asarray(np.einsum("ndt,ntc->ndc", basis, rng.standard_normal((n, rank, cols)).astype(np.float32)))


def unclamped_cholesky_qr2(y):
    """CholeskyQR2 as it was before pivots were clamped (the shift only): the failing baseline."""
    def one_round(a):
        gram = jnp.einsum("...nr,...ns->...rs", a, a, precision=jax.lax.Precision.HIGHEST)
        r = gram.shape[-1]
        gram = gram + gram_shift(jnp.trace(gram, axis1=-2, axis2=-1), r)[..., None, None] * jnp.eye(r)
        return jnp.swapaxes(jax.scipy.linalg.solve_triangular(
            jnp.linalg.cholesky(gram), jnp.swapaxes(a, -1, -2), lower=True), -1, -2)

    return one_round(one_round(y))


def column_norms(q):
    return np.linalg.norm(np.asarray(q), axis=-2)


def test_cholesky_pivot_of_an_indefinite_gram_is_clamped():
    # A Gram matrix that rounding left slightly indefinite: the second pivot is negative.
    gram = [[jnp.float32(1.0)], [jnp.float32(1.0), jnp.float32(1.0 - 1e-5)]]
    shift = gram_shift(jnp.float32(2.0 - 1e-5), 2)
    chol, keep = unrolled_cholesky(gram, shift)
    assert np.isfinite(float(chol[1][1])) and float(chol[1][1]) == pytest.approx(float(jnp.sqrt(shift)))
    assert bool(keep[0]) and not bool(keep[1])


@pytest.mark.parametrize("rank", [1, 2])
def test_rank_deficient_columns_come_out_orthonormal_or_short(rank):
    # ``rank`` unit columns span the space; the rest are dropped (zero) or, where rounding left a
    # sliver of a column just above the keep threshold in the first round, short and orthogonal
    # to the span: never longer than one, never NaN. A sliver's length after the second round,
    # sqrt(x / (x + 1)) with x its own part over the shift, depends on the rounding (one of these
    # 1,024 draws reaches 0.12 on an Intel Xeon CPU), so it is bounded by one, not by a fixed
    # fraction; what the fit relies on is that it adds nothing along the unit columns.
    q = np.asarray(cholesky_qr2(rank_deficient_columns(rank, rank=rank)), np.float64)
    norms = column_norms(q)
    assert np.all(np.isfinite(q))
    assert norms.max() < 1 + 1e-3
    unit = np.abs(norms - 1) < 1e-3
    assert np.all(np.sum(unit, axis=-1) == rank)
    for qi, ui in zip(q, unit):
        np.testing.assert_allclose(qi[:, ui].T @ qi[:, ui], np.eye(rank), atol=1e-5)
        assert np.all(np.abs(qi[:, ui].T @ qi[:, ~ui]) < 1e-4)


def test_lost_shift_margin_fails_unclamped_and_stays_bounded_clamped(lost_margin):
    y = rank_deficient_columns(3, rank=1)
    assert not np.all(np.isfinite(np.asarray(unclamped_cholesky_qr2(y))))     # the emulation bites
    q = cholesky_qr2(y)
    assert np.all(np.isfinite(np.asarray(q)))
    assert column_norms(q).max() < 1.1


def test_fit_of_a_rank_one_state_is_exact_and_finite(lost_margin):
    rng = np.random.default_rng(4)
    k = rng.standard_normal((64, 32)).astype(np.float32)
    u = rng.standard_normal((64, 32)).astype(np.float32) * 3.0
    s = jnp.asarray(k[:, :, None] * u[:, None, :])
    config = LeapQuantConfig(bits=8)
    ck = windowed.encode_checkpoint(config, s)
    dense = windowed.decode_checkpoint(config, ck)
    assert np.all(np.isfinite(np.asarray(dense)))
    err = np.linalg.norm(np.asarray(dense - s), axis=(1, 2)) / np.linalg.norm(np.asarray(s), axis=(1, 2))
    assert err.max() < 5e-3        # the fp16 factors carry it; the residual is rounding noise


def test_extreme_decay_inputs():
    g = extreme_decay_log_decays()
    assert g.dtype == np.float32 and g[EXTREME_DECAYS.index(0.0)] == -1e4 and g[EXTREME_DECAYS.index(1.0)] == 0
    assert g[EXTREME_DECAYS.index(1.0 - 1e-7)] < 0                  # not rounded to alpha = 1
    # the draw of the test below, with per-channel decays (the same shapes to compile)
    x = extreme_decay_sequence(jax.random.PRNGKey(0), 1, 6, dk=16, dv=16, per_channel_decay=True)
    assert x["g"].shape == (1, 6, 8, 16) and x["v"].shape == (1, 6, 8, 16)
    np.testing.assert_allclose(np.linalg.norm(np.asarray(x["k"]), axis=-1), 1.0, rtol=1e-5)


# Measured at dk = dv = 32, 192 tokens: the worst head's errors are about 6e-3 (LeapQuant 8 bits
# against fp32); the fully decayed head's about 3e-4.
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_extreme_heads_decode_finite_with_per_head_errors(kda):
    r = extreme_decay_check(make_method("leapquant"), tokens=192, chunk=96, batch=1, dk=32, dv=32,
                            per_channel_decay=kda)
    assert r["all_finite"], r["heads"]
    for head in r["heads"]:
        assert head["state_rel_error"] < 2e-2 and head["output_rel_error"] < 2e-2, head


def test_extreme_heads_decode_finite_when_the_shift_margin_is_lost(lost_margin):
    r = extreme_decay_check(make_method("leapquant"), tokens=192, chunk=96, batch=2, dk=32, dv=32)
    assert r["all_finite"], r["heads"]
    fully_decayed = r["heads"][EXTREME_DECAYS.index(0.0)]
    assert fully_decayed["state_rel_error"] < 5e-3, fully_decayed


def test_record_log_decays_are_clamped_so_minus_infinity_reads_as_zero():
    # alpha = 0 given as log-decay -inf (or below fp16's range) would make G_l - G_j = inf - inf.
    x = extreme_decay_sequence(jax.random.PRNGKey(1), 1, 6, dk=16, dv=16)
    x["g"] = jnp.where(x["g"] < -1, -jnp.inf, x["g"])
    method = make_method("leapquant", window=4)
    o, st = method.decode(method.init(1, 8, 16, 16), **x)
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(method.to_dense(st))))
    assert float(jnp.min(st.buffer.g.astype(jnp.float32))) >= windowed.RECORD_LOG_DECAY_MIN
    o_ref, _ = make_method("fp32").decode(make_method("fp32").init(1, 8, 16, 16), **x)
    h = EXTREME_DECAYS.index(0.0)
    np.testing.assert_allclose(np.asarray(o[:, :, h]), np.asarray(o_ref[:, :, h]), rtol=2e-2, atol=1e-6)
