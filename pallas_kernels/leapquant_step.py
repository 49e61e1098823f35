"""LeapQuant decode step inside a window (DESIGN §3, §6): GDN (scalar decay) and KDA (per-channel).

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

Grid: one program per (sequence, head, value block ``BV``). Each program reads the key-side
data (records' ``k`` and ``g``, ``K``, the vectors) whole and the value-side data (codes,
scales, ``u``, ``U``) for its block. Only live records (slot < pos) are loaded: masked
loads fetch nothing for dead slots. The buffer is updated in place (``k``, ``u``, ``g`` are
aliased inputs/outputs; donate the state under ``jit``), by the value block 0 program for
``k`` and ``g``. A sequence with ``pos >= p`` appends nothing (as ``append_record``).

Rounding: all arithmetic is fp32 (elementwise products and reductions, no tensor-core dots).
The record is rounded to the record dtype when stored; the output read uses the rounded
record (``k``, ``u``, ``g`` of the new slot), exactly as the reference reads its buffer.

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
from leapquant_jax.quantizers import IntTensor, packed_rows, qmax_for_bits
from leapquant_jax.recurrence import Token
from leapquant_jax.state import Checkpoint, LeapQuantConfig, LeapQuantState, WindowBuffer

from ._compat import compiler_params, default_interpret, load, pl

f32 = jnp.float32


def num_parts(bits: int) -> int:
    """Key-row parts the packed codes split into: 1 (8 bits), 2 (4 bits), 4 (6 bits)."""
    return {8: 1, 4: 2, 6: 4}[bits]


def load_code_parts(codes_ref, bits: int, dk: int):
    """Signed codes of a packed tile as ``num_parts(bits)`` fp32 arrays ``[dk / parts, BV]``.

    Part ``i`` holds key rows ``[i * dk / parts, (i + 1) * dk / parts)``.
    """
    if bits == 8:
        return [codes_ref[...].astype(f32)]
    if bits == 4:
        p = codes_ref[...].astype(jnp.int32)
        return [((p & 15) - 8).astype(f32), ((p >> 4) - 8).astype(f32)]
    m = dk // 4
    planes = [codes_ref[pl.ds(i * m, m), :].astype(jnp.int32) for i in range(3)]
    top = ((planes[0] >> 6) & 3) | (((planes[1] >> 6) & 3) << 2) | (((planes[2] >> 6) & 3) << 4)
    return [((q & 63) - 32).astype(f32) for q in planes] + [(top - 32).astype(f32)]


def window_decay_part(g_ref, live, part, per_channel: bool):
    """Log-space decays of the live records for key rows ``part`` (a ``pl.ds``).

    Returns ``(D0, d)``: ``D0 = exp(G_l)`` (``[]`` or ``[n]``) and ``d_j = exp(G_l - G_j)`` for
    live slots, 0 for dead ones (``[p]`` or ``[p, n]``). Dead slots are never loaded.
    """
    if per_channel:
        g = load(g_ref.at[:, part], mask=live[:, None], other=0.0).astype(f32)   # [p, n]
        G = jnp.cumsum(g, axis=0)
        G_l = jnp.sum(g, axis=0)                                                   # [n]
        d = jnp.exp(jnp.where(live[:, None], G_l[None, :] - G, -jnp.inf))
        return jnp.exp(G_l), d
    g = load(g_ref, mask=live, other=0.0).astype(f32)                              # [p]
    G = jnp.cumsum(g, axis=0)
    G_l = jnp.sum(g)
    return jnp.exp(G_l), jnp.exp(jnp.where(live, G_l - G, -jnp.inf))


# ----------------------------------------------------------------------------- kernel


def _step_kernel(*refs, bits, rank, window, dk, per_channel, smoothing, rec_dtype):
    it = iter(refs)
    pos_ref, q_ref, w_ref, b_ref, v_ref, g_ref, beta_ref = (next(it) for _ in range(7))
    codes_ref, scale_ref = next(it), next(it)
    smooth_ref = next(it) if smoothing else None
    ck_ref, cu_ref = (next(it), next(it)) if rank else (None, None)
    bk_ref, bu_ref, bg_ref = next(it), next(it), next(it)
    o_ref, bk_out, bu_out, bg_out = next(it), next(it), next(it), next(it)

    parts = num_parts(bits)
    n = dk // parts
    pos = pos_ref[...]
    live = jnp.arange(window) < pos                                               # [p]
    rec = jnp.dtype(rec_dtype)

    if not per_channel:
        D0, d = window_decay_part(bg_ref, live, None, False)                     # [], [p]
        a_new = jnp.exp(g_ref[...].astype(rec).astype(f32))

    codes = load_code_parts(codes_ref, bits, dk)
    a1 = a2 = None                                   # Z^T (c D0 x): [BV]
    kx1 = kx2 = None                                 # records: k_j . (d_j x), [p]
    cc1 = [0.0] * rank                               # compensators: K_c . (D0 x)
    cc2 = [0.0] * rank
    kq_new = 0.0                                     # k_new . q (rounded record)
    for i in range(parts):
        sl = pl.ds(i * n, n)
        if per_channel:
            D0, d = window_decay_part(bg_ref, live, sl, True)                     # [n], [p, n]
        x1 = b_ref[sl]
        q = q_ref[sl]
        w_r = w_ref[sl].astype(rec).astype(f32)
        kq_new = kq_new + jnp.sum(w_r * q)
        if per_channel:
            x2 = jnp.exp(g_ref[sl].astype(rec).astype(f32)) * q
        else:
            x2 = a_new * q
        y1, y2 = D0 * x1, D0 * x2
        kb = load(bk_ref.at[:, sl], mask=live[:, None], other=0.0).astype(f32)   # [p, n]
        if per_channel:
            t1 = jnp.sum(kb * (d * x1[None, :]), axis=1)
            t2 = jnp.sum(kb * (d * x2[None, :]), axis=1)
        else:
            t1 = jnp.sum(kb * x1[None, :], axis=1)
            t2 = jnp.sum(kb * x2[None, :], axis=1)
        kx1 = t1 if kx1 is None else kx1 + t1
        kx2 = t2 if kx2 is None else kx2 + t2
        for c in range(rank):
            kc = ck_ref[c, sl].astype(f32)
            cc1[c] = cc1[c] + jnp.sum(kc * y1)
            cc2[c] = cc2[c] + jnp.sum(kc * y2)
        if smoothing:
            sm = smooth_ref[sl]
            y1, y2 = sm * y1, sm * y2
        z = codes[i]
        s1 = jnp.sum(z * y1[:, None], axis=0)
        s2 = jnp.sum(z * y2[:, None], axis=0)
        a1 = s1 if a1 is None else a1 + s1
        a2 = s2 if a2 is None else a2 + s2
    if not per_channel:
        kx1, kx2 = d * kx1, d * kx2

    scale = scale_ref[...]
    ub = load(bu_ref, mask=live[:, None], other=0.0).astype(f32)                 # [p, BV]
    r1 = scale * a1 + jnp.sum(kx1[:, None] * ub, axis=0)
    r2 = scale * a2 + jnp.sum(kx2[:, None] * ub, axis=0)
    for c in range(rank):
        uc = cu_ref[c, :].astype(f32)
        r1 = r1 + cc1[c] * uc
        r2 = r2 + cc2[c] * uc
    u = beta_ref[...] * (v_ref[...] - r1)
    u_r = u.astype(rec)
    o_ref[...] = r2 + u_r.astype(f32) * kq_new

    first_block = pl.program_id(2) == 0       # outside pl.when: interpret mode needs it there

    @pl.when(pos < window)
    def _append():
        bu_out[pos, :] = u_r

    @pl.when((pos < window) & first_block)
    def _append_key_side():
        bk_out[pos, :] = w_ref[...].astype(rec)
        if per_channel:
            bg_out[pos, :] = g_ref[...].astype(rec)
        else:
            bg_out[pos] = g_ref[...].astype(rec)


# ----------------------------------------------------------------------------- wrapper


def step_unsupported_reason(config: LeapQuantConfig, state: LeapQuantState) -> str | None:
    """Why the step kernel cannot take ``config``/``state`` (``None`` if it can)."""
    from .api import unsupported_reason

    return unsupported_reason(config, state)


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
    """Value columns per program."""
    return min(dv, 64)


@functools.partial(jax.jit, static_argnames=("config", "block_v", "num_warps", "interpret"), donate_argnums=(1,))
def leapquant_step(config: LeapQuantConfig, state: LeapQuantState, token: Token, *, block_v: int | None = None,
                   num_warps: int = 4, interpret: bool | None = None):
    """One in-window decode step. Same contract as ``windowed.step_reference``.

    state: ``LeapQuantState`` (donated: its buffer is updated in place); token: ``Token`` with
    ``[B, H, ...]`` fields. Returns ``(o [B, H, dv] fp32, state with pos + 1)``.
    """
    from .api import unsupported_reason

    why = unsupported_reason(config, state)
    if why is not None:
        raise ValueError(f"leapquant_step kernel cannot run: {why}")
    check_token(state, token)
    interpret = default_interpret() if interpret is None else interpret
    bsz, h, dk, dv = state.shape
    bv = default_block_v(dv) if block_v is None else block_v
    if dv % bv or bv & (bv - 1):
        raise ValueError(f"block_v={bv} must be a power of two dividing dv={dv}")
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
        smoothing=config.smoothing, rec_dtype=config.record_dtype)
    o, bk, bu, bg = pl.pallas_call(
        kernel,
        grid=(bsz, h, dv // bv),
        in_specs=specs,
        out_specs=[vec_v, k_spec, u_spec, g_spec],
        out_shape=[jax.ShapeDtypeStruct((bsz, h, dv), f32), jax.ShapeDtypeStruct(buf.k.shape, buf.k.dtype),
                   jax.ShapeDtypeStruct(buf.u.shape, buf.u.dtype), jax.ShapeDtypeStruct(buf.g.shape, buf.g.dtype)],
        input_output_aliases={first_buf: 1, first_buf + 1: 2, first_buf + 2: 3},
        compiler_params=compiler_params(num_warps=num_warps),
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


__all__ = ["check_token", "leapquant_step", "leapquant_step_reference", "load_code_parts", "num_parts",
           "step_bytes", "window_decay_part"]
