"""The Mosaic GPU dense step against the reference, in the Mosaic GPU interpreter on the CPU, and
lowered for CUDA (which checks every register layout and copy it names without a GPU).

Inputs as in ``test_kernels``: realistic keys, decays and queries on a random dense state with
outlier value columns; several steps in a row, so a wrong in-place write shows in the next one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from leapquant_jax import dispatch
from leapquant_jax.recurrence import delta_rule_token
from pallas_kernels import mosaic_dense
from pallas_kernels.dense_step import dense_step_reference

from helpers import random_sequence, random_state, rel, token_at

# Its tests share compiled programs (the same shapes and configs): one xdist worker compiles
# them once (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("mosaic_dense")


def check_steps(kda, dtype, bsz, h, dv, steps=2, seed=0, **opts):
    """``steps`` kernel steps in a row; each against the reference's update of the kernel's own
    previous state (fp32: equal to fp32 rounding; bf16: the fp32 update rounded once, so within
    half a bf16 step of it)."""
    key = jax.random.PRNGKey(seed)
    seq = random_sequence(key, bsz, steps, h, 128, dv, kda)
    s_k = random_state(jax.random.fold_in(key, 1), bsz, h, 128, dv).astype(dtype)
    for i in range(steps):
        o_r, exact = dense_step_reference(s_k.astype(jnp.float32), token_at(seq, i))      # unrounded update
        o_k, s_k = mosaic_dense.dense_step(jnp.copy(s_k), token_at(seq, i), **opts)
        assert s_k.dtype == jnp.dtype(dtype) and s_k.shape == exact.shape
        assert rel(o_k, o_r) < 1e-5
        a, b = np.asarray(s_k, np.float64), np.asarray(exact, np.float64)
        if dtype == "float32":
            assert rel(a, b) < 1e-6
        else:
            assert np.all(np.abs(a - b) <= 2.0 ** -8 * np.abs(b) + 1e-6 * np.abs(b).max())
    return o_k, s_k


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mosaic_dense_step_matches_reference(kda, dtype):
    # defaults: every programs-th tile, the new block written over its input slot
    check_steps(kda, dtype, 3, 2, 128, seed=1 + 2 * kda + (dtype == "bfloat16"), programs=4)


@pytest.mark.parametrize("opts", [
    dict(block_v=32, programs=5, interleave=False),              # runs of unequal length (24 tiles)
    dict(block_v=128, programs=2, stages=2),
    dict(block_v=64, programs=3, inplace=False),                 # two output slots of its own
    dict(block_v=64, programs=12),                               # one tile per program: no delayed refill
    dict(block_v=64, programs=3, store="global"),                # from the registers to device memory
], ids=["runs", "whole-heads", "out-of-place", "one-tile-each", "global-stores"])
def test_mosaic_dense_step_launch_options(opts):
    check_steps(True, "float32", 3, 2, 128, **opts)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_mosaic_dense_step_fully_decayed_heads(kda):
    seq = random_sequence(jax.random.PRNGKey(3), 2, 1, 2, 128, 128, kda, log_decay=-1e3)
    s = random_state(jax.random.PRNGKey(4), 2, 2, 128, 128)
    o_k, s_k = mosaic_dense.dense_step(jnp.copy(s), token_at(seq, 0))
    o_r, s_r = dense_step_reference(s, token_at(seq, 0))
    assert np.all(np.isfinite(o_k)) and np.all(np.isfinite(s_k))
    assert rel(o_k, o_r) < 1e-5 and rel(s_k, s_r) < 1e-6


def test_mosaic_dense_step_runs_inside_scan():
    # the models' decode loops: the kernel's refs inside a scanned body
    seq = random_sequence(jax.random.PRNGKey(5), 2, 3, 2, 128, 128, False)
    s = random_state(jax.random.PRNGKey(6), 2, 2, 128, 128)
    toks = jax.tree_util.tree_map(lambda x: jnp.moveaxis(x, 1, 0), seq)

    def body(state, x):
        o, state = mosaic_dense.dense_step(state, delta_rule_token(**x))
        return state, o

    s_k, o_k = jax.jit(lambda s: jax.lax.scan(body, s, toks))(s)
    s_r = s
    for i in range(3):
        o_r, s_r = dense_step_reference(s_r, token_at(seq, i))
        assert rel(o_k[i], o_r) < 1e-5          # every stacked output, not only the last
    assert rel(s_k, s_r) < 1e-6


def test_mosaic_dense_step_under_vmap_folds_the_mapped_axis():
    # The per-step methods run under vmap: the mapped axis joins the batch, one launch, the same
    # result as one call per mapped entry (one entry's token unmapped: broadcast).
    seq = random_sequence(jax.random.PRNGKey(7), 2, 1, 2, 128, 128, True)
    tok = token_at(seq, 0)
    states = jnp.stack([random_state(jax.random.PRNGKey(8 + i), 2, 2, 128, 128) for i in range(3)])
    o_v, s_v = jax.jit(jax.vmap(lambda s: mosaic_dense.dense_step(s, tok, programs=4)))(states)
    assert o_v.shape == (3, 2, 2, 128) and s_v.shape == states.shape
    for i in range(3):
        o_1, s_1 = mosaic_dense.dense_step(jnp.copy(states[i]), tok, programs=4)
        np.testing.assert_array_equal(o_v[i], o_1)
        np.testing.assert_array_equal(s_v[i], s_1)


def test_the_mosaic_dense_step_through_dispatch():
    # impl="mosaic" through the front door: the Mosaic GPU dense step, interpreted here (which
    # kernel auto takes where: test_dispatch)
    seq = random_sequence(jax.random.PRNGKey(9), 1, 1, 2, 128, 128, False)
    s = random_state(jax.random.PRNGKey(10), 1, 2, 128, 128)
    o_a, s_a = dispatch.dense_step(jnp.copy(s), token_at(seq, 0), impl="mosaic")
    o_b, s_b = mosaic_dense.dense_step(jnp.copy(s), token_at(seq, 0))
    np.testing.assert_array_equal(o_a, o_b)
    np.testing.assert_array_equal(s_a, s_b)
    with pytest.raises(ValueError, match="impl='mosaic' cannot run the dense_step here"):
        dispatch.dense_step(s[:, :, :64], token_at(random_sequence(jax.random.PRNGKey(9), 1, 1, 2, 64, 128, False), 0),
                            impl="mosaic")


@pytest.mark.parametrize("kda, dtype, store", [(False, "float32", "tma"), (True, "float32", "tma"),
                                               (False, "bfloat16", "tma"), (True, "bfloat16", "tma"),
                                               (True, "float32", "global"), (False, "bfloat16", "global")])
def test_mosaic_dense_step_lowers_for_cuda(kda, dtype, store):
    from jax import export

    bsz, h = 4, 4
    z = lambda *shape: jnp.zeros(shape)
    tok = delta_rule_token(q=z(bsz, h, 128), k=z(bsz, h, 128), v=z(bsz, h, 128),
                           g=z(bsz, h, 128) if kda else z(bsz, h), beta=z(bsz, h))
    f = jax.jit(lambda s, t: mosaic_dense.dense_step(s, t, programs=3, store=store, interpret=False))
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    (jnp.zeros((bsz, h, 128, 128), dtype), tok))
    text = export.export(f, platforms=["cuda"])(*shapes).mlir_module()
    assert "mosaic_gpu" in text
    assert text.count("stablehlo.output_operand_alias<") == 2          # the state and the output only


def test_mosaic_kernel_results_leave_through_an_optimization_barrier():
    # Compiled for the GPU, XLA's dynamic-slice fusion fed a scan's stacked outputs to the kernel
    # as its output buffer while the kernel wrote through the aliased input: all-zero outputs
    # (mosaic_shared.run_kernel). Only the compiled program shows it, so here the exported module
    # must pass the kernel's results through the barrier that keeps them out of that fusion.
    from jax import export

    seq = random_sequence(jax.random.PRNGKey(5), 2, 3, 2, 128, 128, False)
    toks = jax.tree_util.tree_map(lambda x: jnp.moveaxis(x, 1, 0), seq)

    def body(state, x):
        o, state = mosaic_dense.dense_step(state, delta_rule_token(**x), programs=2, interpret=False)
        return state, o

    f = jax.jit(lambda s, t: jax.lax.scan(body, s, t))
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    (random_state(jax.random.PRNGKey(6), 2, 2, 128, 128), toks))
    text = export.export(f, platforms=["cuda"])(*shapes).mlir_module()
    call = text.index("mosaic_gpu")
    barrier = text.find("stablehlo.optimization_barrier", call)
    assert barrier > call
    result = text.rfind("\n", 0, call)
    name = text[result:call].split("=")[0].strip().split(":")[0]      # the custom call's result, e.g. %0
    assert name.startswith("%") and name in text[barrier:text.find("\n", barrier)]


def test_mosaic_dense_step_rejects_what_it_cannot_run():
    seq = random_sequence(jax.random.PRNGKey(0), 2, 1, 2, 128, 128, False)
    tok = token_at(seq, 0)
    s = jnp.zeros((2, 2, 128, 128))
    with pytest.raises(ValueError, match="dk=64"):
        mosaic_dense.dense_step(jnp.zeros((2, 2, 64, 128)), token_at(random_sequence(jax.random.PRNGKey(0), 2, 1, 2, 64, 128,
                                                                           False), 0))
    with pytest.raises(ValueError, match="block_v=16"):
        mosaic_dense.dense_step(s, tok, block_v=16)
    with pytest.raises(ValueError, match="token.v"):
        mosaic_dense.dense_step(s, tok.replace(v=jnp.zeros((2, 2, 64))))
    with pytest.raises(TypeError, match="states"):
        mosaic_dense.dense_step(s.astype(jnp.float16), tok)
    with pytest.raises(ValueError, match="shared memory"):
        mosaic_dense.dense_step(s, tok, block_v=128, stages=4)
    with pytest.raises(ValueError, match="stages=0"):
        mosaic_dense.dense_step(s, tok, stages=0)
    with pytest.raises(ValueError, match="store='smem'"):
        mosaic_dense.dense_step(s, tok, store="smem")
    assert mosaic_dense.unsupported_reason(s, tok) is None
    assert "dk=64" in mosaic_dense.unsupported_reason(jnp.zeros((2, 2, 64, 128)), tok)


def test_tile_orders_cover_every_tile_once():
    for tiles, programs in [(12, 5), (7, 7), (64, 3), (5, 1)]:
        for interleave in (False, True):
            seen = []
            for c in range(programs):
                count = mosaic_dense.tile_order(c, 0, tiles, programs, interleave, np)[1]
                seen += [int(mosaic_dense.tile_order(c, i, tiles, programs, interleave, np)[0]) for i in range(count)]
                # steps past the count repeat the last tile
                last = mosaic_dense.tile_order(c, count - 1, tiles, programs, interleave, np)[0]
                assert mosaic_dense.tile_order(c, count + 2, tiles, programs, interleave, np)[0] == last
            assert sorted(seen) == list(range(tiles)), (tiles, programs, interleave)
