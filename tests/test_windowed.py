"""The windowed recurrence against the dense fp32 recurrence (two oracles, tested against each other)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from leapquant_jax import make_method
from leapquant_jax.compensators import compensator_matrix, fit_subspace, fit_svd, random_start
from leapquant_jax.recurrence import recurrent_scan
from leapquant_jax.state import LeapQuantConfig
from leapquant_jax import windowed
from helpers import jit_as_served, random_inputs, rel

# Its tests share compiled programs (the same shapes and configs): one xdist worker compiles
# them once (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("windowed")

IDENTITY = dict(residual_format="fp32", record_dtype="float32", impl="reference")


def draw(kda, *, batch, tokens, heads, dv, key_heads=None):
    """The first sequences, tokens, heads and value columns of one draw ``[3, 1000, 4, ...]`` of
    16 x 16 heads: most tests here take their inputs from it (each new input spec compiles the
    generator again, for many seconds); KDA's per-channel decays (``kda``) are drawn in NumPy as
    the generator draws them, alpha uniform in its default range (0.9, 0.999).
    ``key_heads`` (GVA) keeps that many heads of q and k."""
    x = {n: np.asarray(v) for n, v in random_inputs(7, batch=3, tokens=1000, heads=4, dk=16, dv=16).items()}
    if kda:
        x["g"] = np.log(np.random.default_rng(7).uniform(0.9, 0.999, x["k"].shape)).astype(np.float32)
    x = {n: v[:batch, :tokens, :heads] for n, v in x.items()}
    x["v"] = x["v"][..., :dv]
    if key_heads is not None:
        x["q"], x["k"] = x["q"][:, :, :key_heads], x["k"][:, :, :key_heads]
    return {n: jnp.asarray(v) for n, v in x.items()}


@pytest.mark.parametrize("kda", [False, True])
def test_identity_format_matches_dense_over_1000_tokens_with_ragged_boundaries(kda):
    """Quantization off: window boundaries (anywhere, per sequence) change nothing but round-off."""
    x = draw(kda, batch=3, tokens=1000, heads=2, dv=8)
    method = make_method("leapquant", window=7, fit="svd", **IDENTITY)
    # Offset each sequence's window phase with a prefill of a different length.
    lengths = jnp.array([0, 3, 11])
    pre = {n: v[:, :11] for n, v in x.items()}
    o_pre, state = jax.jit(lambda a: method.prefill(**a, lengths=lengths))(pre)
    assert list(np.asarray(state.pos)) == [0, 3, 4]
    rest = {n: v[:, 11:] for n, v in x.items()}
    o, state = jax.jit(lambda s, a: method.decode(s, **a))(state, rest)
    # Sequence b reads its first n tokens and then token 11 on. One scan for the three: before them,
    # 11 - n tokens that change nothing (beta = 0, alpha = 1: the state stays exactly as it is).
    seq = {}
    for name, v in x.items():
        v = np.asarray(v)
        seq[name] = np.stack([np.concatenate([np.zeros((11 - n,) + v.shape[2:], np.float32), v[b, :n], v[b, 11:]])
                              for b, n in enumerate([0, 3, 11])])
    o_ref, s_ref = recurrent_scan(None, **seq)
    for b in range(3):
        assert rel(o[b], o_ref[b, 11:]) < 1e-5
        assert rel(method.to_dense(state)[b], s_ref[b]) < 1e-5


@pytest.mark.parametrize("window", [1, 4, 16])
def test_identity_windows_with_compensators_and_smoothing(window):
    x = draw(False, batch=2, tokens=70, heads=2, dv=16, key_heads=1)
    o_ref, s_ref = recurrent_scan(None, **x)
    method = make_method("leapquant", window=window, rank=3, fit="subspace", **IDENTITY)
    o, state = jax.jit(lambda a: method.decode(method.init(2, 2, 16, 16), **a))(x)
    assert rel(o, o_ref) < 1e-5
    assert rel(method.to_dense(state), s_ref) < 1e-5


def test_step_reads_match_the_state_it_represents():
    """u and o from eq. 10 equal reads of the reconstructed dense state, mid-window."""
    x = draw(True, batch=2, tokens=5, heads=2, dv=8)
    cfg = LeapQuantConfig(bits=6, window=8, impl="reference")
    method = make_method("leapquant", bits=6, window=8, impl="reference")
    dense0 = jnp.asarray(np.random.default_rng(0).standard_normal((2, 2, 16, 8)), jnp.float32)
    state = method.from_dense(dense0, per_channel_decay=True)
    step = jax.jit(lambda s, tok: method.step(s, **tok))
    reconstruct = jax.jit(lambda s: windowed.reconstruct_reference(cfg, s))
    for t in range(5):
        tok = {n: v[:, t] for n, v in x.items()}
        before = reconstruct(state)
        o, state = step(state, tok)
        after = reconstruct(state)
        alpha = jnp.exp(tok["g"])
        u = tok["beta"][..., None] * (tok["v"] - jnp.einsum("bhkv,bhk->bhv", before, alpha * tok["k"]))
        expect = alpha[..., None] * before + tok["k"][..., :, None] * u[..., None, :]
        assert rel(after, expect) < 2e-3   # records are stored in fp16
        # The token's own term is exact: o reads the state with the fp32 record.
        assert rel(o, jnp.einsum("bhkv,bhk->bhv", expect, tok["q"])) < 1e-5


def test_quantized_windowed_beats_per_step_on_long_memory():
    x = random_inputs(5, batch=2, tokens=512, heads=2, dk=32, dv=32, decay=(0.995, 0.9999))
    o_ref, s_ref = recurrent_scan(None, **x)
    errs = {}
    for name in ["int8", "int8-w", "leapquant"]:
        m = make_method(name) if name == "int8" else make_method(name, impl="reference")
        o, s = jax.jit(lambda a: m.decode(m.init(2, 2, 32, 32), **a))(x)
        errs[name] = rel(m.to_dense(s), s_ref)
    assert errs["leapquant"] < errs["int8-w"] < errs["int8"]


def test_fully_decayed_zero_and_zero_column_states_flush_finite():
    cfg = LeapQuantConfig(bits=4, window=4, impl="reference")
    dense = np.zeros((3, 2, 16, 8), np.float32)
    dense[2, :, :, :4] = np.random.default_rng(0).standard_normal((2, 16, 4))
    dense = jnp.asarray(dense)
    method = make_method("leapquant", bits=4, window=4, impl="reference")
    state = method.from_dense(dense)
    x = draw(False, batch=3, tokens=9, heads=2, dv=8)
    x["g"] = x["g"].at[0].set(-1e4)             # sequence 0: fully decayed every token
    x["v"] = x["v"].at[1].set(0.0)              # sequence 1: stays exactly zero
    o, state = jax.jit(lambda s, a: method.decode(s, **a))(state, x)
    dense_after = method.to_dense(state)
    for leaf in jax.tree_util.tree_leaves(state):
        assert np.all(np.isfinite(np.asarray(leaf, np.float32)))
    assert np.all(np.isfinite(np.asarray(o)))
    np.testing.assert_array_equal(np.asarray(dense_after[1]), 0.0)
    # Fully decayed: only the last window's records survive, and they are finite.
    assert np.all(np.isfinite(np.asarray(windowed.reconstruct_reference(cfg, state))))


def test_long_decay_over_20000_tokens_stays_finite():
    spec_x = random_inputs(11, batch=1, tokens=20000, heads=1, dk=8, dv=8, decay=(0.9999, 0.9999))
    method = make_method("leapquant", impl="reference", rank=2)
    o, state = jax.jit(lambda a: method.decode(method.init(1, 1, 8, 8), **a))(spec_x)
    assert np.all(np.isfinite(np.asarray(o)))
    _, s_ref = recurrent_scan(None, **spec_x)
    assert rel(method.to_dense(state), s_ref) < 0.05


def test_subspace_fit_recovers_a_low_rank_state():
    a, b = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 32, 4)), jnp.float32)
    low = jnp.einsum("hkr,hvr->hkv", a, b[..., :4][:, :32])
    k_svd, u_svd = fit_svd(low, 4)
    k_sub, u_sub = fit_subspace(low, 4, iters=2)
    for k, u in [(k_svd, u_svd), (k_sub, u_sub)]:
        assert rel(compensator_matrix(k, u), low) < 2e-3     # fp16 factors
    warm_k, _ = fit_subspace(low, 4, iters=1, start=k_sub)
    assert rel(compensator_matrix(warm_k, jnp.einsum("hkv,hrk->hrv", low, warm_k.astype(jnp.float32))), low) < 2e-3


def test_subspace_fit_takes_a_precomputed_first_round():
    # the split flush kernel hands over (S S^T Q_0)^T (or (S^T Q_0)^T); the fit must equal the one
    # that computes it
    s = jnp.asarray(np.random.default_rng(3).standard_normal((2, 3, 32, 16)), jnp.float32)
    q0 = random_start(32, 4, 0)
    first_z = jnp.einsum("bhkv,rk->bhrv", s, q0, precision=jax.lax.Precision.HIGHEST)
    first_y = jnp.einsum("bhkv,bhrv->bhrk", s, first_z, precision=jax.lax.Precision.HIGHEST)
    for iters in (1, 2):
        a = fit_subspace(s, 4, iters=iters)
        for given in (dict(first_z=first_z), dict(first_y=first_y)):
            b = fit_subspace(s, 4, iters=iters, **given)
            for x, y in zip(a, b):
                np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-3, atol=1e-3)


def test_cholesky_qr2_unrolled_matches_householder_qr(monkeypatch):
    # ranks above UNROLLED_RANK take Householder QR; on full-rank columns both give the same basis
    from leapquant_jax import compensators

    y = jnp.asarray(np.random.default_rng(5).standard_normal((3, 32, 6)) * [1.0, 3.0, 0.1, 2.0, 1e-3, 5.0], jnp.float32)
    unrolled = np.asarray(compensators.cholesky_qr2(y))
    monkeypatch.setattr(compensators, "UNROLLED_RANK", 0)
    householder = np.asarray(compensators.cholesky_qr2(y))
    np.testing.assert_allclose(unrolled, householder, atol=1e-5)
    np.testing.assert_allclose(np.einsum("bnr,bns->brs", unrolled, unrolled), np.broadcast_to(np.eye(6), (3, 6, 6)),
                               atol=1e-5)


def test_zero_state_fit_is_finite():
    k, u = fit_subspace(jnp.zeros((2, 16, 8)), 4)
    assert np.all(np.isfinite(np.asarray(k, np.float32))) and np.all(np.asarray(u) == 0)


def test_checkpoint_layout_and_bytes():
    method = make_method("leapquant")
    state = jax.eval_shape(lambda: method.init(2, 3, 128, 128))
    ck = state.checkpoint
    assert ck.residual.codes.shape == (2, 3, 128, 128) and ck.residual.codes.dtype == jnp.int8
    assert ck.residual.scale.shape == (2, 3, 128) and ck.smooth.shape == (2, 3, 128)
    assert ck.comp_k.shape == (2, 3, 4, 128) and ck.comp_k.dtype == jnp.float16
    from leapquant_jax.quantizers import tree_bytes
    assert tree_bytes(ck) == 2 * 3 * 19456           # docs/design.md §4: 19,456 bytes per head
    assert state.buffer.k.shape == (2, 3, 16, 128) and state.pos.shape == (2,)


def test_config_and_method_errors():
    with pytest.raises(ValueError, match="unknown method"):
        make_method("int7")
    with pytest.raises(ValueError, match="per-step"):
        make_method("int8", window=8)
    with pytest.raises(ValueError, match="bits must be"):
        make_method("leapquant", bits=5)
    with pytest.raises(ValueError, match="window"):
        make_method("leapquant", window=0)
    with pytest.raises(ValueError, match="unknown option"):
        make_method("leapquant", colour="red")
    with pytest.raises(ValueError, match="neither compensators"):
        make_method("int8-w", rank=4)
    with pytest.raises(ValueError, match="state must be"):
        make_method("leapquant").from_dense(jnp.zeros((4, 4)))


# ----------------------------------------------------------------------------- GVA: key records per key head


def _expanded(x, heads):
    """The inputs with q and k repeated to the value heads (value head j reads key head j // n)."""
    return dict(x, q=jnp.repeat(x["q"], heads // x["q"].shape[2], axis=2),
                k=jnp.repeat(x["k"], heads // x["k"].shape[2], axis=2))


@pytest.mark.parametrize("kda, key_heads", [(False, 2), (True, 2), (False, 1)], ids=["gdn", "kda", "gdn-one-key-head"])
def test_shared_key_records_equal_expanded_keys(kda, key_heads):
    """Keys stored once per key head give the numbers of keys stored once per value head, bit for
    bit: ragged window positions, several flushes, 8-bit codes, prefill and decode."""
    h, p = 4, 8
    x = draw(kda, batch=3, tokens=45, heads=h, dv=16, key_heads=key_heads)
    method = make_method("leapquant", window=p, impl="reference")
    lengths = jnp.array([0, 3, 11])
    # bit for bit holds for XLA's optimised compile, the one users run (``jit_as_served``)
    run = jit_as_served(lambda a, ln: method.prefill(**{n: v[:, :11] for n, v in a.items()}, lengths=ln))
    decode = jit_as_served(lambda s, a: method.decode(s, **{n: v[:, 11:] for n, v in a.items()}))
    outs = {}
    for name, inputs in (("shared", x), ("expanded", _expanded(x, h))):
        o_pre, state = run(inputs, lengths)
        o, state = decode(state, inputs)
        outs[name] = (o_pre, o, state)
    (pre_s, o_s, st_s), (pre_e, o_e, st_e) = outs["shared"], outs["expanded"]
    assert st_s.buffer.k.shape == (3, key_heads, p, 16) and st_e.buffer.k.shape == (3, h, p, 16)
    assert st_s.key_heads == key_heads and st_s.shape == st_e.shape == (3, h, 16, 16)
    assert list(np.asarray(st_s.pos)) == [(n + 34) % p for n in (0, 3, 11)]
    for b, n in enumerate([0, 3, 11]):   # outputs of padding positions are unspecified
        np.testing.assert_array_equal(pre_s[b, :n], pre_e[b, :n])
    np.testing.assert_array_equal(o_s, o_e)
    for a, b in zip(jax.tree_util.tree_leaves(st_s.checkpoint), jax.tree_util.tree_leaves(st_e.checkpoint)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(st_s.buffer.u, st_e.buffer.u)
    np.testing.assert_array_equal(st_s.buffer.g, st_e.buffer.g)
    # every value head's copy of a key record is its key head's record
    np.testing.assert_array_equal(jnp.repeat(st_s.buffer.k, h // key_heads, axis=1), st_e.buffer.k)
    np.testing.assert_array_equal(method.to_dense(st_s), method.to_dense(st_e))
    # and the windowed recurrence itself: sequence 2 read every token, close to the dense fp32 state
    _, s_ref = recurrent_scan(None, **x)
    assert rel(method.to_dense(st_s)[2], s_ref[2]) < 0.05


def test_shared_key_records_step_by_step_from_a_dense_state():
    # method.step with k per key head, from a rounded dense state, across a flush (window 4)
    x = draw(False, batch=2, tokens=9, heads=4, dv=8, key_heads=2)
    method = make_method("leapquant", bits=6, window=4, rank=2, impl="reference")
    dense0 = jnp.asarray(np.random.default_rng(1).standard_normal((2, 4, 16, 8)), jnp.float32)
    shared, expanded = method.from_dense(dense0, key_heads=2), method.from_dense(dense0)
    step = jax.jit(lambda s, tok: method.step(s, **tok))
    xe = _expanded(x, 4)
    for t in range(9):
        o_s, shared = step(shared, {n: v[:, t] for n, v in x.items()})
        o_e, expanded = step(expanded, {n: v[:, t] for n, v in xe.items()})
        np.testing.assert_array_equal(o_s, o_e)
    assert shared.buffer.k.shape == (2, 2, 4, 16)
    np.testing.assert_array_equal(method.to_dense(shared), method.to_dense(expanded))


def test_buffer_keeps_one_key_record_per_key_head():
    # the Qwen3.5-9B linear-attention shape: 32 value heads read 16 key heads
    from leapquant_jax.quantizers import tree_bytes

    method = make_method("leapquant")
    shared = jax.eval_shape(lambda: method.init(2, 32, 128, 128, key_heads=16))
    full = jax.eval_shape(lambda: method.init(2, 32, 128, 128))
    assert shared.buffer.k.shape == (2, 16, 16, 128) and shared.buffer.k.dtype == jnp.float16
    assert shared.buffer.u.shape == (2, 32, 16, 128) and shared.buffer.g.shape == (2, 32, 16)
    assert full.buffer.k.shape == (2, 32, 16, 128)
    assert tree_bytes(shared.checkpoint) == tree_bytes(full.checkpoint) == 2 * 32 * 19456
    # per value head: 16 fp16 records of k (4,096 B) now count once per key head, so 2,048 B fewer
    assert tree_bytes(full) - tree_bytes(shared) == 2 * 32 * 2048
    kda = jax.eval_shape(lambda: method.init(1, 4, 64, 32, per_channel_decay=True, key_heads=1))
    assert kda.buffer.k.shape == (1, 1, 16, 64) and kda.buffer.g.shape == (1, 4, 16, 64)
