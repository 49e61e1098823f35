"""The chunkwise-parallel delta rule against the token-serial fp32 recurrence."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from leapquant_jax import dispatch
from leapquant_jax.chunked import chunk_delta_rule, unit_lower_inverse
from leapquant_jax.impls import Impl
from leapquant_jax.recurrence import recurrent_scan
from helpers import numpy_inputs, rel

# Its tests share compiled programs (the same shapes and configs): one xdist worker compiles
# them once (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("chunked")

# fp32 round-off: the cases below measured 2e-7 to 6e-7 relative (strong decays included).
TOL = 2e-6


@pytest.mark.parametrize("inter", ["serial", "associative"])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize(
    "tokens, chunk, group, dk, dv, key_heads, use_s0, lengths",
    [
        # T not a multiple of the chunk, GVA, awkward head sizes, an initial state
        (63, 16, 64, 60, 100, 2, True, None),
        # chunks of 64 (four KDA sub-chunks), two groups, padding, ragged lengths, zero state
        (130, 64, 2, 32, 24, None, False, (130, 64)),
    ],
)
def test_chunked_matches_recurrence(kda, tokens, chunk, group, dk, dv, key_heads, use_s0, lengths, inter):
    x = numpy_inputs(10 + tokens + kda, batch=2, tokens=tokens, heads=4, dk=dk, dv=dv, kda=kda, key_heads=key_heads)
    s0 = jnp.asarray(np.random.default_rng(tokens).standard_normal((2, 4, dk, dv)) * 0.3, jnp.float32) if use_s0 else None
    lens = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    run = jax.jit(lambda x, s0, lens: chunk_delta_rule(**x, initial_state=s0, lengths=lens, chunk=chunk, group=group,
                                                                     inter=inter))
    o, s = run(x, s0, lens)
    assert o.shape == x["v"].shape and o.dtype == jnp.float32
    assert s.shape == (2, 4, dk, dv) and s.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(s)))
    o_ref, s_ref = recurrent_scan(s0, **x)
    if lengths is None:
        assert rel(o, o_ref) < TOL
        assert rel(s, s_ref) < TOL
        return
    # The state after each row's own tokens only (64 is a multiple of the chunk, 130 is not), from
    # one scan of the same shape: row b's n tokens after T - n tokens that change nothing (beta = 0,
    # alpha = 1: the state stays exactly as it is).
    rows = {name: np.stack([np.concatenate([np.zeros((tokens - n,) + a.shape[2:], np.float32), np.asarray(a)[b, :n]])
                            for b, n in enumerate(lengths)]) for name, a in x.items()}
    _, s_rows = recurrent_scan(None, **rows)
    for b, n in enumerate(lengths):
        assert rel(o[b, :n], o_ref[b, :n]) < TOL
        assert rel(s[b], s_rows[b]) < TOL


def _gradients(kda, fn):
    """Gradients w.r.t. the inputs and the initial state of ``sum(o * wo) + sum(s * ws)`` for
    ``(o, s) = fn(x, s0)``, on the gradient tests' inputs (a fully decayed head, an alpha = 0.99999
    head, GVA, T = 70); returns ``(x, (gx, gs))``."""
    x = numpy_inputs(3 + kda, batch=2, tokens=70, heads=4, dk=16, dv=8, kda=kda, key_heads=2)
    rng = np.random.default_rng(9)
    s0 = jnp.asarray(rng.standard_normal((2, 4, 16, 8)) * 0.3, jnp.float32)
    wo = jnp.asarray(rng.standard_normal(x["v"].shape), jnp.float32)
    ws = jnp.asarray(rng.standard_normal(s0.shape), jnp.float32)

    def loss(x, s0):
        o, s = fn(x, s0)
        return jnp.sum(o * wo) + jnp.sum(s * ws)
    return x, jax.jit(jax.grad(loss, argnums=(0, 1)))(x, s0)


@functools.cache
def _recurrence_gradients(kda):
    """The token-serial recurrence's ``_gradients``, once per decay kind (both ``inter`` cases)."""
    return _gradients(kda, lambda x, s0: recurrent_scan(s0, **x))[1]


@pytest.mark.parametrize("inter", ["serial", "associative"])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_gradients_match_recurrence(kda, inter):
    """Gradients w.r.t. every input and the initial state, through a fully decayed head, an
    alpha = 0.99999 head, GVA and padding (T = 70 in chunks of 16, three chunks per group)."""
    x, (gx, gs) = _gradients(kda, lambda x, s0: chunk_delta_rule(**x, initial_state=s0, chunk=16, group=3,
                                                                 inter=inter))
    rx, rs = _recurrence_gradients(kda)
    for name in x:
        assert bool(jnp.all(jnp.isfinite(gx[name]))), name
        assert rel(gx[name], rx[name]) < 1e-5, name
    assert rel(gs, rs) < 1e-5
    # a fully decayed head's log-decay has no influence (its alpha is exactly 0)
    assert float(jnp.max(jnp.abs(gx["g"][:, :, 0]))) == 0.0


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize(
    "tokens, chunk, group, key_heads, use_s0, lengths",
    [
        (63, 16, 64, 2, True, None),          # padding, GVA, an initial state
        (130, 64, 2, None, False, (130, 64)),  # two groups of two chunks, padding, ragged lengths
    ],
)
def test_kernel_scan_matches_serial_form(kda, tokens, chunk, group, key_heads, use_s0, lengths):
    """``impl="triton"`` (the Pallas chunk scan, interpret mode here) against ``impl="reference"``,
    the lax.scan it replaces (itself checked against the recurrence above), on every valid token."""
    x = numpy_inputs(40 + tokens + kda, batch=2, tokens=tokens, heads=4, dk=32, dv=16, kda=kda, key_heads=key_heads)
    s0 = jnp.asarray(np.random.default_rng(tokens).standard_normal((2, 4, 32, 16)) * 0.3, jnp.float32) if use_s0 else None
    lens = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    run = jax.jit(lambda x, s0, lens, impl: chunk_delta_rule(**x, initial_state=s0, lengths=lens, chunk=chunk,
                                                             group=group, impl=impl), static_argnums=3)
    (o, s), (o_ref, s_ref) = run(x, s0, lens, "triton"), run(x, s0, lens, "reference")
    assert rel(s, s_ref) < 1e-6
    for b in range(2):
        n = tokens if lengths is None else lengths[b]
        assert rel(o[b, :n], o_ref[b, :n]) < 1e-6


def test_kernel_scan_gradients_and_reasons():
    """The kernel path differentiates through the serial form's derivative; sizes it cannot take
    are refused by name, and ``auto`` takes the reference off the GPU."""
    x = numpy_inputs(5, batch=2, tokens=40, heads=4, dk=16, dv=16, kda=True, key_heads=2)
    s0 = jnp.asarray(np.random.default_rng(2).standard_normal((2, 4, 16, 16)) * 0.3, jnp.float32)
    wo = jnp.asarray(np.random.default_rng(3).standard_normal(x["v"].shape), jnp.float32)

    def grad(impl):
        def loss(x, s0):
            o, s = chunk_delta_rule(**x, initial_state=s0, chunk=16, impl=impl)
            return jnp.sum(o * wo) + jnp.sum(s)
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, s0)

    (gk, gsk), (gs, gss) = grad("triton"), grad("reference")
    for name in x:
        assert rel(gk[name], gs[name]) < 1e-6, name
    assert rel(gsk, gss) < 1e-6
    with pytest.raises(ValueError, match="impl='triton' cannot run the chunk_scan here: dk=8"):
        chunk_delta_rule(**numpy_inputs(0, batch=1, tokens=8, heads=2, dk=8, dv=16, kda=False), impl="triton")
    with pytest.raises(ValueError, match="impl='triton' cannot run inter='associative'"):
        chunk_delta_rule(**numpy_inputs(0, batch=1, tokens=8, heads=2, dk=16, dv=16, kda=False), inter="associative",
                         impl="triton")
    if jax.default_backend() != "gpu":
        assert dispatch.resolve("chunk_scan", "auto", 128, 128, 64) is Impl.REFERENCE


def test_chunk_kernels_lower_to_triton():
    """The chunked form's kernels compile for the GPU at both precisions (the chunk scan with a
    chunk count that is not a power of two)."""
    from pallas_kernels.chunk_scan import chunk_scan
    from pallas_kernels.kda_scores import kda_pair_scores

    disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    n, r, c, dk, dv = 3, 4, 64, 128, 128
    f = jax.ShapeDtypeStruct
    args = (f((r, dk, dv), jnp.float32), f((n, r, c, dk), jnp.float32), f((n, r, c, dv), jnp.float32),
            f((n, r, c, dk), jnp.float32), f((n, r, dk), jnp.float32), f((n, r, c, dk), jnp.float32),
            f((n, r, c, c), jnp.float32))
    qkg = (f((5, c, dk), jnp.float32),) * 3
    for precision in (jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT):
        fn = jax.jit(lambda *a, precision=precision: chunk_scan(*a, precision=precision, interpret=False))
        jax.export.export(fn, platforms=["cuda"], disabled_checks=disabled)(*args)
        fn = jax.jit(lambda *a, precision=precision: kda_pair_scores(*a, precision=precision, interpret=False))
        jax.export.export(fn, platforms=["cuda"], disabled_checks=disabled)(*qkg)


@pytest.mark.parametrize("chunk, dk", [(16, 16), (64, 32)])
def test_kda_pair_scores_kernel(chunk, dk):
    """The KDA pair-score kernel (interpret mode) against the pure-JAX form and a brute-force sum,
    with fully decayed channels and tokens (log-decay -104) among ordinary decays."""
    from leapquant_jax.chunk_ops import kda_cumulative, pair_scores_kda
    from pallas_kernels.kda_scores import kda_pair_scores

    rng = np.random.default_rng(chunk + dk)
    q, k = (jnp.asarray(rng.standard_normal((3, chunk, dk)), jnp.float32) for _ in range(2))
    g = np.log(rng.uniform(0.5, 1.0, (3, chunk, dk)))
    g[0, 5, : dk // 2] = -104.0
    g[1] = -104.0
    G = jax.jit(kda_cumulative)(jnp.asarray(g, jnp.float32))
    got = kda_pair_scores(q, k, G, interpret=True)
    ref = jax.jit(pair_scores_kda, static_argnums=3)(q, k, G, jax.lax.Precision.HIGHEST)
    Gn = np.asarray(G, np.float64)
    decay = np.exp(np.minimum(Gn[:, :, None, :] - Gn[:, None, :, :], 0.0)) * np.tril(np.ones((chunk, chunk)))[..., None]
    brute = np.stack([np.sum(np.asarray(x, np.float64)[:, :, None, :] * np.asarray(k, np.float64)[:, None, :, :] * decay,
                             -1) for x in (k, q)], axis=1)
    assert bool(jnp.all(jnp.isfinite(got)))
    assert rel(got, ref) < 1e-6
    assert rel(got, brute) < 1e-6
    assert float(jnp.max(jnp.abs(jnp.triu(got, 1)))) == 0.0


def test_unit_lower_inverse_inverts():
    a = jnp.tril(jnp.asarray(np.random.default_rng(0).standard_normal((3, 32, 32)) * 0.3, jnp.float32), -1)
    inv = jax.jit(unit_lower_inverse)(a)
    np.testing.assert_allclose(inv @ (jnp.eye(32) + a), jnp.broadcast_to(jnp.eye(32), a.shape), atol=1e-5)
    assert bool(jnp.all(jnp.triu(inv, 1) == 0))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(chunk=24), "chunk must be a power of two"),
        (dict(group=0), "group must be"),
        (dict(inter="parallel"), "inter must be one of"),
        (dict(initial_state=jnp.zeros((2, 4, 8, 7))), "initial_state must be"),
        (dict(lengths=jnp.array([3], jnp.int32)), "lengths must be"),
        (dict(lengths=jnp.array([3.0, 4.0])), "lengths must be"),
        (dict(lengths=jnp.array([3, 9], jnp.int32)), r"lengths must lie in \[0, T\]"),
        (dict(beta=jnp.zeros((2, 8, 3))), "beta must be"),
    ],
)
def test_bad_arguments_are_named(change, match):
    x = numpy_inputs(0, batch=2, tokens=8, heads=4, dk=8, dv=8, kda=False)
    with pytest.raises((ValueError, TypeError), match=match):
        chunk_delta_rule(**{**x, **change})


@pytest.mark.parametrize("chunk, dk", [(32, 128), (64, 16), (128, 64)])
def test_kda_pair_scores_kernel_slices(chunk, dk):
    """The pair-score kernel at the shapes its loops split differently: two sub-chunks with ``dk``
    in several key and diagonal slices; ``dk`` a single 16-column slice; eight sub-chunks."""
    test_kda_pair_scores_kernel(chunk, dk)


@pytest.mark.parametrize("chunk, dk", [(16, 16), (32, 64)])
def test_kda_pair_scores_lower_small(chunk, dk):
    """The pair-score kernel compiles for the GPU with one and two sub-chunks, at both precisions."""
    from pallas_kernels.kda_scores import kda_pair_scores

    disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    qkg = (jax.ShapeDtypeStruct((3, chunk, dk), jnp.float32),) * 3
    for precision in (jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT):
        fn = jax.jit(lambda *a, precision=precision: kda_pair_scores(*a, precision=precision, interpret=False))
        jax.export.export(fn, platforms=["cuda"], disabled_checks=disabled)(*qkg)
