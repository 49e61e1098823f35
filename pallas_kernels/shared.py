"""Kernel helpers the decode step and the window flushes share: the packed residual codes' planar
layout (``num_parts``, ``code_planes``, ``unpack_codes``, ``load_code_parts``, ``store_codes``, and
as one tile ``load_code_tile``, ``store_code_tile``; an
fp32 checkpoint tile, ``fp32-w``'s, is read through them as ``FP32_TILE`` "bits": ``tile_bits``), the window's
log-space decays (``window_decays``, ``window_decay_part``) and exact reads of the int8 codes on
the tensor cores (``DIGIT_BITS``, ``int8_digits``, ``combine_digits``); CholeskyQR2 on columns held as pieces
(``scale_cols_to_unit_max``, ``cholesky_qr_round``: the fused and Mosaic GPU flushes). Used
inside Pallas kernel bodies only (Triton and Mosaic GPU alike)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from leapquant_jax.compensators import NORMAL_TINY, gram_shift, unrolled_cholesky
from leapquant_jax.quantizers import code_parts, packed_rows, signed_codes, unsigned_codes

from ._compat import load, pl

f32 = jnp.float32

# The ``bits`` the kernels give a checkpoint kept in fp32 as it is (``residual_format="fp32"``,
# ``fp32-w``): one part of ``dk`` rows, read as it is, no column scales.
FP32_TILE = 32


def tile_bits(config) -> int:
    """The checkpoint tile's ``bits`` for the kernels: ``FP32_TILE`` for an fp32 residual, else
    ``config.bits`` (integer codes)."""
    return FP32_TILE if config.residual_format == "fp32" else config.bits


def num_parts(bits: int) -> int:
    """Key-row parts the packed codes split into: 1 (8 bits, an fp32 tile), 2 (4 bits), 4 (6 and
    2 bits) (``quantizers.code_parts``, the reference's layout)."""
    return 1 if bits == FP32_TILE else code_parts(bits)


def tile_rows(dk: int, bits: int) -> int:
    """Rows of the checkpoint tile ``[rows, dv]``: ``quantizers.packed_rows``, ``dk`` for an fp32 tile."""
    return dk if bits == FP32_TILE else packed_rows(dk, bits)


def code_planes(codes_ref, bits: int, n: int, start=0, rows: int | None = None, at=lambda *idx: idx):
    """The packed byte rows of a chunk of codes, not yet unpacked: one plane at 8, 4 and 2 bits,
    three planes of ``n`` rows each at 6 bits (``unpack_codes`` turns them into codes).

    ``at`` maps the (rows, columns) index to the ref's full index (a leading head index where a
    block holds several heads). Loading and unpacking are apart so that a kernel can issue its
    other loads before any arithmetic waits on the codes.
    """
    rows = n if rows is None else rows
    planes = 3 if bits == 6 else 1
    return [codes_ref[at(pl.ds(i * n + start, rows), slice(None))] for i in range(planes)]


def unpack_codes(planes, bits: int, dtype=f32):
    """Signed codes ``[rows, BV]`` of ``dtype`` per key-row part from ``code_planes``' bytes (an
    fp32 tile's values as they are): the 8-bit codes as stored; below, the unsigned codes of the
    planar layout made signed by ``quantizers.signed_codes`` (at 2 bits the odd ``2u - 3``)."""
    if bits in (8, FP32_TILE):
        return [planes[0].astype(dtype)]
    planes = [x.astype(jnp.int32) for x in planes]
    if bits == 4:
        p = planes[0]
        parts = [p & 15, p >> 4]
    elif bits == 2:
        p = planes[0]
        parts = [(p >> (2 * i)) & 3 for i in range(code_parts(2))]
    else:
        top = ((planes[0] >> 6) & 3) | (((planes[1] >> 6) & 3) << 2) | (((planes[2] >> 6) & 3) << 4)
        parts = [q & 63 for q in planes] + [top]
    return [signed_codes(u, bits).astype(dtype) for u in parts]


def load_code_parts(codes_ref, bits: int, dk: int, start=0, rows: int | None = None, dtype=f32):
    """Signed codes of a packed tile as ``num_parts(bits)`` arrays ``[rows, BV]`` of ``dtype``.

    Part ``i`` holds key rows ``i * dk / parts + start + [0, rows)``; ``rows`` defaults to the
    whole part. Every part of a chunk comes from the same packed byte rows (planar layout).
    """
    return unpack_codes(code_planes(codes_ref, bits, dk // num_parts(bits), start, rows), bits, dtype)


def load_code_tile(codes_ref, bits: int, dk: int, dtype=f32):
    """Signed codes of a packed tile as one array ``[dk, BV]`` of ``dtype``, key rows in order: a
    kernel on it runs the same code at every width, where a list of parts would multiply its code
    (and a Triton kernel's compile time) by up to four. Row ``i`` of part ``i // n`` (``n = dk /
    parts``) reads byte row ``i % n`` of every plane (a gather: those rows repeat, L1 hits), unpacks
    them as ``unpack_codes`` does, and keeps its own part's code."""
    parts = num_parts(bits)
    if parts == 1:
        return load_code_parts(codes_ref, bits, dk, dtype=dtype)[0]
    n = dk // parts
    rows = jax.lax.broadcasted_iota(jnp.int32, (dk,), 0)
    planes = [codes_ref[c * n + rows % n, :] for c in range(3 if bits == 6 else 1)]
    vals = unpack_codes(planes, bits, dtype)
    part = (rows // n)[:, None]
    x = vals[-1]
    for i in range(parts - 2, -1, -1):
        x = jnp.where(part == i, vals[i], x)
    return x


def store_code_tile(codes_out, q_int, bits: int, dk: int):
    """``store_codes`` of one int32 tile ``[dk, dv]`` of signed codes, key rows in order
    (``load_code_tile``'s inverse): its parts split off exactly, each a masked sum over the
    stacked axis (Triton has no gather)."""
    parts = num_parts(bits)
    n = dk // parts
    if parts > 1:
        x = q_int.reshape(parts, n, q_int.shape[1])
        which = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
        q_int = [jnp.sum(jnp.where(which == i, x, 0), axis=0) for i in range(parts)]
    else:
        q_int = [q_int]
    store_codes(codes_out, q_int, bits, dk, 0, n)


def store_codes(codes_out, q_int, bits, dk, start, rows):
    """Packs and stores signed codes: ``q_int`` holds one ``[rows, dv]`` int32 tile per code part
    (key rows ``i * dk / parts + start + [0, rows)``), written to packed byte rows
    ``start + [0, rows)`` of each plane (the planar layout of ``leapquant_jax.quantizers``, the
    stored codes ``quantizers.unsigned_codes``), with integer masks and shifts only (the Triton
    flushes and the Mosaic GPU flush alike)."""
    if bits == 8:
        codes_out[pl.ds(start, rows), :] = q_int[0].astype(jnp.int8)
        return
    u = [unsigned_codes(x, bits) for x in q_int]
    if bits == 4:
        lo, hi = u
        codes_out[pl.ds(start, rows), :] = (lo | (hi << 4)).astype(jnp.uint8)
    elif bits == 2:
        packed = u[0]
        for i in range(1, len(u)):
            packed = packed | (u[i] << (2 * i))
        codes_out[pl.ds(start, rows), :] = packed.astype(jnp.uint8)
    else:
        a, b, c_, d4 = u
        m = dk // num_parts(bits)
        for p_, quarter in enumerate((a, b, c_)):
            codes_out[pl.ds(p_ * m + start, rows), :] = (quarter | (((d4 >> (2 * p_)) & 3) << 6)).astype(jnp.uint8)


def window_decays(g, live):
    """``(D0, d)`` from the records' log-decays ``g`` (``[p]``, or ``[p, n]`` per channel) loaded
    with dead slots as 0: ``D0 = exp(G_l)`` (``[]`` or ``[n]``) and ``d_j = exp(G_l - G_j)`` for
    live slots, 0 for dead ones (masked before ``exp``, never divided)."""
    g = g.astype(f32)
    G = jnp.cumsum(g, axis=0)
    if g.ndim == 2:
        G_l = jnp.sum(g, axis=0)                                                   # [n]
        return jnp.exp(G_l), jnp.exp(jnp.where(live[:, None], G_l[None, :] - G, -jnp.inf))
    G_l = jnp.sum(g)
    return jnp.exp(G_l), jnp.exp(jnp.where(live, G_l - G, -jnp.inf))


def window_decay_part(g_ref, live, part, per_channel: bool):
    """``window_decays`` of the live records for key rows ``part`` (a ``pl.ds``), loaded here;
    dead slots are never loaded."""
    if per_channel:
        return window_decays(load(g_ref.at[:, part], mask=live[:, None], other=0.0), live)
    return window_decays(load(g_ref, mask=live, other=0.0), live)


# ----------------------------------------------------------------------------- exact code reads

DIGIT_BITS = 22     # fixed-point bits of a vector split into int8 digits (DIGITS of them)
DIGITS = 3
DIGIT_SCALE_FLOOR = 2.0 ** -100   # least max |x| of a digit split: 2**DIGIT_BITS / floor stays finite


def int8_digits(x, inv):
    """Balanced base-256 digits ``d_0 + 256 d_1 + 65536 d_2 = round(x * inv)``, each int32 of ``x``'s shape in int8 range.

    ``|x * inv| <= 2**22`` keeps ``|d_2| <= 65``; the rounding error is at most
    ``1.25 * 2**-23 max|x|`` per element (half a step, plus the fp32 rounding of ``x * inv``).
    """
    xi = jnp.floor(x * inv + 0.5).astype(jnp.int32)
    out = []
    for _ in range(DIGITS - 1):
        d = ((xi + 128) & 255) - 128
        out.append(d)
        xi = (xi - d) >> 8
    return out + [xi]


def combine_digits(sums):
    """The three digit sums (lowest digit first; int32 or fp32, any equal shapes) recombined in
    fp32: ``(s2 * 2**16 + s1 * 2**8) + s0``, in this order in every kernel."""
    s0, s1, s2 = (x.astype(f32) for x in sums)
    return (s2 * 65536.0 + s1 * 256.0) + s0


def scale_cols_to_unit_max(cols):
    """Columns ``cols[c][part]`` (arrays) divided by their largest magnitude, as
    ``compensators.scale_to_unit_max`` (left as they are when all are zero)."""
    m = None
    for col in cols:
        for x in col:
            mx = jnp.max(jnp.abs(x))
            m = mx if m is None else jnp.maximum(m, mx)
    m = jnp.where(m > NORMAL_TINY, m, 1.0)
    return [[x / m for x in col] for col in cols]


def _zero_unless(keep, x):
    return jnp.where(keep, x, 0.0)


def cholesky_qr_round(cols, rank, sqrt=jnp.sqrt, zero_unless=_zero_unless):
    """One round of Cholesky QR on ``rank`` columns ``cols[c][part]`` (fp32 arrays), with the
    reference's factorisation (``compensators.unrolled_cholesky``: pivots clamped, a column
    without a direction of its own dropped, zero). ``sqrt`` and ``zero_unless(keep, x)`` (``x``
    where the scalar ``keep`` holds, else zeros): for a backend that lowers neither ``sqrt`` nor
    a select of an array by a scalar."""
    def dot(a, b):
        return sum(jnp.sum(x * y) for x, y in zip(a, b))

    gram = [[dot(cols[a], cols[b]) for b in range(a + 1)] for a in range(rank)]
    chol, keep = unrolled_cholesky(gram, gram_shift(sum(gram[a][a] for a in range(rank)), rank), sqrt=sqrt)
    out = []
    for i in range(rank):
        col = list(cols[i])
        for j in range(i):
            col = [x - chol[i][j] * y for x, y in zip(col, out[j])]
        out.append([zero_unless(keep[i], x / chol[i][i]) for x in col])
    return out


__all__ = ["DIGITS", "DIGIT_BITS", "DIGIT_SCALE_FLOOR", "FP32_TILE", "cholesky_qr_round", "code_planes",
           "combine_digits", "int8_digits", "load_code_parts", "load_code_tile", "num_parts",
           "scale_cols_to_unit_max", "store_code_tile", "store_codes", "tile_bits", "tile_rows",
           "unpack_codes", "window_decay_part", "window_decays"]
