"""Dense per-step GDN/KDA decode step on Pallas Mosaic GPU (Hopper), state in fp32 or bf16, ``dk = 128``.

Contract and arithmetic: ``dense_step.dense_step``'s (in fp32, for ``S [dk, BV]``):

    u = beta (v - S^T b),  S' = Diag(exp(g)) S + w u^T,  o = S'^T q = S^T (exp(g) q) + (w . q) u

(GDN's scalar ``exp(g)`` applied after the sums), ``S'`` stored in place in the state's dtype
(bf16 rounded to nearest even), ``o`` from the unrounded ``S'``.

Why: the dense step moves the whole state twice per token and does little arithmetic, so it is as
fast as its copies. Here the copy engine (TMA) brings each state tile into shared memory,
``stages`` tiles in flight per program, while the registers work on an earlier one.

Structure: the ``[B H]`` heads' value blocks of ``BV`` columns are ``T = B H dv / BV`` tiles;
``programs`` programs of one warpgroup each take every ``programs``-th tile (``tile_order``; or a
run of consecutive tiles). A program copies in its tiles' scalars (``g`` for GDN, ``beta``;
packed by XLA) once, then walks its tiles in an ``emit_pipeline``. The new block is stored from
the registers straight to device memory (``store="global"``) or written over its input slot and
copied out by TMA (``store="tma"``); the output row leaves through two alternating slots. Register
layout (``mosaic_shared.rows_layout``): key rows over the warps and registers, the ``BV`` columns
over the lanes. Under ``vmap`` the mapped axis joins the batch (``mosaic_shared.fold_vmap``);
``launch`` runs the same pipeline around other arithmetic (``bench.mosaic_dense --copy-only``).

Defaults, the fastest measured (H200, batch 512; docs/performance.md): 64 columns per tile for
fp32, 128 for bf16 (32 KB tiles), three stages, two programs per SM, ``store="global"``. Bytes per
step and head: ``dense_step.dense_step_bytes``. Tested with JAX 0.10.2 (Mosaic GPU interpret mode
and lowering on the CPU) and 0.11.2 (compiled, H200).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from leapquant_jax.recurrence import Token

from .dense_step import STATE_DTYPES, check_dense_inputs
from .mosaic_shared import (
    META_ALIGN, SMEM_LIMIT, Layouts, aligned, check_launch, default_programs, fold_vmap, lane_params, resolve_interpret,
    rows_layout, run_kernel,
)

f32 = jnp.float32
DK = 128                 # key rows of a head: the vectors' layout spreads them over the 32 lanes, 4 each
BLOCKS_V = (32, 64, 128)  # value columns per tile the register layout takes
DEFAULT_STAGES = 3
STORES = ("tma", "global")   # how a new state block leaves: copied out of shared memory, or from the registers
DEFAULT_STORE = "global"     # a little faster than "tma" (docs/performance.md)


def default_block_v(dtype) -> int:
    """Value columns per tile: 64 for fp32 states, 128 for bf16 ones (32 KB tiles; the fastest
    measured, docs/performance.md)."""
    return 128 if jnp.dtype(dtype).itemsize == 2 else 64


def smem_bytes(block_v: int, stages: int, dtype, per_channel: bool, per_pad: int, state_slots: bool) -> int:
    """Shared memory of one program (each buffer from a 1 KB boundary, ``mosaic_shared.aligned``):
    ``stages`` of each input tile, the output row's two slots, the scalars, and where
    ``state_slots`` (copied out through TMA, not in place) two state blocks."""
    tile = DK * block_v * jnp.dtype(dtype).itemsize
    inputs = [tile, 4 * DK, 4 * DK, 4 * DK, 4 * block_v] + ([4 * DK] if per_channel else [])
    return (aligned(*(stages * x for x in inputs)) + aligned(2 * 4 * block_v, 16 * per_pad)
            + (aligned(2 * tile) if state_slots else 0))


# ----------------------------------------------------------------------------- kernel


def _tile_step(meta_all, i, t, *, per_channel, bv, lay):
    """Tile ``i`` of the program from its shared-memory tiles ``t``: ``(o [BV], S' [dk, BV])`` in fp32."""
    L = rows_layout(DK, bv)
    VCOL = L.reduce(0)                    # [BV] over the lanes
    ROW = L.reduce(1)                     # [dk] over the warps and registers
    VEC = rows_layout(4, DK).reduce(0)    # [dk] over the lanes (the dot w . q)
    beta = meta_all[i, 1]
    rows = lambda y: lay.cast(jax.lax.broadcast_in_dim(y, (DK, bv), (0,)), L)
    cols = lambda y: lay.cast(jax.lax.broadcast_in_dim(y, (DK, bv), (1,)), L)

    s = lay.load(t["s"], L).astype(f32)
    q = lay.load(t["q"], ROW)
    if per_channel:
        alpha = jnp.exp(lay.load(t["g"], ROW))
        q = alpha * q
    sb = jnp.sum(s * rows(lay.load(t["b"], ROW)), axis=0)
    sq = jnp.sum(s * rows(q), axis=0)
    u = beta * (lay.load(t["v"], VCOL) - sb)
    wq = jnp.sum(lay.load(t["w"], VEC) * lay.load(t["q"], VEC))
    wu = rows(lay.load(t["w"], ROW)) * cols(u)
    if per_channel:
        return sq + wq * u, rows(alpha) * s + wu
    a = jnp.exp(meta_all[i, 0])
    return a * sq + wq * u, a * s + wu


def tile_order(c, i, tiles: int, programs: int, interleave: bool, xp=jnp):
    """``(tile, count)``: the tile program ``c`` takes at its step ``i`` and how many it takes.
    Runs: tiles ``[c T // programs, (c + 1) T // programs)``; interleaved: ``c + i programs``. The
    steps past a program's count repeat its last tile (read, never written)."""
    if interleave:
        count = (tiles - c + programs - 1) // programs
        return c + xp.minimum(i, count - 1) * programs, count
    start = (c * tiles) // programs
    count = ((c + 1) * tiles) // programs - start
    return start + xp.minimum(i, count - 1), count


def _program(refs, scratch, *, tile_fn, names, tiles, programs, per, nb, stages, per_channel, bv, dtype, inplace,
             interleave, direct, interpret):
    """Program ``c``: its tiles in ``tile_order``; ``direct``: the new state block stored from the
    registers (``store="global"``)."""
    meta_all, o_s = scratch[:2]
    c = jax.lax.axis_index("c")
    count = tile_order(c, 0, tiles, programs, interleave)[1]
    lay = Layouts(interpret)

    def tile_of(i):
        return tile_order(c, i, tiles, programs, interleave)[0]

    def fetch(bar):
        plgpu.copy_gmem_to_smem(refs["meta"].at[c], meta_all, bar.at[0])
        plgpu.barrier_wait(bar.at[0])

    pl.run_scoped(fetch, plgpu.Barrier(num_arrivals=1, num_barriers=1))

    def body(idx, *tiles_in):
        i = idx[0]
        t = tile_of(i)
        tile = dict(zip(names, tiles_in))
        o, s_new = tile_fn(meta_all, i, tile, per_channel=per_channel, bv=bv, lay=lay)
        slot = i % 2
        # The copies out of tile i - 2 have read their slots (o's; in place, the state's slot of
        # tile i - 2 was already refilled, so this only bounds the groups in flight).
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        o_s[slot] = o
        head, cols = t // nb, pl.ds((t % nb) * bv, bv)
        if direct:
            @pl.when(i < count)
            def _():
                refs["s"].at[head, :, cols][...] = s_new.astype(dtype)
        else:
            s_out = tile["s"] if inplace else scratch[2].at[slot]
            s_out[...] = s_new.astype(dtype)
        plgpu.commit_smem()

        @pl.when(i < count)
        def _():
            plgpu.copy_smem_to_gmem(o_s.at[slot], refs["o"].at[head, cols], commit_group=False)
            if not direct:
                plgpu.copy_smem_to_gmem(s_out, refs["s"].at[head, :, cols], commit_group=False)

        plgpu.commit_smem_to_gmem_group()
        if inplace:
            # The pipeline refills this tile's state slot after the next tile's body (the
            # state's spec delays its release by one step): by then this copy has read it.
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)

    specs = dict(
        s=plgpu.BlockSpec((None, DK, bv), lambda i: (tile_of(i) // nb, 0, tile_of(i) % nb),
                          delay_release=1 if inplace else 0),
        v=plgpu.BlockSpec((None, bv), lambda i: (tile_of(i) // nb, tile_of(i) % nb)))
    vec = plgpu.BlockSpec((None, DK), lambda i: (tile_of(i) // nb, 0))
    plgpu.emit_pipeline(body, grid=(per,), in_specs=[specs.get(name, vec) for name in names],
                        max_concurrent_steps=stages)(*[refs[name] for name in names])
    plgpu.wait_smem_to_gmem(0)


# ----------------------------------------------------------------------------- wrapper


def _check(values: jax.Array, token: Token, block_v: int) -> None:
    if values.ndim == 4 and values.shape[2] != DK:
        raise ValueError(f"dk={values.shape[2]}: the Mosaic GPU dense step takes dk = {DK}")
    if block_v not in BLOCKS_V:
        raise ValueError(f"block_v={block_v}: the Mosaic GPU dense step takes {BLOCKS_V}")
    check_dense_inputs(values, token, block_v)


def unsupported_reason(values: jax.Array, token: Token, block_v: int | None = None) -> str | None:
    """Why this kernel cannot take the ``[B, H, dk, dv]`` state ``values`` and ``token`` (``None``
    when it can): ``dense_step``'s input checks, ``dk = 128``, ``block_v`` in ``BLOCKS_V`` dividing ``dv``."""
    try:
        _check(values, token, block_v or default_block_v(values.dtype))
    except (ValueError, TypeError) as err:
        return str(err)
    return None


@functools.partial(jax.jit, static_argnames=("block_v", "programs", "stages", "inplace", "interleave", "store",
                                             "interpret"))
def dense_step(state: jax.Array, token: Token, *, block_v: int | None = None, programs: int | None = None,
               stages: int = DEFAULT_STAGES, inplace: bool = True, interleave: bool = True,
               store: str = DEFAULT_STORE, interpret=None):
    """One dense step on a ``[B, H, 128, dv]`` fp32 or bf16 state (``dense_step.dense_step``'s contract).

    token: general-form ``Token`` with ``H`` value heads. Returns ``(o [B, H, dv] fp32, state)``,
    the state updated in place when the caller's ``jit`` donates it. ``block_v``: value columns
    per tile (``default_block_v``); ``programs``: of the launch (``mosaic_shared.default_programs``);
    ``stages``: tiles in flight per program; ``inplace``: the new state block is written over
    its input slot in shared memory and copied out from there (the slot is refilled one tile
    later), instead of through two output slots of its own (which a program of a single tile
    always takes: the delayed refill needs two stages); ``interleave``: which tiles a program
    takes (``tile_order``); ``store``: how the new state block leaves, ``"global"`` (the default:
    stored from the registers straight to device memory, the state's slot refilled at once;
    ``inplace`` then has no effect) or ``"tma"`` (written to shared memory and copied out by
    TMA). ``interpret``: ``None`` runs compiled on a GPU and in the Mosaic GPU interpreter
    elsewhere.
    """
    return launch(state, token, _tile_step, block_v=block_v, programs=programs, stages=stages, inplace=inplace,
                  interleave=interleave, store=store, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("tile_fn", "block_v", "programs", "stages", "inplace", "interleave",
                                             "store", "interpret"))
def launch(state: jax.Array, token: Token, tile_fn, *, block_v=None, programs=None, stages=DEFAULT_STAGES,
           inplace=True, interleave=True, store=DEFAULT_STORE, interpret=None):
    """``dense_step`` with ``tile_fn`` (``_tile_step``'s signature) as each tile's arithmetic: the
    same pipeline around other arithmetic (``bench.mosaic_dense``'s copy-only variant). Under
    ``vmap`` the mapped axis joins the batch (``mosaic_shared.fold_vmap``)."""
    try:
        _check(state, token, block_v or default_block_v(state.dtype))
    except (ValueError, TypeError) as err:
        raise type(err)(f"Mosaic GPU dense_step cannot run: {err}") from None
    check_launch(programs, stages)
    if store not in STORES:
        raise ValueError(f"store={store!r} must be one of {STORES}")
    interpret = resolve_interpret(interpret, "the Mosaic GPU dense step")
    run = functools.partial(_launch, tile_fn=tile_fn, block_v=block_v, programs=programs, stages=stages,
                            inplace=inplace and store == "tma", interleave=interleave, store=store,
                            interpret=interpret)
    return fold_vmap(run)(state, token)


def _launch(state, token, *, tile_fn, block_v, programs, stages, inplace, interleave, store, interpret):
    """``launch`` on checked options: the scalars' packing and the kernel's launch."""
    bsz, h, dk, dv = state.shape
    bv = block_v or default_block_v(state.dtype)
    per_channel = token.g.ndim == 3
    n, nb = bsz * h, dv // bv
    tiles = n * nb

    def layout(programs):   # (tiles per program, padded to whole scalar runs; stages; in place; bytes)
        per = -(-tiles // programs)
        per_pad = -(-per // META_ALIGN) * META_ALIGN
        st = min(stages, per)
        inp = inplace and st >= 2
        return per, per_pad, st, inp, smem_bytes(bv, st, state.dtype, per_channel, per_pad,
                                                 store == "tma" and not inp)

    if programs is None:
        programs = default_programs(tiles, lambda p: layout(p)[-1])
    programs = min(programs, tiles)
    per, per_pad, stages, inplace, need = layout(programs)
    if need > SMEM_LIMIT:
        raise ValueError(f"block_v={bv} with stages={stages} needs {need} bytes of shared memory per program "
                         f"(at most {SMEM_LIMIT}): take fewer stages or a narrower block")

    # Each program's tiles' scalars (g for GDN, beta, 0, 0), padded to whole 128-byte runs.
    scalars = jnp.stack([jnp.zeros((n,), f32) if per_channel else token.g.reshape(n).astype(f32),
                         token.beta.reshape(n).astype(f32)] + [jnp.zeros((n,), f32)] * 2, axis=-1)
    heads = tile_order(np.arange(programs)[:, None], np.arange(per_pad)[None, :], tiles, programs, interleave,
                       np)[0] // nb
    meta = scalars[jnp.asarray(heads, jnp.int32)]                                  # [programs, per_pad, 4]

    flat = lambda x: x.reshape((n,) + x.shape[2:]).astype(f32)
    arrays = dict(s=state.reshape(n, dk, dv), q=flat(token.q), b=flat(token.b), w=flat(token.w), v=flat(token.v))
    if per_channel:
        arrays["g"] = flat(token.g)
    names = tuple(arrays)
    values = dict(arrays, meta=meta, o=jnp.zeros((n, dv), f32))
    scratch = [plgpu.SMEM((per_pad, 4), f32), plgpu.SMEM((2, bv), f32)]
    if not inplace and store == "tma":
        scratch.append(plgpu.SMEM((2, dk, bv), state.dtype))
    body = functools.partial(_program, tile_fn=tile_fn, names=names, tiles=tiles, programs=programs, per=per, nb=nb,
                             stages=stages, per_channel=per_channel, bv=bv, dtype=state.dtype, inplace=inplace,
                             interleave=interleave, direct=store == "global", interpret=bool(interpret))

    def kernel(refs):
        @pl.core_map(plgpu.Mesh(grid=(programs,), grid_names=("c",)), compiler_params=lane_params(),
                     interpret=interpret, name=f"dense_step_mosaic_{'kda' if per_channel else 'gdn'}_{state.dtype}")
        def dense_step_mosaic():
            pl.run_scoped(lambda *s: body(refs, s), *scratch)

    new = run_kernel(kernel, values)
    return new["o"].reshape(bsz, h, dv), new["s"].reshape(state.shape)

__all__ = ["BLOCKS_V", "DEFAULT_STORE", "DK", "SMEM_LIMIT", "STATE_DTYPES", "STORES", "default_block_v",
           "default_programs", "dense_step", "launch", "smem_bytes", "unsupported_reason"]
