"""``fp32-w``'s kernels against the reference, in interpret mode on the CPU: the Triton step reading
the fp32 checkpoint tile, the split flush's first stage written over the checkpoint, their
lowering to Triton IR, and the method on the kernels through several windows.

fp32-w rounds nothing (fp32 checkpoint, fp32 records), so kernel and reference differ only in the
order of their fp32 sums: outputs, records and rebuilt checkpoints agree to 1e-6 relative, the
key and log-decay records bit for bit, and a checkpoint the flush skips stays bit for bit.
The compiled kernels: ``pytest -m gpu -k fp32w`` (``tests/test_gpu_checks.py``).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import copy_tree, live_state, lower_to_triton, random_sequence, random_state, rel
from kernel_helpers import state_shapes, traced
from leapquant_jax import dispatch, make_method, windowed
from leapquant_jax.quantizers import FloatTensor
from leapquant_jax.recurrence import delta_rule_token
from leapquant_jax.state import LeapQuantConfig
from pallas_kernels import leapquant_flush, mosaic_flush, mosaic_step, support
from pallas_kernels.leapquant_flush import flush_bytes, flush_fused, flush_split, leapquant_flush_reference
from pallas_kernels.leapquant_step import leapquant_step, leapquant_step_reference, step_bytes

pytestmark = pytest.mark.xdist_group("kernels")

TOL = 1e-6


def config(window=8, impl="pallas") -> LeapQuantConfig:
    return make_method("fp32-w", window=window, impl=impl).config


def check_step(cfg, st, tok, **opts):
    """The step kernel against ``windowed.step_reference`` from the same state."""
    o_r, n_r = leapquant_step_reference(cfg, st, tok)
    o_k, n_k = leapquant_step(cfg, copy_tree(st), tok, interpret=True, **opts)
    assert np.all(np.isfinite(o_k))
    assert rel(o_k, o_r) < TOL
    np.testing.assert_array_equal(n_k.pos, n_r.pos)
    np.testing.assert_array_equal(n_k.buffer.k, n_r.buffer.k)
    np.testing.assert_array_equal(n_k.buffer.g, n_r.buffer.g)
    assert rel(n_k.buffer.u, n_r.buffer.u) < TOL
    chex.assert_trees_all_equal(n_k.checkpoint, st.checkpoint)        # the step writes no state
    return o_k, n_k


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("key_heads", [None, 1], ids=["heads", "gva"])
def test_step_kernel_matches_reference(kda, key_heads):
    cfg = config()
    st, tok = live_state(cfg, jax.random.PRNGKey(1 + kda), 3, 2, 32, 64, kda, pos=[0, 4, 7], key_heads=key_heads)
    assert isinstance(st.checkpoint.residual, FloatTensor)
    check_step(cfg, st, tok)


@pytest.mark.parametrize("kda, opts", [(False, {}), (True, dict(chunk=32, block_v=64, heads_per_program=2))],
                         ids=["gdn", "kda-chunks-blocks-two-heads"])
def test_step_kernel_on_a_128_tile(kda, opts):
    # the models' 128 x 128 heads, window 16, GVA (4 value heads, 2 key heads); KDA walks the key
    # rows in four chunks, two value blocks, two heads per program
    cfg = config(window=16)
    st, tok = live_state(cfg, jax.random.PRNGKey(7 + kda), 2, 4, 128, 128, kda, pos=[3, 15], key_heads=2)
    check_step(cfg, st, tok, **opts)


def test_step_kernel_fully_decayed_heads_and_zero_state():
    cfg = config()
    st, tok = live_state(cfg, jax.random.PRNGKey(3), 3, 2, 32, 64, True, pos=[5, 2, 0], log_decay=-1e3, zero=True)
    o_k, _ = check_step(cfg, st, tok)
    assert np.all(np.isfinite(o_k))


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("only_full", [False, True], ids=["all", "only-full"])
def test_flush_kernel_rebuilds_the_checkpoint_unrounded(kda, only_full):
    cfg = config()
    st, _ = live_state(cfg, jax.random.PRNGKey(5 + kda), 3, 2, 32, 64, kda, pos=[8, 4, 7], key_heads=1)
    ref = leapquant_flush_reference(cfg, st, only_full=only_full)
    for flushed in (flush_split(cfg, copy_tree(st), only_full=only_full, interpret=True),
                    dispatch.leapquant_flush(cfg, copy_tree(st), only_full=only_full)):   # impl="pallas"
        np.testing.assert_array_equal(flushed.pos, ref.pos)
        chex.assert_trees_all_equal(flushed.buffer, st.buffer)      # every slot is past pos, never read
        assert flushed.checkpoint.smooth is None and flushed.checkpoint.comp_k.shape[-2] == 0
        got, want = flushed.checkpoint.residual.values, ref.checkpoint.residual.values
        assert got.dtype == jnp.float32
        assert rel(got, want) < TOL
        flushed_rows = slice(None) if not only_full else slice(0, 1)
        assert rel(got[flushed_rows], windowed.reconstruct_reference(cfg, st)[flushed_rows]) < TOL
        if only_full:      # the sequences whose window is not full keep their checkpoint bit for bit
            np.testing.assert_array_equal(got[1:], st.checkpoint.residual.values[1:])


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_flush_kernel_on_a_128_tile(kda):
    # the step's 128 x 128 heads (GVA: 4 value heads, 2 key heads)
    cfg = config(window=16)
    st, _ = live_state(cfg, jax.random.PRNGKey(9 + kda), 2, 4, 128, 128, kda, pos=[16, 9], key_heads=2)
    got = flush_split(cfg, copy_tree(st), only_full=True, block_v=64 if kda else None, interpret=True)
    want = leapquant_flush_reference(cfg, st, only_full=True)
    assert rel(got.checkpoint.residual.values[0], want.checkpoint.residual.values[0]) < TOL
    np.testing.assert_array_equal(got.checkpoint.residual.values[1], st.checkpoint.residual.values[1])


def test_the_kernels_lower_to_triton():
    for kda in (False, True):
        cfg = config(window=16)
        st = state_shapes(cfg, 2, 4, 128, 128, kda, key_heads=2)
        tok = delta_rule_token(q=jnp.zeros((2, 2, 128)), k=jnp.zeros((2, 2, 128)), v=jnp.zeros((2, 4, 128)),
                               g=jnp.zeros((2, 4, 128) if kda else (2, 4)), beta=jnp.zeros((2, 4)), key_heads=2)
        lower_to_triton(functools.partial(leapquant_step, cfg, interpret=False), st, tok)
        lower_to_triton(functools.partial(leapquant_step, cfg, chunk=32, heads_per_program=2, interpret=False),
                        st, tok)
        lower_to_triton(functools.partial(flush_split, cfg, only_full=True, interpret=False), st)


def ragged_decode(method, state, seq, offsets):
    """``seq``'s tokens through ``method.step``, sequence ``i`` starting at step ``offsets[i]``."""
    def body(s, i):
        xs = {n: jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False) for n, x in seq.items()}
        o, s = method.step(s, **xs, active=i >= offsets)
        return s, o

    state, o = jax.lax.scan(body, state, jnp.arange(seq["q"].shape[1]))
    return jnp.moveaxis(o, 0, 1), state


@pytest.mark.parametrize("kda, key_heads", [(False, None), (True, None), (False, 1)], ids=["gdn", "kda", "gdn-gva"])
def test_method_on_the_kernels_equals_the_reference_and_the_fp32_recurrence(kda, key_heads):
    # window 4, 14 tokens, sequences starting at steps 0, 3 and 6: flushes at different steps
    seq = random_sequence(jax.random.PRNGKey(20 + kda), 3, 14, 2, 32, 32, kda)
    if key_heads is not None:
        seq = dict(seq, q=seq["q"][:, :, :key_heads], k=seq["k"][:, :, :key_heads])
    s0 = random_state(jax.random.PRNGKey(21), 3, 2, 32, 32)
    offsets = jnp.array([0, 3, 6], jnp.int32)
    runs = {}
    for impl in ("pallas", "reference"):
        m = make_method("fp32-w", window=4, impl=impl)
        st = m.from_dense(s0, per_channel_decay=kda, key_heads=key_heads)
        o, st = jax.jit(lambda st: ragged_decode(m, st, seq, offsets))(st)
        assert st.key_heads == (key_heads or 2)
        runs[impl] = (o, m.to_dense(st), st)
    fp32 = make_method("fp32", impl="reference")
    o32, s32 = jax.jit(lambda: ragged_decode(fp32, fp32.from_dense(s0), seq, offsets))()
    (o_k, d_k, st_k), (o_r, d_r, st_r) = runs["pallas"], runs["reference"]
    np.testing.assert_array_equal(st_k.pos, st_r.pos)
    assert list(np.asarray(st_k.pos)) == [14 % 4, 11 % 4, 8 % 4]
    assert np.all(np.isfinite(o_k))
    assert rel(o_k, o_r) < TOL and rel(d_k, d_r) < TOL
    assert rel(o_k, o32) < TOL and rel(d_k, fp32.to_dense(s32)) < TOL


def test_what_the_kernels_take_and_refuse_by_name():
    cfg = config()
    st = state_shapes(cfg, 2, 2, 32, 32)           # shapes only (the checks run as under jit, at trace time)
    tok = delta_rule_token(q=jnp.zeros((2, 2, 32)), k=jnp.zeros((2, 2, 32)), v=jnp.zeros((2, 2, 32)),
                           g=jnp.zeros((2, 2)), beta=jnp.zeros((2, 2)))
    assert support.unsupported_reason(cfg, st) is None
    assert dispatch.resolve("step", "pallas", cfg, st) == "triton"
    assert dispatch.resolve("flush", "pallas", cfg, st) == "split"
    assert dispatch.resolve("step", "auto", cfg, st) == "reference"      # no GPU here
    # the fused flush and the Mosaic GPU kernels read or write integer codes
    assert "fp32-w" in leapquant_flush.fused_unsupported_reason(cfg, st)
    with pytest.raises(ValueError, match="an fp32 checkpoint .fp32-w. is rebuilt by the split flush alone"):
        traced(functools.partial(flush_fused, cfg, interpret=True), st)
    with pytest.raises(ValueError, match="impl='fused' cannot run the flush here"):
        traced(functools.partial(dispatch.leapquant_flush, cfg, impl="fused"), st)
    assert "8-bit integer codes" in mosaic_step.unsupported_reason(cfg, st)
    assert "8-bit integer codes" in mosaic_flush.unsupported_reason(cfg, st)
    with pytest.raises(ValueError, match="reduce='dot' reads int8 codes; an fp32 checkpoint"):
        traced(functools.partial(leapquant_step, cfg, reduce="dot", interpret=True), st, tok)
    # an fp32 residual with Compensator Tokens or smoothing is not fp32-w: the kernels refuse it
    for options in (dict(compensators=True), dict(smoothing=True)):
        other = LeapQuantConfig(**{**dict(residual_format="fp32", compensators=False, smoothing=False,
                                          record_dtype="float32", window=8), **options})
        why = support.unsupported_reason(other, state_shapes(other, 2, 2, 32, 32))
        assert "an fp32 residual with Compensator Tokens or smoothing" in why
    bf16 = LeapQuantConfig(residual_format="bf16", compensators=False, smoothing=False, window=8)
    assert "fp32 checkpoint (fp32-w) only" in support.unsupported_reason(bf16, state_shapes(bf16, 2, 2, 32, 32))


def test_auto_on_a_gpu_takes_the_triton_step_and_split_flush_hopper_too(monkeypatch):
    from bench.decode import build_method
    from pallas_kernels import api

    method = build_method("fp32-w")         # bench.decode's and bench.serve's state: impl auto
    assert method.config.impl == "auto" and method.config == config(window=16, impl="auto")
    st = jax.eval_shape(lambda: method.init(2, 4, 128, 128, key_heads=2))
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    for hopper in (False, True):
        monkeypatch.setattr(api, "on_hopper", lambda: hopper)
        assert dispatch.resolve("step", "auto", method.config, st) == "triton"
        assert dispatch.resolve("flush", "auto", method.config, st) == "split"


def test_byte_counts_read_an_fp32_tile_without_scales():
    cfg = config(window=16)
    e, dk, dv, p = 4, 128, 128, 16
    # checkpoint, records read at pos 5, the token's q w b v g beta, the record written, the output
    want = 4 * dk * dv + 5 * e * (dv + 1) + 4 * (2 * dk + dv + 2) + e * (dv + 1) + 4 * dv + 4
    want += 5 * e * dk + 4 * dk + e * dk
    assert step_bytes(cfg, dk, dv, 5, False) == want
    # read the checkpoint and the records, write the checkpoint: no fp32 state through memory
    assert flush_bytes(cfg, dk, dv, False, "split") == 2 * 4 * dk * dv + e * p * (dv + 1 + dk) + 4
    assert flush_bytes(cfg, dk, dv, False, "split") == flush_bytes(cfg, dk, dv, False, "fused")
