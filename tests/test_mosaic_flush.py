"""The Mosaic GPU flush against the reference, in the Mosaic GPU interpreter on the CPU, and
lowered for CUDA (which checks every register layout and copy it names without a GPU).

States as in ``test_kernels``: a random dense state with outlier value columns, then reference
steps at realistic keys and decays, set to ragged window positions (``check_flush``: codes within
one step of the reference's, the decoded state's error against the exact state as the reference's).
At 8 bits every option; at 6, 4 and 2 bits (packed codes read and written in registers, six
Compensator Tokens) each width in GDN and KDA, both reconstructions, and lowered.
"""

from __future__ import annotations

import functools

import chex
import jax
import numpy as np
import pytest

from leapquant_jax import dispatch, windowed
from leapquant_jax.impls import Impl
from leapquant_jax.quantizers import round_codes
from leapquant_jax.state import LeapQuantConfig
from pallas_kernels import leapquant_flush, mosaic_flush, mosaic_shared

from helpers import check_flush, copy_tree, expanded_state, live_state
from kernel_helpers import launch_smem, state_shapes, traced

# Its tests share compiled programs (the same shapes and configs, op by op and kernel by kernel):
# one xdist worker compiles them once (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("mosaic_flush")


def mosaic(**opts):
    def flush(config, state, *, only_full):
        return mosaic_flush.leapquant_flush(config, state, only_full=only_full, **opts)
    return flush


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("opts", [dict(programs=2), dict(programs=2, stages=2), dict(programs=3, chunk=32)],
                         ids=["one-stage", "two-stages", "ragged-programs-chunk-32"])
def test_mosaic_flush_matches_reference(kda, opts):
    config = LeapQuantConfig(bits=8, window=16)
    st, _ = live_state(config, jax.random.PRNGKey(30 + kda), 2, 2, 128, 128, kda, pos=[16, 9])
    check_flush(config, st, flush=mosaic(**opts))


@pytest.mark.parametrize("options", [dict(warm_start=True, fit_iters=2), dict(rank=2, smoothing=False),
                                     dict(compensators=False), dict(window=4, record_dtype="bfloat16")],
                         ids=["warm-start-two-rounds", "rank-2-no-smoothing", "no-compensators", "p4-bf16"])
def test_mosaic_flush_other_configs(options):
    config = LeapQuantConfig(bits=8, **{"window": 8, **options})
    st, _ = live_state(config, jax.random.PRNGKey(40), 1, 2, 128, 128, False, pos=[config.window])
    check_flush(config, st, flush=mosaic(programs=2))


@pytest.mark.parametrize("bits, kda, opts", [
    (6, False, dict(programs=2)),
    (6, True, dict(programs=3, chunk=32, recon="fma")),       # a whole 6-bit code part per chunk
    (4, False, dict(programs=2, stages=2, recon="fma")),
    (4, True, dict(programs=2)),
    (2, False, dict(programs=2, recon="fma")),
    (2, True, dict(programs=2)),
], ids=["int6-gdn", "int6-kda-fma-chunk-32", "int4-gdn-fma-two-stages", "int4-kda", "int2-gdn-fma", "int2-kda"])
def test_mosaic_flush_packed_codes_match_reference(bits, kda, opts):
    # The old codes unpacked and the new ones packed in registers, quantizers' planar layout; the
    # default six Compensator Tokens (recon: the low-rank part on the tensor cores by default at
    # p = 16, else on the CUDA cores).
    config = LeapQuantConfig(bits=bits, window=16)
    assert config.effective_rank == 6
    assert mosaic_flush.unsupported_reason(config, state_shapes(config, 2, 2, 128, 128, kda)) is None
    st, _ = live_state(config, jax.random.PRNGKey(50 + 2 * bits + kda), 2, 1, 128, 128, kda, pos=[16, 9])
    ker, ref = check_flush(config, st, flush=mosaic(**opts))
    assert ker.checkpoint.residual.codes.dtype == ref.checkpoint.residual.codes.dtype == np.uint8
    assert np.any(np.asarray(ker.checkpoint.residual.codes) != np.asarray(st.checkpoint.residual.codes))
    if bits == 2:
        # a zero state: 2 bits have no zero code (the odd levels), the tie goes up to 1, as the
        # reference's. The reference first and the kernel waited for: no eager op of this thread
        # meets the interpreter's callbacks mid-run.
        st = windowed.init_state(config, 2, 1, 128, 128, kda)
        ref = jax.block_until_ready(windowed.flush_reference(config, st))
        ker = jax.block_until_ready(mosaic(**opts)(config, copy_tree(st), only_full=False))
        np.testing.assert_array_equal(ker.checkpoint.residual.codes, ref.checkpoint.residual.codes)
        assert np.all(np.asarray(windowed.decode_checkpoint(config, ker.checkpoint)) == 0)


@pytest.mark.parametrize("kernels", [mosaic_flush, leapquant_flush], ids=["mosaic", "triton"])
def test_flushes_round_codes_as_the_reference(kernels):
    # The codes' rule in the flush kernels (round_codes through their GRID_MATH: Mosaic GPU's floor
    # through int32, Triton's round from floor) on every rounding boundary and between them, at
    # every width: the reference's to the bit.
    t = np.concatenate([np.arange(-40, 40.25, 0.25), np.nextafter(np.arange(-40.0, 41.0), np.inf),
                        np.nextafter(np.arange(-40.0, 41.0), -np.inf),
                        np.asarray(jax.random.uniform(jax.random.PRNGKey(0), (4096,), minval=-40, maxval=40))])
    t = jax.numpy.asarray(t, jax.numpy.float32)
    for bits in (8, 6, 4, 2):
        np.testing.assert_array_equal(round_codes(t, bits, xp=kernels.GRID_MATH), round_codes(t, bits))


def test_mosaic_flush_only_full_windows_and_shared_key_records():
    # Only the full window (sequence 0) flushes; the others are left exactly as they were. GVA:
    # value heads 0 and 1 read key head 0's records, as the layout with a copy per value head.
    config = LeapQuantConfig(bits=8, window=8)
    st, _ = live_state(config, jax.random.PRNGKey(41), 3, 2, 128, 128, True, pos=[8, 3, 0], key_heads=1)
    ker, _ = check_flush(config, st, only_full=True, flush=mosaic(programs=4))
    rest = lambda tree: jax.tree_util.tree_map(lambda x: x[1:], tree)   # noqa: E731
    chex.assert_trees_all_equal(rest(ker), rest(st))
    ker_e = mosaic_flush.leapquant_flush(config, copy_tree(expanded_state(st)), only_full=True, programs=4)
    chex.assert_trees_all_equal(ker.checkpoint, ker_e.checkpoint)


@pytest.mark.parametrize("pos", [[8, 8, 3, 0, 8], [8, 3, 0, 1, 2], [2, 3, 0, 1, 7]],
                         ids=["many-full", "few-full", "none-full"])
def test_auto_flush_of_full_windows_needs_no_decision_on_the_host(monkeypatch, pos):
    # On Hopper auto runs the Mosaic GPU flush alone on every step, whatever the fill: no loop
    # waits on the device for a predicate and the fused flush never runs; the full windows flush,
    # the others are left exactly as they were.
    config = LeapQuantConfig(bits=8, window=8)
    st, _ = live_state(config, jax.random.PRNGKey(48), 5, 2, 128, 128, False, pos=pos)
    monkeypatch.setattr(dispatch, "resolve", lambda op, impl, *a: Impl.MOSAIC)
    seen = []
    kernel = dispatch.kernel

    def counted(op, impl):
        seen.append(impl)
        return kernel(op, impl)
    monkeypatch.setattr(dispatch, "kernel", counted)
    monkeypatch.setattr(dispatch, "_at_most_once", lambda *a: pytest.fail("a loop on a predicate"))
    ker, _ = check_flush(config, st, only_full=True, impl="auto")
    assert seen == [Impl.MOSAIC]
    partial = lambda tree: jax.tree_util.tree_map(lambda x: x[np.asarray(pos) < 8], tree)   # noqa: E731
    chex.assert_trees_all_equal(partial(ker), partial(st))


@pytest.mark.parametrize("pos", [[8, 3, 8, 0, 8], [2, 3, 0, 1, 7]], ids=["three-full", "none-full"])
def test_mosaic_flush_walks_the_list_of_flushed_heads_as_the_pipeline(pos):
    # walk="list": each program copies in the flushed heads only, from the list XLA makes of them
    # (here 3 programs over 6 of 10 heads, or none): the flushed heads as the reference's (the
    # interpreter fuses the two walks' arithmetic apart, so not bit for bit the pipeline's), the
    # others untouched (GVA: the key records by key head).
    config = LeapQuantConfig(bits=8, window=8)
    st, _ = live_state(config, jax.random.PRNGKey(49), 5, 2, 128, 128, True, pos=pos, key_heads=1)
    a, _ = check_flush(config, st, only_full=True, flush=mosaic(programs=3, walk="list"))
    partial = lambda tree: jax.tree_util.tree_map(lambda x: x[np.asarray(pos) < 8], tree)   # noqa: E731
    chex.assert_trees_all_equal(partial(a), partial(st))
    b = mosaic_flush.leapquant_flush(config, copy_tree(st), only_full=True, programs=3, walk="pipeline")
    np.testing.assert_allclose(a.checkpoint.residual.scale, b.checkpoint.residual.scale, rtol=1e-4)


def test_mosaic_flush_chunk_loop_matches_the_written_out_chunks():
    # The passes' loops over one chunk's code (the default) compute what the written-out chunks
    # do, up to the interpreter's own fusion of products and sums (a code on a rounding boundary).
    config = LeapQuantConfig(bits=8, window=8)
    st, _ = live_state(config, jax.random.PRNGKey(43), 1, 2, 128, 128, False, pos=[8])
    rolled = mosaic_flush.leapquant_flush(config, copy_tree(st), programs=2)
    written = mosaic_flush.leapquant_flush(config, copy_tree(st), programs=2, unroll=True)
    a, b = (np.asarray(x.checkpoint.residual.codes, np.int32) for x in (rolled, written))
    assert np.abs(a - b).max() <= 1 and np.mean(a != b) < 1e-3
    for name in ("smooth", "comp_k", "comp_u"):
        np.testing.assert_allclose(np.asarray(getattr(rolled.checkpoint, name), np.float32),
                                   np.asarray(getattr(written.checkpoint, name), np.float32), rtol=1e-3, atol=1e-6)
    # A factor on an fp16 rounding boundary may round apart in the two forms (one ulp, 6e-4 relative, as
    # allowed above); the residual's column maxima then move by a few 1e-5.
    np.testing.assert_allclose(rolled.checkpoint.residual.scale, written.checkpoint.residual.scale, rtol=1e-4)
    assert np.any(np.asarray(rolled.checkpoint.residual.codes) != np.asarray(st.checkpoint.residual.codes))


def test_mosaic_flush_sums_over_8_or_32_lanes_alike():
    # The fit's row sums over 8 lanes (their layout is compiled only; the interpreter has none)
    # take its columns through shared memory: both rounds of a two-round fit come out the same.
    config = LeapQuantConfig(bits=8, window=8, warm_start=True, fit_iters=2)
    st, _ = live_state(config, jax.random.PRNGKey(47), 1, 2, 128, 128, True, pos=[8])
    a, _ = check_flush(config, st, flush=mosaic(programs=2, sum_lanes=8))
    b = mosaic_flush.leapquant_flush(config, copy_tree(st), programs=2, sum_lanes=32)
    chex.assert_trees_all_equal(a.checkpoint, b.checkpoint)


def test_mosaic_flush_under_vmap_folds_the_mapped_axis():
    # Under vmap the mapped axis joins the batch: one launch, the same checkpoints as one flush
    # per mapped entry (only_full: each entry's own full windows, a full one and a partial one).
    config = LeapQuantConfig(bits=8, window=8)
    sts = [live_state(config, jax.random.PRNGKey(44 + i), 1, 2, 128, 128, False, pos=pos)[0]
           for i, pos in enumerate(([8], [2]))]
    both = jax.tree_util.tree_map(lambda *x: jax.numpy.stack(x), *sts)
    flush = lambda s: mosaic_flush.leapquant_flush(config, s, only_full=True, programs=2)
    out = jax.jit(jax.vmap(flush))(both)
    for i, st in enumerate(sts):
        one = flush(copy_tree(st))
        chex.assert_trees_all_equal(one, jax.tree_util.tree_map(lambda x: x[i], out))


def test_the_mosaic_flush_through_dispatch():
    # impl="mosaic" through the front door: the Mosaic GPU flush, interpreted here (which kernel
    # auto takes where: test_dispatch)
    config = LeapQuantConfig(bits=8, window=8)
    st, _ = live_state(config, jax.random.PRNGKey(46), 1, 2, 128, 128, False, pos=[8])
    a = dispatch.leapquant_flush(config, copy_tree(st), only_full=True, impl="mosaic")
    b = mosaic_flush.leapquant_flush(config, copy_tree(st), only_full=True)
    chex.assert_trees_all_equal(a, b)
    with pytest.raises(ValueError, match="dk=64"):
        traced(functools.partial(dispatch.leapquant_flush, config, impl="mosaic"), state_shapes(config, 1, 2, 64, 128))


def test_mosaic_flush_fully_decayed_heads_and_zero_state():
    # the shapes and launch of test_mosaic_flush_matches_reference[one-stage-*]
    config = LeapQuantConfig(bits=8, window=16)
    st, _ = live_state(config, jax.random.PRNGKey(42), 2, 2, 128, 128, True, pos=[16, 9], log_decay=-1e3, zero=True)
    # A rank-1 state the Compensator Tokens take whole: the residual is rounding noise whose codes
    # are arbitrary in both; finite, and as close to the exact state as the reference.
    check_flush(config, st, codes_agree=False, flush=mosaic(programs=2))
    # the kernel waited for: no eager op of this thread meets the interpreter's callbacks mid-run
    st = windowed.init_state(config, 2, 2, 128, 128)
    ker = jax.block_until_ready(mosaic(programs=2)(config, copy_tree(st), only_full=False))
    assert np.all(np.asarray(windowed.decode_checkpoint(config, ker.checkpoint)) == 0)


@pytest.mark.parametrize("stages, unroll, sum_lanes, walk",
                         [(1, False, 8, "pipeline"), (2, False, 8, "pipeline"), (1, True, 8, "pipeline"),
                          (1, False, 32, "pipeline"), (1, False, 8, "list")],
                         ids=["one-stage", "two-stages", "unrolled", "sums-over-32-lanes", "list"])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_mosaic_flush_lowers_for_cuda(kda, stages, unroll, sum_lanes, walk):
    # Lowering builds the Mosaic GPU module: every register layout, reduction and copy is checked
    # here without a GPU. The checkpoint's five arrays are written in place, nothing else.
    from jax import export

    config = LeapQuantConfig(bits=8, window=16)
    st = state_shapes(config, 4, 4, 128, 128, kda, key_heads=2)
    f = jax.jit(lambda s: mosaic_flush.leapquant_flush(config, s, only_full=True, programs=3, stages=stages,
                                                       unroll=unroll, sum_lanes=sum_lanes, walk=walk, interpret=False))
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), st)
    with launch_smem() as sizes:
        text = export.export(f, platforms=["cuda"])(shapes).mlir_module()
    assert "mosaic_gpu" in text
    assert text.count("stablehlo.output_operand_alias<") == 5
    check_smem(sizes, config, stages, kda, mosaic_flush.listed_entries(6) if walk == "list" else 0)


def check_smem(sizes, config, stages, kda, listed, fit="fma"):
    # smem_bytes with the reductions' scratch (as two_per_sm counts it) is what the launch asks for.
    if sizes is None:
        pytest.skip("this JAX's Mosaic GPU sizes its launch elsewhere: smem_bytes not compared with the lowering")
    assert sizes[-1] == mosaic_flush.smem_bytes(config, stages, kda, listed, fit) + mosaic_shared.REDUCTION_SCRATCH


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("bits", [6, 4, 2])
def test_mosaic_flush_lowers_packed_codes_for_cuda(bits, kda):
    # The packed codes' loads, unpacking, packing and stores in their register layouts, lowered:
    # GDN with the records on the tensor cores (the default at p = 16), KDA on the CUDA cores
    # with chunks of a whole 6- or 2-bit code part (32 rows); the default six Compensator Tokens.
    from jax import export

    config = LeapQuantConfig(bits=bits, window=16)
    st = state_shapes(config, 4, 4, 128, 128, kda, key_heads=2)
    opts = dict(recon="fma", chunk=32) if kda else {}
    f = jax.jit(lambda s: mosaic_flush.leapquant_flush(config, s, programs=3, interpret=False, **opts))
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), st)
    with launch_smem() as sizes:
        text = export.export(f, platforms=["cuda"])(shapes).mlir_module()
    assert "mosaic_gpu" in text
    assert text.count("stablehlo.output_operand_alias<") == 5
    check_smem(sizes, config, 1, kda, 0)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_mosaic_flush_tensor_core_reconstruction(kda):
    # recon="wgmma" / "records": the reconstruction's low-rank part (or the records' alone) on the
    # tensor cores from fp16 pieces of the scaled decayed keys. In the interpreter the same pieces
    # meet through jnp.dot (ragged positions, dead slots, a head with no live record, GVA); lowered,
    # the wgmma, its swizzled operands (the records' values copied in swizzled, the tokens' stored)
    # and the swizzled state's loads and stores, each checked free of bank conflicts where the
    # lowering is asked to.
    from jax import export

    config = LeapQuantConfig(bits=8, window=16)
    st, _ = live_state(config, jax.random.PRNGKey(60 + kda), 3, 2, 128, 128, kda, pos=[16, 11, 0], key_heads=1)
    # the Compensator Tokens' part with the records' (GDN) or on the CUDA cores (KDA)
    recon = "records" if kda else "wgmma"
    check_flush(config, st, flush=mosaic(programs=2, recon=recon, fit="fma"))
    # the tokens join the product where their operands fit in the state's second half: up to a window of 40
    assert [mosaic_flush.mm_rows(p, 4, "wgmma") for p in (16, 32, 48)] == [80, 112, 96]
    assert mosaic_flush.mm_rows(16, 4, "records") == 32 and mosaic_flush.mm_rows(16, 0, "wgmma") == 32
    for cfg in (config, LeapQuantConfig(bits=8, window=32)):
        st = state_shapes(cfg, 2, 2, 128, 128, kda)
        f = jax.jit(lambda s, cfg=cfg: mosaic_flush.leapquant_flush(cfg, s, recon=recon, interpret=False))
        shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), st)
        assert "mosaic_gpu" in export.export(f, platforms=["cuda"])(shapes).mlir_module()


@pytest.mark.parametrize("kda, bits", [(False, 8), (True, 4)], ids=["gdn-int8", "kda-int4"])
def test_mosaic_flush_fit_on_the_tensor_cores(kda, bits):
    # fit="wgmma": Y = S Z as TF32 products of the swizzled state by Z's rows, each accumulator stored
    # transposed into Y's rows. In the interpreter Y meets through jnp.dot and the flush must match the
    # reference (four and six Compensator Tokens, two fit rounds); lowered, the wgmma, the transposed
    # store and the shared memory smem_bytes counts (Y's and Z's rows in memory the fit already shares).
    from jax import export

    config = LeapQuantConfig(bits=bits, window=16)
    st, _ = live_state(config, jax.random.PRNGKey(64 + kda), 3, 2, 128, 128, kda, pos=[16, 11, 16], key_heads=1)
    check_flush(config, st, flush=mosaic(programs=2, recon="wgmma", fit="wgmma"))
    config2 = LeapQuantConfig(bits=bits, window=16, fit_iters=2)
    check_flush(config2, st, flush=mosaic(programs=2, recon="wgmma", fit="wgmma"))
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    state_shapes(config, 4, 4, 128, 128, kda, key_heads=2))
    f = jax.jit(lambda s: mosaic_flush.leapquant_flush(config, s, only_full=True, programs=3, fit="wgmma",
                                                       interpret=False))
    with launch_smem() as sizes:
        assert "mosaic_gpu" in export.export(f, platforms=["cuda"])(shapes).mlir_module()
    # the default where it runs: the tensor cores' reconstruction, at most 8 Compensator Tokens, 4 bits up
    assert mosaic_flush.default_fit(config) == "wgmma" and mosaic_flush.default_fit(config, "fma") == "fma"
    assert mosaic_flush.default_fit(LeapQuantConfig(bits=8, window=16, rank=12)) == "fma"
    assert mosaic_flush.default_fit(LeapQuantConfig(bits=2, window=16)) == "fma"
    assert mosaic_flush.default_fit(LeapQuantConfig(bits=8, window=16, record_dtype="bfloat16")) == "fma"
    # no more than the fit on the CUDA cores takes: two programs per SM still fit
    assert mosaic_flush.smem_bytes(config, 1, kda, 0, "wgmma") == mosaic_flush.smem_bytes(config, 1, kda, 0)
    for opts, match in [(dict(fit="mma"), "fit='mma'"), (dict(fit="wgmma", recon="fma"), "recon='wgmma'")]:
        with pytest.raises(ValueError, match=match):
            traced(functools.partial(mosaic_flush.leapquant_flush, config, **opts), st)
    wide = LeapQuantConfig(bits=8, window=16, rank=12)
    with pytest.raises(ValueError, match="at most 8 Compensator Tokens"):
        traced(functools.partial(mosaic_flush.leapquant_flush, wide, fit="wgmma"),
               state_shapes(wide, 2, 2, 128, 128, False))
    check_smem(sizes, config, 1, kda, mosaic_flush.listed_entries(6), "wgmma")


def test_mosaic_flush_tensor_core_reconstruction_window_32():
    config = LeapQuantConfig(bits=8, window=32)
    st, _ = live_state(config, jax.random.PRNGKey(62), 1, 2, 128, 128, False, pos=[32])
    check_flush(config, st, flush=mosaic(programs=2, recon="wgmma"))


def test_mosaic_flush_takes_the_tensor_cores_where_they_can_run():
    # recon=None: the tensor cores for float16 records and a window of 16 to 64, the CUDA cores otherwise.
    for options, recon in [(dict(window=16), "wgmma"), (dict(window=64), "wgmma"), (dict(window=8), "fma"),
                           (dict(window=16, record_dtype="bfloat16"), "fma"), (dict(window=24), "fma")]:
        config = LeapQuantConfig(bits=8, **options)
        assert mosaic_flush.default_recon(config) == recon, options
        assert mosaic_flush.takes_tensor_cores(config) == (recon == "wgmma")


def test_mosaic_flush_rejects_what_it_cannot_run(monkeypatch):
    # shapes only (the checks run as under jit, at trace time)
    def state(config, dk=128, dv=128):
        return state_shapes(config, 2, 2, dk, dv)

    c8 = LeapQuantConfig(bits=8, window=8)
    for config, st, match in [
        (c8, state(c8, dv=64), "dv=64"),
        (c8, state(c8, dk=64), "dk=64"),
        (c8, state(LeapQuantConfig(bits=8, window=4)), "slots"),
    ]:
        assert mosaic_flush.unsupported_reason(config, st) is not None
        with pytest.raises(ValueError, match=match):
            traced(functools.partial(mosaic_flush.leapquant_flush, config), st)
    st = state_shapes(c8, 8, 2, 128, 128)
    for opts, match in [(dict(chunk=24), "chunk=24"), (dict(chunk=8), "sum_lanes=8"),
                        (dict(sum_lanes=16), "sum_lanes=16"), (dict(stages=0), "stages=0"),
                        (dict(programs=0), "programs=0"),
                        (dict(stages=8, programs=1), "shared memory"), (dict(recon="mma"), "recon='mma'"),
                        (dict(walk="heads"), "walk='heads'"), (dict(walk="list", stages=2), "one stage")]:
        with pytest.raises(ValueError, match=match):
            traced(functools.partial(mosaic_flush.leapquant_flush, c8, **opts), st)
    # the list's head indices are fp32: past LIST_MAX_HEADS the list is refused, the default walks the pipeline
    monkeypatch.setattr(mosaic_flush, "LIST_MAX_HEADS", 8)
    nine = state_shapes(c8, 3, 3, 128, 128)
    with pytest.raises(ValueError, match=r"walk='list' lists at most 8 heads \(fp32 indices\); got 9"):
        traced(functools.partial(mosaic_flush.leapquant_flush, c8, only_full=True, walk="list"), nine)
    traced(functools.partial(mosaic_flush.leapquant_flush, c8, only_full=True), nine)
    for config in (LeapQuantConfig(bits=8, window=16, record_dtype="bfloat16"), LeapQuantConfig(bits=8, window=8)):
        with pytest.raises(ValueError, match="float16 records"):
            traced(functools.partial(mosaic_flush.leapquant_flush, config, recon="wgmma"),
                   state_shapes(config, 2, 2, 128, 128))
    # below 8 bits a chunk lies within a code part (the 32 or 64 key rows of its byte rows)
    for bits, chunk, rows in ((6, 64, 32), (2, 128, 32), (4, 128, 64)):
        config = LeapQuantConfig(bits=bits, window=8)
        with pytest.raises(ValueError, match=f"chunk={chunk} must be a multiple of 4 dividing the {rows} key rows "
                                             f"of a {bits}-bit code part"):
            traced(functools.partial(mosaic_flush.leapquant_flush, config, chunk=chunk),
                   state_shapes(config, 2, 2, 128, 128))


def test_mosaic_flush_keeps_two_programs_per_sm_with_either_walk(monkeypatch):
    # One stage at every width, GDN and KDA, batch 512 x 32 heads on an H100's 132 SMs: two programs
    # per SM; the list's row (64 entries) lies in the scalars' buffer, no buffer of its own (the
    # list walk adds only its barriers, one per input).
    monkeypatch.setattr(mosaic_shared, "sm_count", lambda: 132)
    listed = mosaic_flush.listed_entries(-(-16384 // 264))
    for bits in (8, 6, 4, 2):
        config = LeapQuantConfig(bits=bits, window=16)
        for per_channel in (False, True):
            smem = mosaic_flush.smem_bytes(config, 1, per_channel)
            listed_smem = mosaic_flush.smem_bytes(config, 1, per_channel, listed)
            assert 0 < listed_smem - smem < mosaic_shared.SMEM_ALIGN
            for x in (smem, listed_smem):
                assert mosaic_shared.default_programs(16384, lambda q, x=x: x) == 264, (bits, per_channel)


def test_mosaic_flush_bytes_read_the_checkpoint_once():
    # The checkpoint read and written once, the records read once, a head's scalars: no decayed
    # keys through device memory (under 60 KB a head at p = 16, GDN and KDA).
    config = LeapQuantConfig(bits=8, window=16)
    ckpt = 128 * 128 + 4 * 128 * 2 + 2 * 4 * 256
    b = mosaic_flush.mosaic_flush_bytes(config, 128, 128, False)
    assert 2 * ckpt + 2 * 16 * 256 < b < 2 * ckpt + 2 * 16 * 256 + 512
    assert mosaic_flush.mosaic_flush_bytes(config, 128, 128, False, group=2) == b - 16 * 128
    kda = mosaic_flush.mosaic_flush_bytes(config, 128, 128, True)
    assert b < kda < 60 * 1024
    # one stage: two programs fit on an SM; two stages: one
    for per_channel in (False, True):
        assert mosaic_shared.two_per_sm(mosaic_flush.smem_bytes(config, 1, per_channel))
        assert not mosaic_shared.two_per_sm(mosaic_flush.smem_bytes(config, 2, per_channel))
    # packed codes: fewer bytes read and written, less shared memory; two programs per SM with
    # one stage and the default six Compensator Tokens too
    for bits, rows in ((6, 96), (4, 64), (2, 32)):
        cb = LeapQuantConfig(bits=bits, window=16)
        assert mosaic_flush.mosaic_flush_bytes(cb, 128, 128, False) == (
            b - 2 * (128 - rows) * 128 + 2 * 2 * 2 * 128 * (cb.effective_rank - config.effective_rank))
        for per_channel in (False, True):
            assert mosaic_shared.two_per_sm(mosaic_flush.smem_bytes(cb, 1, per_channel))
