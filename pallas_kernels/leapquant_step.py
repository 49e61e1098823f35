"""LeapQuant decode step inside a window (docs/design.md §3, §6): GDN (scalar decay) and KDA (per-channel).

Why: a step inside a window writes no state, only its record, and reads the quantized
checkpoint instead of an fp32 state. The step's cost is the bytes it reads, so the kernel
reads the codes tile once and serves both reads of the token from it:

* ``u = beta (v - S_l^T b)`` with ``l = pos`` records, then the record ``(w, u, g)`` is
  appended at slot ``pos``;
* ``o = S_{l+1}^T q`` including the new record.

With ``D0 = exp(G_l)`` and ``d_j = exp(G_l - G_j)`` (log-space sums of the live records'
decays, masked before ``exp``, never divided), both reads share the decays: the output read
is the read at ``l`` of ``x2 = exp(g_new) q`` plus the new record's term. For each vector ``x``

    S_l^T x = scale * (Z^T (c * D0 * x)) + U^T (K (D0 * x)) + sum_j u_j (k_j . (d_j * x))

so ``C`` and the decays are folded into the vector before the integer matrix ``Z``; the
Compensator Tokens ``(K, U)`` are ``r`` records with decay 1 placed before the real ones.
Codes at 6 and 4 bits are unpacked in registers from the planar layout of
``leapquant_jax.quantizers`` (each byte plane pairs with a contiguous slice of the vector).

Grid: one program per (sequence, head, value block ``BV``). Each program walks the key rows in
chunks (``chunk`` rows of every code part per iteration; by default the whole part, no loop),
reading each chunk of codes, record keys, ``K`` and the vectors once. The value-side data
(scales, ``u``, ``U``) is read for the program's block.

The two code reads (``reduce="dot"``, the default where a chunk is at least 32 rows) run on
the int8 tensor cores: each vector is split into three balanced int8 digits of one fixed-point
scale (``2**-22 max|x|``), so ``[digits of x1; digits of x2] @ Z`` is one int8 dot with exact
int32 sums, recombined in fp32 (about fp32's accuracy: the digit rounding is about
``2**-23 max|x|`` per element). ``reduce="lanes"`` accumulates fp32 products elementwise
and sums across threads once after the loop. Record and Compensator-Token products are
elementwise in both. Only live records (slot < pos) are loaded: masked loads fetch nothing
for dead slots. The new record is stored into the buffer (``k``, ``u``, ``g`` are aliased
inputs/outputs, so in place when the caller's ``jit`` donates the state), ``k`` and ``g`` by the
value block 0 program. The step needs ``pos < p`` (as ``windowed.step_reference``); a sequence at
``pos >= p`` writes nothing (no out-of-bounds store) and its output is unspecified.

Fastest on the H200 at batch 512 (``bench/results``): ``reduce="dot"``, the whole part per
chunk, ``BV = dv``, 2 warps for GDN and 1 for KDA.

Rounding: fp32 arithmetic, but for the digit split above. The record is rounded to the
record dtype when stored, for later tokens; the token's own
output uses its fp32 ``k``, ``u`` and ``g``, exactly as the reference does.

Bytes moved per step and head (counted by ``step_bytes``, used by ``bench/kernels.py``),
``l = pos`` live records, record itemsize ``e``, ``r`` Compensator Tokens:
codes ``dk dv bits/8`` + scales ``4 dv`` + smoothing ``4 dk`` + compensators ``2 r (dk + dv)``
+ live records ``l (e dk + e dv + e g)`` (``g`` is 1 or ``dk`` values) + token
``4 (3 dk + dv + 2)`` (+ ``4 (dk - 1)`` for KDA's g) + written record ``e (dk + dv + g)`` +
output ``4 dv`` + ``pos`` ``4``.

Tested with JAX 0.10.2 (interpret mode, CPU) and 0.11.2 (compiled, H200).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from leapquant_jax import windowed
from leapquant_jax.quantizers import packed_rows
from leapquant_jax.recurrence import Token
from leapquant_jax.state import LeapQuantConfig, LeapQuantState, WindowBuffer

from ._compat import compiler_params, default_interpret, load, pl
from .shared import load_code_parts, num_parts, window_decay_part
from .support import unsupported_reason

f32 = jnp.float32


DIGIT_BITS = 22     # fixed-point bits of a vector split into int8 digits (DIGITS of them)
DIGITS = 3
DOT_ROWS = 16       # rows of a Triton dot operand (the digit rows, zero-padded)
DIGIT_SCALE_FLOOR = 2.0 ** -100   # least max |x| of a digit split: 2**DIGIT_BITS / floor stays finite
RECORD_LOG_DECAY_MIN = windowed.RECORD_LOG_DECAY_MIN


def vector_scale(x):
    """``(2**DIGIT_BITS / m, m / 2**DIGIT_BITS)`` for ``m = max |x|``, ``m`` floored at ``DIGIT_SCALE_FLOOR``.

    The floor keeps ``2**DIGIT_BITS / m`` finite when ``m`` is zero or denormal (a vector
    decayed by ``exp(G)`` with ``G`` below about -87): unfloored, a denormal ``m`` gives an
    infinite ``inv`` and, where the GPU flushes ``x`` to zero, ``0 * inf = NaN`` digits.
    Entries below the floor's resolution (``2**-122``) read as zero.
    """
    m = jnp.maximum(jnp.max(jnp.abs(x)), DIGIT_SCALE_FLOOR)
    return (2.0 ** DIGIT_BITS) / m, m * (2.0 ** -DIGIT_BITS)


def int8_digits(x, inv):
    """Balanced base-256 digits ``d_0 + 256 d_1 + 65536 d_2 = round(x * inv)``, each ``[n]`` int32 in int8 range.

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
    parts = [jnp.sum(jnp.where(rows == DIGITS * v + i, acc, 0), axis=0).astype(f32) for i in range(DIGITS)]
    return (parts[2] * 65536.0 + parts[1] * 256.0) + parts[0]


# ----------------------------------------------------------------------------- kernel


def _step_kernel(*refs, bits, rank, window, dk, per_channel, smoothing, rec_dtype, chunk, use_dot):
    it = iter(refs)
    pos_ref, q_ref, w_ref, b_ref, v_ref, g_ref, beta_ref = (next(it) for _ in range(7))
    codes_ref, scale_ref = next(it), next(it)
    smooth_ref = next(it) if smoothing else None
    ck_ref, cu_ref = (next(it), next(it)) if rank else (None, None)
    bk_ref, bu_ref, bg_ref = next(it), next(it), next(it)
    o_ref, bk_out, bu_out, bg_out = next(it), next(it), next(it), next(it)

    parts = num_parts(bits)
    n = dk // parts                                   # key rows per code part
    ch = chunk                                        # key rows per part per loop iteration
    bv = o_ref.shape[-1]
    pos = pos_ref[...]
    live = jnp.arange(window) < pos                   # [p]
    rec = jnp.dtype(rec_dtype)
    comp_tile = rank > 0 and (rank & (rank - 1)) == 0
    if not per_channel:
        D0, d = window_decay_part(bg_ref, live, None, False)                     # [], [p]
        a_new = jnp.exp(g_ref[...])
    if use_dot:
        # The code reads run on the int8 tensor cores: both vectors (smoothed, and with KDA's
        # per-channel decays folded in; GDN's scalar decays are applied after) split into int8
        # digits with one fixed-point scale per vector over the whole key range, from a
        # pre-pass over the vectors (which are small next to the codes).
        z1, z2 = b_ref[...], q_ref[...]
        if per_channel:
            D0_all, _ = window_decay_part(bg_ref, live, pl.ds(0, dk), True)
            z1, z2 = D0_all * z1, D0_all * jnp.exp(g_ref[...]) * z2
        if smoothing:
            z1, z2 = smooth_ref[...] * z1, smooth_ref[...] * z2
        (inv1, back1), (inv2, back2) = vector_scale(z1), vector_scale(z2)

    # Products are accumulated over the key chunks and reduced once at the end: acc [ch, BV]
    # elementwise (or [DOT_ROWS, BV] int32 from the dot), kacc [p, ch] (records), cacc [r, ch]
    # (compensators), kq [ch].
    def chunk_body(j, carry):
        acc1, acc2, k1, k2, c1, c2, kq = carry
        start = j * ch if isinstance(j, int) else pl.multiple_of(j * ch, ch)
        codes = load_code_parts(codes_ref, bits, dk, start, ch, jnp.int8 if use_dot else f32)
        for i in range(parts):
            sl = pl.ds(i * n + start, ch)
            if per_channel:
                D0_, dd = window_decay_part(bg_ref, live, sl, True)                # [ch], [p, ch]
            else:
                D0_ = D0
            x1 = b_ref[sl]
            q = q_ref[sl]
            kq = kq + w_ref[sl] * q
            x2 = (jnp.exp(g_ref[sl]) if per_channel else a_new) * q
            y1, y2 = D0_ * x1, D0_ * x2
            kb = load(bk_ref.at[:, sl], mask=live[:, None], other=0.0).astype(f32)   # [p, ch]
            if per_channel:
                kb = kb * dd
            k1 = k1 + kb * x1[None, :]
            k2 = k2 + kb * x2[None, :]
            if comp_tile:
                kc = ck_ref[:, sl].astype(f32)                                        # [r, ch]
                c1 = c1 + kc * y1[None, :]
                c2 = c2 + kc * y2[None, :]
            elif rank:
                kcs = [ck_ref[c, sl].astype(f32) for c in range(rank)]
                c1 = tuple(a + kc * y1 for a, kc in zip(c1, kcs))
                c2 = tuple(a + kc * y2 for a, kc in zip(c2, kcs))
            if use_dot and not per_channel:
                y1, y2 = x1, q
            if smoothing:
                sm = smooth_ref[sl]
                y1, y2 = sm * y1, sm * y2
            if use_dot:
                acc1 = acc1 + jax.lax.dot(digit_rows([y1, y2], [inv1, inv2], ch), codes[i],
                                          preferred_element_type=jnp.int32)
            else:
                acc1 = acc1 + codes[i] * y1[:, None]
                acc2 = acc2 + codes[i] * y2[:, None]
        return acc1, acc2, k1, k2, c1, c2, kq

    if comp_tile:
        c0 = jnp.zeros((rank, ch), f32)
    else:
        c0 = tuple(jnp.zeros((ch,), f32) for _ in range(rank))
    acc0 = ((jnp.zeros((DOT_ROWS, bv), jnp.int32), None) if use_dot
            else (jnp.zeros((ch, bv), f32), jnp.zeros((ch, bv), f32)))
    init = acc0 + (jnp.zeros((window, ch), f32), jnp.zeros((window, ch), f32), c0, c0, jnp.zeros((ch,), f32))
    nch = n // ch
    carry = chunk_body(0, init) if nch == 1 else jax.lax.fori_loop(0, nch, chunk_body, init)
    acc1, acc2, k1, k2, c1, c2, kq = carry

    kx1 = jnp.sum(k1, axis=1)                                                     # [p]
    kx2 = jnp.sum(k2, axis=1)
    if not per_channel:
        kx1, kx2 = d * kx1, d * kx2
    scale = scale_ref[...]
    ub = load(bu_ref, mask=live[:, None], other=0.0).astype(f32)                 # [p, BV]
    if use_dot:
        z1, z2 = undigit(acc1, 0) * back1, undigit(acc1, 1) * back2
        if not per_channel:
            z1, z2 = D0 * z1, (D0 * a_new) * z2
    else:
        z1, z2 = jnp.sum(acc1, axis=0), jnp.sum(acc2, axis=0)
    r1 = scale * z1 + jnp.sum(kx1[:, None] * ub, axis=0)
    r2 = scale * z2 + jnp.sum(kx2[:, None] * ub, axis=0)
    if comp_tile:
        cu = cu_ref[...].astype(f32)                                               # [r, BV]
        r1 = r1 + jnp.sum(jnp.sum(c1, axis=1)[:, None] * cu, axis=0)
        r2 = r2 + jnp.sum(jnp.sum(c2, axis=1)[:, None] * cu, axis=0)
    else:
        for c in range(rank):
            uc = cu_ref[c, :].astype(f32)
            r1 = r1 + jnp.sum(c1[c]) * uc
            r2 = r2 + jnp.sum(c2[c]) * uc
    u = beta_ref[...] * (v_ref[...] - r1)
    u_r = u.astype(rec)
    o_ref[...] = r2 + u * jnp.sum(kq)

    first_block = pl.program_id(2) == 0       # outside pl.when: interpret mode needs it there

    @pl.when(pos < window)
    def _append():
        bu_out[pos, :] = u_r

    @pl.when((pos < window) & first_block)
    def _append_key_side():
        bk_out[pos, :] = w_ref[...].astype(rec)
        g_rec = jnp.maximum(g_ref[...], RECORD_LOG_DECAY_MIN).astype(rec)   # as windowed.append_record
        if per_channel:
            bg_out[pos, :] = g_rec
        else:
            bg_out[pos] = g_rec


# ----------------------------------------------------------------------------- wrapper


def check_token(state: LeapQuantState, token: Token) -> None:
    """Raises ``ValueError`` when the token does not match the state."""
    bsz, h, dk, dv = state.shape
    for name, x, shape in (("q", token.q, (bsz, h, dk)), ("w", token.w, (bsz, h, dk)), ("b", token.b, (bsz, h, dk)),
                           ("v", token.v, (bsz, h, dv)), ("beta", token.beta, (bsz, h))):
        if x.shape != shape:
            raise ValueError(f"token.{name} must be {shape} to match the state, got {x.shape}")
    gshape = (bsz, h, dk) if state.per_channel_decay else (bsz, h)
    if token.g.shape != gshape:
        kind = "per-channel (KDA)" if state.per_channel_decay else "scalar (GDN)"
        raise ValueError(f"token.g must be {gshape}: the state holds {kind} decays; got {token.g.shape}")


def default_block_v(dv: int) -> int:
    """Value columns per program (whole rows were fastest on the H200, see ``bench/results``)."""
    return dv


def default_chunk(dk: int, bits: int, per_channel: bool) -> int:
    """Key rows per code part per loop iteration: the whole part (no loop), the fastest with
    the int8 dots on the H200 at batch 512 for GDN and KDA (``bench/results``)."""
    return dk // num_parts(bits)


def default_num_warps(per_channel: bool) -> int:
    """Warps per program: 2 for GDN, 1 for KDA, the fastest on the H200 at batch 512 (``bench/results``)."""
    return 1 if per_channel else 2


REDUCES = ("dot", "lanes")
MIN_DOT_ROWS = 32   # the int8 mma's K


def default_reduce(chunk: int) -> str:
    """``dot`` (int8 tensor cores) where a chunk is a whole int8 mma deep, else ``lanes``."""
    return "dot" if chunk >= MIN_DOT_ROWS else "lanes"


@functools.partial(jax.jit, static_argnames=("config", "block_v", "chunk", "reduce", "num_warps", "num_stages",
                                             "interpret"))
def leapquant_step(config: LeapQuantConfig, state: LeapQuantState, token: Token, *, block_v: int | None = None,
                   chunk: int | None = None, reduce: str | None = None, num_warps: int | None = None, num_stages: int = 1,
                   interpret: bool | None = None):
    """One in-window decode step. Same contract as ``windowed.step_reference``.

    state: ``LeapQuantState``; token: ``Token`` with ``[B, H, ...]`` fields. The buffer is
    updated in place when the caller's ``jit`` donates the state (or it is dead after the call
    inside one); otherwise XLA copies it first. Returns ``(o [B, H, dv] fp32, state with pos + 1)``.
    ``reduce``: how the code reads are summed, ``"dot"`` (int8 digits on the tensor cores;
    needs ``chunk >= 32``) or ``"lanes"`` (fp32 products summed across threads); the default
    takes ``dot`` where it can.
    """
    why = unsupported_reason(config, state)
    if why is not None:
        raise ValueError(f"leapquant_step kernel cannot run: {why}")
    check_token(state, token)
    interpret = default_interpret() if interpret is None else interpret
    bsz, h, dk, dv = state.shape
    bv = default_block_v(dv) if block_v is None else block_v
    if dv % bv or bv & (bv - 1) or bv < 16:
        raise ValueError(f"block_v={bv} must be a power of two >= 16 dividing dv={dv}")
    ch = default_chunk(dk, config.bits, state.per_channel_decay) if chunk is None else chunk
    if (dk // num_parts(config.bits)) % ch or ch & (ch - 1) or ch < 16:
        raise ValueError(f"chunk={ch} must be a power of two >= 16 dividing the {dk // num_parts(config.bits)} rows of a code part")
    reduce = default_reduce(ch) if reduce is None else reduce
    num_warps = default_num_warps(state.per_channel_decay) if num_warps is None else num_warps
    if reduce not in REDUCES:
        raise ValueError(f"reduce={reduce!r}: expected one of {REDUCES}")
    if reduce == "dot" and ch < MIN_DOT_ROWS:
        raise ValueError(f"reduce='dot' needs chunk >= {MIN_DOT_ROWS} (the int8 mma depth), got chunk={ch}")
    ckpt, buf = state.checkpoint, state.buffer
    per_channel = state.per_channel_decay
    p, r = config.window, config.effective_rank
    rows = packed_rows(dk, config.bits)

    vec_k = pl.BlockSpec((None, None, dk), lambda i, j, c: (i, j, 0))
    vec_v = pl.BlockSpec((None, None, bv), lambda i, j, c: (i, j, c))
    scalar = pl.BlockSpec((None, None), lambda i, j, c: (i, j))
    args = [state.pos.astype(jnp.int32), token.q.astype(f32), token.w.astype(f32), token.b.astype(f32),
            token.v.astype(f32), token.g.astype(f32), token.beta.astype(f32), ckpt.residual.codes, ckpt.residual.scale]
    specs = [pl.BlockSpec((None,), lambda i, j, c: (i,)), vec_k, vec_k, vec_k, vec_v,
             vec_k if per_channel else scalar, scalar,
             pl.BlockSpec((None, None, rows, bv), lambda i, j, c: (i, j, 0, c)), vec_v]
    if config.smoothing:
        args.append(ckpt.smooth)
        specs.append(vec_k)
    if r:
        args += [ckpt.comp_k, ckpt.comp_u]
        specs += [pl.BlockSpec((None, None, r, dk), lambda i, j, c: (i, j, 0, 0)),
                  pl.BlockSpec((None, None, r, bv), lambda i, j, c: (i, j, 0, c))]
    k_spec = pl.BlockSpec((None, None, p, dk), lambda i, j, c: (i, j, 0, 0))
    u_spec = pl.BlockSpec((None, None, p, bv), lambda i, j, c: (i, j, 0, c))
    g_spec = k_spec if per_channel else pl.BlockSpec((None, None, p), lambda i, j, c: (i, j, 0))
    first_buf = len(args)
    args += [buf.k, buf.u, buf.g]
    specs += [k_spec, u_spec, g_spec]

    kernel = functools.partial(
        _step_kernel, bits=config.bits, rank=r, window=p, dk=dk, per_channel=per_channel,
        smoothing=config.smoothing, rec_dtype=config.record_dtype, chunk=ch, use_dot=reduce == "dot")
    o, bk, bu, bg = pl.pallas_call(
        kernel,
        grid=(bsz, h, dv // bv),
        in_specs=specs,
        out_specs=[vec_v, k_spec, u_spec, g_spec],
        out_shape=[jax.ShapeDtypeStruct((bsz, h, dv), f32), jax.ShapeDtypeStruct(buf.k.shape, buf.k.dtype),
                   jax.ShapeDtypeStruct(buf.u.shape, buf.u.dtype), jax.ShapeDtypeStruct(buf.g.shape, buf.g.dtype)],
        input_output_aliases={first_buf: 1, first_buf + 1: 2, first_buf + 2: 3},
        compiler_params=compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"leapquant_step_{'kda' if per_channel else 'gdn'}_int{config.bits}",
    )(*args)
    new = LeapQuantState(checkpoint=ckpt, buffer=WindowBuffer(k=bk, u=bu, g=bg), pos=state.pos + 1)
    return o, new


def step_bytes(config: LeapQuantConfig, dk: int, dv: int, pos: int, per_channel: bool) -> int:
    """Bytes one head moves in one step at window position ``pos`` (the module docstring's count)."""
    e = jnp.dtype(config.record_dtype).itemsize
    gl = dk if per_channel else 1
    r = config.effective_rank
    n = dk * dv * config.bits // 8 + 4 * dv + (4 * dk if config.smoothing else 0) + 2 * r * (dk + dv)
    n += pos * e * (dk + dv + gl)
    n += 4 * (3 * dk + dv + 2) + (4 * (dk - 1) if per_channel else 0)
    n += e * (dk + dv + gl) + 4 * dv + 4
    return n


# ----------------------------------------------------------------------------- reference


def leapquant_step_reference(config: LeapQuantConfig, state: LeapQuantState, token: Token, **_unused):
    """The oracle: ``windowed.step_reference`` (same signature and contract)."""
    return windowed.step_reference(config, state, token)


__all__ = ["check_token", "leapquant_step", "leapquant_step_reference", "step_bytes"]
