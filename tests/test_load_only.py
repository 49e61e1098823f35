"""``pallas_kernels.load_only``: the step's bytes with a trivial reduction, in interpret mode
against NumPy, its byte count against ``step_bytes``, and its lowering to Triton (no GPU)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from bench.kernel_timing import LOAD_ONLY_VARIANTS
from leapquant_jax.state import LeapQuantConfig
from pallas_kernels.leapquant_step import step_bytes
from pallas_kernels.load_only import load_only_step

from helpers import copy_tree, live_state, lower_to_triton, random_sequence, token_at
from kernel_helpers import state_shapes, traced

# Its tests share compiled programs (the same shapes and configs): one xdist worker compiles
# them once (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("load_only")


def numpy_load_only(config, st, tok):
    """The load-only kernel's reduction (its docstring) and records, in float64 numpy."""
    ck = st.checkpoint
    f = lambda x: np.asarray(x, np.float64)   # noqa: E731
    codes, scale = f(ck.residual.codes), f(ck.residual.scale)
    k, u, g = (np.array(x) for x in (st.buffer.k, st.buffer.u, st.buffer.g))
    pos = np.asarray(st.pos)
    bsz, h, p = k.shape[0], k.shape[1], config.window
    o = np.zeros(codes.shape[:2] + codes.shape[-1:])
    for i in range(bsz):
        live = slice(0, min(pos[i], p))
        for j in range(h):
            s = (np.sum(f(tok.q)[i, j] + f(tok.w)[i, j] + f(tok.b)[i, j]) + np.sum(f(tok.g)[i, j]) + f(tok.beta)[i, j]
                 + np.sum(f(ck.smooth)[i, j]) + np.sum(f(ck.comp_k)[i, j]) + np.sum(f(k[i, j, live]))
                 + np.sum(f(g[i, j, live])))
            col = (codes[i, j].sum(0) * scale[i, j] + f(ck.comp_u)[i, j].sum(0) + f(u[i, j, live]).sum(0)
                   + f(tok.v)[i, j])
            o[i, j] = col + s
        if pos[i] < p:
            k[i, :, pos[i]] = np.asarray(tok.w[i], k.dtype)
            u[i, :, pos[i]] = o[i].astype(u.dtype)
            g[i, :, pos[i]] = np.asarray(tok.g[i], g.dtype)
    return o, k, u, g


@pytest.mark.parametrize("bits, kda, chunk", [(8, False, None), (8, True, 16), (6, True, None), (4, False, 8)])
def test_load_only_kernel_matches_numpy(bits, kda, chunk):
    # bits 6: rank 6 (not a power of two, one Compensator Token row at a time) and three code planes;
    # every record slot filled, so a missing mask on a dead slot shows; pos = p reads all, writes nothing
    config = LeapQuantConfig(bits=bits, window=4)
    bsz, h, dk, dv = 3, 2, 32, 32
    st, _ = live_state(config, jax.random.PRNGKey(3), bsz, h, dk, dv, kda, [0, 2, 4], steps=config.window)
    tok = token_at(random_sequence(jax.random.PRNGKey(9), bsz, 1, h, dk, dv, kda), 0)
    want_o, want_k, want_u, want_g = numpy_load_only(config, st, tok)
    o, new = load_only_step(config, copy_tree(st), tok, chunk=chunk, interpret=True)
    np.testing.assert_allclose(np.asarray(o), want_o, rtol=1e-5, atol=1e-3)
    np.testing.assert_array_equal(np.asarray(new.pos), [1, 3, 5])
    for got, want in ((new.buffer.k, want_k), (new.buffer.g, want_g)):
        np.testing.assert_array_equal(np.asarray(got), want)
    # u's record is o rounded to fp16: the fp32 and float64 sums may straddle a rounding boundary
    np.testing.assert_allclose(np.asarray(new.buffer.u, np.float64), want_u.astype(np.float64), rtol=2 ** -10, atol=1e-3)


@pytest.mark.parametrize("kda", [False, True])
def test_load_only_kernel_moves_step_bytes(kda):
    # The bytes the kernel's operands give per head (the first pos records read, one record
    # written, the token read as fp32) are step_bytes at every window position.
    config = LeapQuantConfig(bits=8, window=4)
    bsz, h, dk, dv = 2, 2, 32, 32
    st = state_shapes(config, bsz, h, dk, dv, kda)                             # dtypes and sizes only
    ck, buf = st.checkpoint, st.buffer

    def per_head(x):
        return x.dtype.itemsize * x.size // (bsz * h)

    fixed = sum(per_head(x) for x in (ck.residual.codes, ck.residual.scale, ck.smooth, ck.comp_k, ck.comp_u))
    record = sum(per_head(x) for x in (buf.k, buf.u, buf.g)) // config.window
    token = 4 * (3 * dk + dv + (dk if kda else 1) + 1)
    for pos in range(config.window):
        assert fixed + pos * record + token + 4 + 4 * dv + record == step_bytes(config, dk, dv, pos, kda)


def test_load_only_kernel_rejects_bad_chunks_and_shared_key_records():
    # shapes only (the checks run as under jit, at trace time)
    config = LeapQuantConfig(bits=8, window=4)
    seq = random_sequence(jax.random.PRNGKey(5), 1, 1, 2, 32, 32, False)
    tok = jax.eval_shape(lambda: token_at(seq, 0))
    with pytest.raises(ValueError, match="chunk=12"):
        traced(functools.partial(load_only_step, config, chunk=12, interpret=True), state_shapes(config, 1, 2, 32, 32), tok)
    gva, tok = state_shapes(config, 1, 2, 32, 32, key_heads=1), jax.eval_shape(lambda: token_at(seq, 0, key_heads=1))
    with pytest.raises(ValueError, match="one key record per value head"):
        traced(functools.partial(load_only_step, config, interpret=True), gva, tok)


@pytest.mark.parametrize("bits, kda", [(8, False), (8, True), (6, True), (4, False)])
def test_load_only_kernel_lowers_to_triton(bits, kda):
    config = LeapQuantConfig(bits=bits, window=16)
    st = state_shapes(config, 2, 2, 128, 128, kda)
    tok = jax.eval_shape(lambda: token_at(random_sequence(jax.random.PRNGKey(0), 2, 1, 2, 128, 128, kda), 0))
    for opts in LOAD_ONLY_VARIANTS:
        f = functools.partial(load_only_step, config, interpret=False, **opts)
        lower_to_triton(f, st, tok)
