"""LeapQuant decode step inside a window on Pallas Triton (docs/design.md §3, §6): GDN and KDA, 8/6/4/2 bits.

Contract: ``windowed.step_reference``'s. Read ``u = beta (v - S_l^T b)`` at ``l = pos`` records,
append the record ``(w, u, g)`` at slot ``pos``, output ``o = S_{l+1}^T q``; no flush, no
checkpoint write. Needs ``pos < p`` (a sequence at ``pos >= p`` writes nothing, its output is
unspecified). The buffer ``k [B, Hk, p, dk]``, ``u [B, H, p, dv]``, ``g`` is aliased in to out.

Why: a step's cost is the bytes it reads, so it reads the codes once and serves both reads from
them. With ``D0 = exp(G_l)`` and ``d_j = exp(G_l - G_j)`` (log-space sums of the live records'
log-decays, masked before ``exp``, never divided), for ``x1 = b`` and ``x2 = exp(g) q``:

    S_l^T x = scale * (Z^T (c * D0 * x)) + U^T (K (D0 * x)) + sum_j u_j (k_j . (d_j * x))

(``o`` adds the new record's term to the read of ``x2``); the Compensator Tokens ``(K, U)`` are
``r`` records with decay 1. Only live records are loaded (masked loads).

Layout: one program per (sequence, ``heads_per_program`` heads, value block ``BV``); it walks each
code part's key rows ``chunk`` at a time (codes ``[rows, BV]`` in the planar layout of
``quantizers``). Loads go codes first, then the key side, the value side after the code reads:
Triton issues loads in program order and never hoists one above a reduction. GVA (``H = n Hk``):
value head ``h`` reads key head ``h // n``; the ``n`` programs of a key group store the same new
key record into the same row, which no program reads.

Code reads (``reduce``): ``"dot"``/``"dot_cols"`` split each vector into three balanced int8
digits of one fixed-point scale (``2**-22 max|x|``), one int8 tensor-core dot with exact int32
sums (the digits as its left or right operand), recombined in fp32; ``"lanes"`` sums fp32
products across threads. Rounding: fp32 but for the digit split (about ``2**-23 max|x|`` per
element); the record is rounded to the record dtype when stored, the token's own output uses its
fp32 ``k``, ``u``, ``g`` (as the reference).

An fp32 checkpoint (``fp32-w``; ``shared.FP32_TILE``): the tile ``[dk, BV]`` is ``S0`` itself
(``Z`` above, one part, ``scale`` 1), read with ``"lanes"``; no Compensator Tokens, no smoothing.

Defaults, each the fastest measured (H200, batch 512; docs/performance.md): ``default_reduce``,
``default_num_warps``, the whole code part per chunk, ``BV = dv``, one head per program.
Bytes per step and value head: ``step_bytes``. Tested with JAX 0.10.2 (interpret mode, CPU) and
0.11.2 (compiled, H200).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from leapquant_jax import windowed
from leapquant_jax.recurrence import Token
from leapquant_jax.state import LeapQuantConfig, LeapQuantState, WindowBuffer

from ._compat import compiler_params, default_interpret, load, pl
from .shared import (DIGIT_BITS, DIGIT_SCALE_FLOOR, DIGITS, FP32_TILE, code_planes, combine_digits, int8_digits,
                     num_parts, tile_bits, tile_rows, unpack_codes, window_decays)
from .support import check_token, unsupported_reason

f32 = jnp.float32


DOT_ROWS = 16       # rows of a Triton dot operand (the digit rows, zero-padded)
RECORD_LOG_DECAY_MIN = windowed.RECORD_LOG_DECAY_MIN


def vector_scale(*pieces):
    """``(2**DIGIT_BITS / m, m / 2**DIGIT_BITS)`` for ``m = max |x|``, ``m`` floored at ``DIGIT_SCALE_FLOOR``.

    ``x`` may come as equal-shaped pieces (a vector's code parts): one cross-thread max of
    their elementwise maximum.

    The floor keeps ``2**DIGIT_BITS / m`` finite when ``m`` is zero or denormal (a vector
    decayed by ``exp(G)`` with ``G`` below about -87): unfloored, a denormal ``m`` gives an
    infinite ``inv`` and, where the GPU flushes ``x`` to zero, ``0 * inf = NaN`` digits.
    Entries below the floor's resolution (``2**-122``) read as zero.
    """
    m = jnp.maximum(jnp.max(functools.reduce(jnp.maximum, (jnp.abs(x) for x in pieces))), DIGIT_SCALE_FLOOR)
    return (2.0 ** DIGIT_BITS) / m, m * (2.0 ** -DIGIT_BITS)


def digit_rows(vectors, invs, n):
    """The int8 dot operand ``[DOT_ROWS, n]``: ``DIGITS`` rows per vector, zero below."""
    rows = jnp.arange(DOT_ROWS)[:, None]
    out = jnp.zeros((DOT_ROWS, n), jnp.int32)
    for v, (x, inv) in enumerate(zip(vectors, invs)):
        for i, d in enumerate(int8_digits(x, inv)):
            out = jnp.where(rows == DIGITS * v + i, d[None, :], out)
    return out.astype(jnp.int8)


def undigit(acc, v):
    """Vector ``v``'s ``x^T Z`` from the int32 dot result ``acc [DOT_ROWS, BV]`` (before ``1 / inv``)."""
    rows = jnp.arange(DOT_ROWS)[:, None]
    return combine_digits([jnp.sum(jnp.where(rows == DIGITS * v + i, acc, 0), axis=0) for i in range(DIGITS)])


def digit_cols(vectors, invs, n):
    """The int8 dot operand ``[n, DOT_ROWS]`` of ``reduce="dot_cols"``: ``DIGITS`` columns per
    vector, zero right of them (``digit_rows`` transposed)."""
    cols = jnp.arange(DOT_ROWS)[None, :]
    out = jnp.zeros((n, DOT_ROWS), jnp.int32)
    for v, (x, inv) in enumerate(zip(vectors, invs)):
        for i, d in enumerate(int8_digits(x, inv)):
            out = jnp.where(cols == DIGITS * v + i, d[:, None], out)
    return out.astype(jnp.int8)


def undigit_cols(acc, v):
    """Vector ``v``'s ``x^T Z`` from the int32 result ``acc [BV, DOT_ROWS]`` of ``Z^T`` times
    ``digit_cols`` (before ``1 / inv``): its sums run along a row of the mma's accumulator,
    across 4 lanes, where ``undigit``'s run down a column, across 8."""
    cols = jnp.arange(DOT_ROWS)[None, :]
    return combine_digits([jnp.sum(jnp.where(cols == DIGITS * v + i, acc, 0), axis=1) for i in range(DIGITS)])


# ----------------------------------------------------------------------------- kernel


def step_operands(config: LeapQuantConfig, state: LeapQuantState, token: Token) -> tuple[list, int]:
    """The step's operands in the order its kernels take them (this one and ``load_only``'s):
    ``pos``; the token's ``q, w, b, v, g, beta`` (fp32); the codes and scales (an fp32 checkpoint:
    its values alone); the smoothing scales where ``config.smoothing``; the Compensator Tokens
    ``k, u`` where the rank is not 0; the records ``k, u, g`` (outputs 1 to 3 alias them).
    Returns ``(operands, index of the first record)``."""
    ckpt, buf = state.checkpoint, state.buffer
    res = ckpt.residual
    tile = [res.values] if tile_bits(config) == FP32_TILE else [res.codes, res.scale]
    args = [state.pos.astype(jnp.int32), token.q.astype(f32), token.w.astype(f32), token.b.astype(f32),
            token.v.astype(f32), token.g.astype(f32), token.beta.astype(f32), *tile]
    if config.smoothing:
        args.append(ckpt.smooth)
    if config.effective_rank:
        args += [ckpt.comp_k, ckpt.comp_u]
    return args + [buf.k, buf.u, buf.g], len(args)


def step_refs(refs, *, smoothing: bool, rank: int, scaled: bool = True) -> tuple:
    """A step kernel's refs (``step_operands``, then the outputs ``o`` and the records ``k, u, g``)
    by name: ``(pos, q, w, b, v, g, beta, codes, scale, smooth, comp_k, comp_u, k, u, g, o, k_out,
    u_out, g_out)``, ``smooth`` and the Compensator Tokens ``None`` where the step has none, and
    ``scale`` ``None`` unless ``scaled`` (an fp32 checkpoint's ``codes`` are its values)."""
    it = iter(refs)
    head = tuple(next(it) for _ in range(8))
    head += (next(it) if scaled else None,)
    smooth = next(it) if smoothing else None
    comp = (next(it), next(it)) if rank else (None, None)
    return head + (smooth,) + comp + tuple(it)


def _step_kernel(*refs, bits, rank, window, dk, per_channel, smoothing, rec_dtype, chunk, use_dot, dot_cols, heads,
                 group, key_block):
    (pos_ref, q_ref, w_ref, b_ref, v_ref, g_ref, beta_ref, codes_ref, scale_ref, smooth_ref, ck_ref, cu_ref,
     bk_ref, bu_ref, bg_ref, o_ref, bk_out, bu_out, bg_out) = step_refs(refs, smoothing=smoothing, rank=rank,
                                                                         scaled=bits != FP32_TILE)

    parts = num_parts(bits)
    n = dk // parts                                   # key rows per code part
    ch = chunk                                        # key rows per part per loop iteration
    nch = n // ch
    bv = o_ref.shape[-1]
    rec = jnp.dtype(rec_dtype)
    comp_tile = rank > 0 and (rank & (rank - 1)) == 0
    every = slice(None)
    pos = pos_ref[...]                        # first: the record loads' masks wait on it
    live = jnp.arange(window) < pos           # [p]
    first_block = pl.program_id(2) == 0       # outside pl.when: interpret mode needs it there

    def at(t):
        """Indexer of head ``t``'s block: the refs have a head axis only when the program holds
        several heads (one head's axis is squeezed, so the default program is the one-head kernel)."""
        if heads == 1:
            return lambda *idx: idx if idx else ...
        t = jnp.int32(t)        # interpret mode's masked load cannot take a Python int index
        return lambda *idx: (t, *idx)

    def at_key(t):
        """Indexer of the key records and the token's key (``w``) of head ``t``: its key head
        ``t // group`` of the program's block of ``key_block`` key heads (squeezed for one)."""
        if key_block == 1:
            return lambda *idx: idx if idx else ...
        kt = jnp.int32(t // group)
        return lambda *idx: (kt, *idx)

    # Loads, separated from the arithmetic: Triton issues loads in program order and does not
    # hoist one above a reduction (a barrier), so a load made late costs a memory round trip.
    def load_key_side(t, start):
        """Per code part: its rows ``start + [0, ch)`` of every key-side input; records masked to live slots."""
        a, ak, out = at(t), at_key(t), []
        for i in range(parts):
            sl = pl.ds(i * n + start, ch)
            x = dict(kb=load(bk_ref.at[ak(every, sl)], mask=live[:, None], other=0.0))      # [p, ch]
            if per_channel:
                x["gb"] = load(bg_ref.at[a(every, sl)], mask=live[:, None], other=0.0)      # [p, ch]
            if comp_tile:
                x["kc"] = ck_ref[a(every, sl)]                                             # [r, ch]
            elif rank:
                x["kc"] = [ck_ref[a(c, sl)] for c in range(rank)]
            if smoothing:
                x["sm"] = smooth_ref[a(sl)]
            x.update(q=q_ref[a(sl)], w=w_ref[ak(sl)], b=b_ref[a(sl)])
            if per_channel:
                x["g"] = g_ref[a(sl)]
            out.append(x)
        return out

    def load_head_decays(t):
        """GDN's record log-decays and the token's (scalar decays serve every key row; KDA's
        per-channel ones come with the key side)."""
        if per_channel:
            return {}
        a = at(t)
        return dict(gb=load(bg_ref.at[a(every)], mask=live, other=0.0), g=g_ref[a()])     # [p], []

    def load_value_side(t, vs):
        """The value-side inputs, added to ``vs``."""
        a = at(t)
        vs.update(ub=load(bu_ref.at[a(every, every)], mask=live[:, None], other=0.0),       # [p, BV]
                  v=v_ref[a(every)], beta=beta_ref[a()])
        if scale_ref is not None:
            vs["scale"] = scale_ref[a(every)]
        if comp_tile:
            vs["cu"] = cu_ref[a(every, every)]                                             # [r, BV]
        elif rank:
            vs["cu"] = [cu_ref[a(c, every)] for c in range(rank)]
        return vs

    def head_decays(vs):
        if not per_channel:
            vs["D0"], vs["d"] = window_decays(vs["gb"], live)                            # [], [p]
            vs["a_new"] = jnp.exp(vs["g"])
        return vs

    def whole_scales(t):
        """The digit scales of a head walked in several chunks: a pre-pass over the whole key
        range of the vectors the chunks split (small next to the codes)."""
        a = at(t)
        z1, z2 = b_ref[a(every)], q_ref[a(every)]
        if per_channel:
            gb = load(bg_ref.at[a(every, every)], mask=live[:, None], other=0.0).astype(f32)   # [p, dk]
            D0 = jnp.exp(jnp.sum(gb, axis=0))
            z1, z2 = D0 * z1, D0 * jnp.exp(g_ref[a(every)]) * z2
        if smoothing:
            sm = smooth_ref[a(every)]
            z1, z2 = sm * z1, sm * z2
        return vector_scale(z1), vector_scale(z2)

    # Products are accumulated over the key chunks and reduced once at the end: acc [ch, BV]
    # elementwise (or [DOT_ROWS, BV] int32 from the dot), kacc [p, ch] (records), cacc [r, ch]
    # (compensators), kq [ch].
    def key_sums(k1, k2, c1, c2, kq):
        """The record, Compensator-Token and ``k . q`` products summed over the key rows."""
        if comp_tile:
            c1, c2 = jnp.sum(c1, axis=1), jnp.sum(c2, axis=1)                       # [r]
        else:
            c1, c2 = tuple(jnp.sum(c) for c in c1), tuple(jnp.sum(c) for c in c2)
        return jnp.sum(k1, axis=1), jnp.sum(k2, axis=1), c1, c2, jnp.sum(kq)          # [p], [p], ..., []

    def chunk_terms(code_bytes, kparts, vs, carry, scales):
        """One chunk's products added to ``carry``, with ``scales`` of the digit split. When the
        chunk is the whole part (one chunk), the scales come from its vectors instead, and the
        key-row sums are made here, before the code reads, so the ``[p, ch]`` products hold no
        registers through them."""
        acc1, acc2, k1, k2, c1, c2, kq = carry
        terms, digit_vectors, scale_vectors = [], [], []
        for x in kparts:
            if per_channel:
                D0_, dd = window_decays(x["gb"], live)                                  # [ch], [p, ch]
            else:
                D0_, dd = vs["D0"], None
            x1, q = x["b"], x["q"]
            kq = kq + x["w"] * q
            a_new = jnp.exp(x["g"]) if per_channel else vs["a_new"]
            x2 = a_new * q
            y1, y2 = D0_ * x1, D0_ * x2
            terms.append((x, x1, x2, y1, y2, dd))
            # The code reads fold C and the decays into the vectors: smoothed, and with KDA's
            # per-channel decays; GDN's scalar decays are applied after the dot.
            if use_dot and not per_channel:
                y1, y2 = x1, q
            if smoothing:
                y1, y2 = x["sm"] * y1, x["sm"] * y2
            digit_vectors.append((y1, y2))
            if use_dot and nch == 1 and per_channel:
                # KDA's x2 scale from (D0 exp(g)) q, the product whole_scales takes: the digits
                # do not depend on the chunking
                s2 = (D0_ * a_new) * q
                y2 = x["sm"] * s2 if smoothing else s2
            scale_vectors.append((y1, y2))

        def digit_scales():
            if not use_dot or nch > 1:
                return scales
            return (vector_scale(*(s1 for s1, _ in scale_vectors)),
                    vector_scale(*(s2 for _, s2 in scale_vectors)))

        # The scales' two reductions go before the record products for KDA and after them for
        # GDN: the faster place for each (docs/performance.md).
        if per_channel:
            scales = digit_scales()
        for x, x1, x2, y1, y2, dd in terms:
            kb = x["kb"].astype(f32)
            if per_channel:
                kb = kb * dd
            k1 = k1 + kb * x1[None, :]
            k2 = k2 + kb * x2[None, :]
            if comp_tile:
                kc = x["kc"].astype(f32)
                c1 = c1 + kc * y1[None, :]
                c2 = c2 + kc * y2[None, :]
            elif rank:
                kcs = [kc.astype(f32) for kc in x["kc"]]
                c1 = tuple(a + kc * y1 for a, kc in zip(c1, kcs))
                c2 = tuple(a + kc * y2 for a, kc in zip(c2, kcs))
        if nch == 1:
            k1, k2, c1, c2, kq = key_sums(k1, k2, c1, c2, kq)
        scales = digit_scales()
        for (y1, y2), codes in zip(digit_vectors, unpack_codes(code_bytes, bits, jnp.int8 if use_dot else f32)):
            if use_dot and dot_cols:
                digits = digit_cols([y1, y2], [scales[0][0], scales[1][0]], ch)
                acc1 = acc1 + jax.lax.dot_general(codes, digits, (((0,), (0,)), ((), ())),
                                                  preferred_element_type=jnp.int32)
            elif use_dot:
                acc1 = acc1 + jax.lax.dot(digit_rows([y1, y2], [scales[0][0], scales[1][0]], ch), codes,
                                          preferred_element_type=jnp.int32)
            else:
                acc1 = acc1 + codes * y1[:, None]
                acc2 = acc2 + codes * y2[:, None]
        return (acc1, acc2, k1, k2, c1, c2, kq), scales

    def finish(t, carry, vs, scales, kparts=None):
        """Head ``t``'s output and new record from its key-row sums (its key side from
        ``kparts``, the whole parts' loads, where given: no load waits at the end)."""
        a = at(t)
        acc1, acc2, kx1, kx2, c1, c2, kq = carry
        if not per_channel:
            kx1, kx2 = vs["d"] * kx1, vs["d"] * kx2
        ub = vs["ub"].astype(f32)                                                     # [p, BV]
        if use_dot:
            (_, back1), (_, back2) = scales
            recombine = undigit_cols if dot_cols else undigit
            z1, z2 = recombine(acc1, 0) * back1, recombine(acc1, 1) * back2
            if not per_channel:
                z1, z2 = vs["D0"] * z1, (vs["D0"] * vs["a_new"]) * z2
        else:
            z1, z2 = jnp.sum(acc1, axis=0), jnp.sum(acc2, axis=0)
        if "scale" in vs:       # integer codes: one scale per value column; an fp32 tile is its values
            z1, z2 = vs["scale"] * z1, vs["scale"] * z2
        r1 = z1 + jnp.sum(kx1[:, None] * ub, axis=0)
        r2 = z2 + jnp.sum(kx2[:, None] * ub, axis=0)
        if comp_tile:
            cu = vs["cu"].astype(f32)                                                  # [r, BV]
            r1 = r1 + jnp.sum(c1[:, None] * cu, axis=0)
            r2 = r2 + jnp.sum(c2[:, None] * cu, axis=0)
        else:
            for c in range(rank):
                uc = vs["cu"][c].astype(f32)
                r1 = r1 + c1[c] * uc
                r2 = r2 + c2[c] * uc
        u = vs["beta"] * (vs["v"] - r1)
        u_r = u.astype(rec)
        o_ref[a(every)] = r2 + u * kq

        @pl.when(pos < window)
        def _append():
            bu_out[a(pos, every)] = u_r

        @pl.when((pos < window) & first_block)
        def _append_key_side():
            # With GVA the ``group`` value heads of a key head each store its key record: the
            # same row (slot ``pos`` of key head ``t // group``) with the same values, all taken
            # from that key head's ``w``, so the order of the stores does not matter. The store
            # writes that row alone (a pointer store on the GPU; no write-back of the block), and
            # no program reads slot ``pos``: record loads are masked to slots ``< pos``.
            ak = at_key(t)
            if kparts is None:
                pieces = [(every, w_ref[ak(every)], g_ref[a(every)] if per_channel else None)]
            else:
                pieces = [(pl.ds(i * n, n), x["w"], x.get("g")) for i, x in enumerate(kparts)]
            # log-decays clamped as windowed.append_record
            for sl, w, g in pieces:
                bk_out[ak(pos, sl)] = w.astype(rec)
                if per_channel:
                    bg_out[a(pos, sl)] = jnp.maximum(g, RECORD_LOG_DECAY_MIN).astype(rec)
            if not per_channel:
                bg_out[a(pos)] = jnp.maximum(vs["g"], RECORD_LOG_DECAY_MIN).astype(rec)

    if comp_tile:
        c0 = jnp.zeros((rank, ch), f32)
    else:
        c0 = tuple(jnp.zeros((ch,), f32) for _ in range(rank))
    acc0 = ((jnp.zeros((bv, DOT_ROWS) if dot_cols else (DOT_ROWS, bv), jnp.int32), None) if use_dot
            else (jnp.zeros((ch, bv), f32), jnp.zeros((ch, bv), f32)))
    init = acc0 + (jnp.zeros((window, ch), f32), jnp.zeros((window, ch), f32), c0, c0, jnp.zeros((ch,), f32))

    # The value side (record values, column scales, U, v, beta) is loaded after a head's code
    # reads, before its sums: loaded with the rest, it would hold registers through the reads
    # (fewer programs per SM, KDA spilling), which costs more than the memory round it saves.
    if nch == 1:
        # The codes (the most bytes) and the key side of every head first, then the arithmetic.
        code_bytes = [code_planes(codes_ref, bits, n, 0, ch, at(t)) for t in range(heads)]
        key_side = [load_key_side(t, 0) for t in range(heads)]
        decays = [load_head_decays(t) for t in range(heads)]
        for t in range(heads):
            vs = head_decays(decays[t])
            carry, scales = chunk_terms(code_bytes[t], key_side[t], vs, init, None)
            finish(t, carry, load_value_side(t, vs), scales, key_side[t])
    else:
        # A loop over chunks: each iteration loads its chunk (codes first), then adds its terms.
        decays = [load_head_decays(t) for t in range(heads)]
        for t in range(heads):
            vs = head_decays(decays[t])
            scales = whole_scales(t) if use_dot else None

            def chunk_body(j, carry, t=t, vs=vs, scales=scales):
                start = pl.multiple_of(j * ch, ch)
                code_bytes = code_planes(codes_ref, bits, n, start, ch, at(t))
                return chunk_terms(code_bytes, load_key_side(t, start), vs, carry, scales)[0]

            acc1, acc2, *keys = jax.lax.fori_loop(0, nch, chunk_body, init)
            finish(t, (acc1, acc2, *key_sums(*keys)), load_value_side(t, vs), scales)


# ----------------------------------------------------------------------------- wrapper


def default_block_v(dv: int) -> int:
    """Value columns per program: whole rows (the fastest measured, docs/performance.md)."""
    return dv


def default_chunk(dk: int, bits: int, per_channel: bool) -> int:
    """Key rows per code part per loop iteration: the whole part, no loop (the fastest measured
    with the int8 dots, GDN and KDA; docs/performance.md)."""
    return dk // num_parts(bits)


def default_num_warps(per_channel: bool, bits: int = 8, reduce: str = "dot") -> int:
    """Warps per program, the fastest measured for ``reduce`` (docs/performance.md): GDN 2, but 1
    with ``dot_cols`` at 4 bits; KDA 1 at 8 bits, 2 at 4 and 4 at 6 (one warp spills at 6 and 4 bits).
    2 bits, not measured: as 6 bits, the other width of four code parts (GDN 2, KDA 4).
    An fp32 tile (``FP32_TILE``, ``fp32-w``): 4, the fastest measured of 2 to 16."""
    if bits == FP32_TILE:
        return 4
    if not per_channel:
        return 1 if (reduce, bits) == ("dot_cols", 4) else 2
    return {8: 1, 4: 2, 6: 4, 2: 4}[bits]


REDUCES = ("dot", "dot_cols", "lanes")
MIN_DOT_ROWS = 32   # the int8 mma's K


# (per_channel, bits) where the digits as the dot's right operand measured faster (docs/performance.md);
# 2 bits, not measured, as 6 bits (four code parts, the same warps: default_num_warps)
DOT_COLS_FASTER = frozenset({(False, 8), (False, 4), (True, 6), (True, 4), (True, 2)})


def default_reduce(chunk: int, per_channel: bool = False, bits: int = 8) -> str:
    """The int8 tensor cores where a chunk is a whole int8 mma deep, else ``lanes``: ``dot_cols``
    where it is the faster orientation (``DOT_COLS_FASTER``, each at its ``default_num_warps``),
    ``dot`` elsewhere. Both give the same outputs. An fp32 tile (``FP32_TILE``) has no int8
    digits: ``lanes``, exact fp32 products."""
    if chunk < MIN_DOT_ROWS or bits == FP32_TILE:
        return "lanes"
    return "dot_cols" if (per_channel, bits) in DOT_COLS_FASTER else "dot"


@functools.partial(jax.jit, static_argnames=("config", "block_v", "chunk", "reduce", "num_warps", "num_stages",
                                             "heads_per_program", "interpret"))
def leapquant_step(config: LeapQuantConfig, state: LeapQuantState, token: Token, *, block_v: int | None = None,
                   chunk: int | None = None, reduce: str | None = None, num_warps: int | None = None, num_stages: int = 1,
                   heads_per_program: int = 1, interpret: bool | None = None):
    """One in-window decode step. Same contract as ``windowed.step_reference``.

    state: ``LeapQuantState``; token: ``Token`` with ``[B, H, ...]`` fields (``w`` may come at
    the buffer's ``Hk`` key heads: ``windowed.match_key_heads``). The buffer is
    updated in place when the caller's ``jit`` donates the state (or it is dead after the call
    inside one); otherwise XLA copies it first. Returns ``(o [B, H, dv] fp32, state with pos + 1)``.
    ``reduce``: how the code reads are summed, ``"dot"`` or ``"dot_cols"`` (int8 digits on the
    tensor cores as the left or the right operand; need ``chunk >= 32`` and integer codes) or
    ``"lanes"`` (fp32 products summed across threads; the one way for an fp32 checkpoint,
    ``fp32-w``); the default (``default_reduce``) takes the faster dot where it can.
    ``heads_per_program``: consecutive heads of one sequence per
    program (a power of two dividing ``H``; default 1), their code and key-side loads issued
    together before any head is computed; with GVA (``H = n Hk``) it must divide ``n`` or be a
    multiple of it, so that a program's heads read whole key heads.
    """
    why = unsupported_reason(config, state)
    if why is not None:
        raise ValueError(f"leapquant_step kernel cannot run: {why}")
    token = windowed.match_key_heads(token, state.key_heads)
    check_token(state, token)
    interpret = default_interpret() if interpret is None else interpret
    bsz, h, dk, dv = state.shape
    bv = default_block_v(dv) if block_v is None else block_v
    if dv % bv or bv & (bv - 1) or bv < 16:
        raise ValueError(f"block_v={bv} must be a power of two >= 16 dividing dv={dv}")
    bits = tile_bits(config)
    ch = default_chunk(dk, bits, state.per_channel_decay) if chunk is None else chunk
    if (dk // num_parts(bits)) % ch or ch & (ch - 1) or ch < 16:
        raise ValueError(f"chunk={ch} must be a power of two >= 16 dividing the {dk // num_parts(bits)} rows of a code part")
    hp = heads_per_program
    if not isinstance(hp, int) or hp < 1 or hp & (hp - 1) or h % hp:
        raise ValueError(f"heads_per_program={hp!r} must be a power of two dividing the {h} heads")
    group = h // state.key_heads                       # value heads per key head (GVA)
    if group % hp and hp % group:
        raise ValueError(f"heads_per_program={hp} must divide or be a multiple of the {group} value heads per key "
                         f"head ({h} value heads, {state.key_heads} key heads)")
    kb = max(hp // group, 1)                           # key heads per program
    reduce = default_reduce(ch, state.per_channel_decay, bits) if reduce is None else reduce
    if num_warps is None:
        num_warps = default_num_warps(state.per_channel_decay, bits, reduce)
    if reduce not in REDUCES:
        raise ValueError(f"reduce={reduce!r}: expected one of {REDUCES}")
    if reduce != "lanes" and bits == FP32_TILE:
        raise ValueError(f"reduce={reduce!r} reads int8 codes; an fp32 checkpoint (fp32-w) is read with 'lanes'")
    if reduce != "lanes" and ch < MIN_DOT_ROWS:
        raise ValueError(f"reduce={reduce!r} needs chunk >= {MIN_DOT_ROWS} (the int8 mma depth), got chunk={ch}")
    ckpt, buf = state.checkpoint, state.buffer
    per_channel = state.per_channel_decay
    p, r = config.window, config.effective_rank
    rows = tile_rows(dk, bits)

    hb = None if hp == 1 else hp          # the head axis of a block: squeezed for one head
    kbb = None if kb == 1 else kb
    vec_k = pl.BlockSpec((None, hb, dk), lambda i, j, c: (i, j, 0))
    # The key side (the token's w, the key records) by key head: program j's first value head
    # j hp reads key head j hp // group; a block of kb > 1 key heads is block j of them.
    if kb == 1:
        key_vec = pl.BlockSpec((None, None, dk), lambda i, j, c: (i, (j * hp) // group, 0))
        k_spec = pl.BlockSpec((None, None, p, dk), lambda i, j, c: (i, (j * hp) // group, 0, 0))
    else:
        key_vec = pl.BlockSpec((None, kbb, dk), lambda i, j, c: (i, j, 0))
        k_spec = pl.BlockSpec((None, kbb, p, dk), lambda i, j, c: (i, j, 0, 0))
    vec_v = pl.BlockSpec((None, hb, bv), lambda i, j, c: (i, j, c))
    scalar = pl.BlockSpec((None, hb), lambda i, j, c: (i, j))
    args, first_buf = step_operands(config, state, token)
    specs = [pl.BlockSpec((None,), lambda i, j, c: (i,)), vec_k, key_vec, vec_k, vec_v,
             vec_k if per_channel else scalar, scalar,
             pl.BlockSpec((None, hb, rows, bv), lambda i, j, c: (i, j, 0, c))]
    if bits != FP32_TILE:
        specs.append(vec_v)         # the column scales
    if config.smoothing:
        specs.append(vec_k)
    if r:
        specs += [pl.BlockSpec((None, hb, r, dk), lambda i, j, c: (i, j, 0, 0)),
                  pl.BlockSpec((None, hb, r, bv), lambda i, j, c: (i, j, 0, c))]
    u_spec = pl.BlockSpec((None, hb, p, bv), lambda i, j, c: (i, j, 0, c))
    g_spec = (pl.BlockSpec((None, hb, p, dk), lambda i, j, c: (i, j, 0, 0)) if per_channel
              else pl.BlockSpec((None, hb, p), lambda i, j, c: (i, j, 0)))
    specs += [k_spec, u_spec, g_spec]

    kernel = functools.partial(
        _step_kernel, bits=bits, rank=r, window=p, dk=dk, per_channel=per_channel,
        smoothing=config.smoothing, rec_dtype=config.record_dtype, chunk=ch, use_dot=reduce != "lanes",
        dot_cols=reduce == "dot_cols",
        heads=hp, group=group, key_block=kb)
    o, bk, bu, bg = pl.pallas_call(
        kernel,
        grid=(bsz, h // hp, dv // bv),
        in_specs=specs,
        out_specs=[vec_v, k_spec, u_spec, g_spec],
        out_shape=[jax.ShapeDtypeStruct((bsz, h, dv), f32), jax.ShapeDtypeStruct(buf.k.shape, buf.k.dtype),
                   jax.ShapeDtypeStruct(buf.u.shape, buf.u.dtype), jax.ShapeDtypeStruct(buf.g.shape, buf.g.dtype)],
        input_output_aliases={first_buf: 1, first_buf + 1: 2, first_buf + 2: 3},
        compiler_params=compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"leapquant_step_{'kda' if per_channel else 'gdn'}_{'fp32' if bits == FP32_TILE else f'int{bits}'}",
    )(*args)
    new = LeapQuantState(checkpoint=ckpt, buffer=WindowBuffer(k=bk, u=bu, g=bg), pos=state.pos + 1)
    return o, new


def step_bytes(config: LeapQuantConfig, dk: int, dv: int, pos: int, per_channel: bool, group: int = 1) -> float:
    """Bytes one value head moves in one step at window position ``pos`` (the module docstring's
    count). ``group``: value heads per key head (GVA), whose shared key bytes (live key records,
    the token's key, the written key record) count ``1 / group`` per value head. An ``int`` when
    ``group`` divides them."""
    e = jnp.dtype(config.record_dtype).itemsize
    gl = dk if per_channel else 1
    r = config.effective_rank
    bits = tile_bits(config)
    n = dk * dv * bits // 8 + (4 * dv if bits != FP32_TILE else 0)          # the tile and its column scales
    n += (4 * dk if config.smoothing else 0) + 2 * r * (dk + dv)
    n += pos * e * (dv + gl)
    n += 4 * (2 * dk + dv + 2) + (4 * (dk - 1) if per_channel else 0)
    n += e * (dv + gl) + 4 * dv + 4
    keys = pos * e * dk + 4 * dk + e * dk
    return n + (keys // group if keys % group == 0 else keys / group)


# ----------------------------------------------------------------------------- reference


def leapquant_step_reference(config: LeapQuantConfig, state: LeapQuantState, token: Token, **_unused):
    """The oracle: ``windowed.step_reference`` (same signature and contract)."""
    return windowed.step_reference(config, state, token)


__all__ = ["check_token", "leapquant_step", "leapquant_step_reference", "step_bytes", "step_operands", "step_refs"]
