"""LeapQuant window flush on Pallas Mosaic GPU (Hopper): GDN and KDA, 8 to 2 bits, 128 x 128 heads.

Contract: ``leapquant_flush.flush_split``'s (``windowed.flush_reference``; with ``only_full`` only
the sequences at ``pos >= p``, ``windowed.maybe_flush``); the buffer is left as it was (no read
reaches a slot at or past the reset ``pos``). Under ``vmap`` the mapped axis joins the batch. With
``only_full`` the programs copy in only the flushed heads (``walk="list"``), so that a decode runs
it on every step (``dispatch.SELF_SKIPPING``).

Why: the split flush sends the fp32 state through device memory and the Triton flush is
latency-bound. Here a program keeps one head's fp32 state (64 KB) in shared memory for every pass
while the copy engine (TMA) brings the next heads in: one read, one write (``mosaic_flush_bytes``).

Structure: ``programs`` programs of one warpgroup walk ``per`` consecutive heads of ``[B H]`` in an
``emit_pipeline`` (``walk="list"``: the flushed heads only). Per head: (0) the decayed key rows
``kd = [D0 K; d_j k_j]`` and row factors ``D0 c`` (``windowed.window_decays``, ``record_keys``), one key
channel per thread, so that ``S = (D0 c)_i scale_j Z_ij + sum_m kd_mi ud_mj`` (``ud = [U; u]``) is
one form for GDN and KDA; then ``chunk`` key rows at a time (``rows_layout(4)``: each warp sums its
rows, then one exchange between the warps, ``meet_warps``): (1) ``S`` and ``Z = S^T Q_0``; (2)
``Y = S Z`` (rows over ``sum_lanes`` lanes) and CholeskyQR2 with the reference's factorisation;
(3) ``U = S^T K^T``, clipped to fp16's range, both rounded to fp16; (4) ``R = S - K^T U``, its
smoothing scales and column maxima in one pass; (5) the codes, written over the input codes in
shared memory and copied out. Each pass is a loop over one chunk's code (``_chunks``); the kernel
places its own barriers where threads exchange data (``auto_barriers=False``).
Codes: int8 ``[dk, 128]`` at 8 bits; below, ``quantizers``' planar layout (uint8 ``[packed_rows,
128]``). Passes (1) and (5) walk ``chunk`` byte rows of every plane at a time: (1) unpacks them in
registers (``mosaic_shared.signed_code_parts``) into every code part's key rows, (5) rounds those
rows (``_grid_codes``: one addition) and packs them into the same byte rows (``shared.store_codes``).
On the tensor cores: ``recon="wgmma"``, the reconstruction's low-rank part (``_rank_part``);
``fit="wgmma"``, pass (2)'s ``Y = S Z`` (``_times_z_mma``, TF32 operands).

Rounding: fp32 in the reference's order but for the summation order of the reconstruction and of
the fit's dot products, ``sqrt`` as ``x rsqrt(x)``, ``floor`` through int32 (``GRID_MATH``) and
divisions as products with reciprocals (Mosaic GPU lowers no ``sqrt`` or ``floor``); a code on a
rounding boundary may differ by one step. ``fit="wgmma"`` rounds ``Y = S Z``'s operands to TF32,
which moves codes further: the decoded-state criterion (``bench.kernel_checks``) judges it.

Defaults, the fastest measured (batch 512; docs/performance.md): one stage (two programs per SM),
``chunk = 16`` rows, ``sum_lanes = 8``, the tensor cores where they can run (``default_recon``,
``default_fit``). Tested with JAX 0.10.2 (interpreter, CPU lowering) and 0.11.2 (H200 and H100).
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from leapquant_jax.compensators import FP16_MAX, SMOOTH_FLOOR, WARM_START_TOPUP, random_start
from leapquant_jax.quantizers import INT_WIDTHS, IntTensor, code_parts, packed_rows, qmax_for_bits, round_codes
from leapquant_jax.state import Checkpoint, LeapQuantConfig, LeapQuantState

from .mosaic_shared import (
    BARRIER_BYTES, SMEM_LIMIT, WARPS, Layouts, aligned, check_chunk, check_launch, code_plane_rows, default_programs,
    fold_vmap, lane_params, meet_warps, resolve_interpret, row_sums_layout, rows_layout, run_kernel, signed_code_parts,
    smem_union, swizzle32_layout, threads_layout, warp_parts,
)
from .shared import cholesky_qr_round, scale_cols_to_unit_max, store_codes
from .support import unsupported_reason as kernels_unsupported_reason

f32 = jnp.float32
DK = 128                 # key rows and value columns of a head (the rows layout's 128 columns)
DEFAULT_CHUNK = 16       # key rows per register tile: 16 keeps the r fit accumulators in registers
DEFAULT_STAGES = 1       # heads in flight per program: one, so that two programs fit on an SM
DEFAULT_SUM_LANES = 8    # lanes a row of S spans in the fit's Y = S Z (mosaic_shared.row_sums_layout)
META_COLS = 4            # a head's scalars before GDN's record log-decays: flushed or not, pos, 0, 0
RECONS = ("fma", "records", "wgmma")   # where the reconstruction's rank-(r + p) products run (leapquant_flush)
FITS = ("fma", "wgmma")     # the fit's Y = S Z: CUDA-core FMAs or the tensor cores (TF32)
FIT_COLS = 8                # fit="wgmma": the product's N, the most Compensator Tokens it takes
FIT_MIN_BITS = 4            # default_fit: the narrowest codes a TF32 fit met the decoded-state criterion at
WALKS = ("pipeline", "list")  # which heads a program copies in: all of its own, or the flushed ones only
LIST_MAX_HEADS = 2 ** 24    # walk="list": its head indices are fp32, exact up to here
MM_DEPTH = 16            # the window's multiple for recon="wgmma": an fp16 wgmma's depth
MM_SCALE = 2.0 ** 14     # the decayed keys' largest magnitude after scaling, well inside fp16's range
MM_FLOOR = 2.0 ** -100   # the scaling's divisor when every decayed key is zero (no live record)
STATE_SWIZZLE = 128      # bytes: the state's swizzle with recon="wgmma" (a 128-byte row per 8-row tile)
MM_SWIZZLE = 32          # bytes: the fp16 operands' swizzle: a wgmma's depth is a multiple of its width (16)


# ----------------------------------------------------------------------------- kernel


def _sqrt(x):
    """``sqrt(x)`` for ``x >= 0`` as ``x rsqrt(x)`` (0 at 0): Mosaic GPU lowers ``rsqrt``, not ``sqrt``."""
    return jnp.where(x > 0, x * jax.lax.rsqrt(x), 0.0)


def _floor(x):
    """``floor(x)`` for ``|x| < 2**31``: Mosaic GPU lowers no ``floor``; the conversion to int32
    truncates toward zero, one less where that went up (a negative non-integer)."""
    t = x.astype(jnp.int32).astype(f32)
    return jnp.where(t > x, t - 1.0, t)


# The array module of quantizers.round_codes here: its rule as the reference's, floor as above.
GRID_MATH = types.SimpleNamespace(floor=_floor, round=jnp.round, clip=jnp.clip)
ROUND_MAGIC = 1.5 * 2.0 ** 23   # t + this in [2**23, 2**24) has a unit last place: fp32 addition rounds t


def _grid_codes(t, bits):
    """``quantizers.round_codes(t, bits)`` as int32 whose low 22 bits hold the code (two's
    complement), all that ``shared.store_codes`` keeps of it. At 8, 6 and 4 bits: ``clip(t) +
    ROUND_MAGIC`` (the addition rounds to the nearest integer, ties to even, as ``round`` does; the
    clip before the rounding gives the same grid value as after it), read as int32: one addition
    for the rounding and the float-to-int conversion. At 2 bits (the nearest odd integer) through
    ``GRID_MATH``."""
    if bits == 2:
        return round_codes(t, bits, xp=GRID_MATH).astype(jnp.int32)
    qmax = qmax_for_bits(bits)
    return jax.lax.bitcast_convert_type(jnp.clip(t, -qmax, qmax) + ROUND_MAGIC, jnp.int32)


def _zero_unless(keep, x):
    """``x`` where the scalar ``keep`` holds, else zeros, as a product: ``x`` is finite here (a
    quotient by a pivot of at least ``sqrt(shift)``)."""
    return x * jnp.where(keep, 1.0, 0.0)


def _cholesky_qr(cols, rank):
    """CholeskyQR2 of the columns ``cols`` (``rank`` fp32 vectors ``[dk]``) as
    ``compensators.cholesky_qr2`` (a dropped column comes out zero)."""
    cols = scale_cols_to_unit_max([[x] for x in cols])
    for _ in range(2):
        cols = cholesky_qr_round(cols, rank, sqrt=_sqrt, zero_unless=_zero_unless)
    return [c[0] for c in cols]


def _chunks(n, fetch, body, carry, unroll):
    """``carry = body(k, fetch(k), carry)`` for the chunks ``k < n``: a ``fori_loop`` (one chunk's
    code, run ``n`` times), or written out ``n`` times with ``unroll`` (static ``k``). ``fetch``
    makes all of a chunk's loads from shared memory before ``body``'s arithmetic and stores, so
    that their latencies overlap (the faster of the orders measured, docs/performance.md)."""
    if unroll:
        for k in range(n):
            carry = body(k, fetch(k), carry)
        return carry
    return jax.lax.fori_loop(0, n, lambda k, c: body(k, fetch(k), c), carry)


def _decayed_keys(meta, t, kd_ref, *, r, p, per_channel, smoothing, lay):
    """The reconstruction's key rows into ``kd_ref [r + p + 1, dk]``: ``D0 K`` (the Compensator
    Tokens' keys), ``w_j k_j`` (the records', zero for dead slots) and the row factors ``D0 c``,
    as ``windowed.window_decays`` and ``record_keys`` make them (log-space running sums of the
    live records' log-decays, masked before ``exp``). ``meta``: the head's scalars (``pos`` at 1;
    GDN's record log-decays from ``META_COLS``); KDA's come per channel in ``t["rg"] [p, dk]``.
    One key channel per thread (``mosaic_shared.threads_layout``): no thread repeats another's
    exponentials, products and stores (in the column layout every warp made all of them)."""
    D = threads_layout()
    pos = meta[1]
    vec = lambda ref: lay.load(ref, D).astype(f32)
    if per_channel:
        gs = [jnp.where(j < pos, vec(t["rg"].at[j]), 0.0) for j in range(p)]
    else:
        gs = [jnp.where(j < pos, meta[META_COLS + j], 0.0) for j in range(p)]
    G = [gs[0]]
    for j in range(1, p):
        G.append(G[-1] + gs[j])
    G_l = G[-1]             # dead slots add zero: the sum of the live records' log-decays
    D0 = jnp.exp(G_l)
    for c in range(r):
        kd_ref[c] = D0 * vec(t["ck"].at[c])
    for j in range(p):
        w = jnp.exp(jnp.where(j < pos, G_l - G[j], -jnp.inf))
        kd_ref[r + j] = w * vec(t["rk"].at[j])
    if smoothing:
        kd_ref[r + p] = D0 * vec(t["smooth"])
    else:
        kd_ref[r + p] = D0 * lay.cast(jnp.ones((DK,), f32), D)


def _swizzled(shape, dtype, swizzle, interpret):
    """Shared memory ``shape`` tiled and swizzled (``_swizzle``), plain in the Mosaic GPU
    interpreter (which has no such transforms)."""
    if interpret:
        return plgpu.SMEM(shape, dtype)
    return plgpu.SMEM(shape, dtype, transforms=_swizzle(dtype, swizzle))


def _swizzle(dtype, swizzle):
    """Tiles of 8 rows by ``swizzle`` bytes of ``dtype``, swizzled over ``swizzle`` bytes."""
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def _rank_part(t, kd_ref, s_ref, a16, *, r, p, tokens, lay):
    """The reconstruction's low-rank part, ``sum_m kd_mi ud_mj``, into ``s_ref [dk, dv]`` on the
    tensor cores, scaled by ``MM_SCALE / max |kd|``; returns that factor's inverse. The records'
    rows ``m = r + j`` always; with ``tokens`` the Compensator Tokens' rows ``m < r`` too
    (``mm_rows``), else the caller adds theirs on the CUDA cores.

    The decayed keys (``kd_ref`` rows, fp32) are scaled per head to a largest magnitude of
    ``MM_SCALE``, so that fp16 neither overflows nor loses the small ones, and split into two fp16
    pieces (``hi``, ``lo = x - hi``: about 22 bits) stored in ``a16 [mm_rows, dk]``: the records'
    ``[hi; lo]`` (``2 p`` rows), then with ``tokens`` the tokens' ``[hi; lo]`` and their values
    ``t["cu"]`` (``MM_DEPTH`` rows each, zero past ``r``). The fp16 values (the records' ``t["ru"]
    [p, dv]``, copied in tiled and swizzled, and the tokens') are exact operands. Two ``wgmma`` of
    depth ``p`` (and two of depth ``MM_DEPTH``) per half of the key rows (64 rows: a 64-register
    accumulator) sum the exact products in fp32. The interpreter takes the same pieces through
    ``jnp.dot``."""
    # Read in the layout of the pieces' conflict-free stores (the read itself is bank-conflicted: 16 rows once)
    load = lambda rows, n: (kd_ref[pl.ds(rows, n)] if lay.interpret else     # noqa: E731
                            plgpu.load(kd_ref.at[pl.ds(rows, n)], (), layout=swizzle32_layout(n), optimized=False))
    x = load(r, p)
    col_max = jnp.max(jnp.abs(x), axis=0)  # the columns' maxima first: one exchange between the warps at the end
    if tokens:
        # The tokens' rows: the first MM_DEPTH rows of kd_ref (r <= MM_DEPTH <= r + p), zero past r
        L = swizzle32_layout(MM_DEPTH)
        row = (jnp.arange(MM_DEPTH)[:, None] if lay.interpret else
               plgpu.broadcasted_iota(jnp.int32, (MM_DEPTH, DK), 0, layout=L))
        xc = jnp.where(row < r, load(0, MM_DEPTH), 0.0)
        col_max = jnp.maximum(col_max, jnp.max(jnp.abs(xc), axis=0))
        uc = lay.cast(jnp.zeros((MM_DEPTH, DK), jnp.float16), L)
        for c in range(r):
            v = t["cu"][c] if lay.interpret else lay.load(t["cu"].at[c], L.reduce(0))
            uc = jnp.where(row == c, lay.cast(jax.lax.broadcast_in_dim(v, (MM_DEPTH, DK), (1,)), L), uc)
    mx = jnp.maximum(jnp.max(col_max, axis=0), MM_FLOOR)

    def pieces(x):
        xs = x * (MM_SCALE / mx)
        hi = xs.astype(jnp.float16)
        return hi, (xs - hi.astype(f32)).astype(jnp.float16)
    operands = [(pieces(x), t["ru"][...] if lay.interpret else t["ru"], 0)]
    if tokens:
        operands.append((pieces(xc), uc, 2 * p))
    if lay.interpret:
        dot = functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST)
        s_ref[...] = sum(dot(a.astype(f32).T, b.astype(f32)) for ab, b, _ in operands for a in ab)
        return mx / MM_SCALE
    products = []
    for (hi, lo), b, at in operands:
        n = hi.shape[0]
        a16[pl.ds(at, n)] = hi
        a16[pl.ds(at + n, n)] = lo
        if at:      # the tokens' values after their pieces
            a16[pl.ds(at + 2 * n, n)] = b
            b = a16.at[pl.ds(at + 2 * n, n)]
        products.append((at, n, b))
    plgpu.commit_smem()     # the generic-proxy stores are seen by the tensor cores' reads
    lay.sync()
    half = DK // 2
    for h in range(2):
        cols = pl.ds(h * half, half)

        def product(acc_ref, cols=cols):
            for at, n, b in products:
                for piece in range(2):
                    plgpu.wgmma(acc_ref, plgpu.transpose_ref(a16.at[pl.ds(at + piece * n, n), cols], (1, 0)), b)
            return acc_ref[...]
        acc = pl.run_scoped(product, plgpu.ACC((half, DK), f32))
        lay.sync()          # a16 lies in the state's second half: every warp's products have read it
        s_ref[cols] = acc
    lay.sync()
    return mx / MM_SCALE


def mm_rows(p: int, r: int, recon: str) -> int:
    """Rows of the tensor-core reconstruction's fp16 operands (``_rank_part``): the records' two
    pieces (``2 p``), then with ``recon="wgmma"`` and Compensator Tokens the tokens' two pieces and
    values (``MM_DEPTH`` rows each), where those fit in the state's second half (``p <= 40``,
    ``r <= MM_DEPTH``); 0 with ``recon="fma"``."""
    if recon == "fma":
        return 0
    tokens = 3 * MM_DEPTH if recon == "wgmma" and 0 < r <= MM_DEPTH and 2 * p + 3 * MM_DEPTH <= DK else 0
    return 2 * p + tokens


def _times_z_mma(zs, s_ref, yt, zt, *, r, lay):
    """``Y = S Z`` on the tensor cores for the columns ``zs`` (``r`` vectors ``[dv]``, ``r <=
    FIT_COLS``): returns ``yt [FIT_COLS, dk]``, whose rows ``c < r`` are Y's columns. ``zs`` go into
    the rows of ``zt`` (tiled and swizzled; rows past ``r`` zero), the ``B`` operand read transposed;
    ``S`` (the state, swizzled, ``recon="wgmma"``) by 64 rows at a time is ``A``: TF32 operands
    (the fit passes the decoded-state criterion with all its products in TF32,
    docs/performance.md), fp32 sums. Each ``[64, FIT_COLS]`` accumulator is stored transposed, in
    ``WGMMA_TRANSPOSED`` registers, into 64 columns of ``yt``. The interpreter takes ``jnp.dot``."""
    lay.sync()          # the last readers of this memory (the warps' exchange, the basis) are past it
    if lay.interpret:
        for c in range(r):
            yt[c] = jnp.dot(s_ref[...], zs[c], precision=jax.lax.Precision.HIGHEST)
        return yt
    # Z's rows as one [FIT_COLS, dk] tile (a tiled ref takes whole tiles): row c of it zs[c], zero past r
    L = rows_layout(WARPS)
    row = plgpu.broadcasted_iota(jnp.int32, (FIT_COLS, DK), 0, layout=L)
    z = lay.cast(jnp.zeros((FIT_COLS, DK), f32), L)
    for c in range(r):
        z = jnp.where(row == c, lay.cast(jax.lax.broadcast_in_dim(zs[c], (FIT_COLS, DK), (1,)), L), z)
    zt[...] = z
    plgpu.commit_smem()     # the generic-proxy stores are seen by the tensor cores' reads
    lay.sync()
    half = DK // 2
    for h in range(2):
        def product(acc_ref, h=h):
            plgpu.wgmma(acc_ref, s_ref.at[pl.ds(h * half, half)], plgpu.transpose_ref(zt, (1, 0)))
            return acc_ref[...]
        acc = pl.run_scoped(product, plgpu.ACC((half, FIT_COLS), f32))
        plgpu.transpose_ref(yt.at[:, pl.ds(h * half, half)], (1, 0))[...] = plgpu.layout_cast(
            acc, plgpu.Layout.WGMMA_TRANSPOSED)
    return yt


def _head_flush(meta, t, outs, s_ref, fit_ref, kd_ref, red, start, *, r, p, per_channel, smoothing, fit_iters, chunk,
                bits, unroll, sum_lanes, recon, a16, fit, tz, lay):
    """One head's flush from its shared-memory tiles ``t`` (a dict of refs) into the output
    slots ``outs`` (codes over ``t["codes"]``, ``scale``, ``smooth``, ``ck``, ``cu``), with ``S`` in
    ``s_ref [dk, dv]``, the fit's rows in ``fit_ref [2, max(r, 2), dk]`` and the reconstruction's key
    rows and row factors in ``kd_ref [r + p + 1, dk]`` (``_decayed_keys``, from the head's scalars
    ``meta``); ``red [max(r, 1), WARPS, dk]``: the warps' exchange of their column sums and maxima
    (``meet_warps``); ``kd_ref``, ``fit_ref`` with ``outs``, and ``red`` share their memory, each
    used while the others are not (``red[0]`` lies in ``fit_ref``: the column maxima meet while the
    outputs wait for their copy); ``start``: the ref of the fit's first basis ``[r, dk]``. Each
    pass walks the key rows ``chunk`` at a time in a loop (``_chunks``); those that read or write
    the ``bits``-bit codes, ``chunk`` byte rows of every plane at a time (each code part's
    ``chunk`` key rows of them, ``key_rows``). ``fit="wgmma"``: ``Y = S Z`` on the tensor cores
    through ``tz`` (``_times_z_mma``), which shares its memory with ``fit_ref``."""
    CH = rows_layout(WARPS)      # a chunk's rows w, w + 4, ... on warp w: its sums over rows stay in a warp
    CROW = CH.reduce(1)          # [chunk] over the warps and registers: a row's factor
    VCOL = CH.reduce(0)          # [128] over the lanes: a column's factor (or a row of the fit)
    nch = DK // chunk
    rows = lambda k: pl.ds(k * chunk, chunk)
    parts = code_parts(bits)
    part_rows = DK // parts
    key_rows = lambda k, j: pl.ds(j * part_rows + k * chunk, chunk)    # code part j's rows at byte rows k chunk
    along = lambda y: lay.cast(jax.lax.broadcast_in_dim(y, (chunk, DK), (0,)), CH)     # [chunk] -> rows
    across = lambda y: lay.cast(jax.lax.broadcast_in_dim(y, (chunk, DK), (1,)), CH)    # [128] -> columns
    zeros = lambda: lay.cast(jnp.zeros((chunk, DK), f32), CH)
    loop = functools.partial(_chunks, nch, unroll=unroll)
    by_bytes = functools.partial(_chunks, part_rows // chunk, unroll=unroll)     # chunks of byte rows

    def col_sums(acc):
        # Each warp's sums over its rows, then one exchange between the warps for all of them.
        return meet_warps([warp_parts(a) for a in acc], red, lay=lay)

    # 0. The decayed keys and row factors, read by other threads in the rows layout.
    _decayed_keys(meta, t, kd_ref, r=r, p=p, per_channel=per_channel, smoothing=smoothing, lay=lay)
    lay.sync()

    # 1. S and the first round's Z = S^T Q_0.
    scale = lay.load(t["scale"], VCOL)
    mm = recon != "fma"     # the records' part on the tensor cores (and the tokens', mm_rows), the rest below
    tokens = mm_rows(p, r, recon) > 2 * p
    fma_rank = 0 if tokens else r
    ud = [lay.load(t["cu"].at[c], VCOL).astype(f32) for c in range(fma_rank)]
    if mm:
        unscale = _rank_part(t, kd_ref, s_ref, a16, r=r, p=p, tokens=tokens, lay=lay)
    else:
        ud += [lay.load(t["ru"].at[j], VCOL).astype(f32) for j in range(p)]

    def build_loads(kr):
        # Key rows kr's factors. With recon="fma" the r + p factor rows are loaded next to their
        # products, not all ahead (20 more vectors in registers).
        x = dict(f=lay.load(kd_ref.at[r + p, kr], CROW), q=[lay.load(start.at[c, kr], CROW) for c in range(r)])
        if mm:
            x.update(acc=lay.load(s_ref.at[kr], CH), kd=[lay.load(kd_ref.at[m, kr], CROW) for m in range(fma_rank)])
        return x

    def build_fetch(k):
        # the byte rows of every plane and the first part's factors; the other parts' next to their products
        return code_plane_rows(t["codes"], bits, DK, k * chunk, chunk, CH, lay), build_loads(key_rows(k, 0))

    def build(k, x, zacc):
        planes, first = x
        for j, z in enumerate(signed_code_parts(planes, bits, lay.layout(CH))):     # exact codes, fp32
            kr = key_rows(k, j)
            y = first if j == 0 else build_loads(kr)
            s = z * along(y["f"]) * across(scale)
            if mm:
                s = y["acc"] * unscale + s
            for m, u in enumerate(ud):
                kd = y["kd"][m] if mm else lay.load(kd_ref.at[m, kr], CROW)
                s = s + along(kd) * across(u)
            s_ref[kr] = s
            zacc = tuple(zacc[c] + s * along(y["q"][c]) for c in range(r))
        return zacc

    zacc = by_bytes(build_fetch, build, tuple(zeros() for _ in range(r)))
    lay.sync()      # every thread is past its reads of kd_ref, whose memory the fit's rows take next

    def times_z(zs):
        """``Y = S Z`` for the columns ``zs`` (``r`` vectors ``[dv]``): stored as rows of ``fit_ref[0]``.
        With ``sum_lanes = 8`` the rows of ``S`` are read in ``row_sums_layout`` (a row's sums cross 8
        lanes, not 32) and ``zs`` pass through ``fit_ref[1]`` (free until the new basis) into its
        column layout."""
        YL, y_across = CH, across
        if sum_lanes == 8:
            YL = row_sums_layout(chunk)
            lay.sync()      # the last round's basis in fit_ref[1] has been read
            for c in range(r):
                fit_ref[1, c] = zs[c]
            lay.sync()
            zs = [lay.load(fit_ref.at[1, c], YL.reduce(0)) for c in range(r)]
            y_across = lambda y: lay.cast(jax.lax.broadcast_in_dim(y, (chunk, DK), (1,)), YL)

        def chunk_rows(k, s, carry):
            for c in range(r):
                fit_ref[0, c, rows(k)] = jnp.sum(s * y_across(zs[c]), axis=1)
            return carry
        loop(lambda k: lay.load(s_ref.at[rows(k)], YL), chunk_rows, ())

    def times_rows(q_row):
        """``S^T q`` for each row ``q_row(c, k)`` (a ``[chunk]`` CROW vector): ``r`` vectors ``[dv]``."""
        def loads(k):
            return lay.load(s_ref.at[rows(k)], CH), [q_row(c, k) for c in range(r)]

        def chunk_rows(k, x, acc):
            s, q = x
            return tuple(acc[c] + s * along(q[c]) for c in range(r))
        acc = loop(loads, chunk_rows, tuple(zeros() for _ in range(r)))
        lay.sync()      # every thread is past its reads of fit_ref, whose memory red takes
        return col_sums(acc)

    if r:
        # 2. Subspace iteration: Y = S Z, orthonormalised; later rounds from the new basis.
        zs = col_sums(zacc)
        for it in range(fit_iters):
            if it:
                zs = times_rows(lambda c, k: lay.load(fit_ref.at[1, c, rows(k)], CROW))
            if fit == "wgmma":
                y_rows = _times_z_mma(zs, s_ref, *tz, r=r, lay=lay)
            else:
                times_z(zs)
                y_rows = fit_ref.at[0]
            lay.sync()
            y = [lay.load(y_rows.at[c], VCOL) for c in range(r)]
            if fit == "wgmma":
                lay.sync()  # every thread has read Y, whose memory the basis takes
            basis = _cholesky_qr(y, r)
            for c in range(r):
                fit_ref[1, c] = basis[c]
            lay.sync()
        # 3. U = S^T K^T from the fp32 K, clipped; both rounded to fp16.
        ks = [lay.load(fit_ref.at[1, c], VCOL) for c in range(r)]    # before red takes fit_ref's memory
        us = times_rows(lambda c, k: lay.load(fit_ref.at[1, c, rows(k)], CROW))
        for c in range(r):
            u16 = jnp.clip(us[c], -FP16_MAX, FP16_MAX).astype(jnp.float16)
            outs["cu"][c] = u16
            k16 = ks[c].astype(jnp.float16)
            outs["ck"][c] = k16
            fit_ref[0, c] = k16.astype(f32)
            us[c] = u16.astype(f32)
        lay.sync()

    # 4, 5. R = S - K^T U from the rounded factors, the smoothing scales of its rows, R / c and
    # its column maxima (a reciprocal per row and per column: a division per element costs
    # about ten instructions). A chunk's rows are whole, so one pass does both.
    def residual_loads(k):
        return lay.load(s_ref.at[rows(k)], CH), [lay.load(fit_ref.at[0, c, rows(k)], CROW) for c in range(r)]

    def residual(k, x, cmax):
        s, kf = x
        for c in range(r):
            s = s - along(kf[c]) * across(us[c])
        if smoothing:
            cs = jnp.maximum(_sqrt(jnp.sum(jnp.abs(s), axis=1) / DK), SMOOTH_FLOOR)
            outs["smooth"][rows(k)] = cs
            s = s * along(1.0 / cs)
        if r or smoothing:
            s_ref[rows(k)] = s
        return jnp.maximum(cmax, jnp.abs(s))

    cmax = loop(residual_loads, residual, zeros())
    lay.sync()      # every thread is past its reads of fit_ref, whose first rows red[0] takes
    new_scale = meet_warps([warp_parts(cmax, jnp.max)], red, lay=lay, combine=jnp.maximum)[0] / qmax_for_bits(bits)
    outs["scale"][...] = new_scale
    inv = across(1.0 / jnp.where(new_scale > 0, new_scale, 1.0))

    # 5. The codes, over the input codes: every part's rows of a chunk of byte rows, packed.
    def codes(k, ss, carry):
        q = [_grid_codes(s * inv, bits) for s in ss]
        store_codes(t["codes"], q, bits, DK, k * chunk, chunk)
        return carry

    by_bytes(lambda k: [lay.load(s_ref.at[key_rows(k, j)], CH) for j in range(parts)], codes, ())


def _program(refs, scratch, *, names, keyed, out_names, n, h, hk, per, stages, r, p, per_channel, smoothing, fit_iters,
             warm_start, chunk, bits, unroll, sum_lanes, recon, fit, walk, programs, interpret):
    """Program ``c``: its heads ``c per + [0, per)``, or with ``walk="list"`` the list's entries
    ``c, c + programs, ...`` (module docstring). ``keyed``: the inputs read per key head (``hk`` of
    the ``h`` heads)."""
    start_s, s_ref, (kd_ref, (fit_ref, slots), red, *tz) = scratch[:3]
    tz = tz[0] if tz else None
    s_ref, a16 = (s_ref[0], s_ref[1][1]) if recon != "fma" else (s_ref, None)
    slots = dict(zip(out_names, slots))
    c = jax.lax.axis_index("c")
    lay = Layouts(interpret)
    delay = min(stages - 1, 1)
    cols, listed = meta_cols(p, per_channel), listed_entries(per)

    def key_head(t):
        return (t // h) * hk + (t % h) // (h // hk)

    def fetch(bars):
        # The launch's count of flushed heads into the decayed keys' first row, free until the first
        # head; with walk="list" the program's row of the list
        plgpu.copy_gmem_to_smem(refs["launch"], kd_ref.at[0], bars.at[0])
        if r and not warm_start:
            plgpu.copy_gmem_to_smem(refs["seeded_start"], start_s, bars.at[1])
            plgpu.barrier_wait(bars.at[1])
        plgpu.barrier_wait(bars.at[0])
        if walk == "list":
            plgpu.copy_gmem_to_smem(refs["order"].at[c], scratch[3][0].at[pl.ds(cols, listed)], bars.at[0])
            plgpu.barrier_wait(bars.at[0])

    pl.run_scoped(fetch, plgpu.Barrier(num_arrivals=1, num_barriers=2))

    def body(idx, *tiles):
        flush_head(c * per + idx[0], dict(zip(names, tiles)))
        # The pipeline refills this head's codes slot after the next head's body where the
        # codes' spec delays its release by one step (two stages or more), else after this one:
        # by then this copy has read it.
        plgpu.wait_smem_to_gmem(delay, wait_read_only=True)

    def flush_head(t, tile):
        # The copies out of the earlier heads have read the output slots, whose memory the
        # decayed keys take (with one stage they ended with the last head's body).
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when((t < n) & (tile["meta"][0] > 0))     # a head that is not flushed: no work, no store
        def _():
            start = tile["start"] if warm_start else start_s
            _head_flush(tile["meta"], tile, slots, s_ref, fit_ref, kd_ref, red, start, r=r, p=p,
                        per_channel=per_channel, smoothing=smoothing, fit_iters=fit_iters, chunk=chunk, bits=bits,
                        unroll=unroll, sum_lanes=sum_lanes, recon=recon, a16=a16, fit=fit, tz=tz, lay=lay)
            plgpu.commit_smem()
            lay.sync()
            plgpu.copy_smem_to_gmem(tile["codes"], refs["codes"].at[t], commit_group=False)
            for name, ref in slots.items():
                plgpu.copy_smem_to_gmem(ref, refs[name].at[t], commit_group=False)

        plgpu.commit_smem_to_gmem_group()

    def spec(name, x):
        zeros = (0,) * (x.ndim - 1)
        head = key_head if name in keyed else (lambda t: t)
        # recon on the tensor cores: the records' values are copied in as their operand
        swizzled = name == "ru" and recon != "fma" and not interpret
        return plgpu.BlockSpec((None,) + x.shape[1:], lambda i: (head(jnp.minimum(c * per + i, n - 1)),) + zeros,
                               transforms=_swizzle(x.dtype, MM_SWIZZLE) if swizzled else (),
                               delay_release=delay if name == "codes" else 0)

    ins = [refs[name] for name in names]
    if walk == "list":
        # The list's row after the head's scalars, in their buffer
        tiles, bars = dict(zip(names, scratch[3])), scratch[4]
        tiles["meta"], row = tiles["meta"].at[pl.ds(0, cols)], tiles["meta"]
        count = kd_ref.at[0][0].astype(jnp.int32)    # read before the first head takes kd_ref's memory

        def entry(j, carry):
            t = row[cols + j].astype(jnp.int32)
            lay.sync()      # every thread is past its reads of the last head's tiles,
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # and its copies out past theirs
            for b, name in enumerate(names):
                plgpu.copy_gmem_to_smem(refs[name].at[key_head(t) if name in keyed else t], tiles[name], bars.at[b])
            for b in range(len(names)):
                plgpu.barrier_wait(bars.at[b])
            flush_head(t, tiles)
            return carry

        jax.lax.fori_loop(0, jnp.maximum(count - c + programs - 1, 0) // programs, entry, None)
        plgpu.wait_smem_to_gmem(0)
        return

    @pl.when(kd_ref.at[0][0] > 0)   # a launch that flushes no head (a count of 0) copies nothing in
    def _():
        plgpu.emit_pipeline(body, grid=(per,), in_specs=[spec(name, x) for name, x in zip(names, ins)],
                            max_concurrent_steps=stages)(*ins)
        plgpu.wait_smem_to_gmem(0)


# ----------------------------------------------------------------------------- wrapper


def unsupported_reason(config: LeapQuantConfig, state: LeapQuantState) -> str | None:
    """Why this kernel cannot take ``config`` and ``state`` (``None`` when it can): the kernels'
    ``support.unsupported_reason``, integer codes at 8, 6, 4 or 2 bits (any rank it allows),
    ``dk = dv = 128``."""
    why = kernels_unsupported_reason(config, state)
    if why is not None:
        return why
    if config.bits not in INT_WIDTHS or not isinstance(state.checkpoint.residual, IntTensor):
        return (f"the Mosaic GPU flush writes 8-bit integer codes and packed 6-, 4- and 2-bit ones only "
                f"(bits={config.bits}, residual_format={config.residual_format!r})")
    dk, dv = state.shape[2:]
    if dk != DK or dv != DK:
        return f"dk={dk}, dv={dv}: the Mosaic GPU flush takes {DK} x {DK} heads"
    return None


def takes_tensor_cores(config: LeapQuantConfig) -> bool:
    """Whether the tensor cores' reconstruction (``recon`` ``"records"`` or ``"wgmma"``) can take
    ``config``: float16 records (exact fp16 operands) and a window that is a multiple of ``MM_DEPTH``
    up to 64 (its operands fit in half the state's memory)."""
    return config.record_dtype == "float16" and config.window % MM_DEPTH == 0 and config.window <= DK // 2


def default_recon(config: LeapQuantConfig) -> str:
    """``recon`` where the caller leaves it ``None``: ``"wgmma"`` where it can run (a little faster
    than ``"records"``, which is a little faster than ``"fma"``, docs/performance.md), else ``"fma"``."""
    return "wgmma" if takes_tensor_cores(config) else "fma"


def default_fit(config: LeapQuantConfig, recon: str | None = None) -> str:
    """``fit`` where the caller leaves it ``None`` (``recon`` as given, ``None``: ``default_recon``):
    ``"wgmma"`` where it can run (the tensor cores' reconstruction, at most ``FIT_COLS`` Compensator
    Tokens) from ``FIT_MIN_BITS`` up (4 to 7% faster than ``"fma"`` and within the decoded-state
    criterion there; at 2 bits GDN's missed it, docs/performance.md), else ``"fma"``."""
    recon = default_recon(config) if recon is None else recon
    fits = recon != "fma" and config.effective_rank <= FIT_COLS and config.bits >= FIT_MIN_BITS
    return "wgmma" if fits else "fma"


def meta_cols(p: int, per_channel: bool) -> int:
    """Columns of a head's row of scalars: ``META_COLS``, then GDN's ``p`` record log-decays, in
    whole 128-byte units (a copy moves a multiple of 128 bytes)."""
    return -(-(META_COLS + (0 if per_channel else p)) // 32) * 32


def smem_bytes(config: LeapQuantConfig, stages: int, per_channel: bool, listed: int = 0, fit: str = "fma") -> int:
    """Shared memory of one program (each buffer from a 1 KB boundary, ``mosaic_shared.aligned``):
    ``stages`` of each of a head's inputs, the fp32 state, the decayed keys or (sharing their
    memory) the fit's rows and the output slots besides the codes or the warps' exchange
    (``meet_warps``), the start and the scalars (with ``walk="list"``, ``listed > 0``: the list's
    ``listed`` entries after them), then the barriers: two for the first copies, then one per stage
    (the pipeline) or one per input (the list). Leaves out the cross-warp reductions'
    ``REDUCTION_SCRATCH``, as ``mosaic_shared.two_per_sm`` counts it. ``fit="wgmma"``: the tensor
    cores' rows of ``Y`` and ``Z`` (``_times_z_mma``) among the buffers that share memory."""
    e = jnp.dtype(config.record_dtype).itemsize
    p, r = config.window, config.effective_rank
    comps = [2 * r * DK] * 2 if r else []
    inputs = [4 * (meta_cols(p, per_channel) + listed), packed_rows(DK, config.bits) * DK, 4 * DK, e * p * DK,
              e * p * DK] + comps
    inputs += ([4 * DK] if config.smoothing else []) + ([e * p * DK] if per_channel else [])
    inputs += [4 * r * DK] if config.warm_start else []
    later = aligned(2 * 4 * max(r, 2) * DK, 4 * DK, *([4 * DK] if config.smoothing else []), *comps)
    exchange = aligned(4 * max(r, 1) * WARPS * DK)
    fit_rows = aligned(4 * FIT_COLS * DK, 4 * FIT_COLS * DK) if fit == "wgmma" else 0   # _times_z_mma's Y and Z
    barriers = 2 + (len(inputs) if listed else stages)
    return (aligned(*(stages * x for x in inputs)) + max(aligned(4 * (r + p + 1) * DK), later, exchange, fit_rows)
            + aligned(4 * DK * DK, 4 * max(r, 1) * DK) + BARRIER_BYTES * barriers)


def listed_entries(per: int) -> int:
    """A program's row of the list (``walk="list"``): ``per`` entries in whole 128-byte units (a copy moves a
    multiple of 128 bytes)."""
    return -(-per // 32) * 32


def _flat(x, n):
    return x.reshape((n,) + x.shape[2:])


@functools.partial(jax.jit, static_argnames=("config", "only_full", "programs", "stages", "chunk", "unroll",
                                             "sum_lanes", "recon", "fit", "walk", "auto_barriers", "interpret"))
def leapquant_flush(config: LeapQuantConfig, state: LeapQuantState, *, only_full: bool = False,
                    programs: int | None = None, stages: int = DEFAULT_STAGES, chunk: int = DEFAULT_CHUNK,
                    unroll: bool = False, sum_lanes: int = DEFAULT_SUM_LANES, recon: str | None = None,
                    fit: str | None = None, walk: str | None = None, auto_barriers: bool = False,
                    interpret=None) -> LeapQuantState:
    """Window flush (``leapquant_flush.flush_split``'s contract) on Mosaic GPU.

    state: ``LeapQuantState`` (``unsupported_reason`` says which), updated in place when the
    caller's ``jit`` donates it. Returns the state with new checkpoints and ``pos = 0`` for the
    flushed sequences. ``programs``: of the launch (``mosaic_shared.default_programs``); ``stages``: heads in
    flight per program (1, the default, lets two programs share an SM; from 2 a program
    prefetches its next head and a head's codes slot is refilled one head later);
    ``chunk``: key rows per register tile (a multiple of 4 dividing 128, and below 8 bits the 64 or
    32 key rows of a code part); ``unroll``: each pass's
    chunks written out one after another instead of a loop over one chunk's code (to measure
    against: its straight-line code misses the instruction cache);
    ``sum_lanes``: lanes a row of ``S`` spans in the fit's ``Y = S Z``, which sums along rows: 8
    (``mosaic_shared.row_sums_layout``, ``chunk`` a multiple of 16) or 32 (the rows layout of the
    other passes);
    ``recon``: the reconstruction's rank-(r + p) products on the CUDA cores (``"fma"``) or the
    tensor cores (``_rank_part``, where ``takes_tensor_cores``): the records' part alone
    (``"records"``) or with the Compensator Tokens' where their operands fit (``"wgmma"``,
    ``mm_rows``); ``None`` (the default): ``default_recon``, the tensor cores where they can run;
    ``fit``: the fit's ``Y = S Z`` on the CUDA cores (``"fma"``) or the tensor cores (``"wgmma"``,
    ``_times_z_mma``: TF32 operands; with the tensor cores' reconstruction and at most ``FIT_COLS``
    Compensator Tokens); ``None`` (the default): ``default_fit``, the tensor cores where they can run;
    ``walk``: which heads a program copies in: ``"pipeline"``, its ``per`` consecutive heads of
    ``[B H]`` in an ``emit_pipeline`` (a head not flushed costs its copy); ``"list"`` (one stage
    only), the flushed heads alone, from a list XLA makes of them (program ``c`` takes entries
    ``c, c + programs, ...``, its row of the list copied in first; at most ``LIST_MAX_HEADS``
    heads); ``None`` (the default): the list with ``only_full`` and one stage (a few percent
    slower than the pipeline with every window full, a fifth of its time with one in 16,
    docs/performance.md), else the pipeline;
    ``auto_barriers``: every store to shared memory fenced by warpgroup barriers
    (``mosaic_shared.lane_params``) instead of the kernel's own barriers where threads exchange
    data. ``interpret``: ``None`` runs compiled on a GPU and in the Mosaic GPU interpreter
    elsewhere. Under ``vmap`` the mapped axis joins the batch (``mosaic_shared.fold_vmap``).
    """
    why = unsupported_reason(config, state)
    if why is not None:
        raise ValueError(f"Mosaic GPU leapquant_flush cannot run: {why}")
    check_launch(programs, stages)
    if walk not in WALKS + (None,) or (walk == "list" and stages != 1):
        raise ValueError(f"walk={walk!r}: expected one of {WALKS} or None, 'list' with one stage (stages={stages})")
    check_chunk(chunk, config.bits, DK)
    if sum_lanes not in (8, 32) or (sum_lanes == 8 and chunk % 16):
        raise ValueError(f"sum_lanes={sum_lanes!r} must be 32, or 8 with chunk a multiple of 16 (chunk={chunk}; "
                         "the default sum_lanes is 8)")
    if recon is None:
        recon = default_recon(config)
    if recon not in RECONS:
        raise ValueError(f"recon={recon!r}: expected one of {RECONS} or None")
    if fit is None:
        fit = default_fit(config, recon)
    if fit not in FITS:
        raise ValueError(f"fit={fit!r}: expected one of {FITS} or None")
    if fit == "wgmma" and (recon == "fma" or config.effective_rank > FIT_COLS):
        raise ValueError(f"fit='wgmma' reads the state the tensor-core reconstruction lays out (recon='wgmma' or "
                         f"'records', got {recon!r}) and takes at most {FIT_COLS} Compensator Tokens "
                         f"(got {config.effective_rank})")
    if recon != "fma" and not takes_tensor_cores(config):
        raise ValueError(f"recon={recon!r} takes float16 records (exact as fp16 operands) and a window that is a "
                         f"multiple of {MM_DEPTH} up to {DK // 2}; got record_dtype={config.record_dtype!r}, window "
                         f"{config.window}")
    interpret = resolve_interpret(interpret, "the Mosaic GPU flush")
    run = functools.partial(_launch, config, only_full=only_full, programs=programs, stages=stages, chunk=chunk,
                            walk=walk, unroll=unroll, sum_lanes=sum_lanes, recon=recon, fit=fit,
                            auto_barriers=auto_barriers,
                            interpret=interpret)
    return fold_vmap(run)(state)


def _launch(config, state, *, only_full, programs, stages, chunk, unroll, sum_lanes, recon, fit, walk, auto_barriers,
            interpret):
    """``leapquant_flush`` on checked options: the XLA prologue and the kernel's launch."""
    bsz, h, dk, dv = state.shape
    ckpt, buf = state.checkpoint, state.buffer
    p, r = config.window, config.effective_rank
    n = bsz * h
    if walk is None:
        walk = "list" if only_full and stages == 1 and n <= LIST_MAX_HEADS else "pipeline"

    def layout(programs):   # (heads per program, stages, bytes)
        per = -(-n // programs)
        st = min(stages, per)
        listed = listed_entries(per) if walk == "list" else 0
        return per, st, smem_bytes(config, st, state.per_channel_decay, listed, fit)

    if programs is None:
        programs = default_programs(n, lambda q: layout(q)[-1])
    programs = min(programs, n)
    per, stages, need = layout(programs)
    programs = -(-n // per)
    listed = listed_entries(per)
    if need > SMEM_LIMIT:
        raise ValueError(f"stages={stages} needs {need} bytes of shared memory per program (at most {SMEM_LIMIT})")
    if walk == "list" and n > LIST_MAX_HEADS:
        raise ValueError(f"walk='list' lists at most {LIST_MAX_HEADS} heads (fp32 indices); got {n} (batch x heads)")

    # Each head's scalars, a row of its own copied in with its tiles: (flushed or not, pos, 0, 0),
    # then GDN's record log-decays, padded to whole 128-byte units.
    flush = (state.pos >= p) if only_full else jnp.ones((bsz,), bool)
    cols = meta_cols(p, state.per_channel_decay)
    head = lambda x: jnp.broadcast_to(x[:, None], (bsz, h)).astype(f32).reshape(n, 1)
    meta = [head(flush), head(state.pos), jnp.zeros((n, META_COLS - 2), f32)]
    if not state.per_channel_decay:
        meta.append(buf.g.astype(f32).reshape(n, p))
    meta = jnp.concatenate(meta, axis=1)
    meta = jnp.pad(meta, ((0, 0), (0, cols - meta.shape[1])))

    arrays = dict(meta=meta, codes=_flat(ckpt.residual.codes, n), scale=_flat(ckpt.residual.scale.astype(f32), n),
                  rk=_flat(buf.k, bsz * state.key_heads), ru=_flat(buf.u, n))
    if state.per_channel_decay:
        arrays["rg"] = _flat(buf.g, n)
    if config.smoothing:
        arrays["smooth"] = _flat(ckpt.smooth.astype(f32), n)
    if r:
        arrays.update(ck=_flat(ckpt.comp_k, n), cu=_flat(ckpt.comp_u, n))
        if config.warm_start:
            # The warm start as the reference makes it (subspace_basis): the old K, a zero row
            # topped up from the seeded start.
            q0 = ckpt.comp_k.astype(f32)
            seed = random_start(dk, r, config.seed)
            q0 = q0 + WARM_START_TOPUP * seed * (jnp.linalg.norm(q0, axis=-1, keepdims=True) == 0)
            arrays["start"] = _flat(q0, n)
    names = tuple(arrays)
    values = dict(arrays)
    out_shapes = dict(scale=((dv,), f32))
    if config.smoothing:
        out_shapes["smooth"] = ((dk,), f32)
    if r:
        out_shapes.update(ck=((r, dk), jnp.float16), cu=((r, dv), jnp.float16))
    out_names = tuple(out_shapes)
    count = jnp.sum(head(flush))
    if walk == "list":
        # The flushed heads' indices, entry i in row i % programs: program c's entries c, c + programs, ...
        order = jnp.nonzero(meta[:, 0] > 0, size=listed * programs, fill_value=0)[0].astype(f32)
        values["order"] = order.reshape(listed, programs).T
    values.update(seeded_start=random_start(dk, max(r, 1), config.seed),
                  launch=jnp.zeros((dk,), f32).at[0].set(count))
    # The decayed keys (read by the reconstruction only) share their memory with the fit's rows
    # and the output slots (written after it) and with the warps' exchange; the fit's rows take at
    # least 2 x 2, so that the exchange's first [WARPS, dk] (the column maxima's) lies in them.
    later = (plgpu.SMEM((2, max(r, 2), dk), f32), [plgpu.SMEM(*out_shapes[name]) for name in out_names])
    state_smem = plgpu.SMEM((dk, dv), f32)
    if recon != "fma":
        # The state tiled and swizzled, so that the accumulators' stores and the rows' loads meet
        # no bank conflicts; the decayed keys' fp16 pieces in its second half until the state is written.
        state_smem = smem_union(interpret, _swizzled((dk, dv), f32, STATE_SWIZZLE, interpret),
                                (plgpu.SMEM((dk // 2, dv), f32),
                                 _swizzled((mm_rows(p, r, recon), dk), jnp.float16, MM_SWIZZLE, interpret)))
    shared = [plgpu.SMEM((r + p + 1, dk), f32), later, plgpu.SMEM((max(r, 1), WARPS, dk), f32)]
    if fit == "wgmma":      # _times_z_mma's rows of Y and of Z, used while no other member is
        shared.append((plgpu.SMEM((FIT_COLS, dk), f32), _swizzled((FIT_COLS, dk), f32, STATE_SWIZZLE, interpret)))
    scratch = [plgpu.SMEM((max(r, 1), dk), f32), state_smem, smem_union(interpret, *shared)]
    if walk == "list":
        # A head's tiles as the pipeline's one stage has them, the program's row of the list after
        # the head's scalars, and a barrier per tile
        swizzled = lambda name: name == "ru" and recon != "fma"   # noqa: E731
        shape = lambda name: (cols + listed,) if name == "meta" else arrays[name].shape[1:]  # noqa: E731
        scratch.append([_swizzled(shape(name), arrays[name].dtype, MM_SWIZZLE, interpret)
                        if swizzled(name) else plgpu.SMEM(shape(name), arrays[name].dtype)
                        for name in names])
        scratch.append(plgpu.Barrier(num_arrivals=1, num_barriers=len(names)))
    body = functools.partial(_program, names=names, keyed=("rk",), out_names=out_names, n=n, h=h,
                             hk=state.key_heads, per=per, stages=stages, r=r, p=p,
                             per_channel=state.per_channel_decay, smoothing=config.smoothing,
                             fit_iters=config.fit_iters, warm_start=config.warm_start, chunk=chunk,
                             bits=config.bits, unroll=unroll, sum_lanes=sum_lanes, recon=recon, fit=fit,
                             walk=walk, programs=programs, interpret=bool(interpret))

    def kernel(refs):
        @pl.core_map(plgpu.Mesh(grid=(programs,), grid_names=("c",)), compiler_params=lane_params(auto_barriers),
                     interpret=interpret,
                     name=f"leapquant_flush_mosaic_{'kda' if state.per_channel_decay else 'gdn'}")
        def leapquant_flush_mosaic():
            pl.run_scoped(lambda *s: body(refs, s), *scratch)

    new = run_kernel(kernel, values)
    comp_k = new["ck"].reshape(ckpt.comp_k.shape) if r else ckpt.comp_k
    comp_u = new["cu"].reshape(ckpt.comp_u.shape) if r else ckpt.comp_u
    smooth = new["smooth"].reshape(ckpt.smooth.shape).astype(ckpt.smooth.dtype) if config.smoothing else ckpt.smooth
    residual = IntTensor(codes=new["codes"].reshape(ckpt.residual.codes.shape),
                         scale=new["scale"].reshape(ckpt.residual.scale.shape).astype(ckpt.residual.scale.dtype),
                         bits=config.bits, dk=dk)
    pos = jnp.where(state.pos >= p, 0, state.pos) if only_full else jnp.zeros_like(state.pos)
    return LeapQuantState(checkpoint=Checkpoint(residual=residual, smooth=smooth, comp_k=comp_k, comp_u=comp_u),
                          buffer=buf, pos=pos)


def mosaic_flush_bytes(config: LeapQuantConfig, dk: int, dv: int, per_channel: bool, group: int = 1) -> float:
    """Bytes one flushed value head moves: the checkpoint read and written, the records read
    (keys once per key group of ``group`` value heads, GVA), and the head's scalars, which XLA
    packs (GDN's record log-decays among them) and the kernel reads."""
    e = jnp.dtype(config.record_dtype).itemsize
    p, r = config.window, config.effective_rank
    ckpt = packed_rows(dk, config.bits) * dv + 4 * dv + (4 * dk if config.smoothing else 0) + 2 * r * (dk + dv)
    records = e * p * (dk / group + dv + (dk if per_channel else 0))
    scalars = (e * p if not per_channel else 0) + 4 + 2 * 4 * meta_cols(p, per_channel)
    return 2 * ckpt + records + scalars


__all__ = ["DEFAULT_CHUNK", "DEFAULT_STAGES", "DEFAULT_SUM_LANES", "FITS", "FIT_COLS", "FIT_MIN_BITS", "META_COLS",
           "RECONS", "default_fit", "default_programs", "default_recon", "leapquant_flush", "meta_cols",
           "mosaic_flush_bytes", "smem_bytes", "takes_tensor_cores", "unsupported_reason"]
