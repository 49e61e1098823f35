"""Helpers of the Mosaic GPU kernels (``mosaic_step``, ``mosaic_dense``, ``mosaic_flush``):
register layouts, the interpret-mode shim, barriers, how a launch is sized and run (inside
``run_state``, folded under ``vmap``), whether the device is a Hopper GPU (``on_hopper``), and the
packed codes read in registers (``code_plane_rows``, ``signed_code_parts``: the step and the flush).

Why one module: the kernels walk their tiles in one ``emit_pipeline`` per program, take the
same register layout (rows over the warps and registers, columns over the lanes), share the
SM's shared-memory budget and run in the Mosaic GPU interpreter on a machine without a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from leapquant_jax.quantizers import code_parts, packed_rows

try:  # the Mosaic GPU interpreter (JAX 0.10+): how the kernels run on a machine without a GPU
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # pragma: no cover - older JAX
    InterpretGPUParams = None

WARPS = 4            # warps of the one warpgroup of a program
LANES = 32
META_ALIGN = 8       # rows of packed per-program scalars (4 fp32 each) per 128-byte run: a TMA copy's unit
SMEM_LIMIT = 232448  # bytes of shared memory a Hopper program may take (227 KB)
SMEM_PER_SM = 233472  # and an SM holds (228 KB),
SMEM_RESERVED = 1024  # 1 KB of it reserved per resident program
SMEM_ALIGN = 1024    # Mosaic GPU starts each shared-memory buffer at a multiple of this
BARRIER_BYTES = 8    # shared memory of one barrier (an mbarrier), after the buffers
REDUCTION_SCRATCH = plgpu.CompilerParams().reduction_scratch_bytes   # what a program adds for cross-warp sums


def _tiled(tiles, *, warp_dims, lane_dims):
    """The Pallas register layout of Mosaic GPU's ``TiledLayout`` over ``tiles`` (the innermost
    dimension the vector), in canonical form."""
    fa = mgpu.fragmented_array
    raw = fa.TiledLayout(fa.Tiling(tiles), warp_dims=warp_dims, lane_dims=lane_dims, vector_dim=-1,
                         _check_canonical=False).canonicalize()
    return plgpu.Layout.TILED(raw.tiling, warp_dims=raw.warp_dims, lane_dims=raw.lane_dims, vector_dim=raw.vector_dim)


def rows_layout(n: int, cols: int = 128):
    """The register layout of a tile ``[n, cols]`` (``n`` a multiple of 4, ``cols`` 32, 64 or 128):
    rows over the 4 warps and each thread's registers, the columns over the 32 lanes,
    ``cols / 32`` per lane (a warp reads one whole row of a tile per load)."""
    if cols % LANES or cols // LANES not in (1, 2, 4):
        raise ValueError(f"cols={cols}: a rows layout spreads 32, 64 or 128 columns over the lanes")
    return _tiled(((n, cols), (n // WARPS, cols), (1, cols // LANES)), warp_dims=(-6,), lane_dims=(-3,))


def swizzle32_layout(n: int):
    """The register layout of a 16-bit tile ``[n, 128]`` (``n`` a multiple of 8) whose stores into
    shared memory tiled ``(8, 16)`` and swizzled over 32 bytes (a tensor-core operand of depth 16)
    meet no bank conflicts: each warp stores one 8 x 16 tile (256 contiguous bytes) at a time, its
    lanes over the tile's 8 rows and four runs of 4 columns; the warps take the tile columns
    ``16 w`` and ``16 w + 64``."""
    if n % 8:
        raise ValueError(f"n={n}: the swizzle-32 layout takes rows in multiples of 8")
    return _tiled(((n, 128), (8, 64), (8, 16), (1, 4)), warp_dims=(-5,), lane_dims=(-4, -3))


def threads_layout():
    """The register layout of a vector ``[128]`` with one element per thread of the warpgroup
    (warp ``w`` holding ``32 w`` to ``32 w + 31``): work on 128 channels that no thread repeats."""
    return _tiled(((WARPS * LANES,), (LANES,), (1,)), warp_dims=(-3,), lane_dims=(-2,))


def row_sums_layout(n: int):
    """The register layout of a tile ``[n, 128]`` (``n`` a multiple of 16) for sums along its rows:
    rows over the 4 warps, then over 4 lanes and each thread's registers; the columns over the
    other 8 lanes, 16 per thread in 4 runs of 4 (32 apart). A row's sum crosses 8 lanes instead
    of the rows layout's 32, and each quarter of a warp still reads 128 contiguous bytes."""
    if n % (4 * WARPS):
        raise ValueError(f"n={n}: the row-sums layout takes rows in multiples of {4 * WARPS}")
    return _tiled(((n, 128), (n // WARPS, 128), (4, LANES), (1, 4)), warp_dims=(-8,), lane_dims=(-4, -3))


class Layouts:
    """Register layouts where the Mosaic GPU lowering needs them; in interpret mode (which has no
    layouts) plain loads and no casts, so that the same body runs there."""

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def load(self, ref, layout):
        return ref[...] if self.interpret else plgpu.load(ref, (), layout=layout)

    def cast(self, x, layout):
        return x if self.interpret else plgpu.layout_cast(x, layout)

    def layout(self, layout):
        """``layout`` compiled, ``None`` in interpret mode (a helper's cue to take its ``jnp`` path)."""
        return None if self.interpret else layout

    def sync(self):
        sync(self.interpret)

    def iota(self, n, layout):
        if self.interpret:
            return jax.lax.broadcasted_iota(jax.numpy.int32, (n,), 0)
        return plgpu.broadcasted_iota(jax.numpy.int32, (n,), 0, layout=layout)


def meet_warps(parts, red, *, lay, combine=jax.numpy.add):
    """The ``combine`` (sums by default, or maxima) over the warps of ``[WARPS, 128]`` tiles ``parts``
    in ``rows_layout(WARPS)`` (each warp's row its partial result): ``[128]`` each in the
    value-column layout ``rows_layout(WARPS).reduce(0)``, the same in every warp, through
    ``red [len(parts), WARPS, 128]`` fp32 between two barriers (the caller makes sure no thread
    still reads what ``red``'s memory held). Why not ``jnp.sum(axis=0)``: Mosaic GPU's generic
    reduction across the warps pays two barriers per vector and bank-conflicted reads; here a
    row's columns are contiguous, so each read is one row for the whole warp, and one exchange
    serves all the parts."""
    VCOL = rows_layout(WARPS).reduce(0)
    for i, part in enumerate(parts):
        red[i] = part
    lay.sync()
    out = [lay.load(red.at[i, 0], VCOL) for i in range(len(parts))]
    for w in range(1, WARPS):
        out = [combine(o, lay.load(red.at[i, w], VCOL)) for i, o in enumerate(out)]
    lay.sync()                   # every warp has read ``red`` before its memory is written again
    return out


def warp_parts(x, combine=jax.numpy.sum):
    """Each warp's ``combine`` over its rows of ``x [n, 128]`` in ``rows_layout(WARPS)`` (warp ``w``
    holding rows ``w, w + WARPS, ...``): ``[WARPS, 128]`` in that layout, in registers only, for
    ``meet_warps``."""
    n, cols = x.shape
    return combine(x.reshape(n // WARPS, WARPS, cols), axis=0)


def code_plane_rows(codes_ref, bits: int, dk: int, start, n: int, layout, lay):
    """The packed byte rows ``start + [0, n)`` of each plane of a head's codes ``codes_ref
    [packed_rows, 128]`` (``quantizers``' planar layout: one plane at 8, 4 and 2 bits, three of
    ``dk / 4`` rows at 6), loaded in ``layout`` (``shared.code_planes`` in a register layout);
    ``signed_code_parts`` makes each key-row part's codes of them (part ``j``: key rows
    ``j dk / parts + start + [0, n)``)."""
    part_rows = dk // code_parts(bits)
    return [lay.load(codes_ref.at[pl.ds(c * part_rows + start, n)], layout)
            for c in range(packed_rows(dk, bits) // part_rows)]


# Each code part's field, as word operations on the byte rows of the planes (``code_plane_rows``):
# ``u = OR over pieces of ((plane ^ xor) >> shift) & mask``, bytewise (``mask <= 0xFF >> shift``:
# a shift of the 32-bit word brings no bit of the next byte into the field), and the signed code
# ``mult u - offset`` (``quantizers.signed_codes``). Pieces: (plane, xor, shift, mask).
CODE_FIELDS = {
    8: [([(0, 0x80, 0, 0xFF)], 1, 128)],
    6: [([(c, 0, 0, 0x3F)], 1, 32) for c in range(3)]           # the planes' low six bits, then the
    + [([(0, 0, 6, 0x03), (1, 0, 4, 0x0C), (2, 0, 2, 0x30)], 1, 32)],   # fourth part of their top two
    4: [([(0, 0, 0, 0x0F)], 1, 8), ([(0, 0, 4, 0x0F)], 1, 8)],
    2: [([(0, 0, 2 * i, 0x03)], 2, 3) for i in range(4)],
}
FIELD_MAGIC = 0x4B000000     # fp32 2**23: with a byte u as its low mantissa bits it reads 2**23 + u


def signed_code_parts(planes, bits: int, layout=None):
    """The signed codes of each key-row part (``quantizers.signed_codes``, fp32, exact) from the
    byte rows of a chunk, ``planes`` (``code_plane_rows``: int8 ``[n, 128]`` at 8 bits, uint8 below),
    as ``CODE_FIELDS`` says. ``layout``: the planes' register layout, compiled (``None``: ``jnp``,
    the interpreter's path and the reference of the compiled one). Compiled, each thread works on
    its 32-bit words of four bytes: the fields' shifts and masks once per word, then per code one
    ``prmt`` that places the field's byte under fp32's exponent of ``2**23`` and one subtraction
    (``2**23 + u - (2**23 + offset)``, exact; at 2 bits ``u`` first, then ``2 u - 3``), no
    integer-to-float conversion."""
    if bits not in CODE_FIELDS:
        raise ValueError(f"bits={bits}: integer codes are 8, 6, 4 or 2 bits")
    if layout is not None:
        return _code_fields_compiled(planes, bits, layout)
    out = []
    for pieces, mult, offset in CODE_FIELDS[bits]:
        u = None
        for c, xor, shift, mask in pieces:
            x = jax.lax.bitcast_convert_type(planes[c], jnp.uint8)
            f = ((x ^ jnp.uint8(xor)) >> shift) & jnp.uint8(mask)
            u = f if u is None else u | f
        out.append(u.astype(jnp.float32) * mult - float(offset))
    return out


def _code_fields_compiled(planes, bits, layout):
    """``signed_code_parts`` on the GPU (``inline_mgpu``): word operations and ``prmt`` per register."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, vector

    shape = planes[0].shape
    fields = CODE_FIELDS[bits]

    @plgpu.inline_mgpu(arg_types=tuple(layout for _ in planes),
                       return_type=tuple(plgpu.ShapeDtypeStruct(shape, jnp.float32, layout) for _ in fields))
    def convert(ctx, *arrays):
        del ctx
        i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
        c = mgpu.utils.c
        word = lambda v: v * 0x01010101
        outs = [np.empty_like(arrays[0].registers) for _ in fields]
        for idx, _ in np.ndenumerate(arrays[0].registers):
            regs = [mgpu.utils.bitcast(a.registers[idx], i32) for a in arrays]
            n = ir.VectorType(arrays[0].registers[idx].type).shape[0]
            for k, (pieces, mult, offset) in enumerate(fields):
                u = None
                for p, xor, shift, mask in pieces:
                    w = regs[p]
                    if xor:
                        w = arith.xori(w, c(word(xor), i32))
                    if shift:
                        w = arith.shrui(w, c(shift, i32))
                    if mask != 0xFF:
                        w = arith.andi(w, c(word(mask), i32))
                    u = w if u is None else arith.ori(u, w)
                vals = []
                for b in range(n):
                    m = llvm.inline_asm(i32, [u], f"prmt.b32 $0, $1, {FIELD_MAGIC:#x}, {0x7440 | b:#x};", "=r,r")
                    v = arith.bitcast(f32, m)
                    if mult == 1:
                        v = arith.subf(v, c(float(2 ** 23 + offset), f32))
                    else:   # mult 2**23 + offset may not be an fp32: u first, then mult u - offset
                        v = arith.subf(v, c(float(2 ** 23), f32))
                        v = arith.subf(arith.mulf(v, c(float(mult), f32)), c(float(offset), f32))
                    vals.append(vector.broadcast(ir.VectorType.get((1,), f32), v))
                outs[k][idx] = mgpu.utils.vector_concat(vals)
        return tuple(mgpu.FragmentedArray(_registers=r, _layout=arrays[0].layout, _is_signed=None) for r in outs)

    return list(convert(*planes))


def resolve_interpret(interpret, what: str):
    """``interpret`` as given, or ``None`` resolved: compiled on a GPU, the Mosaic GPU interpreter
    elsewhere (an error naming ``what`` where this JAX has none)."""
    if interpret is None and jax.default_backend() != "gpu":
        if InterpretGPUParams is None:
            raise RuntimeError(f"{what} needs a GPU or the Mosaic GPU interpreter (JAX >= 0.10)")
        return InterpretGPUParams()
    return interpret


def sm_count() -> int:
    """Streaming multiprocessors of the default device (1 where it does not say)."""
    try:
        sms = jax.devices()[0].core_count
    except (AttributeError, RuntimeError):
        sms = 1
    return max(1, int(sms or 1))


def check_launch(programs, stages) -> None:
    """``ValueError`` unless ``programs`` (or ``None``) and ``stages`` are positive integers."""
    if programs is not None and (not isinstance(programs, int) or programs < 1):
        raise ValueError(f"programs={programs!r} must be a positive integer")
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages={stages!r} must be a positive integer")


def check_chunk(chunk, bits: int, dk: int) -> None:
    """``ValueError`` unless ``chunk`` (key rows of each code part per register tile) is a
    positive multiple of ``WARPS`` dividing the ``dk / parts`` key rows of a ``bits``-bit code part."""
    part_rows = dk // code_parts(bits)
    if not isinstance(chunk, int) or chunk < WARPS or chunk % WARPS or part_rows % chunk:
        where = f"dk={dk}" if part_rows == dk else f"the {part_rows} key rows of a {bits}-bit code part"
        raise ValueError(f"chunk={chunk!r} must be a multiple of {WARPS} dividing {where}")


def aligned(*sizes: int) -> int:
    """Bytes of shared memory that buffers of ``sizes`` bytes take, each from a ``SMEM_ALIGN`` boundary."""
    return sum(-(-x // SMEM_ALIGN) * SMEM_ALIGN for x in sizes)


def smem_union(interpret, *trees):
    """Shared memory for trees of buffers (``plgpu.SMEM``) whose lifetimes are disjoint: one region
    (``plgpu.RefUnion``) compiled, separate buffers in the Mosaic GPU interpreter (which has no
    aliased refs). Either way the kernel receives the trees as given."""
    return tuple(trees) if interpret else plgpu.RefUnion(*trees)


def per_sm(smem: int, cross_warp_sums: bool = True) -> int:
    """Programs of ``smem`` bytes of shared memory each (their buffers and barriers) that fit on an
    SM, each with the per-program reserve and, for a kernel compiled with ``cross_warp_sums``
    (``lane_params``), the cross-warp reductions' scratch."""
    return SMEM_PER_SM // (smem + (REDUCTION_SCRATCH if cross_warp_sums else 0) + SMEM_RESERVED)


def two_per_sm(smem: int, cross_warp_sums: bool = True) -> bool:
    """Whether two programs of ``smem`` bytes fit on an SM (``per_sm``)."""
    return per_sm(smem, cross_warp_sums) >= 2


def default_programs(units: int, smem_of) -> int:
    """Programs of a launch over ``units`` tiles or heads: two per SM where two fit in its shared
    memory (``two_per_sm`` of ``smem_of(programs)`` bytes), else one (the fastest measured,
    docs/performance.md); at most one per unit."""
    sms = sm_count()
    per_sm = 2 if two_per_sm(smem_of(2 * sms)) else 1
    return max(1, min(per_sm * sms, units))


def lane_params(auto_barriers: bool = True, cross_warp_sums: bool = True):
    """Compiler parameters of every kernel here: Lane lowering semantics (the layouts above are
    per-thread register layouts; JAX 0.11's default, Warpgroup, infers its own). Without
    ``auto_barriers`` no store to shared memory is fenced by warpgroup barriers (two per store):
    the kernel places its own (``sync``) where threads exchange data through shared memory.
    Without ``cross_warp_sums`` (a kernel whose reductions stay within a warp, its warps meeting
    through its own buffers, ``meet_warps``) no ``REDUCTION_SCRATCH`` is reserved: Mosaic GPU
    reserves it for any reduction."""
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane,
                                unsafe_no_auto_barriers=not auto_barriers,
                                reduction_scratch_bytes=REDUCTION_SCRATCH if cross_warp_sums else 0)


def sync(interpret) -> None:
    """A barrier of the program's warpgroup (nothing in interpret mode, which runs a program's
    threads as one): what one thread stored to shared memory is visible to all after it."""
    if interpret:
        return

    @plgpu.inline_mgpu()
    def barrier(ctx):
        del ctx
        mgpu.utils.warpgroup_barrier()

    barrier()


def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x), which the compiled
    Mosaic GPU kernels need (``api``)."""
    if jax.default_backend() != "gpu":
        return False
    cc = str(getattr(jax.devices()[0], "compute_capability", "") or "")
    return cc.split(".")[0] == "9"


def fold_vmap(fn):
    """``fn`` (arrays, or pytrees of them, each ``[B, ...]`` with the same batch axis ``B`` first,
    independent along it; results likewise) with a batching rule: under ``vmap`` the mapped
    axis ``V`` is folded into ``B`` (``[V, B, ...]`` -> ``[V B, ...]``, unmapped inputs broadcast)
    and ``fn`` runs once on the folded batch. Why: a ``core_map`` kernel has no batching rule of
    its own, and the per-step methods run under ``vmap``."""
    f = jax.custom_batching.custom_vmap(fn)

    @f.def_vmap
    def rule(axis_size, in_batched, *args):
        tmap = jax.tree_util.tree_map
        args = tmap(lambda x, b: x if b else jax.numpy.broadcast_to(x, (axis_size,) + x.shape), args,
                    tuple(in_batched))
        out = f(*tmap(lambda x: x.reshape((axis_size * x.shape[1],) + x.shape[2:]), args))
        out = tmap(lambda x: x.reshape((axis_size, x.shape[0] // axis_size) + x.shape[1:]), out)
        return out, tmap(lambda _: True, out)

    return f


def run_kernel(kernel, values: dict) -> dict:
    """The final values of the arrays ``values`` (a dict of them) after ``kernel(refs)``, which
    launches a ``core_map`` reading and writing ``refs``, mutable copies of them (in place
    where the caller's ``jit`` donates the inputs). Why ``run_state``: its state stays inside,
    so the launch can sit under ``fold_vmap``'s batching rule. Why the optimization barrier on
    the results: where a result is stored into a slice of a larger array (a ``lax.scan``'s
    stacked outputs), XLA's dynamic-slice fusion hands the kernel that slice as the result's
    buffer, while the kernel writes the result through its aliased input; the slice then keeps
    its old contents (a scanned decode's outputs came back all zero; ``tests/test_mosaic_dense.py``
    checks the barrier)."""
    return jax.lax.optimization_barrier(pl.run_state(kernel)(values))


__all__ = ["BARRIER_BYTES", "CODE_FIELDS", "FIELD_MAGIC", "InterpretGPUParams", "LANES", "Layouts", "META_ALIGN",
           "REDUCTION_SCRATCH", "SMEM_ALIGN", "SMEM_LIMIT", "SMEM_PER_SM", "SMEM_RESERVED", "WARPS", "aligned",
           "check_chunk", "check_launch", "code_plane_rows", "default_programs", "fold_vmap", "lane_params",
           "meet_warps", "on_hopper", "per_sm", "resolve_interpret", "row_sums_layout", "rows_layout", "run_kernel",
           "signed_code_parts", "sm_count", "smem_union", "swizzle32_layout", "sync", "threads_layout", "two_per_sm",
           "warp_parts"]
