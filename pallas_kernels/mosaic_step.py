"""LeapQuant decode step inside a window on Pallas Mosaic GPU (Hopper): GDN and KDA, 8 to 2 bits, 128 x 128 heads.

Contract: ``leapquant_step.leapquant_step``'s (``windowed.step_reference``: ``u`` read at ``l =
pos``, the record appended at slot ``pos``, the output read at ``l = pos + 1``; needs ``pos < p``,
a sequence at ``pos >= p`` writes nothing and its output is unspecified). The buffer's arrays are
the kernel's refs (``mosaic_shared.run_kernel``), updated in place.

Why: the Triton step is bound by the SM's L1/shared-memory pipe (its codes cross it three times).
Here the copy engine (TMA) brings each head's tiles into shared memory, ``stages`` in flight.

Structure: ``programs`` programs of one warpgroup (128 threads) each walk ``per`` consecutive heads
of the flattened ``[B H]`` in an ``emit_pipeline`` (heads past ``B H`` repeat the last and store
nothing). Per head: the token's vectors, the codes ``[packed_rows, 128]``, the scales, the
Compensator Tokens and the record slots in parts of ``slot_copy`` (a copy has a static size: a part
with no live slot comes from the head's first part, which the L2 holds; dead slots are masked in
the arithmetic; ``mosaic_step_bytes``). A head's scalars (GDN: ``g``, ``beta``, ``pos``, ``D0``,
``exp(g)`` and the records' decays, packed by XLA with
``windowed.window_decays``; KDA: ``beta``, ``pos``) come in one copy per program; KDA's
per-channel decays are made in the kernel from the records' log-decays, one channel per thread
(``_kda_decays``). Outputs and the new record leave through two alternating shared-memory slots.

Arithmetic, for ``x1 = b``, ``x2 = exp(g) q``: ``S_l^T x = scale D0 (Z^T (c x)) + U^T (K (D0 x)) +
sum_j u_j d_j (k_j . x)``. Records and Compensator Tokens go four rows at a time, one per warp
(``rows_layout(4)``), each warp summing its rows in registers. The code sums (``dot``): ``"rows"``
(the same way, so that the codes', records' and Compensator Tokens' partial sums meet across the
warps once per head, ``meet_warps``), ``"wgmma"`` (one bf16 ``wgmma`` against three exact bf16
pieces of each vector) or ``"fma"`` (``chunk`` rows at a time, Mosaic GPU's generic reduction).
Codes: int8 ``[dk, 128]`` at 8 bits; below, ``quantizers``' planar layout (uint8), unpacked in
registers (``mosaic_shared.signed_code_parts``): the same byte rows of each plane give every code
part's key rows, each times the vectors at those rows (``"rows"`` and ``"fma"``; ``"wgmma"`` 8 bits only).
A rank ``r`` that is not a multiple of 4 ends on a group of four that overlaps the one before,
its rows already counted zeroed (``token_row_groups``): six tokens, the default below 8 bits.
Rounding: fp32 throughout (the code products exact); the record rounded to the record dtype.

Defaults (docs/performance.md gives what each was measured against): ``dot="rows"``; three
programs per SM at 4 and 2 bits where they fit, else two (``default_programs``); three heads in
flight where the SM's programs still fit, else two (``default_stages``); GDN's records in parts of
eight slots (``default_slot_copy``). Tested with JAX 0.10.2 (interpret mode, lowering on the CPU)
and 0.11.2 (compiled: H200 and H100).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from leapquant_jax import windowed
from leapquant_jax.quantizers import INT_WIDTHS, IntTensor, code_parts, packed_rows
from leapquant_jax.recurrence import Token
from leapquant_jax.state import LeapQuantConfig, LeapQuantState, WindowBuffer

from .mosaic_shared import (
    BARRIER_BYTES, WARPS, Layouts, aligned, check_chunk, check_launch, code_plane_rows, fold_vmap, lane_params,
    meet_warps, per_sm, resolve_interpret, rows_layout, run_kernel, signed_code_parts, sm_count, threads_layout,
)
from .support import check_token

f32 = jnp.float32
RECORD_LOG_DECAY_MIN = windowed.RECORD_LOG_DECAY_MIN
MIN_HEADS = 8        # heads a program takes at least by default: each program's first copies wait unhidden
THREE_PER_SM_BITS = 4   # code widths whose step takes three programs per SM where they fit (default_programs)
THREE_PER_SM_GAIN = 1.1  # time per head with two programs per SM over three's there: the least measured
META_COLS = 8        # a head's scalars before its records' decays: g, beta, pos, D0, exp(g), 0, 0, 0
LANES_COLS = 128     # value columns a warp covers: 32 lanes x 4
DOTS = ("fma", "rows", "wgmma")   # the code sums on the CUDA cores (two ways) or the tensor cores
DEFAULT_DOT = "rows"      # the fastest of the three measured (docs/performance.md)
DEFAULT_SLOT_COPY = 2 * WARPS  # GDN's record slots per copy, the fastest measured (docs/performance.md)
PIECE_ROWS = 8       # the wgmma's N: three bf16 pieces of each of the two vectors, two zero rows
MM_SWIZZLE = 128     # bytes: the wgmma operands' shared-memory swizzle


# ----------------------------------------------------------------------------- kernel


def _code_products(t, factors, *, n, dk, lay, bits=8):
    """The codes times two vectors on the CUDA cores, ``n`` key rows of each code part at a time
    (``mosaic_shared.signed_code_parts`` of the same byte rows of each plane), summed elementwise
    over the steps: two ``[n, 128]`` tiles in ``rows_layout(n)``. ``factors(rows)``: the two vectors at key rows
    ``rows`` (``[n]`` each, in ``rows_layout(n).reduce(1)``); part ``j`` of a step at byte rows
    ``s + [0, n)`` covers key rows ``j dk / parts + s + [0, n)``."""
    R = rows_layout(n)
    along_cols = lambda y: lay.cast(jax.lax.broadcast_in_dim(y, (n, LANES_COLS), (0,)), R)
    part_rows = dk // code_parts(bits)
    acc1 = acc2 = None
    for k in range(part_rows // n):
        zs = signed_code_parts(code_plane_rows(t["codes"], bits, dk, k * n, n, R, lay), bits, lay.layout(R))
        for j, z in enumerate(zs):
            rows = pl.ds(j * part_rows + k * n, n)
            y1, y2 = factors(rows)
            t1, t2 = z * along_cols(y1), z * along_cols(y2)
            acc1, acc2 = (t1, t2) if acc1 is None else (acc1 + t1, acc2 + t2)
    return acc1, acc2


def code_sums_fma(t, *, dk, smoothing, chunk, lay, decay=None, bits=8):
    """``(Z^T (c b), Z^T (c q))`` (``[128]`` each, value-column layout; ``c`` the smoothing scales or
    1) on the CUDA cores: the codes read ``chunk`` key rows of each code part at a time
    (``_code_products``), products summed elementwise over the chunks, then across the rows once.
    ``decay``: ``(ref, row)`` where KDA's per-channel decays scale the two vectors too
    (``ref[row]`` times ``b``, ``ref[row + 1]`` times ``q``; ``_kda_decays``)."""
    CROW = rows_layout(chunk).reduce(1)

    def factors(rows):
        y1, y2 = lay.load(t["b"].at[rows], CROW), lay.load(t["q"].at[rows], CROW)
        if smoothing:
            sm = lay.load(t["smooth"].at[rows], CROW)
            y1, y2 = sm * y1, sm * y2
        if decay is not None:
            ref, row = decay
            y1, y2 = lay.load(ref.at[row, rows], CROW) * y1, lay.load(ref.at[row + 1, rows], CROW) * y2
        return y1, y2

    acc1, acc2 = _code_products(t, factors, n=chunk, dk=dk, lay=lay, bits=bits)
    return jnp.sum(acc1, axis=0), jnp.sum(acc2, axis=0)


def _bf16_pieces(y):
    """``(hi, mid, lo)``: three bf16 arrays whose sum is the fp32 ``y`` exactly (8 significant bits
    each; every remainder is exact in fp32)."""
    hi = y.astype(jnp.bfloat16)
    rest = y - hi.astype(f32)
    mid = rest.astype(jnp.bfloat16)
    return hi, mid, (rest - mid.astype(f32)).astype(jnp.bfloat16)


def code_sums_wgmma(t, mm, *, dk, smoothing, lay, decay=None):
    """``code_sums_fma``'s sums on the tensor cores: one bf16 ``wgmma`` ``[128 v, dk] x [dk, 8]``.

    Left: the codes, converted to bf16 (exact) into ``mm``'s tile ``[dk, 128]`` and read
    transposed. Right: the vectors ``c b`` and ``c q`` as three bf16 pieces each (``_bf16_pieces``,
    exact), the rows of ``mm``'s ``[PIECE_ROWS, dk]`` (two rows zero). Each product of a code and
    a piece is exact in fp32 and the tensor cores sum them in fp32; a vector's three columns are
    added afterwards. The sums go through ``mm``'s ``[2, 128]`` fp32 rows into the value-column
    layout. ``decay``: as ``code_sums_fma``'s. The interpreter (no transposed ``wgmma`` operand
    there) takes the same pieces through ``jnp.dot``."""
    a16, b16, sv = mm
    VCOL = rows_layout(WARPS).reduce(0)
    P = rows_layout(PIECE_ROWS)
    y1, y2 = lay.load(t["b"], VCOL), lay.load(t["q"], VCOL)
    if smoothing:
        sm = lay.load(t["smooth"], VCOL)
        y1, y2 = sm * y1, sm * y2
    if decay is not None:
        ref, row = decay
        y1, y2 = lay.load(ref.at[row], VCOL) * y1, lay.load(ref.at[row + 1], VCOL) * y2
    along = lambda y: lay.cast(jax.lax.broadcast_in_dim(y, (PIECE_ROWS, dk), (1,)), P)
    if lay.interpret:
        row = jax.lax.broadcasted_iota(jnp.int32, (PIECE_ROWS, dk), 0)
    else:
        row = plgpu.broadcasted_iota(jnp.int32, (PIECE_ROWS, dk), 0, layout=P)
    hi, mid, lo = _bf16_pieces(jnp.where(row < 3, along(y1), along(y2)))
    part = row % 3
    pieces = jnp.where(part == 0, hi, jnp.where(part == 1, mid, lo))
    pieces = jnp.where(row < 6, pieces, jnp.zeros_like(pieces))
    if lay.interpret:
        z = t["codes"][...].astype(f32)
        acc = jnp.dot(z.T, pieces.astype(f32).T, precision=jax.lax.Precision.HIGHEST)     # [128, PIECE_ROWS]
        s1, s2 = jnp.sum(acc[:, :3], axis=1), jnp.sum(acc[:, 3:6], axis=1)
        return s1, s2
    a16[...] = lay.load(t["codes"], rows_layout(dk)).astype(jnp.bfloat16)
    b16[...] = pieces
    plgpu.commit_smem()        # the generic-proxy stores are seen by the tensor cores' reads
    lay.sync()

    def product(acc_ref):
        plgpu.wgmma(acc_ref, plgpu.transpose_ref(a16, (1, 0)), plgpu.transpose_ref(b16, (1, 0)))
        return acc_ref[...]

    acc = pl.run_scoped(product, plgpu.ACC((LANES_COLS, PIECE_ROWS), f32))
    col = plgpu.broadcasted_iota(jnp.int32, (LANES_COLS, PIECE_ROWS), 1, layout=plgpu.Layout.WGMMA)
    sv[0] = jnp.sum(jnp.where(col < 3, acc, 0.0), axis=1)
    sv[1] = jnp.sum(jnp.where((col >= 3) & (col < 6), acc, 0.0), axis=1)
    lay.sync()
    return lay.load(sv.at[0], VCOL), lay.load(sv.at[1], VCOL)


def mm_scratch(dk: int):
    """The tensor-core code sums' shared memory: the bf16 codes ``[dk, 128]`` and pieces
    ``[PIECE_ROWS, dk]``, tiled and swizzled for ``wgmma``, and the sums ``[2, 128]`` fp32."""
    tr = (plgpu.TilingTransform((8, MM_SWIZZLE // 2)), plgpu.SwizzleTransform(MM_SWIZZLE))
    return (plgpu.SMEM((dk, LANES_COLS), jnp.bfloat16, transforms=tr),
            plgpu.SMEM((PIECE_ROWS, dk), jnp.bfloat16, transforms=tr), plgpu.SMEM((2, LANES_COLS), f32))


def code_vectors(t, xv, *, smoothing, lay, decays=None):
    """The vectors of the code sums, ``c b`` and ``c q`` (``c`` the smoothing scales or 1; times
    KDA's per-channel ``decays = (D0, D0 exp(g))``, ``[128]`` each in ``threads_layout``), into the
    rows of ``xv [2, dk]`` fp32, one key channel per thread. The caller syncs before they are read."""
    D = threads_layout()
    y1, y2 = lay.load(t["b"], D), lay.load(t["q"], D)
    if smoothing:
        sm = lay.load(t["smooth"], D)
        y1, y2 = sm * y1, sm * y2
    if decays is not None:
        y1, y2 = decays[0] * y1, decays[1] * y2
    xv[0] = y1
    xv[1] = y2


def code_partials_rows(t, xv, *, dk, lay, bits=8):
    """Each warp's part of the code sums ``Z^T xv[0]`` and ``Z^T xv[1]`` (``code_vectors``): two
    ``[WARPS, 128]`` tiles in ``rows_layout(WARPS)``, whose sums over their rows (the warps) are the
    code sums. The codes go ``WARPS`` byte rows at a time, byte row ``WARPS k + m`` on warp ``m``
    (``_code_products``: each code part's key row of it), each key row times its two factors (one
    value for the whole warp, read from ``xv``), summed in registers: no exchange between the warps
    here, so that the caller adds these parts to the records' before their one exchange
    (``_head_step`` with ``dot="rows"``)."""
    WROW = rows_layout(WARPS).reduce(1)
    return _code_products(t, lambda rows: (lay.load(xv.at[0, rows], WROW), lay.load(xv.at[1, rows], WROW)),
                          n=WARPS, dk=dk, lay=lay, bits=bits)


def slot_rows(parts, start, n=None):
    """Record slot ``start`` (``n=None``) or slots ``start + [0, n)`` of a head's record tile,
    which comes as ``parts``: a list of shared-memory refs ``[slot_copy, d]`` of consecutive slots
    (``_launch``); the ``n`` slots lie in one part."""
    size = parts[0].shape[0]
    part = parts[start // size]
    return part.at[start % size] if n is None else part.at[pl.ds(start % size, n)]


def _kda_decays(i, meta_all, t, dec, *, p, lay):
    """KDA's decays of head ``i`` into ``dec [p + 3, dk]`` fp32, as ``windowed.window_decays`` makes
    them: the records' ``d_j = exp(G_l - G_j)`` (rows ``j < p``; 0 past ``pos``), ``D0 = exp(G_l)``
    (row ``p``), ``D0 exp(g)`` (row ``p + 1``) and the token's ``exp(g)`` (row ``p + 2``), from the
    running sums of the live records' log-decays ``t["bg"]`` (``slot_rows``; masked before ``exp``). One
    key channel per thread (``threads_layout``): 16 exponentials a thread, none repeated. Returns
    ``(D0, D0 exp(g))`` (that layout, for ``code_vectors``); the caller syncs before ``dec`` is read."""
    D = threads_layout()
    pos = meta_all[i, 2]
    G, Gs = None, []
    for j in range(p):
        gj = jnp.where(j < pos, lay.load(slot_rows(t["bg"], j), D).astype(f32), 0.0)
        G = gj if G is None else G + gj
        Gs.append(G)
    for j in range(p):       # dead slots added zero: G is the sum of the live records' log-decays
        dec[j] = jnp.exp(jnp.where(j < pos, G - Gs[j], -jnp.inf))
    d0, a = jnp.exp(G), jnp.exp(lay.load(t["g"], D))
    dec[p] = d0
    dec[p + 1] = d0 * a
    dec[p + 2] = a
    return d0, d0 * a


def token_row_groups(r: int) -> list[tuple[int, int]]:
    """The ``WARPS``-row groups ``(start, skip)`` that cover ``r`` rows (``r`` 0 or at least
    ``WARPS``): whole groups, then where ``r`` is not a multiple of ``WARPS`` one that ends at row
    ``r`` and leaves out (``skip``) its first rows, already counted by the group before."""
    groups = [(start, 0) for start in range(0, r - WARPS + 1, WARPS)]
    if r % WARPS:
        groups.append((r - WARPS, WARPS - r % WARPS))
    return groups


def _head_step(i, meta_all, dec, t, *, dk, p, r, smoothing, chunk, lay, red, mm=None, per_channel=False, dot="fma",
               bits=8):
    """Head ``i`` of the program from its tiles ``t`` (a dict of shared-memory refs):
    ``(o [128] fp32, u [128] fp32, w [dk] fp32)``, each in the value-column layout. ``red``: the
    records' partial sums' shared memory ``[2, WARPS, 128]`` fp32; ``mm``: the code sums' scratch
    (``dot="wgmma"``: ``mm_scratch``; ``"rows"``: ``(xv [2, dk] fp32,)``, ``code_vectors``;
    ``"fma"``: ``None``). ``dec``: with ``per_channel`` (KDA) the decays' shared memory
    ``[p + 3, dk]`` (``_kda_decays``), else unused (GDN's scalar decays come with the head's
    scalars ``meta_all[i]``).

    The records and Compensator Tokens go ``WARPS`` rows at a time, one row per warp
    (``rows_layout(WARPS)``; the tokens' last group as ``token_row_groups`` says, its rows already
    counted zeroed): each warp sums its rows' ``u_j (k_j . x)`` in its registers, and the
    warps' partials meet once, through ``red`` (the value columns of a row contiguous, so each
    read is one row for the whole warp, without bank conflicts): one exchange between the warps
    for both vectors and both kinds of rows (with ``dot="rows"`` the code sums' parts too)."""
    W = rows_layout(WARPS)       # [WARPS, 128]: row m on warp m, the 128 columns over the lanes
    VCOL = W.reduce(0)           # [128] over lanes: a value column's vector (or a record column's)
    WROW = W.reduce(1)           # [WARPS]: one value per warp
    beta = meta_all[i, 1]
    decay = decays = None
    if per_channel:
        decays = _kda_decays(i, meta_all, t, dec, p=p, lay=lay)
        decay = (dec, p)
    if dot == "rows":
        code_vectors(t, mm[0], smoothing=smoothing, lay=lay, decays=decays)
    if per_channel or dot == "rows":
        lay.sync()               # the decays and vectors made one channel per thread are read in other layouts
    codes1 = codes2 = s1 = s2 = None
    if dot == "rows":
        codes1, codes2 = code_partials_rows(t, mm[0], dk=dk, lay=lay, bits=bits)   # [WARPS, 128] W
    elif dot == "fma":
        s1, s2 = code_sums_fma(t, dk=dk, smoothing=smoothing, chunk=chunk, lay=lay, decay=decay, bits=bits)
    else:
        s1, s2 = code_sums_wgmma(t, mm, dk=dk, smoothing=smoothing, lay=lay, decay=decay)
    scale = lay.load(t["scale"], VCOL)
    along_rows = lambda x: lay.cast(jax.lax.broadcast_in_dim(x, (WARPS, LANES_COLS), (1,)), W)
    along_cols = lambda y: lay.cast(jax.lax.broadcast_in_dim(y, (WARPS, LANES_COLS), (0,)), W)
    x1 = lay.load(t["b"], VCOL)
    qv = lay.load(t["q"], VCOL)
    if per_channel:          # the decays are inside the sums: per key channel
        f1 = f2 = scale                                                            # [128] VCOL
        x2 = lay.load(dec.at[p + 2], VCOL) * qv
        d0 = lay.load(dec.at[p], VCOL)
        rows_x1, rows_x2 = along_rows(x1), along_rows(x2)
        ct_x1, ct_x2 = along_rows(d0 * x1), along_rows(d0 * x2)
    else:
        D0, a_new = meta_all[i, 3], meta_all[i, 4]
        f1, f2 = D0 * scale, (D0 * a_new) * scale                                  # [128] VCOL
        x2 = a_new * qv
        rows_x1, rows_x2 = along_rows(x1), along_rows(x2)

    # The code sums, whole (r) or as the warps' parts (part), times their column factors.
    r1 = r2 = part1 = part2 = None
    if s1 is None:
        part1, part2 = codes1 * along_rows(f1), codes2 * along_rows(f2)
    else:
        r1, r2 = f1 * s1, f2 * s2
    # Records and Compensator Tokens: k_j . x over the key columns, then sum_j u_j (...).
    groups = [("rk", "ru", m * WARPS, 0) for m in range(p // WARPS)]
    groups += [("ck", "cu", start, skip) for start, skip in token_row_groups(r)]
    pos = meta_all[i, 2]         # records at slots >= pos are dead

    def terms(kname, uname, start, skip):
        rows = pl.ds(start, WARPS)
        if kname == "rk":        # a record group lies in one copied part of the slots (slot_rows)
            k, u = (lay.load(slot_rows(t[name], start, WARPS), W).astype(f32) for name in (kname, uname))
        else:
            k = lay.load(t[kname].at[rows], W).astype(f32)                         # [WARPS, dk]
            u = lay.load(t[uname].at[rows], W).astype(f32)                         # [WARPS, 128]
        if skip:                 # rows the group before counted
            if lay.interpret:
                row = jax.lax.broadcasted_iota(jnp.int32, (WARPS, LANES_COLS), 0)
            else:
                row = plgpu.broadcasted_iota(jnp.int32, (WARPS, LANES_COLS), 0, layout=W)
            u = jnp.where(row >= skip, u, 0.0)
        if per_channel and kname == "rk":      # the records' decays d_j per channel (0 past pos)
            d = lay.load(dec.at[rows], W)
            k1, k2 = jnp.sum(k * (d * rows_x1), axis=1), jnp.sum(k * (d * rows_x2), axis=1)
        elif per_channel:                      # the checkpoint's decays D0 per channel
            k1, k2 = jnp.sum(k * ct_x1, axis=1), jnp.sum(k * ct_x2, axis=1)
        else:
            if kname == "rk":    # the records' decays d_j (0 past pos)
                d = lay.load(meta_all.at[i, pl.ds(META_COLS + start, WARPS)], WROW)
            else:                # the checkpoint's decay D0
                d = D0
            k1 = jnp.sum(k * rows_x1, axis=1) * d                                  # [WARPS] WROW
            k2 = jnp.sum(k * rows_x2, axis=1) * d
        return u * along_cols(k1), u * along_cols(k2)

    for group in groups:
        if part1 is None:
            part1, part2 = terms(*group)
        elif group[0] == "rk" and group[2] and not per_channel:
            # a record group past pos adds zero: skipped (GDN; KDA's step measured no faster for it)
            add = lambda parts, group=group: tuple(x + y for x, y in zip(parts, terms(*group)))
            part1, part2 = jax.lax.cond(group[2] < pos, add, lambda parts: parts, (part1, part2))
        else:
            part1, part2 = (x + y for x, y in zip((part1, part2), terms(*group)))
    y1, y2 = meet_warps([part1, part2], red, lay=lay)
    r1, r2 = (y1, y2) if r1 is None else (r1 + y1, r2 + y2)
    u = beta * (lay.load(t["v"], VCOL) - r1)
    w = lay.load(t["w"], VCOL)
    return r2 + u * jnp.sum(w * qv), u, w


def _program(refs, scratch, *, head, names, keyed, slotted, slot_copy, n, per, stages, dk, p, r, h, hk, group,
             log_heads, smoothing, chunk, per_channel, dot, bits, interpret):
    """Program ``c``: its heads ``c per + [0, per)`` (module docstring). ``refs``: the kernel's
    GMEM refs by name; ``keyed``: the names read per key head; ``slotted``: the record arrays
    ``[., p, d]``, copied in parts of ``slot_copy`` slots, a part past the head's ``pos`` (no live
    slot) from the head's first part instead (an L2 hit: no device-memory bytes), so that a step
    reads about the live slots alone; the head's tile of such an array is the list of its parts
    (``slot_rows``). ``head``: a head's arithmetic
    (``_head_step``). ``scratch``: the scalars, then GDN's record log-decays ``[per, p]`` or KDA's
    decays ``[p + 3, dk]`` (``_kda_decays``), the output and record slots, the warps' partial
    sums, KDA's log-decay record slots, the code sums' scratch (``_head_step``'s ``mm``)."""
    meta_all, dec, o_s, u_s, k_s, red, *mm = scratch
    g_s = mm.pop(0) if per_channel else None
    rg_all = None if per_channel else dec
    mm = tuple(mm) or None
    bg, bk, bu, o_gmem = refs["bg"], refs["rk"], refs["ru"], refs["o"]
    c = jax.lax.axis_index("c")
    lay = Layouts(interpret)

    def key_head(t):
        return (t // h) * hk + (t % h) // group

    # GDN: the record log-decays of the program's real heads, ``log_heads`` a copy (``n`` is a
    # multiple of it), copied in once and out at the end; KDA's come with each head's tiles.
    groups = [] if per_channel else [(j, c * per + j * log_heads) for j in range(per // log_heads)]

    def fetch(bars):
        plgpu.copy_gmem_to_smem(refs["meta"].at[c], meta_all, bars.at[0])
        for j, start in groups:
            pl.when(start < n)(lambda j=j, start=start: plgpu.copy_gmem_to_smem(
                bg.at[pl.ds(start, log_heads)], rg_all.at[pl.ds(j * log_heads, log_heads)], bars.at[j + 1]))
        plgpu.barrier_wait(bars.at[0])
        for j, start in groups:
            pl.when(start < n)(lambda j=j: plgpu.barrier_wait(bars.at[j + 1]))

    pl.run_scoped(fetch, plgpu.Barrier(num_arrivals=1, num_barriers=len(groups) + 1))

    def body(idx, *tiles):
        i = idx[0]
        t = c * per + i
        tiles = list(tiles)
        tile = {name: [tiles.pop(0) for _ in range(p // slot_copy)] if name in slotted else tiles.pop(0)
                for name in names}
        o, u, w = head(i, meta_all, dec, tile, dk=dk, p=p, r=r, smoothing=smoothing, chunk=chunk, lay=lay, red=red,
                       mm=mm, per_channel=per_channel, dot=dot, bits=bits)
        pos = meta_all[i, 2].astype(jnp.int32)
        real = t < n
        live = (pos < p) & real
        slot = i % 2
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)      # the copies out of head i - 2 have read this slot
        o_s[slot] = o
        u_s[slot] = u.astype(u_s.dtype)
        k_s[slot] = w.astype(k_s.dtype)
        if per_channel:
            g_new = lay.load(tile["g"], rows_layout(WARPS).reduce(0))
            g_s[slot] = jnp.maximum(g_new, RECORD_LOG_DECAY_MIN).astype(g_s.dtype)
        else:
            @pl.when(live)
            def _():
                rg_all[i, pos] = jnp.maximum(meta_all[i, 0], RECORD_LOG_DECAY_MIN).astype(rg_all.dtype)

        plgpu.commit_smem()
        pl.when(real)(lambda: plgpu.copy_smem_to_gmem(o_s.at[slot], o_gmem.at[t], commit_group=False))
        pl.when(live)(lambda: plgpu.copy_smem_to_gmem(u_s.at[slot], bu.at[t, pos], commit_group=False))
        if per_channel:
            pl.when(live)(lambda: plgpu.copy_smem_to_gmem(g_s.at[slot], bg.at[t, pos], commit_group=False))
        # With GVA the first value head of a key group stores the key record.
        pl.when(live & ((t % h) % group == 0))(
            lambda: plgpu.copy_smem_to_gmem(k_s.at[slot], bk.at[key_head(t), pos], commit_group=False))
        plgpu.commit_smem_to_gmem_group()

    def spec(x, key):
        zeros = (0,) * (x.ndim - 1)
        return plgpu.BlockSpec((None,) + x.shape[1:], lambda i: (key(jnp.minimum(c * per + i, n - 1)),) + zeros)

    def slot_spec(x, key, part):
        def index(i):
            head_ = key(jnp.minimum(c * per + i, n - 1))
            if part == 0:
                return head_, 0, 0
            live = part * slot_copy < meta_all[i, 2]      # a slot below pos lies in this part
            return head_, jnp.where(live, part, 0).astype(jnp.int32), 0
        return plgpu.BlockSpec((None, slot_copy, x.shape[-1]), index)

    ins, specs = [], []
    for name in names:
        key = key_head if name in keyed else (lambda t: t)
        x = refs[name]
        parts = range(p // slot_copy) if name in slotted else [None]
        for part in parts:
            ins.append(x)
            specs.append(spec(x, key) if part is None else slot_spec(x, key, part))
    plgpu.emit_pipeline(body, grid=(per,), in_specs=specs, max_concurrent_steps=stages)(*ins)
    plgpu.commit_smem()
    for j, start in groups:
        pl.when(start < n)(lambda j=j, start=start: plgpu.copy_smem_to_gmem(
            rg_all.at[pl.ds(j * log_heads, log_heads)], bg.at[pl.ds(start, log_heads)]))
    plgpu.wait_smem_to_gmem(0)


# ----------------------------------------------------------------------------- wrapper


def unsupported_reason(config: LeapQuantConfig, state: LeapQuantState) -> str | None:
    """Why this kernel cannot take ``config`` and ``state`` (``None`` when it can): integer codes
    at 8, 6, 4 or 2 bits, ``dk = dv = 128``, ``p`` a multiple of 4, ``r`` 0 or at least 4 (the
    Compensator Tokens go 4 rows at a time, ``token_row_groups``), key heads dividing ``H``; with
    scalar (GDN) decays also a head's ``p`` record log-decays a multiple of 16 bytes (the copy
    engine's row stride) and ``B H`` a multiple of ``log_decay_heads``."""
    ckpt, buf = state.checkpoint, state.buffer
    if config.residual_format is not None or config.bits not in INT_WIDTHS:
        return f"the Mosaic GPU step reads 8-bit integer codes and packed 6-, 4- and 2-bit ones only " \
               f"(bits={config.bits}, residual_format={config.residual_format!r})"
    if not isinstance(ckpt.residual, IntTensor) or ckpt.residual.bits != config.bits:
        return f"the state's residual is not a {config.bits}-bit integer tensor"
    if buf.k.ndim != 4 or buf.u.ndim != 4:
        return f"the window buffer must be [B, Hk, p, dk] / [B, H, p, dv], got {buf.k.shape} / {buf.u.shape}"
    b, h, dk, dv = state.shape
    p, r = config.window, config.effective_rank
    if buf.u.shape[2] != p:
        return f"the buffer holds {buf.u.shape[2]} slots but window={p}"
    if dk != LANES_COLS or dv != LANES_COLS:
        return f"dk={dk}, dv={dv}: the Mosaic GPU step takes {LANES_COLS} x {LANES_COLS} heads"
    if p % WARPS:
        return f"window={p}: the Mosaic GPU step takes multiples of {WARPS}"
    if 0 < r < WARPS:
        return f"rank={r}: the Mosaic GPU step takes 0 or at least {WARPS} Compensator Tokens"
    if state.pos.shape != (b,):
        return f"pos must be [B] = ({b},), got {state.pos.shape}"
    if buf.g.shape not in ((b, h, p), (b, h, p, dk)):
        return f"buffer log-decays must be [B, H, p] or [B, H, p, dk], got {buf.g.shape}"
    row = p * jnp.dtype(buf.g.dtype).itemsize
    if not state.per_channel_decay and row % 16:
        return f"window={p}: a head's record log-decays ({row} bytes of {buf.g.dtype}) must be a multiple of 16 bytes"
    grain = log_decay_heads(p, jnp.dtype(buf.g.dtype).itemsize)
    if not state.per_channel_decay and (b * h) % grain:
        return (f"B * H = {b * h}: with scalar (GDN) decays the Mosaic GPU step takes a multiple of {grain} "
                f"(heads whose {p} record log-decays in {buf.g.dtype} fill whole 128-byte copies)")
    if h % state.key_heads:
        return f"{state.key_heads} key heads do not divide {h} value heads"
    if config.smoothing and ckpt.smooth is None:
        return "smoothing is on but the checkpoint has no smoothing scales"
    if ckpt.comp_k.shape[-2] != r:
        return f"the checkpoint holds {ckpt.comp_k.shape[-2]} Compensator Tokens, the config {r}"
    return None


def default_slot_copy(p: int, per_channel: bool = False) -> int:
    """Record slots per copy where the caller leaves it ``None``: for GDN ``DEFAULT_SLOT_COPY``
    where it divides the window ``p``; the whole window for KDA, whose three record arrays in
    parts made its step slower (more copies per head behind its two heads in flight;
    docs/performance.md), and where it does not divide ``p``."""
    return DEFAULT_SLOT_COPY if p % DEFAULT_SLOT_COPY == 0 and not per_channel else p


MAX_STAGES = 3       # heads in flight per program by default, where the launch's programs per SM fit (default_stages)


def smem_bytes(config: LeapQuantConfig, stages: int, per_channel: bool, per: int, dot: str = DEFAULT_DOT,
               slot_copy: int | None = None, dk: int = 128, dv: int = 128) -> int:
    """Shared memory of one program of ``per`` heads (``_launch``'s buffers, each from a 1 KB
    boundary, ``mosaic_shared.aligned``, and its barriers): ``stages`` of each of a head's input
    tiles (record arrays in parts of ``slot_copy`` slots), then the scratch. Leaves out the
    cross-warp reductions' ``REDUCTION_SCRATCH`` (``dot="fma"`` only), as ``mosaic_shared.per_sm``
    counts it."""
    e = jnp.dtype(config.record_dtype).itemsize
    p, r = config.window, config.effective_rank
    slot_copy = default_slot_copy(p, per_channel) if slot_copy is None else slot_copy
    stages = min(stages, per)
    parts = lambda d: [slot_copy * d * e] * (p // slot_copy)
    tiles = [4 * dk, 4 * dk, 4 * dk, 4 * dv, packed_rows(dk, config.bits) * dv, 4 * dv]      # q w b v codes scale
    tiles += ([4 * dk] if config.smoothing else []) + ([2 * r * dk, 2 * r * dv] if r else [])
    tiles += parts(dk) + parts(dv) + ([4 * dk] + parts(dk) if per_channel else [])            # rk ru (g bg)
    cols = META_COLS + (0 if per_channel else p)
    scratch = [4 * per * cols, 4 * (p + 3) * dk if per_channel else e * per * p, 4 * 2 * dv, e * 2 * dv, e * 2 * dk,
               4 * 2 * WARPS * dv] + ([e * 2 * dk] if per_channel else [])
    if dot == "wgmma":       # mm_scratch: the bf16 codes and pieces, the sums
        scratch += [2 * dk * LANES_COLS, 2 * PIECE_ROWS * dk, 4 * 2 * LANES_COLS]
    elif dot == "rows":      # code_vectors' xv
        scratch.append(4 * 2 * dk)
    barriers = 1 + (0 if per_channel else per // log_decay_heads(p, e)) + stages
    return aligned(*(stages * x for x in tiles), *scratch) + BARRIER_BYTES * barriers


def default_stages(config: LeapQuantConfig, per_channel: bool, per: int, dot: str = DEFAULT_DOT,
                   slot_copy: int | None = None, resident: int = 2) -> int:
    """Heads in flight per program where the caller leaves ``stages`` to the kernel: ``MAX_STAGES``
    where ``resident`` programs (at least two) still fit in an SM's shared memory (``smem_bytes``),
    else two: a third head in flight that costs an SM a program measured slower (docs/performance.md)."""
    smem = smem_bytes(config, MAX_STAGES, per_channel, per, dot, slot_copy)
    return MAX_STAGES if per_sm(smem, cross_warp_sums=dot == "fma") >= max(2, resident) else 2


def log_decay_heads(p: int, itemsize: int) -> int:
    """GDN's heads per copy of record log-decays: the fewest whose ``p`` log-decays of ``itemsize``
    bytes fill whole 128-byte copies."""
    return 128 // math.gcd(128, p * itemsize)


def head_grain(config: LeapQuantConfig, per_channel: bool) -> int:
    """A program's heads come in multiples of this: whole 128-byte copies of their rows of scalars
    (``META_COLS``, then GDN's ``p`` record decays, fp32) and of GDN's record log-decays."""
    p = config.window
    cols = META_COLS + (0 if per_channel else p)
    grain = 128 // math.gcd(128, 4 * cols)
    return grain if per_channel else math.lcm(grain, log_decay_heads(p, jnp.dtype(config.record_dtype).itemsize))


def split_heads(n: int, programs: int, grain: int) -> tuple[int, int]:
    """``(programs, per)``: ``n`` heads split into programs of ``per`` heads, a multiple of ``grain``,
    as evenly as ``programs`` allows (the last program may take fewer)."""
    per = -(-n // programs)
    per = -(-per // grain) * grain
    return -(-n // per), per


def default_programs(config: LeapQuantConfig, per_channel: bool, n: int, dot: str = DEFAULT_DOT,
                     slot_copy: int | None = None, stages: int | None = None) -> int:
    """Programs of a launch over ``n`` heads where the caller leaves ``programs`` to the kernel, at
    most one per ``MIN_HEADS`` heads: three per SM at ``THREE_PER_SM_BITS`` bits and below where
    three fit in an SM's shared memory with ``stages`` heads in flight each (two where ``None``;
    ``smem_bytes``) and put at most ``THREE_PER_SM_GAIN`` times two's heads on the fullest SM
    (``split_heads`` in multiples of ``head_grain``), else two. Why: at 4 and 2 bits the step's
    arithmetic (more code parts a byte, six Compensator Tokens) outlasts its copies and a third
    program's warps hide it; at 8 and 6 bits a third program gained 1-2% (docs/performance.md)."""
    sms, grain = sm_count(), head_grain(config, per_channel)
    two, three = (max(1, min(k * sms, n // MIN_HEADS)) for k in (2, 3))
    if config.bits > THREE_PER_SM_BITS:
        return two
    _, per = split_heads(n, three, grain)
    smem = smem_bytes(config, stages or 2, per_channel, per, dot, slot_copy)
    if per_sm(smem, cross_warp_sums=dot == "fma") < 3:
        return two

    def fullest(programs):      # heads on the SM with the most programs
        programs, per = split_heads(n, programs, grain)
        return per * -(-programs // sms)
    return three if fullest(three) <= THREE_PER_SM_GAIN * fullest(two) else two


def _flat(x, n):
    return x.reshape((n,) + x.shape[2:])


@functools.partial(jax.jit, static_argnames=("config", "programs", "stages", "chunk", "dot", "slot_copy", "interpret"))
def leapquant_step(config: LeapQuantConfig, state: LeapQuantState, token: Token, *, programs: int | None = None,
                   stages: int | None = None, chunk: int | None = None, dot: str | None = None,
                   slot_copy: int | None = None, interpret=None):
    """One in-window decode step (``windowed.step_reference``'s contract) on Mosaic GPU.

    state: ``LeapQuantState`` (``unsupported_reason`` says which); token: ``Token`` with
    ``[B, H, ...]`` fields (``w`` may come at the buffer's ``Hk`` key heads). Returns
    ``(o [B, H, 128] fp32, state with pos + 1)``; the buffer is updated in place when the
    caller's ``jit`` donates the state. ``programs``: programs of the launch (default
    ``default_programs``: three per SM at 4 and 2 bits where they fit, else two); ``stages``: heads
    in flight per program (default ``default_stages``: three where the SM's programs still fit in
    its shared memory, else two); ``chunk``: key
    rows of each code part per code read with ``dot="fma"`` (default a whole part, ``dk`` at 8 bits,
    the faster); ``dot``: how the code sums run (module docstring: ``"rows"``, the default
    ``DEFAULT_DOT``; ``"fma"``; ``"wgmma"``, 8 bits only). ``interpret``: ``None`` runs compiled on a
    GPU and in the Mosaic GPU interpreter elsewhere. ``slot_copy``: record slots per copy (a
    multiple of 4 dividing ``p``; default ``default_slot_copy``):
    parts with no live slot move no device-memory bytes (``_program``).
    """
    return launch(config, state, token, _head_step, programs=programs, stages=stages, chunk=chunk, dot=dot,
                  slot_copy=slot_copy, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("config", "head", "programs", "stages", "chunk", "dot", "slot_copy",
                                             "interpret"))
def launch(config: LeapQuantConfig, state: LeapQuantState, token: Token, head, *, programs=None, stages=None,
           chunk=None, dot=None, slot_copy=None, interpret=None):
    """``leapquant_step`` with ``head`` (``_head_step``'s signature) as each head's arithmetic:
    the same pipeline around other arithmetic (``bench.mosaic_step``'s load-only variant). Under
    ``vmap`` the mapped axis joins the batch (``mosaic_shared.fold_vmap``)."""
    why = unsupported_reason(config, state)
    if why is not None:
        raise ValueError(f"Mosaic GPU leapquant_step cannot run: {why}")
    dot = DEFAULT_DOT if dot is None else dot
    if dot not in DOTS:
        raise ValueError(f"dot={dot!r}: choose one of {DOTS}")
    interpret = resolve_interpret(interpret, "the Mosaic GPU step")
    token = windowed.match_key_heads(token, state.key_heads)
    check_token(state, token)
    slot_copy = default_slot_copy(config.window, state.per_channel_decay) if slot_copy is None else slot_copy
    if not isinstance(slot_copy, int) or slot_copy < WARPS or slot_copy % WARPS or config.window % slot_copy:
        raise ValueError(f"slot_copy={slot_copy!r}: record slots per copy must be a multiple of {WARPS} dividing "
                         f"the window ({config.window})")
    run = functools.partial(_launch, config, head=head, programs=programs, stages=stages, chunk=chunk, dot=dot,
                            slot_copy=slot_copy, interpret=interpret)
    return fold_vmap(run)(state, token)


def _launch(config, state, token, *, head, programs, stages, chunk, dot, slot_copy, interpret):
    """``launch`` on checked inputs: the scalars' packing and the kernel's launch."""
    bsz, h, dk, dv = state.shape
    hk = state.key_heads
    ckpt, buf = state.checkpoint, state.buffer
    p, r = config.window, config.effective_rank
    bits = config.bits
    if dot != "fma" and chunk is not None:
        raise ValueError(f"chunk={chunk}: only dot='fma' reads the codes in chunks (dot={dot!r})")
    if dot == "wgmma" and bits != 8:
        raise ValueError(f"dot='wgmma' reads 8-bit codes only (bits={bits}): take dot='rows' or dot='fma'")
    chunk = dk // code_parts(bits) if chunk is None else chunk
    check_chunk(chunk, bits, dk)
    n = bsz * h
    per_channel = state.per_channel_decay
    check_launch(programs, 1 if stages is None else stages)
    if programs is None:
        programs = default_programs(config, per_channel, n, dot, slot_copy, stages)
    log_heads = log_decay_heads(p, jnp.dtype(buf.g.dtype).itemsize)    # the buffer's, whatever the config says
    programs, per = split_heads(n, programs, math.lcm(head_grain(config, per_channel), log_heads))
    if stages is None:
        stages = default_stages(config, per_channel, per, dot, slot_copy, resident=-(-programs // sm_count()))
    stages = min(stages, per)

    # The scalars of every head, padded to whole programs: (g, beta, pos, D0, exp(g), 0, 0, 0) and
    # for GDN its records' decays d_0 .. d_{p-1} (as the reference makes them); KDA's decays are
    # per channel and made in the kernel from the records' log-decays (_kda_decays).
    zero = jnp.zeros((bsz, h), f32)
    pos = jnp.broadcast_to(state.pos[:, None], (bsz, h)).astype(f32)
    if per_channel:
        meta = jnp.stack([zero, token.beta.astype(f32), pos] + [zero] * (META_COLS - 3), axis=-1)
    else:
        G_l, d = windowed.window_decays(buf, state.pos, 1)
        meta = jnp.concatenate([jnp.stack([token.g.astype(f32), token.beta.astype(f32), pos, jnp.exp(G_l[..., 0]),
                                           jnp.exp(token.g.astype(f32)), zero, zero, zero], axis=-1),
                                d[..., 0]], axis=-1)
    cols = meta.shape[-1]
    meta = jnp.pad(meta.reshape(n, cols), ((0, programs * per - n), (0, 0))).reshape(programs, per, cols)
    arrays = dict(q=_flat(token.q.astype(f32), n), w=_flat(token.w.astype(f32), bsz * hk),
                  b=_flat(token.b.astype(f32), n), v=_flat(token.v.astype(f32), n),
                  codes=_flat(ckpt.residual.codes, n), scale=_flat(ckpt.residual.scale.astype(f32), n))
    if config.smoothing:
        arrays["smooth"] = _flat(ckpt.smooth.astype(f32), n)
    if r:
        arrays.update(ck=_flat(ckpt.comp_k, n), cu=_flat(ckpt.comp_u, n))
    arrays.update(rk=_flat(buf.k, bsz * hk), ru=_flat(buf.u, n))
    if per_channel:          # read with each head's tiles, the new row written at pos
        arrays.update(g=_flat(token.g.astype(f32), n), bg=_flat(buf.g, n))
    names = tuple(arrays)
    values = dict(arrays, meta=meta, bg=_flat(buf.g, n), o=jnp.zeros((n, dv), f32))
    decays = plgpu.SMEM((p + 3, dk), f32) if per_channel else plgpu.SMEM((per, p), buf.g.dtype)
    scratch = [plgpu.SMEM((per, cols), f32), decays, plgpu.SMEM((2, dv), f32),
               plgpu.SMEM((2, dv), buf.u.dtype), plgpu.SMEM((2, dk), buf.k.dtype), plgpu.SMEM((2, WARPS, dv), f32)]
    if per_channel:
        scratch.append(plgpu.SMEM((2, dk), buf.g.dtype))
    if dot == "wgmma":
        scratch += list(mm_scratch(dk))
    elif dot == "rows":
        scratch.append(plgpu.SMEM((2, dk), f32))
    slotted = ("rk", "ru", "bg") if per_channel else ("rk", "ru")
    body = functools.partial(_program, head=head, names=names, keyed=("w", "rk"), slotted=slotted,
                             slot_copy=slot_copy, n=n, per=per, stages=stages,
                             dk=dk, p=p, r=r, h=h, hk=hk, group=h // hk, log_heads=log_heads,
                             smoothing=config.smoothing, chunk=chunk, per_channel=per_channel, dot=dot, bits=bits,
                             interpret=bool(interpret))

    def kernel(refs):
        # dot="fma" sums over the warps with Mosaic GPU's reduction; the others meet through `red`
        @pl.core_map(plgpu.Mesh(grid=(programs,), grid_names=("c",)),
                     compiler_params=lane_params(cross_warp_sums=dot == "fma"), interpret=interpret,
                     name="leapquant_step_mosaic")
        def leapquant_step_mosaic():
            pl.run_scoped(lambda *s: body(refs, s), *scratch)

    new = run_kernel(kernel, values)
    new_buf = WindowBuffer(k=new["rk"].reshape(buf.k.shape), u=new["ru"].reshape(buf.u.shape),
                           g=new["bg"].reshape(buf.g.shape))
    o = new["o"].reshape(bsz, h, dv)
    return o, LeapQuantState(checkpoint=ckpt, buffer=new_buf, pos=state.pos + 1)


def copied_slots(p: int, pos: int, slot_copy: int) -> int:
    """Record slots a step at ``pos`` copies in from device memory: whole parts of ``slot_copy``
    slots up to the last live one, and the first part always (``_program``)."""
    return slot_copy * max(1, -(-pos // slot_copy))


def mosaic_step_bytes(config: LeapQuantConfig, dk: int, dv: int, group: int = 1, per_channel: bool = False,
                      pos: int | None = None, slot_copy: int | None = None) -> float:
    """Device-memory bytes one value head moves in one step of this kernel at window position
    ``pos`` (``None``: the mean over ``0 .. p - 1``), its records copied ``slot_copy`` slots at a
    time (``copied_slots``; default ``default_slot_copy``). ``group``: value heads per key head,
    whose key bytes count ``1 / group``; ``per_channel``: KDA (the token's ``g [dk]``, the copied
    log-decay rows of ``dk`` in, one out; no record decays among the scalars)."""
    e = jnp.dtype(config.record_dtype).itemsize
    p, r = config.window, config.effective_rank
    if pos is None:
        return sum(mosaic_step_bytes(config, dk, dv, group, per_channel, j, slot_copy) for j in range(p)) / p
    slots = copied_slots(p, pos, default_slot_copy(p, per_channel) if slot_copy is None else slot_copy)
    n = packed_rows(dk, config.bits) * dv + 4 * dv               # checkpoint: the codes and scales,
    n += (4 * dk if config.smoothing else 0) + 2 * r * (dk + dv)  # the smoothing, the Compensator Tokens
    n += slots * e * dv                                          # value records
    if per_channel:          # log-decay rows in and the new one out; the token's g; the scalars
        n += slots * e * dk + e * dk + 4 * dk + 4 * META_COLS
    else:                    # log-decays in and out; the scalars and the records' decays
        n += 2 * p * e + 4 * (META_COLS + p)
    n += 4 * (2 * dk + dv)                                       # q, b, v
    n += 4 * dv + e * dv                                         # output; the u record
    keys = slots * e * dk + 4 * dk + e * dk                      # key records, w, the key record
    return n + keys / group


__all__ = ["DEFAULT_DOT", "DEFAULT_SLOT_COPY", "DOTS", "MAX_STAGES", "MIN_HEADS", "THREE_PER_SM_BITS",
           "THREE_PER_SM_GAIN", "code_partials_rows", "code_sums_fma", "code_sums_wgmma", "code_vectors",
           "copied_slots", "default_programs", "default_slot_copy", "default_stages", "head_grain", "launch",
           "leapquant_step", "log_decay_heads", "mm_scratch", "mosaic_step_bytes", "slot_rows", "smem_bytes",
           "split_heads", "token_row_groups", "unsupported_reason"]
