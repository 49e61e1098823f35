"""LeapQuant window flush (DESIGN §3, §6): reconstruct ``S_p``, fit, smooth, quantize, write.

Why: once per window the state is materialised in fp32 and rounded once into the next
checkpoint. Done in one kernel, the dense ``S_p`` never leaves the chip: the flush reads the
old checkpoint and the buffer and writes the new checkpoint, nothing else.

One program per (sequence, head) holds the whole ``S [dk, dv]`` tile in fp32, split into
key-row parts that match the packed code planes (1 part at 8 bits, 2 at 4, 4 at 6), and

1. reconstructs ``S = D0 * (C deq(Z) + K^T U) + sum_j (d_j * k_j) u_j^T`` (log-space decays,
   masked before ``exp``: a fully decayed head gives zeros, not NaN);
2. fits ``r`` Compensator Tokens by ``fit_iters`` rounds of subspace iteration
   ``Y = S (S^T Q)`` from the seeded Gaussian start (or warm-started from the old ``K``)
   with CholeskyQR2 in scalar arithmetic (``r <= 8``: the ``r x r`` Gram matrix, its Cholesky
   factor and the triangular solve are unrolled), ``K = Q^T``, ``U = S^T K^T`` (clipped to
   the fp16 range), both rounded to fp16;
3. smooths the residual ``R = S - K^T U`` (rounded factors) by ``c_i = sqrt(mean_j |R_ij|)``
   floored at 1e-12, quantizes ``R / c`` with one scale per value column (round half to even)
   and packs the codes (planar 6/4-bit layout);
4. writes codes, scales, ``c``, ``K``, ``U`` in place and zeroes the buffer.

Which sequences flush: ``only_full=True`` skips (reads and writes nothing for) sequences whose
window is not full (``pos < p``), so a batch at ragged positions pays only for its full
windows and ``windowed.maybe_flush``'s select leaves the rest as they were; ``only_full=False``
flushes every sequence, the contract of ``windowed.flush_reference``. ``pos`` is reset in
XLA after the kernel.

Rounding: fp32 throughout (elementwise products and reductions); fp16 rounding of ``K``,
``U``; the code rounding. Summation order differs from the XLA reference, so a code sitting
on a rounding boundary may differ by one step; the decoded states agree to a quantization
step on those few elements.

Bytes moved per flushed head (``flush_bytes``): read the checkpoint
(``dk dv bits/8 + 4 dv + 4 dk + 2 r (dk + dv)``) and ``p`` records ``e p (dk + dv + g)``, write
the checkpoint and zero the buffer (the same counts again), plus the start ``4 r dk`` and
``pos`` ``4``.

Tested with JAX 0.10.2 (interpret mode, CPU) and 0.11.2 (compiled, H200).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from leapquant_jax import windowed
from leapquant_jax.compensators import FP16_MAX, random_start
from leapquant_jax.quantizers import IntTensor, packed_rows, qmax_for_bits
from leapquant_jax.state import Checkpoint, LeapQuantConfig, LeapQuantState, WindowBuffer

from ._compat import compiler_params, default_interpret, pl, round_half_even
from .leapquant_step import load_code_parts, num_parts

f32 = jnp.float32
SMOOTH_FLOOR = 1e-12


def _cholesky_qr_round(cols, rank):
    """One round of Cholesky QR on columns ``cols[c][part]`` (lists of fp32 vectors)."""
    def dot(a, b):
        return sum(jnp.sum(x * y) for x, y in zip(a, b))

    gram = [[dot(cols[a], cols[b]) if b <= a else None for b in range(rank)] for a in range(rank)]
    trace = sum(gram[a][a] for a in range(rank))
    shift = 1e-6 * trace / rank + 1e-30
    chol = [[None] * rank for _ in range(rank)]
    for i in range(rank):
        for j in range(i + 1):
            acc = gram[i][j] + (shift if i == j else 0.0)
            for k in range(j):
                acc = acc - chol[i][k] * chol[j][k]
            chol[i][j] = jnp.sqrt(acc) if i == j else acc / chol[j][j]
    out = []
    for i in range(rank):
        col = list(cols[i])
        for j in range(i):
            col = [x - chol[i][j] * y for x, y in zip(col, out[j])]
        out.append([x / chol[i][i] for x in col])
    return out


# ----------------------------------------------------------------------------- kernel


def _flush_kernel(*refs, bits, rank, window, dk, dv, per_channel, smoothing, warm_start, fit_iters, only_full):
    it = iter(refs)
    pos_ref, start_ref, codes_ref, scale_ref = (next(it) for _ in range(4))
    smooth_ref = next(it) if smoothing else None
    ck_ref, cu_ref = (next(it), next(it)) if rank else (None, None)
    bk_ref, bu_ref, bg_ref = next(it), next(it), next(it)
    codes_out, scale_out = next(it), next(it)
    smooth_out = next(it) if smoothing else None
    ck_out, cu_out = (next(it), next(it)) if rank else (None, None)
    bk_out, bu_out, bg_out = next(it), next(it), next(it)

    parts = num_parts(bits)
    n = dk // parts
    qmax = qmax_for_bits(bits)
    pos = pos_ref[...]
    slices = [pl.ds(i * n, n) for i in range(parts)]

    def body():
        # --- 1. reconstruct S_pos, part by part: [n, dv] each
        codes = load_code_parts(codes_ref, bits, dk)
        scale = scale_ref[...]
        cu = [cu_ref[c, :].astype(f32) for c in range(rank)]
        old_k = [[ck_ref[c, sl].astype(f32) for sl in slices] for c in range(rank)]
        S = []
        for i, sl in enumerate(slices):
            s = codes[i] * scale[None, :]
            if smoothing:
                s = smooth_ref[sl][:, None] * s
            for c in range(rank):
                s = s + old_k[c][i][:, None] * cu[c][None, :]
            # records, newest first: acc = G_l - G_j (log space), d_j = exp(acc) for live slots.
            # A rolled loop keeps the Triton program small (an unrolled one compiled for minutes
            # at 6 bits).
            def record(t, carry, sl=sl):
                acc, rec = carry
                j = window - 1 - t
                live_j = j < pos
                dj = jnp.where(live_j, jnp.exp(acc), 0.0)
                rec = rec + (dj * bk_ref[j, sl].astype(f32))[:, None] * bu_ref[j, :].astype(f32)[None, :]
                gj = bg_ref[j, sl] if per_channel else bg_ref[j]
                return acc + jnp.where(live_j, gj.astype(f32), 0.0), rec

            acc0 = jnp.zeros((n,), f32) if per_channel else jnp.zeros((), f32)
            acc, rec = jax.lax.fori_loop(0, window, record, (acc0, jnp.zeros((n, dv), f32)))
            D0 = jnp.exp(acc)
            s = (D0[:, None] if per_channel else D0) * s + rec
            S.append(s)

        # --- 2. Compensator Tokens
        new_k, new_u = [], []
        if rank:
            if warm_start:
                q = [list(old_k[c]) for c in range(rank)]
                for c in range(rank):
                    nrm = sum(jnp.sum(x * x) for x in q[c])
                    top = jnp.where(nrm == 0.0, 1e-3, 0.0)
                    q[c] = [x + top * start_ref[c, sl] for x, sl in zip(q[c], slices)]
            else:
                q = [[start_ref[c, sl] for sl in slices] for c in range(rank)]
            for _ in range(fit_iters):
                z = [sum(jnp.sum(s * x[:, None], axis=0) for s, x in zip(S, q[c])) for c in range(rank)]   # [dv]
                y = [[jnp.sum(s * z[c][None, :], axis=1) for s in S] for c in range(rank)]               # [n]
                q = _cholesky_qr_round(_cholesky_qr_round(y, rank), rank)
            for c in range(rank):
                uc = sum(jnp.sum(s * x[:, None], axis=0) for s, x in zip(S, q[c]))
                uc = jnp.minimum(jnp.maximum(uc, -FP16_MAX), FP16_MAX)
                new_k.append([x.astype(jnp.float16) for x in q[c]])
                new_u.append(uc.astype(jnp.float16))
            S = [s - sum(new_k[c][i].astype(f32)[:, None] * new_u[c].astype(f32)[None, :] for c in range(rank))
                 for i, s in enumerate(S)]

        # --- 3. smoothing and quantization
        if smoothing:
            cs = [jnp.maximum(jnp.sqrt(jnp.sum(jnp.abs(s), axis=1) / dv), SMOOTH_FLOOR) for s in S]
            S = [s / c[:, None] for s, c in zip(S, cs)]
        colmax = None
        for s in S:
            m = jnp.max(jnp.abs(s), axis=0)
            colmax = m if colmax is None else jnp.maximum(colmax, m)
        new_scale = colmax / qmax
        div = jnp.where(new_scale > 0, new_scale, 1.0)
        q_int = [jnp.clip(round_half_even(s / div[None, :]), -qmax, qmax).astype(jnp.int32) for s in S]

        # --- 4. write the checkpoint, zero the buffer
        if bits == 8:
            codes_out[...] = q_int[0].astype(jnp.int8)
        elif bits == 4:
            lo, hi = (x + 8 for x in q_int)
            codes_out[...] = (lo | (hi << 4)).astype(jnp.uint8)
        else:
            a, b, c_, d4 = (x + 32 for x in q_int)
            m = dk // 4
            for p_, quarter in enumerate((a, b, c_)):
                codes_out[pl.ds(p_ * m, m), :] = (quarter | (((d4 >> (2 * p_)) & 3) << 6)).astype(jnp.uint8)
        scale_out[...] = new_scale
        if smoothing:
            for c, sl in zip(cs, slices):
                smooth_out[sl] = c
        for c in range(rank):
            for x, sl in zip(new_k[c], slices):
                ck_out[c, sl] = x
            cu_out[c, :] = new_u[c]
        bk_out[...] = jnp.zeros(bk_out.shape, bk_out.dtype)
        bu_out[...] = jnp.zeros(bu_out.shape, bu_out.dtype)
        bg_out[...] = jnp.zeros(bg_out.shape, bg_out.dtype)

    if only_full:
        pl.when(pos >= window)(body)
    else:
        body()


# ----------------------------------------------------------------------------- wrapper


@functools.partial(jax.jit, static_argnames=("config", "only_full", "num_warps", "interpret"))
def leapquant_flush(config: LeapQuantConfig, state: LeapQuantState, *, only_full: bool = False,
                    num_warps: int | None = None, interpret: bool | None = None) -> LeapQuantState:
    """Window flush in place. ``only_full=False``: every sequence (``windowed.flush_reference``);
    ``only_full=True``: only sequences with ``pos >= p`` (``windowed.maybe_flush``).

    state: ``LeapQuantState`` (updated in place when the caller's ``jit`` donates it). Returns
    the state with new checkpoints, zeroed buffers and ``pos = 0`` for the flushed sequences.
    """
    from .api import unsupported_reason

    why = unsupported_reason(config, state)
    if why is not None:
        raise ValueError(f"leapquant_flush kernel cannot run: {why}")
    interpret = default_interpret() if interpret is None else interpret
    bsz, h, dk, dv = state.shape
    ckpt, buf = state.checkpoint, state.buffer
    per_channel = state.per_channel_decay
    p, r = config.window, config.effective_rank
    rows = packed_rows(dk, config.bits)
    if num_warps is None:  # the fastest on the H200 at batch 512 (bench/results)
        num_warps = 4 if per_channel else 8

    def spec(*shape):
        return pl.BlockSpec((None, None) + shape, lambda i, j: (i, j) + (0,) * len(shape))

    start = random_start(dk, max(r, 1), config.seed)                               # [r, dk]
    args = [state.pos.astype(jnp.int32), start, ckpt.residual.codes, ckpt.residual.scale]
    specs = [pl.BlockSpec((None,), lambda i, j: (i,)), pl.BlockSpec(start.shape, lambda i, j: (0, 0)),
             spec(rows, dv), spec(dv)]
    outs = [ckpt.residual.codes, ckpt.residual.scale]
    out_specs = [spec(rows, dv), spec(dv)]
    if config.smoothing:
        args.append(ckpt.smooth); specs.append(spec(dk))
        outs.append(ckpt.smooth); out_specs.append(spec(dk))
    if r:
        args += [ckpt.comp_k, ckpt.comp_u]; specs += [spec(r, dk), spec(r, dv)]
        outs += [ckpt.comp_k, ckpt.comp_u]; out_specs += [spec(r, dk), spec(r, dv)]
    g_spec = spec(p, dk) if per_channel else spec(p)
    args += [buf.k, buf.u, buf.g]; specs += [spec(p, dk), spec(p, dv), g_spec]
    outs += [buf.k, buf.u, buf.g]; out_specs += [spec(p, dk), spec(p, dv), g_spec]
    first = 2
    aliases = {first + i: i for i in range(len(outs))}

    kernel = functools.partial(
        _flush_kernel, bits=config.bits, rank=r, window=p, dk=dk, dv=dv, per_channel=per_channel,
        smoothing=config.smoothing, warm_start=config.warm_start, fit_iters=config.fit_iters, only_full=only_full)
    res = pl.pallas_call(
        kernel,
        grid=(bsz, h),
        in_specs=specs,
        out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outs],
        input_output_aliases=aliases,
        compiler_params=compiler_params(num_warps=num_warps),
        interpret=interpret,
        name=f"leapquant_flush_{'kda' if per_channel else 'gdn'}_int{config.bits}",
    )(*args)
    res = list(res)
    codes, scale = res.pop(0), res.pop(0)
    smooth = res.pop(0) if config.smoothing else ckpt.smooth
    comp_k, comp_u = (res.pop(0), res.pop(0)) if r else (ckpt.comp_k, ckpt.comp_u)
    bk, bu, bg = res
    residual = IntTensor(codes=codes, scale=scale, bits=config.bits, dk=dk)
    pos = jnp.where(state.pos >= p, 0, state.pos) if only_full else jnp.zeros_like(state.pos)
    return LeapQuantState(
        checkpoint=Checkpoint(residual=residual, smooth=smooth, comp_k=comp_k, comp_u=comp_u),
        buffer=WindowBuffer(k=bk, u=bu, g=bg),
        pos=pos,
    )


def flush_bytes(config: LeapQuantConfig, dk: int, dv: int, per_channel: bool) -> int:
    """Bytes one flushed head moves (the module docstring's count)."""
    e = jnp.dtype(config.record_dtype).itemsize
    r = config.effective_rank
    ckpt = dk * dv * config.bits // 8 + 4 * dv + (4 * dk if config.smoothing else 0) + 2 * r * (dk + dv)
    records = e * config.window * (dk + dv + (dk if per_channel else 1))
    return 2 * (ckpt + records) + 4 * r * dk + 4


# ----------------------------------------------------------------------------- reference


def leapquant_flush_reference(config: LeapQuantConfig, state: LeapQuantState, *, only_full: bool = False, **_unused):
    """The oracle: ``windowed.flush_reference`` (every sequence) or ``maybe_flush`` (full ones)."""
    if only_full:
        return windowed.maybe_flush(config, state)
    return windowed.flush_reference(config, state)


__all__ = ["flush_bytes", "leapquant_flush", "leapquant_flush_reference"]
