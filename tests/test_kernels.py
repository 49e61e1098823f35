"""The Pallas kernels against their references, in interpret mode on the CPU.

Every check draws fresh random inputs with realistic statistics (L2-normalised keys with a
few outlier channels, decays near 1, queries carrying 1/sqrt(dk)); states come from a few
reference steps on top of a random dense state, at ragged window positions. The kernels
compute in fp32 (the step's int8-digit dots are exact integer sums of a 22-bit fixed-point
split), so single-op outputs match to ~1e-6 relative; values rounded to fp16 records or
integer codes may differ by one rounding step where the fp32 inputs differ in the last bit,
and the tests bound those by one step.

``test_kernels_lower_to_triton`` lowers every kernel to Triton IR (no GPU needed), which
catches primitives the Pallas Triton backend cannot lower; compiled runs are in ``bench/``.
The Mosaic GPU step runs in the Mosaic GPU interpreter (which simulates its shared memory,
copies and barriers, not its register layouts) and is lowered for CUDA, which checks every
layout it names.
"""

from __future__ import annotations

import functools
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from leapquant_jax import dispatch, windowed
from leapquant_jax.impls import Impl
from leapquant_jax.methods import make_method
from leapquant_jax.quantizers import INT_WIDTHS, code_parts, pack_codes, signed_codes
from leapquant_jax.recurrence import delta_rule_token, recurrent_scan
from leapquant_jax.state import LeapQuantConfig
from pallas_kernels import api, support
from pallas_kernels.dense_step import dense_step, dense_step_reference
from pallas_kernels.leapquant_flush import flush_fused, flush_split
from pallas_kernels.leapquant_step import MIN_DOT_ROWS, int8_digits, leapquant_step, leapquant_step_reference
from pallas_kernels import mosaic_step
from pallas_kernels.mosaic_shared import (
    CODE_FIELDS, FIELD_MAGIC, REDUCTION_SCRATCH, per_sm, signed_code_parts, two_per_sm,
)

from helpers import (FLUSHES, check_flush, copy_tree, expanded_state, live_state, lower_to_triton, random_sequence,
                     random_state, rel, token_at)
from kernel_helpers import check_writes_nothing_past_the_window, launch_smem, state_shapes, traced

# Its tests share compiled programs (the same shapes and configs, op by op and kernel by kernel):
# one xdist worker compiles them once (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("kernels")

INTERPRET = True
FP16_ULP = 2.0 ** -10


# ----------------------------------------------------------------------------- dense step


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_step_kernel_matches_reference(kda, dtype):
    key = jax.random.PRNGKey(hash((kda, dtype)) % 1000)
    seq = random_sequence(key, 2, 3, 2, 64, 64, kda)
    s = random_state(jax.random.fold_in(key, 1), 2, 2, 64, 64).astype(dtype)
    for i in range(3):
        o_r, s_r = dense_step_reference(s, token_at(seq, i))
        _, s32 = dense_step_reference(s.astype(jnp.float32), token_at(seq, i))  # unrounded update
        o_k, s = dense_step(jnp.copy(s), token_at(seq, i), block_v=32, interpret=INTERPRET)
        assert rel(o_k, o_r) < 1e-5
        a, b, exact = (np.asarray(x, np.float64) for x in (s, s_r, s32))
        if dtype == "float32":
            assert rel(a, b) < 1e-6
        else:  # both round the same fp32 update (equal to ~1e-7) to bf16: each within half an ulp
            for x in (a, b):
                assert np.all(np.abs(x - exact) <= 2.0 ** -8 * np.abs(exact) + 1e-6 * np.abs(exact).max())


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_dense_step_kernel_zero_state_and_full_decay(kda):
    seq = random_sequence(jax.random.PRNGKey(3), 2, 1, 2, 64, 64, kda, log_decay=-1e3)
    s = jnp.zeros((2, 2, 64, 64))
    o_k, s_k = dense_step(jnp.copy(s), token_at(seq, 0), interpret=INTERPRET)
    o_r, s_r = dense_step_reference(s, token_at(seq, 0))
    assert np.all(np.isfinite(o_k)) and np.all(np.isfinite(s_k))
    assert rel(o_k, o_r) < 1e-6 and rel(s_k, s_r) < 1e-6


def test_dense_step_rejects_bad_inputs():
    seq = random_sequence(jax.random.PRNGKey(0), 2, 1, 2, 64, 64, False)
    with pytest.raises(ValueError, match="token.v"):
        dense_step(jnp.zeros((2, 2, 64, 32)), token_at(seq, 0), interpret=INTERPRET)
    with pytest.raises(TypeError, match="states"):
        dense_step(jnp.zeros((2, 2, 64, 64), jnp.float16), token_at(seq, 0), interpret=INTERPRET)


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_per_step_methods_run_the_dense_kernel_like_the_reference(name):
    from leapquant_jax.methods import PerStepMethod, make_method

    key = jax.random.PRNGKey(11)
    seq = random_sequence(key, 3, 4, 2, 32, 64, True)
    kernel, ref = make_method(name, impl="pallas"), make_method(name, impl="reference")
    sk = sr = kernel.from_dense(random_state(jax.random.fold_in(key, 1), 3, 2, 32, 64))
    active = jnp.asarray([True, False, True])
    for i in range(4):
        ok, sk = kernel.step_token(sk, token_at(seq, i), active=active)
        orf, sr = ref.step_token(sr, token_at(seq, i), active=active)
        assert rel(ok, orf) < 1e-5
    a, b = np.asarray(kernel.to_dense(sk), np.float64), np.asarray(ref.to_dense(sr), np.float64)
    tol = 1e-6 if name == "fp32" else 2.0 ** -7  # bf16: both round one fp32 update, at most an ulp apart
    assert np.max(np.abs(a - b)) <= tol * np.abs(b).max()
    with pytest.raises(ValueError, match="takes no options"):
        make_method("int8", impl="pallas")
    with pytest.raises(ValueError, match="fp32 and bf16"):
        PerStepMethod("int8", impl="pallas")


# ----------------------------------------------------------------------------- LeapQuant step


def check_step(config, st, tok, kernel=leapquant_step, interpret=INTERPRET, **opts):
    o_r, n_r = leapquant_step_reference(config, st, tok)
    o_k, n_k = kernel(config, copy_tree(st), tok, interpret=interpret, **opts)
    assert np.all(np.isfinite(o_k))
    assert rel(o_k, o_r) < 1e-5, rel(o_k, o_r)
    np.testing.assert_array_equal(n_k.pos, n_r.pos)
    np.testing.assert_array_equal(n_k.buffer.k, n_r.buffer.k)
    np.testing.assert_array_equal(n_k.buffer.g, n_r.buffer.g)
    # u is computed in fp32 (agreeing to ~1e-7) and rounded to the record dtype: one ulp at most
    u_k, u_r = np.asarray(n_k.buffer.u, np.float64), np.asarray(n_r.buffer.u, np.float64)
    assert np.all(np.abs(u_k - u_r) <= FP16_ULP * np.abs(u_r) + 1e-7)
    chex.assert_trees_all_equal(n_k.checkpoint, n_r.checkpoint)              # the step writes no state
    return o_k, n_k


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("bits, dk", [(8, 64), (6, 64), (6, 128), (4, 64), (2, 64), (2, 128)])
def test_step_kernel_matches_reference(bits, dk, kda):
    # 6 and 2 bits at dk = 64 have 16-row code parts: the lanes sums (the dot needs 32 rows)
    config = LeapQuantConfig(bits=bits, window=8)
    st, tok = live_state(config, jax.random.PRNGKey(10 * bits + kda + dk), 3, 2, dk, 64, kda, pos=[0, 4, 7])
    check_step(config, st, tok)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("reduce, chunk", [("lanes", 16), ("dot", 32), ("dot_cols", 32)])
def test_step_kernel_reductions_and_key_chunks(reduce, chunk, kda):
    # a rolled loop over key chunks, each way of summing the code reads
    config = LeapQuantConfig(bits=8, window=8)
    st, tok = live_state(config, jax.random.PRNGKey(40 + kda), 2, 2, 64, 64, kda, pos=[2, 6])
    check_step(config, st, tok, reduce=reduce, chunk=chunk)


@pytest.mark.parametrize("bits, kda", [(8, False), (8, True), (4, True)])
def test_step_kernel_dot_orientations_agree(bits, kda):
    # the digits as the dot's left or right operand: the same int32 sums, recombined in the same
    # order, so the same outputs (each default takes one of them)
    config = LeapQuantConfig(bits=bits, window=8)
    st, tok = live_state(config, jax.random.PRNGKey(45 + bits + kda), 2, 2, 64, 64, kda, pos=[3, 7])
    o_rows, _ = check_step(config, st, tok, reduce="dot")
    o_cols, _ = check_step(config, st, tok, reduce="dot_cols")
    np.testing.assert_array_equal(o_rows, o_cols)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("opts", [dict(), dict(reduce="lanes", chunk=16, block_v=32)], ids=["whole-part", "chunks"])
def test_step_kernel_two_heads_per_program(opts, kda):
    # each program loads both heads before computing either; with chunks, the loop per head
    config = LeapQuantConfig(bits=8, window=8)
    st, tok = live_state(config, jax.random.PRNGKey(50 + kda), 2, 4, 64, 64, kda, pos=[5, 1])
    check_step(config, st, tok, heads_per_program=2, **opts)


@pytest.mark.parametrize("bits, kda", [(8, False), (8, True), (6, True)])
def test_step_kernel_two_heads_per_program_lowers_to_triton(bits, kda):
    config = LeapQuantConfig(bits=bits, window=8)
    st = state_shapes(config, 2, 2, 64, 64, kda)
    tok = token_at(random_sequence(jax.random.PRNGKey(0), 2, 1, 2, 64, 64, kda), 0)
    for opts in (dict(), dict(chunk=16, reduce="lanes")):
        f = functools.partial(leapquant_step, config, heads_per_program=2, interpret=False, **opts)
        lower_to_triton(f, st, tok)


def test_step_kernel_rejects_bad_heads_per_program():
    # shapes only (the checks run as under jit, at trace time)
    config = LeapQuantConfig(bits=8, window=4)
    st = state_shapes(config, 1, 2, 64, 64)
    tok = jax.eval_shape(lambda: token_at(random_sequence(jax.random.PRNGKey(6), 1, 1, 2, 64, 64, False), 0))
    for hp in (0, 3, 4):
        with pytest.raises(ValueError, match="heads_per_program"):
            traced(functools.partial(leapquant_step, config, heads_per_program=hp, interpret=INTERPRET), st, tok)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("bits, hp", [(8, 1), (8, 2), (4, 4)])
def test_step_kernel_with_shared_key_records(bits, hp, kda):
    # GVA: 4 value heads read 2 key heads. The program of value head j reads key head j // 2 and
    # stores the new key record there (two programs, or two heads of one, store the same row).
    config = LeapQuantConfig(bits=bits, window=8)
    st, tok = live_state(config, jax.random.PRNGKey(70 + bits + hp + kda), 3, 4, 64, 64, kda, pos=[0, 4, 7],
                         key_heads=2)
    assert st.buffer.k.shape == (3, 2, 8, 64) and tok.w.shape == (3, 2, 64)
    o_k, n_k = check_step(config, st, tok, heads_per_program=hp)
    # the same kernel on the layout without GVA (each value head its key's copy): the same numbers
    o_e, n_e = leapquant_step(config, copy_tree(expanded_state(st)), tok.replace(w=jnp.repeat(tok.w, 2, axis=1)),
                              heads_per_program=hp, interpret=INTERPRET)
    np.testing.assert_array_equal(o_k, o_e)
    np.testing.assert_array_equal(jnp.repeat(n_k.buffer.k, 2, axis=1), n_e.buffer.k)
    np.testing.assert_array_equal(n_k.buffer.u, n_e.buffer.u)


def test_step_kernel_key_groups_of_three():
    # 6 value heads over 2 key heads: one head per program reads key head j // 3; two heads per
    # program would straddle key groups and are refused
    config = LeapQuantConfig(bits=8, window=4)
    st, tok = live_state(config, jax.random.PRNGKey(77), 2, 6, 64, 64, False, pos=[1, 3], key_heads=2)
    check_step(config, st, tok)
    with pytest.raises(ValueError, match="must divide or be a multiple of the 3 value heads per key head"):
        leapquant_step(config, st, tok, heads_per_program=2, interpret=INTERPRET)
    # a key per value head cannot go into a record per key head
    with pytest.raises(ValueError, match="token.w has 6 key heads"):
        leapquant_step(config, st, tok.replace(w=jnp.repeat(tok.w, 3, axis=1)), interpret=INTERPRET)


def test_int8_digits_recombine_exactly():
    x = jnp.concatenate([jax.random.normal(jax.random.PRNGKey(0), (1000,)) * 3.0, jnp.array([0.0, 1e-30, -7.5])])
    m = jnp.max(jnp.abs(x))
    inv = 2.0 ** 22 / m
    d = [np.asarray(v) for v in int8_digits(x, inv)]
    assert all(v.min() >= -128 and v.max() <= 127 for v in d) and np.abs(d[2]).max() <= 65
    whole = d[0].astype(np.int64) + 256 * d[1].astype(np.int64) + 65536 * d[2].astype(np.int64)
    np.testing.assert_array_equal(whole, np.floor(np.asarray(x * inv, np.float64) + 0.5).astype(np.int64))
    # half a fixed-point step, plus the fp32 rounding of x * inv (an eighth of a step near 2**22)
    assert np.abs(whole / np.asarray(inv, np.float64) - np.asarray(x, np.float64)).max() <= 0.625 / float(inv)


def test_step_kernel_head_size_128_value_blocks():
    config = LeapQuantConfig(bits=8, window=4, record_dtype="bfloat16")
    st, tok = live_state(config, jax.random.PRNGKey(4), 2, 1, 128, 128, True, pos=[1, 3])
    o_r, n_r = leapquant_step_reference(config, st, tok)
    for bv in (32, 128):
        o_k, n_k = leapquant_step(config, copy_tree(st), tok, block_v=bv, interpret=INTERPRET)
        assert rel(o_k, o_r) < 1e-5
        np.testing.assert_array_equal(n_k.buffer.k, n_r.buffer.k)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_step_kernel_fully_decayed_heads_and_zero_state(kda):
    config = LeapQuantConfig(bits=8, window=8)
    st, tok = live_state(config, jax.random.PRNGKey(2), 2, 2, 64, 64, kda, pos=[3, 6], log_decay=-1e3, zero=True)
    o_k, _ = check_step(config, st, tok)
    assert np.all(np.isfinite(o_k))


def test_step_kernel_never_writes_past_the_window():
    # pos == p breaks the step's precondition (pos < p); the kernel must still write nothing
    # out of bounds, and the other sequences are unaffected.
    config = LeapQuantConfig(bits=8, window=4)
    st, tok = live_state(config, jax.random.PRNGKey(6), 2, 1, 64, 64, False, pos=[4, 2])
    check_writes_nothing_past_the_window(config, st, tok, functools.partial(leapquant_step, interpret=INTERPRET))


def test_step_kernel_rejects_mismatched_token_and_bad_options():
    config = LeapQuantConfig(bits=8, window=4)
    st, tok = live_state(config, jax.random.PRNGKey(6), 2, 1, 64, 64, False, pos=[0, 2])
    kda_tok = tok.replace(g=jnp.zeros((2, 1, 64)))
    with pytest.raises(ValueError, match="GDN"):
        leapquant_step(config, st, kda_tok, interpret=INTERPRET)
    with pytest.raises(ValueError, match="int8 mma"):
        leapquant_step(config, st, tok, reduce="dot", chunk=16, interpret=INTERPRET)
    with pytest.raises(ValueError, match="reduce"):
        leapquant_step(config, st, tok, reduce="mma", interpret=INTERPRET)
    with pytest.raises(ValueError, match="impl='chunked' is not an implementation of the flush"):
        dispatch.leapquant_flush(config, st, impl="chunked")


# ----------------------------------------------------------------------------- LeapQuant flush


@pytest.mark.parametrize("impl", ["split", "fused"])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("bits", [8, 6, 4, 2])
def test_flush_kernel_matches_reference(bits, kda, impl):
    config = LeapQuantConfig(bits=bits, window=8)
    st, _ = live_state(config, jax.random.PRNGKey(100 + 10 * bits + kda), 2, 2, 64, 64, kda, pos=[8, 5])
    check_flush(config, st, impl=impl)


@pytest.mark.parametrize("impl", ["split", "fused"])
def test_flush_kernel_rounds_two_bit_ties_as_the_reference(impl):
    # 2-bit codes are the odd integers, so a value at an even multiple of the scale is a tie, which
    # quantizers.round_codes sends up (2 floor(t / 2) + 1). Here every even key row is a tie: a
    # checkpoint of codes -3, -1, 1 there (3 in row 1: column scales 1) plus one record adding 1
    # to those rows, no decay, no Compensator Tokens or smoothing: small integers, exact in fp32 in
    # any summation order, so kernel and reference must agree code for code.
    config = LeapQuantConfig(bits=2, window=4, compensators=False, smoothing=False)
    dk = dv = 64
    rng = np.random.default_rng(5)
    z = rng.choice([-3, -1, 1, 3], (1, 1, dk, dv))
    z[..., ::2, :] = rng.choice([-3, -1, 1], (1, 1, dk // 2, dv))
    z[..., 1, :] = 3
    st = windowed.from_dense(config, jnp.asarray(z, jnp.float32))
    np.testing.assert_array_equal(config.format.integer_values(st.checkpoint.residual), z)
    k = np.zeros(st.buffer.k.shape, np.float32)
    k[..., 0, ::2] = 1.0
    u = np.zeros(st.buffer.u.shape, np.float32)
    u[..., 0, :] = 1.0
    st = st.replace(buffer=st.buffer.replace(k=jnp.asarray(k, st.buffer.k.dtype), u=jnp.asarray(u, st.buffer.u.dtype)),
                    pos=jnp.ones((1,), jnp.int32))
    ker, ref = check_flush(config, st, impl=impl)
    expected = z.copy()
    expected[..., ::2, :] += 2                              # t = z + 1, even: up to z + 2
    np.testing.assert_array_equal(config.format.integer_values(ref.checkpoint.residual), expected)
    chex.assert_trees_all_equal(ker.checkpoint, ref.checkpoint)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("impl", ["split", "fused"])
def test_flush_kernel_window_16_head_128(impl, kda):
    # p >= 16: the split flush's records term is one dot; warm start from the old K
    config = LeapQuantConfig(bits=8, window=16, warm_start=True)
    st, _ = live_state(config, jax.random.PRNGKey(60 + kda), 2, 1, 128, 128, kda, pos=[16, 9])
    check_flush(config, st, impl=impl)


@pytest.mark.parametrize("pos", [[4, 1, 4, 2, 3], [4, 1, 0, 2, 3]], ids=["split-branch", "fused-branch"])
@pytest.mark.parametrize("impl", ["auto", "split", "fused"])
def test_flush_kernel_only_full_windows(impl, pos):
    # auto takes the split flush when enough windows are full (2 of 5 here), else the fused one
    # (1 of 5, below dispatch.MIN_FULL_FRACTION)
    config = LeapQuantConfig(bits=8, window=4, warm_start=True)
    st, _ = live_state(config, jax.random.PRNGKey(7), 5, 2, 64, 64, False, pos=pos)
    ker, ref = check_flush(config, st, only_full=True, impl=impl)
    second = lambda tree: jax.tree_util.tree_map(lambda x: x[1], tree)   # noqa: E731
    chex.assert_trees_all_equal(second(ker), second(st))                      # a partial window is untouched


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_flush_kernel_fully_decayed_heads_and_zero_state(kda):
    config = LeapQuantConfig(bits=8, window=4)
    st, _ = live_state(config, jax.random.PRNGKey(8), 2, 1, 64, 64, kda, pos=[4, 2], log_decay=-1e3, zero=True)
    # Only the newest record survives: a rank-1 state that the Compensator Tokens take whole,
    # leaving a residual of rounding noise (~1e-13) whose codes are arbitrary in both.
    check_flush(config, st, codes_agree=False)
    st = windowed.init_state(config, 2, 1, 64, 64, kda)                        # all zero: zero codes, no NaN
    ker = FLUSHES["auto"](config, copy_tree(st))
    assert np.all(np.asarray(windowed.decode_checkpoint(config, ker.checkpoint)) == 0)


@pytest.mark.parametrize("impl", ["split", "fused"])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_flush_kernel_with_shared_key_records(kda, impl):
    # GVA: the flush program of value head j reads the key records of key head j // 2
    config = LeapQuantConfig(bits=8, window=8)
    st, _ = live_state(config, jax.random.PRNGKey(80 + kda), 2, 4, 64, 64, kda, pos=[8, 5], key_heads=2)
    ker, _ = check_flush(config, st, impl=impl)
    ker_e = FLUSHES[impl](config, copy_tree(expanded_state(st)))
    chex.assert_trees_all_equal(ker.checkpoint, ker_e.checkpoint)


@pytest.mark.parametrize("impl", ["split", "fused"])
def test_flush_kernel_head_size_128_options(impl):
    config = LeapQuantConfig(bits=8, window=4, rank=2, fit_iters=2, smoothing=False)
    st, _ = live_state(config, jax.random.PRNGKey(9), 1, 1, 128, 128, False, pos=[4])
    check_flush(config, st, impl=impl)


@pytest.mark.parametrize("options, kda", [(dict(compensators=False), False), (dict(window=32, bits=4), True),
                                          (dict(compensators=False, smoothing=False), True)],
                         ids=["no-compensators", "window-32-int4-kda", "no-compensators-no-smoothing-kda"])
def test_flush_kernel_other_configs(options, kda):
    config = LeapQuantConfig(**options)
    p = config.window
    st, _ = live_state(config, jax.random.PRNGKey(11), 2, 1, 64, 64, kda, pos=[p, p // 2 - 1])
    check_flush(config, st, impl="split")


# ----------------------------------------------------------------------------- through the method


@pytest.mark.parametrize("kda, key_heads", [(False, None), (True, None), (False, 1)], ids=["gdn", "kda", "gdn-gva"])
def test_method_pallas_matches_reference_through_flushes(kda, key_heads):
    # window 4, 10 tokens: two flushes in the middle of the run; GVA: 2 value heads, 1 key head
    seq = random_sequence(jax.random.PRNGKey(20 + kda), 2, 10, 2, 64, 64, kda)
    if key_heads is not None:
        seq = dict(seq, q=seq["q"][:, :, :key_heads], k=seq["k"][:, :, :key_heads])
    s0 = random_state(jax.random.PRNGKey(21), 2, 2, 64, 64)
    outs = {}
    for impl in ("pallas", "reference"):
        m = make_method("leapquant", bits=8, window=4, impl=impl)
        o, st = m.decode(m.from_dense(s0, per_channel_decay=kda, key_heads=key_heads), **seq)
        assert st.key_heads == (key_heads or 2)
        outs[impl] = (o, m.to_dense(st))
    o_exact, s_exact = recurrent_scan(s0, **seq)
    o_k, o_r = outs["pallas"][0], outs["reference"][0]
    assert np.all(np.isfinite(o_k))
    assert rel(o_k, o_r) < 1e-3
    assert rel(o_k, o_exact) <= 1.5 * rel(o_r, o_exact)
    assert rel(outs["pallas"][1], s_exact) <= 1.5 * rel(outs["reference"][1], s_exact)


# ----------------------------------------------------------------------------- support and lowering


@pytest.mark.parametrize(
    "options, dk, words",
    [
        (dict(fit="svd"), 64, "subspace"),
        (dict(residual_format="bf16", compensators=False, smoothing=False), 64, "integer"),
        (dict(window=12), 64, "power of two"),
        (dict(rank=9), 64, "at most"),
        (dict(), 96, "head sizes"),
    ],
)
def test_unsupported_reason_names_the_limit(options, dk, words):
    config = LeapQuantConfig(**options)
    st = state_shapes(config, 1, 1, dk, 64)
    why = support.unsupported_reason(config, st)
    assert why is not None and words in why
    m = make_method("leapquant", impl="pallas", **options)
    seq = random_sequence(jax.random.PRNGKey(0), 1, 1, 1, dk, 64, False)
    with pytest.raises(ValueError, match="cannot run"):
        traced(lambda s: m.step(s, **{n: x[:, 0] for n, x in seq.items()}), jax.eval_shape(lambda: m.init(1, 1, dk, 64)))


def test_byte_counts_share_key_bytes_within_a_key_group():
    # GVA: the live key records, the token's key and the written key record count once per key
    # head, half of them per value head when two value heads share a key head
    from pallas_kernels.leapquant_flush import flush_bytes
    from pallas_kernels.leapquant_step import step_bytes

    config = LeapQuantConfig(bits=8, window=16)
    dk, dv, e = 128, 128, 2
    for kda in (False, True):
        for pos in (0, 7, 15):
            keys = pos * e * dk + 4 * dk + e * dk
            assert step_bytes(config, dk, dv, pos, kda) - step_bytes(config, dk, dv, pos, kda, group=2) == keys // 2
            assert step_bytes(config, dk, dv, pos, kda, group=3) == pytest.approx(
                step_bytes(config, dk, dv, pos, kda) - 2 * keys / 3, rel=1e-12)
        for impl in ("split", "fused"):
            assert (flush_bytes(config, dk, dv, kda, impl) - flush_bytes(config, dk, dv, kda, impl, group=2)
                    == e * 16 * dk // 2)


def test_supported_configs_have_no_reason():
    for bits in INT_WIDTHS:
        for kda in (False, True):
            config = LeapQuantConfig(bits=bits)
            assert support.unsupported_reason(config, state_shapes(config, 2, 2, 64, 128, kda)) is None


def test_two_bit_codes_need_16_row_parts_and_run_on_the_mosaic_kernels(monkeypatch):
    # 2 bits: four code parts of dk / 4 rows, each at least a Triton dot's 16 (dk = 64, not 32);
    # the Mosaic GPU step reads them and the Mosaic GPU flush writes them, so auto takes both on
    # Hopper at 128 x 128 heads
    config = LeapQuantConfig(bits=2, window=8)
    why = support.unsupported_reason(config, state_shapes(config, 1, 1, 32, 64))
    assert why is not None and "dk=32 at 2 bits" in why and "16 rows" in why
    st = state_shapes(config, 4, 2, 128, 128)
    assert dispatch.resolve("step", "mosaic", config, st) is Impl.MOSAIC
    assert dispatch.resolve("flush", "mosaic", config, st) is Impl.MOSAIC
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(api, "on_hopper", lambda: True)
    c8 = LeapQuantConfig(bits=8, window=8)
    assert dispatch.resolve("step", "auto", c8, state_shapes(c8, 4, 2, 128, 128)) is Impl.MOSAIC
    assert dispatch.resolve("step", "auto", config, st) is Impl.MOSAIC
    assert dispatch.resolve("flush", "auto", config, st) is Impl.MOSAIC


@pytest.mark.parametrize("bits, kda, dk", [(8, False, 64), (8, True, 64), (6, True, 64), (4, False, 64),
                                           (2, True, 128)])
def test_kernels_lower_to_triton(bits, kda, dk):
    config = LeapQuantConfig(bits=bits, window=8)
    st = state_shapes(config, 2, 2, dk, 64, kda)
    tok = token_at(random_sequence(jax.random.PRNGKey(0), 2, 1, 2, dk, 64, kda), 0)

    lower_to_triton(functools.partial(leapquant_step, config, interpret=False), st, tok)
    # code parts of 16 rows (6 bits at dk = 64): too few for the int8 mma (the lanes sums only)
    for reduce in ("lanes",) if dk // code_parts(bits) < MIN_DOT_ROWS else ("dot", "dot_cols", "lanes"):
        lower_to_triton(functools.partial(leapquant_step, config, reduce=reduce, interpret=False), st, tok)
    for flush in (flush_split, flush_fused):
        lower_to_triton(functools.partial(flush, config, only_full=True, interpret=False), st)
    lower_to_triton(functools.partial(dense_step, interpret=False), jnp.zeros((2, 2, dk, 64), jnp.bfloat16), tok)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_kernels_with_shared_key_records_lower_to_triton(kda):
    # GVA: the key side's index maps (one key head per program, and two value heads of one key
    # head in a program) and the flushes' key-record specs lower as the one-head kernels do
    config = LeapQuantConfig(bits=8, window=8)
    st = state_shapes(config, 2, 4, 64, 64, kda, key_heads=2)
    tok = token_at(random_sequence(jax.random.PRNGKey(0), 2, 1, 4, 64, 64, kda), 0, key_heads=2)

    for hp in (1, 2, 4):
        lower_to_triton(functools.partial(leapquant_step, config, heads_per_program=hp, interpret=False), st, tok)
    for flush in (flush_split, flush_fused):
        lower_to_triton(functools.partial(flush, config, only_full=True, interpret=False), st)


def test_method_pallas_eager_step_with_active_mask():
    # Outside jit: the kernels must not consume the caller's state (the method reads it again
    # to keep inactive sequences).
    seq = random_sequence(jax.random.PRNGKey(30), 2, 1, 1, 64, 64, False)
    xs = {n: x[:, 0] for n, x in seq.items()}
    s0 = random_state(jax.random.PRNGKey(31), 2, 1, 64, 64)
    active = jnp.array([True, False])
    out = {}
    for impl in ("pallas", "reference"):
        m = make_method("leapquant", bits=8, window=4, impl=impl)
        st = m.from_dense(s0)
        o, new = m.step(st, **xs, active=active)
        out[impl] = (o, new, st)
    assert rel(out["pallas"][0], out["reference"][0]) < 1e-5
    np.testing.assert_array_equal(out["pallas"][1].pos, [1, 0])
    np.testing.assert_array_equal(out["pallas"][2].pos, [0, 0])             # the input is still usable


def test_the_kernels_package_imports_one_way():
    # Every import of every module (function bodies included): no kernel module reaches back to
    # `api`, and the package's own import graph has no cycle.
    import ast

    folder = Path(__file__).resolve().parents[1] / "pallas_kernels"
    graph = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    deps.update([node.module] if node.module else [a.name for a in node.names])
                elif node.module and node.module.startswith("pallas_kernels"):
                    deps.add(node.module.split(".", 1)[1] if "." in node.module else "__init__")
        graph[path.stem] = deps & {p.stem for p in folder.glob("*.py")}
    assert not any("api" in deps for name, deps in graph.items() if name != "__init__"), graph
    done = set()

    def visit(name, trail):
        assert name not in trail, f"import cycle: {' -> '.join(trail + [name])}"
        if name in done:
            return
        for dep in graph.get(name, ()):
            visit(dep, trail + [name])
        done.add(name)

    for name in graph:
        visit(name, [])


# ----------------------------------------------------------------------------- Mosaic GPU step


@pytest.mark.parametrize("bsz, h, key_heads, opts, dot, kda", [
    (6, 4, None, dict(), "wgmma", False),      # the last program's heads past B H repeat and store nothing
    (6, 4, None, dict(), "fma", False),
    (6, 4, None, dict(), "rows", False),
    (4, 4, 2, dict(record_dtype="bfloat16"), "wgmma", False),       # GVA: one key record per key head
    (2, 4, None, dict(compensators=False, smoothing=False), "wgmma", False),
    (5, 3, None, dict(), "wgmma", True),       # KDA: per-channel decays made in the kernel; B H = 15
    (3, 4, None, dict(window=4), "fma", True),        # KDA takes windows whose log-decays fill no 128-byte copy
    (3, 4, None, dict(), "rows", True),
    (4, 4, 2, dict(record_dtype="bfloat16", smoothing=False), "wgmma", True),
], ids=["ragged-programs", "ragged-programs-fma", "ragged-programs-rows", "gva-bf16", "no-ct-no-smoothing", "kda",
        "kda-fma", "kda-rows", "kda-gva-bf16"])
def test_mosaic_step_matches_reference(bsz, h, key_heads, opts, dot, kda):
    config = LeapQuantConfig(bits=8, **{"window": 8, **opts})
    p = config.window
    pos = [(3 * b + 1) % p for b in range(bsz - 1)] + [p - 1]       # ragged, one at the last slot
    st, tok = live_state(config, jax.random.PRNGKey(bsz), bsz, h, 128, 128, kda, pos=pos, key_heads=key_heads)
    check_step(config, st, tok, kernel=mosaic_step.leapquant_step, interpret=None, programs=2, stages=2, dot=dot)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_mosaic_step_code_chunks_fully_decayed_heads_and_window_end(kda):
    config = LeapQuantConfig(bits=8, window=8)
    st, tok = live_state(config, jax.random.PRNGKey(8), 2, 4, 128, 128, kda, pos=[5, 2], log_decay=-1e3, zero=True)
    for opts in (dict(dot="fma", chunk=16), dict(dot="rows"), dict(dot="wgmma"), dict(dot="rows", slot_copy=4 if kda else 8)):
        o_k, _ = check_step(config, st, tok, kernel=mosaic_step.leapquant_step, interpret=None, **opts)
        assert np.all(np.isfinite(o_k))
    # pos == p breaks the step's precondition: that sequence writes nothing, the others are unaffected.
    st, tok = live_state(config, jax.random.PRNGKey(9), 2, 4, 128, 128, kda, pos=[8, 3])
    check_writes_nothing_past_the_window(config, st, tok, mosaic_step.leapquant_step)


def test_signed_code_parts_match_the_packed_layout():
    # every field of random packed bytes (and the 8-bit codes as they are), as quantizers packs and signs them
    for bits in (8, 4, 6, 2):
        u = jax.random.randint(jax.random.PRNGKey(bits), (128, 128), 0, 2 ** bits)
        packed = pack_codes(u, bits)
        rows = 128 // code_parts(bits)
        planes = [packed[c * rows:(c + 1) * rows] for c in range(packed.shape[0] // rows)]
        parts = signed_code_parts(planes, bits)
        assert all(z.dtype == jnp.float32 for z in parts)
        np.testing.assert_array_equal(jnp.concatenate(parts), signed_codes(u, bits).astype(jnp.float32))
        # the compiled path shifts whole 32-bit words: no bit of the next byte may reach a field
        for pieces, mult, offset in CODE_FIELDS[bits]:
            assert all(mask <= 0xFF >> shift for _, _, shift, mask in pieces)
            assert offset < 2 ** 23 and mult in (1, 2)     # every step of mult u - offset exact in fp32
    assert mosaic_step.token_row_groups(0) == []
    assert mosaic_step.token_row_groups(8) == [(0, 0), (4, 0)]
    assert mosaic_step.token_row_groups(6) == [(0, 0), (2, 2)]
    assert mosaic_step.token_row_groups(5) == [(0, 0), (1, 3)]


@pytest.mark.parametrize("bits", [8, 6, 4, 2])
def test_code_tile_loads_and_stores_the_planar_layout(bits):
    """``shared.load_code_tile`` gives the signed codes in key-row order (``quantizers``' layout)
    and ``store_code_tile`` packs them back to the same bytes, interpreted and lowered to Triton."""
    from jax.experimental import pallas as pl
    from pallas_kernels._compat import compiler_params
    from pallas_kernels.shared import load_code_tile, store_code_tile

    dk, dv = 128, 64
    unsigned = jax.random.randint(jax.random.PRNGKey(bits), (dk, dv), 0, 2 ** bits)
    codes = signed_codes(unsigned, bits)
    packed = pack_codes(unsigned, bits)

    def kernel(c_ref, z_ref, o_ref):
        z = load_code_tile(c_ref, bits, dk)
        z_ref[...] = z
        store_code_tile(o_ref, z.astype(jnp.int32), bits, dk)

    def run(x, interpret):
        return pl.pallas_call(kernel, out_shape=[jax.ShapeDtypeStruct((dk, dv), jnp.float32),
                                                 jax.ShapeDtypeStruct(x.shape, x.dtype)],
                              interpret=interpret, compiler_params=compiler_params(num_warps=4))(x)

    z, again = run(packed, True)
    np.testing.assert_array_equal(np.asarray(z), np.asarray(codes, np.float32))
    np.testing.assert_array_equal(np.asarray(again), np.asarray(packed))
    lower_to_triton(functools.partial(run, interpret=False), packed)


def test_code_fields_on_whole_words_as_the_gpu_runs_them():
    # The compiled path's arithmetic on numpy words: each thread's four bytes of a plane as one
    # uint32, the fields' xor / shift / mask / or on the whole word, then per byte prmt's
    # 0x4B0000uu read as fp32 (2**23 + u), less 2**23 + offset (at 2 bits: u, then 2 u - 3), in fp32.
    for bits in (8, 6, 4, 2):
        u = jax.random.randint(jax.random.PRNGKey(40 + bits), (128, 128), 0, 2 ** bits)
        packed = np.asarray(pack_codes(u, bits)).view(np.uint8)
        rows = 128 // code_parts(bits)
        words = [np.ascontiguousarray(packed[c * rows:(c + 1) * rows]).view("<u4")
                 for c in range(packed.shape[0] // rows)]
        parts = []
        for pieces, mult, offset in CODE_FIELDS[bits]:
            w = np.zeros_like(words[0])
            for c, xor, shift, mask in pieces:
                w |= ((words[c] ^ np.uint32(xor * 0x01010101)) >> np.uint32(shift)) & np.uint32(mask * 0x01010101)
            byte = np.stack([(w >> np.uint32(8 * b)) & np.uint32(0xFF) for b in range(4)], axis=-1).reshape(rows, 128)
            f = (np.uint32(FIELD_MAGIC) | byte).view(np.float32)
            if mult == 1:
                parts.append(f - np.float32(2 ** 23 + offset))
            else:
                parts.append((f - np.float32(2 ** 23)) * np.float32(mult) - np.float32(offset))
        np.testing.assert_array_equal(np.concatenate(parts), np.asarray(signed_codes(u, bits), np.float32))


@pytest.mark.parametrize("bits, kda, dot, opts", [
    (4, False, "rows", dict()),
    (4, False, "fma", dict()),
    (4, True, "rows", dict(stages=None)),     # default_stages: three heads in flight
    (4, True, "fma", dict(chunk=16)),         # four reads of each part's 64 rows
    (6, False, "fma", dict()),
    (6, True, "rows", dict()),
    (2, False, "rows", dict()),
    (2, True, "fma", dict()),
    (4, False, "rows", dict(config=dict(compensators=False, smoothing=False))),
    (8, False, "rows", dict(config=dict(rank=5))),   # the tokens' last group skips three rows
], ids=["int4-rows", "int4-fma", "int4-kda-rows", "int4-kda-fma-chunks", "int6-fma", "int6-kda-rows", "int2-rows",
        "int2-kda-fma", "int4-no-ct-no-smoothing", "int8-rank5"])
def test_mosaic_step_packed_codes_and_six_tokens_match_reference(bits, kda, dot, opts):
    # below 8 bits the default rank is 6: the tokens' last group of four overlaps the first
    opts = dict(opts)
    config = LeapQuantConfig(bits=bits, **{"window": 8, **opts.pop("config", {})})
    bsz = 3 if kda else 4                    # GDN: B H a multiple of log_decay_heads
    pos = [(3 * b + 2) % 8 for b in range(bsz - 1)] + [7]
    st, tok = live_state(config, jax.random.PRNGKey(70 + 4 * bits + kda), bsz, 2, 128, 128, kda, pos=pos)
    assert mosaic_step.unsupported_reason(config, st) is None
    stages = opts.pop("stages", 2)
    check_step(config, st, tok, kernel=mosaic_step.leapquant_step, interpret=None, programs=2, stages=stages, dot=dot,
               **opts)


def test_the_mosaic_step_through_dispatch():
    # impl="mosaic" through the front door: the Mosaic GPU step, interpreted here (which kernel
    # auto takes where: test_dispatch)
    config = LeapQuantConfig(bits=8, window=8)
    st, tok = live_state(config, jax.random.PRNGKey(12), 2, 4, 128, 128, False, pos=[3, 6])
    o_a, a = dispatch.leapquant_step(config, copy_tree(st), tok, impl="mosaic")
    o_b, b = mosaic_step.leapquant_step(config, copy_tree(st), tok)
    np.testing.assert_array_equal(o_a, o_b)
    chex.assert_trees_all_equal(a, b)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("bits", [8, 6, 4, 2])
def test_mosaic_step_lowers_for_cuda(bits, kda):
    # Lowering builds the Mosaic GPU module: every register layout and copy the kernel names is
    # checked here, without a GPU. Only the buffer's three arrays and the output are written. The
    # shared memory the launch asks for is what mosaic_step.smem_bytes counts (default_stages
    # relies on it).
    from jax import export

    config = LeapQuantConfig(bits=bits, window=16)
    st = state_shapes(config, 4, 4, 128, 128, kda, key_heads=2)
    tok = delta_rule_token(q=jnp.zeros((4, 2, 128)), k=jnp.zeros((4, 2, 128)), v=jnp.zeros((4, 4, 128)),
                           g=jnp.zeros((4, 4, 128) if kda else (4, 4)), beta=jnp.zeros((4, 4)), key_heads=2)
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (st, tok))
    taken = mosaic_step.default_stages(config, kda, 8)
    other = 2 if taken == mosaic_step.MAX_STAGES else mosaic_step.MAX_STAGES    # the count default_stages did not take
    launches = [(dot, None) for dot in (mosaic_step.DOTS if bits == 8 else ("rows", "fma"))] + [("rows", other)]
    with launch_smem() as sizes:
        for dot, stages in launches:
            f = jax.jit(lambda s, t: mosaic_step.leapquant_step(config, s, t, programs=2, stages=stages, dot=dot,
                                                                interpret=False))
            text = export.export(f, platforms=["cuda"])(*shapes).mlir_module()
            assert "mosaic_gpu" in text
            assert text.count("stablehlo.output_operand_alias<") == 4
            if sizes is not None:
                want = mosaic_step.default_stages(config, kda, 8, dot) if stages is None else stages
                # Mosaic GPU's reduction scratch with dot="fma" alone: the other dots' warps meet through `red`
                scratch = REDUCTION_SCRATCH if dot == "fma" else 0
                assert sizes[-1] == mosaic_step.smem_bytes(config, want, kda, 8, dot) + scratch
    if sizes is None:
        pytest.skip("this JAX's Mosaic GPU sizes its launch elsewhere: smem_bytes not compared with the lowering")


def test_mosaic_step_takes_three_heads_in_flight_where_two_programs_fit():
    # Batch 512 x 32 heads on 132 SMs, two programs per SM: 256 of 64 heads. Three heads in flight keep two
    # programs per SM for GDN at every width and for KDA at 4 and 2 bits; KDA at 8 and 6 bits and
    # the tensor cores' tile would lose the second program with three, so they take two.
    fits = lambda c, stages, kda, dot="rows": two_per_sm(mosaic_step.smem_bytes(c, stages, kda, 64, dot), dot == "fma")
    for bits in INT_WIDTHS:
        c = LeapQuantConfig(bits=bits, window=16)
        assert mosaic_step.default_stages(c, False, 64) == 3 and fits(c, 3, False)
        assert mosaic_step.default_stages(c, True, 64) == (3 if bits <= 4 else 2)
        assert fits(c, 2, True) and fits(c, 3, True) == (bits <= 4)
    c8 = LeapQuantConfig(bits=8, window=16)
    assert mosaic_step.default_stages(c8, False, 64, "wgmma") == 2 and not fits(c8, 3, False, "wgmma")


def test_mosaic_step_takes_three_programs_per_sm_at_four_bits_and_below(monkeypatch):
    # Batch 512 x 32 heads on 132 SMs. At 4 and 2 bits, GDN and KDA, three programs per SM of two heads
    # in flight fit (no reduction scratch with dot="rows"): 373 programs of 44 heads, at most 132 on an SM
    # against two's 128; at 8 and 6 bits, or with dot="fma"'s scratch where three no longer fit, two
    # programs of 64 heads.
    monkeypatch.setattr(mosaic_step, "sm_count", lambda: 132)
    n = 16384
    for bits in INT_WIDTHS:
        c = LeapQuantConfig(bits=bits, window=16)
        for kda in (False, True):
            grain = mosaic_step.head_grain(c, kda)
            programs, per = mosaic_step.split_heads(n, mosaic_step.default_programs(c, kda, n), grain)
            resident = -(-programs // 132)
            assert (programs, per, resident) == ((373, 44, 3) if bits <= 4 else (256, 64, 2)), (bits, kda)
            stages = mosaic_step.default_stages(c, kda, per, resident=resident)
            if bits == 4:       # three heads in flight would cost the SM its third program
                assert stages == 2 and per_sm(mosaic_step.smem_bytes(c, 3, kda, per), cross_warp_sums=False) < 3
            assert per_sm(mosaic_step.smem_bytes(c, stages, kda, per), cross_warp_sums=False) >= resident
    c4 = LeapQuantConfig(bits=4, window=16)
    assert mosaic_step.default_programs(c4, True, n, "fma") == 264      # 2 KB of scratch a program: three no longer fit
    assert mosaic_step.default_programs(c4, True, 64) == 8              # small batches: at least MIN_HEADS a program
    assert mosaic_step.default_programs(c4, True, n, stages=3) == 264   # three heads in flight: three no longer fit
    # Batch 594 splits evenly both ways (144 heads an SM); at batch 128 three would put 36 heads on the
    # fullest SM against two's 32 (12.5% more, above THREE_PER_SM_GAIN): two.
    assert mosaic_step.default_programs(c4, True, 594 * 32) == 396
    assert mosaic_step.default_programs(c4, True, 128 * 32) == 264
    # the grain: whole 128-byte copies of the scalars' rows and of GDN's record log-decays
    assert [mosaic_step.head_grain(c4, kda) for kda in (False, True)] == [4, 4]
    assert mosaic_step.log_decay_heads(8, 2) == 8 and mosaic_step.split_heads(20, 3, 8) == (3, 8)


def test_mosaic_step_rejects_what_it_cannot_run():
    # shapes only (the checks run as under jit, at trace time)
    def state(config, dk=128, dv=128, kda=False, bsz=2, h=4):
        return state_shapes(config, bsz, h, dk, dv, kda)

    c8 = LeapQuantConfig(bits=8, window=8)
    for config, st, match in [
        (c8, state(c8, dv=64), "dv=64"),
        (c8, state(c8, dk=64), "dk=64"),
        (c8, state(c8, bsz=1, h=6), "scalar .GDN. decays .* a multiple of 8"),
        (LeapQuantConfig(bits=8, window=8, rank=2), state(LeapQuantConfig(bits=8, window=8, rank=2)),
         "rank=2: .* 0 or at least 4"),
        # GDN's log-decay rows of 8 bytes: the copy engine's row stride is a multiple of 16 bytes, whatever B H
        (LeapQuantConfig(bits=8, window=4), state(LeapQuantConfig(bits=8, window=4)), "multiple of 16 bytes"),
        (LeapQuantConfig(bits=8, window=4), state(LeapQuantConfig(bits=8, window=4), bsz=4), "multiple of 16 bytes"),
    ]:
        assert mosaic_step.unsupported_reason(config, st) is not None
        with pytest.raises(ValueError, match=match):
            traced(functools.partial(mosaic_step.leapquant_step, config), st, delta_rule_token(
                q=jnp.zeros(st.shape[:2] + (st.shape[2],)), k=jnp.zeros(st.shape[:2] + (st.shape[2],)),
                v=jnp.zeros(st.shape[:2] + (st.shape[3],)), g=jnp.zeros(st.shape[:2]), beta=jnp.zeros(st.shape[:2])))
    # KDA's log-decays travel with each head's tiles: any B H, any window the others allow.
    assert mosaic_step.unsupported_reason(c8, state(c8, bsz=1, h=6, kda=True)) is None
    c4 = LeapQuantConfig(bits=8, window=4)
    assert mosaic_step.unsupported_reason(c4, state(c4, kda=True)) is None
    # packed codes with the default six Compensator Tokens
    for bits in (6, 4, 2):
        config = LeapQuantConfig(bits=bits, window=8)
        assert config.effective_rank == 6
        for kda in (False, True):
            assert mosaic_step.unsupported_reason(config, state(config, kda=kda)) is None
    st = state(c8)
    tok = delta_rule_token(q=jnp.zeros((2, 4, 128)), k=jnp.zeros((2, 4, 128)), v=jnp.zeros((2, 4, 128)),
                           g=jnp.zeros((2, 4)), beta=jnp.zeros((2, 4)))
    step = functools.partial(mosaic_step.leapquant_step, c8)
    for chunk in (24, 0, -4, 8.0):       # named, not a division by zero or a float slice
        with pytest.raises(ValueError, match=f"chunk={chunk!r} must be a multiple of 4 dividing dk=128"):
            traced(functools.partial(step, dot="fma", chunk=chunk), st, tok)
    for dot in ("rows", "wgmma"):
        with pytest.raises(ValueError, match="only dot='fma'"):
            traced(functools.partial(step, dot=dot, chunk=32), st, tok)
    with pytest.raises(ValueError, match="dot='tensor'"):
        traced(functools.partial(step, dot="tensor"), st, tok)
    for slot_copy in (0, 2, 6, 16, 4.0):
        with pytest.raises(ValueError, match=f"slot_copy={slot_copy!r}: record slots per copy must be a multiple of 4 "
                                             "dividing the window .8."):
            traced(functools.partial(step, slot_copy=slot_copy), st, tok)
    int4 = LeapQuantConfig(bits=4, window=8)
    step4 = functools.partial(mosaic_step.leapquant_step, int4)
    with pytest.raises(ValueError, match="dot='wgmma' reads 8-bit codes only .bits=4."):
        traced(functools.partial(step4, dot="wgmma"), state(int4), tok)
    with pytest.raises(ValueError, match="chunk=128 must be a multiple of 4 dividing the 64 key rows of a 4-bit"):
        traced(functools.partial(step4, dot="fma", chunk=128), state(int4), tok)
    with pytest.raises(ValueError, match="token.v"):
        traced(step, st, tok.replace(v=jnp.zeros((2, 4, 64))))
