"""LeapQuant window flush on Pallas Triton (docs/design.md §3, §6): reconstruct ``S_p``, fit, smooth, quantize.

Contract: ``windowed.flush_reference``'s (``only_full=False``: every sequence) or
``windowed.maybe_flush``'s (``only_full=True``: the sequences at ``pos >= p``; the kernels read
and write nothing for the others). The checkpoint (codes ``[B, H, packed_rows, dv]``, scale
``[B, H, dv]``, smooth ``[B, H, dk]``, fp16 ``K [B, H, r, dk]``, ``U [B, H, r, dv]``) is written
in place; ``pos`` is reset in XLA. No flush writes the buffer: every slot is then past the reset
``pos``, and every read of a record stops at ``pos`` (the reference returns an empty buffer).

Two flushes, one contract (``leapquant_jax.dispatch`` chooses between them):

* ``flush_split``, three stages. A kernel per (sequence, head, value block ``BV``) rebuilds
  ``S[:, block] = D0 (c deq(Z) + K^T U) + sum_j (d_j k_j) u_j^T`` in fp32 and, while the block
  is on chip, its part of the fit's first round ``S_b (S_b^T Q_0)``; XLA finishes the fit with
  the reference's own ``compensators.fit_subspace`` (reading ``S`` once); a kernel per (sequence,
  head) forms ``R = S - K^T U`` from the rounded factors, smooths, quantizes and packs. Why: many
  programs in flight at every stage, at the cost of the fp32 state through device memory.
* ``flush_fused``: one program per (sequence, head) does it all with the fp32 tile in registers.
  Why: it reads nothing for a sequence whose window is not full, so few full windows cost little.

An fp32 checkpoint (``fp32-w``, ``shared.FP32_TILE``; no Compensator Tokens, no smoothing):
``flush_split`` is stage 1 alone, ``S_p`` written over the checkpoint in place in IEEE fp32 (no
fit, no rounding); ``flush_fused`` refuses it (``fused_unsupported_reason``).

Decays are log-space sums masked before ``exp`` (a fully decayed head gives zeros, not NaN). The
fit starts from the seeded Gaussian (or the warm start: the old ``K``, a zero row topped up) and
orthonormalises with the reference's CholeskyQR2. Smoothing ``c_i = sqrt(mean_j |R_ij|)`` floored
at ``SMOOTH_FLOOR``; one scale per value column; codes rounded as ``quantizers.round_codes`` (half
to even; at 2 bits the nearest odd integer), packed planar, and held unpacked as one ``[dk, BV]``
tile at every width (``shared.load_code_tile``, ``store_code_tile``). Rounding: fp32 (stage 1's records dot
as 3xTF32 on the GPU, about fp32); ``K``, ``U`` in fp16.
The summation order differs from the reference's, so a code on a rounding boundary may differ by
one step. GVA (``H = n Hk``): the program of value head ``j`` reads the key records of ``j // n``.

Defaults: ``default_reconstruct_block`` value columns in stage 1, 8 warps in stage 3, the fused
flush on 8 (GDN) or 4 (KDA) warps: the fastest measured (docs/performance.md). Bytes per flushed
value head: ``flush_bytes``. Tested with JAX 0.10.2 (interpret mode, CPU) and 0.11.2 (compiled, H200).
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp

from leapquant_jax import windowed
from leapquant_jax.compensators import (
    FP16_MAX, SMOOTH_FLOOR, WARM_START_TOPUP, fit_subspace, random_start,
)
from leapquant_jax.quantizers import FloatTensor, IntTensor, packed_rows, qmax_for_bits, round_codes
from leapquant_jax.state import Checkpoint, LeapQuantConfig, LeapQuantState

from ._compat import compiler_params, default_interpret, is_pow2, load, pl, round_half_even
from .shared import (
    FP32_TILE, cholesky_qr_round, load_code_tile, scale_cols_to_unit_max, store_code_tile, tile_bits,
    tile_rows, window_decay_part,
)
from .support import unsupported_reason

f32 = jnp.float32


def _row(x, i):
    """Row ``i`` of a small register tile ``[R, n] -> [n]`` (a masked sum: Triton has no gather)."""
    return jnp.sum(jnp.where(jnp.arange(x.shape[0])[:, None] == i, x, 0.0), axis=0)


def _records_term(kd, bu, dot):
    """``sum_j kd_j u_j^T`` over the window: ``kd [p, n]``, ``bu [p, BV]`` -> ``[n, BV]``.

    One dot for ``p >= 16`` (a Triton dot's least depth); smaller windows sum ``p`` outer products.
    """
    if kd.shape[0] >= 16:
        return dot(kd, bu)
    return sum(_row(kd, j)[:, None] * _row(bu, j)[None, :] for j in range(kd.shape[0]))


# The array module of quantizers.round_codes in a Triton kernel: its rule as the reference's,
# round (ties to even) from floor (``round_half_even``: Triton lowers no ``round``).
GRID_MATH = types.SimpleNamespace(floor=jnp.floor, round=round_half_even, clip=jnp.clip)


def _quantize_parts(S, bits):
    """Quantizes smoothed residual parts ``S`` (``[n, BV]`` each) with one scale per value column,
    ``colmax / qmax``: ``(codes, scale [BV])``, ``codes`` one int32 ``[n, BV]`` tile per part
    (``round_codes`` through ``GRID_MATH``; an all-zero column gets scale 0 and the codes of 0: 0, or 1 at 2 bits)."""
    colmax = None
    for s in S:
        m = jnp.max(jnp.abs(s), axis=0)
        colmax = m if colmax is None else jnp.maximum(colmax, m)
    new_scale = colmax / qmax_for_bits(bits)
    div = jnp.where(new_scale > 0, new_scale, 1.0)
    return [round_codes(s / div[None, :], bits, xp=GRID_MATH).astype(jnp.int32) for s in S], new_scale


def _quantize_and_write(S, new_k, new_u, *, bits, dk, dv, slices, smoothing, outs):
    """Steps shared by the fused and split flushes: smooth the residual parts ``S`` (``[n, dv]``
    each, factors already subtracted), quantize, pack and write codes, scales, ``c``, ``K``, ``U``.

    new_k: ``r`` lists of fp16 parts ``[n]``; new_u: ``r`` fp16 rows ``[dv]``.
    """
    codes_out, scale_out, smooth_out, ck_out, cu_out = outs
    if smoothing:
        cs = [jnp.maximum(jnp.sqrt(jnp.sum(jnp.abs(s), axis=1) / dv), SMOOTH_FLOOR) for s in S]
        S = [s / c[:, None] for s, c in zip(S, cs)]
    q_int, new_scale = _quantize_parts(S, bits)
    store_code_tile(codes_out, q_int[0], bits, dk)
    scale_out[...] = new_scale
    if smoothing:
        for c, sl in zip(cs, slices):
            smooth_out[sl] = c
    for c in range(len(new_u)):
        for x, sl in zip(new_k[c], slices):
            ck_out[c, sl] = x
        cu_out[c, :] = new_u[c]


def _part_slices(dk):
    """Key-row slices of the parts a flush holds ``S`` in: one, every key row, at every width (the
    codes as one tile, ``load_code_tile``: the kernel's code and compile time as at 8 bits). The
    kernels keep ``S`` and the fit's columns as lists of parts, as ``cholesky_qr_round`` takes them."""
    return [pl.ds(0, dk)]


def _input_refs(it, smoothing, rank, scaled=True):
    """pos, start, codes, scale, smooth (or None), K, U (or None), buffer k, u, g; ``scale`` None
    unless ``scaled`` (an fp32 checkpoint's ``codes`` are its values)."""
    head = [next(it) for _ in range(3)] + [next(it) if scaled else None]
    smooth = next(it) if smoothing else None
    comps = (next(it), next(it)) if rank else (None, None)
    return (*head, smooth, *comps, next(it), next(it), next(it))


def _checkpoint_outs(it, smoothing, rank):
    """codes, scale, smooth (or None), K, U (or None): the checkpoint outputs, in place."""
    codes_out, scale_out = next(it), next(it)
    smooth_out = next(it) if smoothing else None
    ck_out, cu_out = (next(it), next(it)) if rank else (None, None)
    return codes_out, scale_out, smooth_out, ck_out, cu_out


def _run(body, pos, window, only_full):
    if only_full:
        pl.when(pos >= window)(body)
    else:
        body()


# ----------------------------------------------------------------------------- kernels


def _fused_kernel(*refs, bits, rank, window, dk, dv, per_channel, smoothing, warm_start, fit_iters, only_full):
    it = iter(refs)
    pos_ref, start_ref, codes_ref, scale_ref, smooth_ref, ck_ref, cu_ref, bk_ref, bu_ref, bg_ref = _input_refs(
        it, smoothing, rank)
    outs = _checkpoint_outs(it, smoothing, rank)

    pos = pos_ref[...]
    slices = _part_slices(dk)

    def body():
        # --- 1. reconstruct S_pos: one part, every key row, [dk, dv]
        codes = [load_code_tile(codes_ref, bits, dk)]
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

            acc0 = jnp.zeros((dk,), f32) if per_channel else jnp.zeros((), f32)
            acc, rec = jax.lax.fori_loop(0, window, record, (acc0, jnp.zeros((dk, dv), f32)))
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
                    top = jnp.where(nrm == 0.0, WARM_START_TOPUP, 0.0)
                    q[c] = [x + top * start_ref[c, sl] for x, sl in zip(q[c], slices)]
            else:
                q = [[start_ref[c, sl] for sl in slices] for c in range(rank)]
            for _ in range(fit_iters):
                z = [sum(jnp.sum(s * x[:, None], axis=0) for s, x in zip(S, q[c])) for c in range(rank)]   # [dv]
                y = [[jnp.sum(s * z[c][None, :], axis=1) for s in S] for c in range(rank)]               # [n]
                q = cholesky_qr_round(cholesky_qr_round(scale_cols_to_unit_max(y), rank), rank)
            for c in range(rank):
                uc = sum(jnp.sum(s * x[:, None], axis=0) for s, x in zip(S, q[c]))
                uc = jnp.minimum(jnp.maximum(uc, -FP16_MAX), FP16_MAX)
                new_k.append([x.astype(jnp.float16) for x in q[c]])
                new_u.append(uc.astype(jnp.float16))
            S = [s - sum(new_k[c][i].astype(f32)[:, None] * new_u[c].astype(f32)[None, :] for c in range(rank))
                 for i, s in enumerate(S)]

        # --- 3, 4. smoothing, quantization, writes
        _quantize_and_write(S, new_k, new_u, bits=bits, dk=dk, dv=dv, slices=slices, smoothing=smoothing, outs=outs)

    _run(body, pos, window, only_full)


def _rebuild_parts(ins, pos, *, bits, rank, window, dk, per_channel, smoothing, precision):
    """``S_pos[:, block]`` in fp32 as key-row parts ``[n, BV]`` (``_part_slices``: one, ``n = dk``):
    ``D0 * (C deq(Z) + K^T U) + sum_j (d_j * k_j) u_j^T`` from the checkpoint and the live records
    (log-space decays masked before ``exp``: a fully decayed head gives zeros, not NaN; the
    records as one dot for ``p >= 16``). ``ins``: the refs of ``_input_refs``."""
    _, _, codes_ref, scale_ref, smooth_ref, ck_ref, cu_ref, bk_ref, bu_ref, bg_ref = ins
    slices = _part_slices(dk)

    def dot(a, b):   # a [p, n], b [p, BV] -> a^T b
        return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=f32)

    codes = [load_code_tile(codes_ref, bits, dk)]
    scale = None if scale_ref is None else scale_ref[...]
    live = jnp.arange(window) < pos
    bu = load(bu_ref, mask=live[:, None], other=0.0).astype(f32)                # [p, BV]
    if not per_channel:
        D0, d = window_decay_part(bg_ref, live, None, False)                    # [], [p]
    S = []
    for i, sl in enumerate(slices):
        if per_channel:
            D0, d = window_decay_part(bg_ref, live, sl, True)                   # [n], [p, n]
        kd = load(bk_ref.at[:, sl], mask=live[:, None], other=0.0).astype(f32)  # [p, n]
        kd = kd * (d if per_channel else d[:, None])
        s = codes[i] if scale is None else codes[i] * scale[None, :]
        if smoothing:
            s = smooth_ref[sl][:, None] * s
        for c in range(rank):
            s = s + ck_ref[c, sl].astype(f32)[:, None] * cu_ref[c, :].astype(f32)[None, :]
        S.append((D0[:, None] if per_channel else D0) * s + _records_term(kd, bu, dot))
    return S


def _start_rows(start_ref, ck_ref, rank, slices, warm_start):
    """The fit's first basis ``Q_0`` as ``r`` rows of key-row parts: the seeded Gaussian, or with
    ``warm_start`` the old ``K`` with all-zero rows topped up from the seed."""
    q = [[start_ref[c, sl] for sl in slices] for c in range(rank)]
    if not warm_start:
        return q
    out = []
    for c in range(rank):
        k0 = [ck_ref[c, sl].astype(f32) for sl in slices]
        top = jnp.where(sum(jnp.sum(x * x) for x in k0) == 0.0, WARM_START_TOPUP, 0.0)
        out.append([x + top * s0 for x, s0 in zip(k0, q[c])])
    return out


def _times_rows(S, q):
    """``q S_b``: rows ``q`` (``r`` lists of parts ``[n]``) times the block's parts ``S`` -> ``r`` rows ``[BV]``
    (elementwise products and exact fp32 sums, as the reference's ``HIGHEST`` einsums)."""
    return [sum(jnp.sum(s * x[:, None], axis=0) for s, x in zip(S, qc)) for qc in q]


def _reconstruct_kernel(*refs, bits, rank, window, dk, per_channel, smoothing, warm_start, only_full, precision):
    """Split flush, stage 1: ``S[:, block]`` in fp32 and this block's part of the first round of
    subspace iteration, ``(S_b S_b^T Q_0)^T`` (``[r, dk]``; ``Y = S S^T Q_0`` sums the blocks)."""
    it = iter(refs)
    ins = _input_refs(it, smoothing, rank, scaled=bits != FP32_TILE)
    s_out = next(it)
    y_out = next(it) if rank else None

    pos = ins[0][...]
    slices = _part_slices(dk)

    def body():
        S = _rebuild_parts(ins, pos, bits=bits, rank=rank, window=window, dk=dk, per_channel=per_channel,
                           smoothing=smoothing, precision=precision)
        for s, sl in zip(S, slices):
            s_out[sl, :] = s
        if rank:
            _first_round(S, _start_rows(ins[1], ins[5], rank, slices, warm_start), slices, y_out)

    _run(body, pos, window, only_full)


def _first_round(S, q, slices, y_out):
    """Writes this block's ``(S_b S_b^T Q)^T`` (``[r, dk]``, rows of key-row parts) to ``y_out``
    for the basis rows ``q`` (``r`` lists of parts ``[n]``)."""
    for c, z in enumerate(_times_rows(S, q)):                                       # z [BV]
        for s, sl in zip(S, slices):
            y_out[c, sl] = jnp.sum(s * z[None, :], axis=1)


def _quantize_kernel(*refs, bits, rank, window, dk, dv, smoothing, only_full):
    """Split flush, stage 3: residual from the rounded factors, smooth, quantize, write in place."""
    it = iter(refs)
    pos_ref, s_ref = next(it), next(it)
    k_ref, u_ref = (next(it), next(it)) if rank else (None, None)
    for _ in range(2 + smoothing + 2 * (rank > 0)):   # the checkpoint inputs, aliased, unread
        next(it)
    outs = _checkpoint_outs(it, smoothing, rank)

    pos = pos_ref[...]
    slices = _part_slices(dk)

    def body():
        new_k = [[k_ref[c, sl] for sl in slices] for c in range(rank)]
        new_u = [u_ref[c, :] for c in range(rank)]
        S = []
        for i, sl in enumerate(slices):
            s = s_ref[sl, :]
            for c in range(rank):
                s = s - new_k[c][i].astype(f32)[:, None] * new_u[c].astype(f32)[None, :]
            S.append(s)
        _quantize_and_write(S, new_k, new_u, bits=bits, dk=dk, dv=dv, slices=slices, smoothing=smoothing, outs=outs)

    _run(body, pos, window, only_full)


# ----------------------------------------------------------------------------- wrapper


def _checkpoint_io(config, state):
    """The in-place outputs of every flush, the checkpoint's arrays, and their block specs ``[..]`` per head."""
    dk, dv = state.shape[2:]
    ckpt, r = state.checkpoint, config.effective_rank

    def spec(*shape):
        return pl.BlockSpec((None, None) + shape, lambda i, j: (i, j) + (0,) * len(shape))

    outs = [ckpt.residual.codes, ckpt.residual.scale]
    out_specs = [spec(packed_rows(dk, config.bits), dv), spec(dv)]
    if config.smoothing:
        outs.append(ckpt.smooth); out_specs.append(spec(dk))
    if r:
        outs += [ckpt.comp_k, ckpt.comp_u]; out_specs += [spec(r, dk), spec(r, dv)]
    return outs, out_specs, spec


def _flushed_pos(config, state, only_full):
    """``pos`` after a flush: 0 for every sequence, or with ``only_full`` for the full windows."""
    return jnp.where(state.pos >= config.window, 0, state.pos) if only_full else jnp.zeros_like(state.pos)


def _new_state(config, state, res, only_full):
    """The flushed state from the kernel's checkpoint outputs ``res`` (the buffer as it was)."""
    res = list(res)
    ckpt = state.checkpoint
    codes, scale = res.pop(0), res.pop(0)
    smooth = res.pop(0) if config.smoothing else ckpt.smooth
    comp_k, comp_u = (res.pop(0), res.pop(0)) if config.effective_rank else (ckpt.comp_k, ckpt.comp_u)
    dk = state.shape[2]
    pos = _flushed_pos(config, state, only_full)
    return LeapQuantState(
        checkpoint=Checkpoint(residual=IntTensor(codes=codes, scale=scale, bits=config.bits, dk=dk), smooth=smooth,
                              comp_k=comp_k, comp_u=comp_u),
        buffer=state.buffer,
        pos=pos,
    )


def _inputs(config, state, spec_k, spec_v, start, spec_keys):
    """Checkpoint and buffer inputs (and their specs) read by the fused flush and split stage 1;
    ``spec_keys`` is the key records' spec (by key head, ``[p, dk]`` per program)."""
    bsz, h, dk, dv = state.shape
    ckpt, buf = state.checkpoint, state.buffer
    p, r = config.window, config.effective_rank
    bits = tile_bits(config)
    args = [state.pos.astype(jnp.int32), start]
    specs = [pl.BlockSpec((None,), lambda i, j, *_: (i,)), pl.BlockSpec(start.shape, lambda *_: (0, 0)),
             spec_v(tile_rows(dk, bits))]
    if bits == FP32_TILE:
        args.append(ckpt.residual.values)
    else:
        args += [ckpt.residual.codes, ckpt.residual.scale]
        specs.append(spec_v())
    if config.smoothing:
        args.append(ckpt.smooth); specs.append(spec_k())
    if r:
        args += [ckpt.comp_k, ckpt.comp_u]; specs += [spec_k(r), spec_v(r)]
    args += [buf.k, buf.u, buf.g]
    specs += [spec_keys, spec_v(p), spec_k(p) if state.per_channel_decay else spec_k(p, vec=False)]
    return args, specs


def _group(state) -> int:
    """Value heads per key head (GVA): the program of value head ``j`` reads the key records of
    key head ``j // group``."""
    return state.shape[1] // state.key_heads


def _check(config, state):
    why = unsupported_reason(config, state)
    if why is not None:
        raise ValueError(f"leapquant_flush kernel cannot run: {why}")


def _name(config, state, stage):
    bits = tile_bits(config)
    return f"leapquant_flush_{stage}_{'kda' if state.per_channel_decay else 'gdn'}_" \
        f"{'fp32' if bits == FP32_TILE else f'int{bits}'}"


def fused_unsupported_reason(config: LeapQuantConfig, state: LeapQuantState) -> str | None:
    """Why ``flush_fused`` cannot take ``config`` and ``state``: ``support.unsupported_reason``,
    or an fp32 checkpoint (``fp32-w``), whose flush is the split flush's first stage alone."""
    why = unsupported_reason(config, state)
    if why is None and tile_bits(config) == FP32_TILE:
        why = "the fused flush fits and quantizes; an fp32 checkpoint (fp32-w) is rebuilt by the split flush alone"
    return why


def _per_head_flush(config, state, kernel, stage, *, only_full, num_warps, interpret, **options):
    """The one-program-per-(sequence, head) flushes' call: checkpoint and records in, the
    checkpoint out in place. ``kernel`` takes the refs and the static ``options`` given here."""
    bsz, h, dk, dv = state.shape
    p, r = config.window, config.effective_rank
    outs, out_specs, spec = _checkpoint_io(config, state)

    def spec_k(*lead, vec=True):
        return spec(*lead, dk) if vec else spec(*lead)

    def spec_v(*lead):
        return spec(*lead, dv)

    group = _group(state)
    keys = pl.BlockSpec((None, None, p, dk), lambda i, j: (i, j // group, 0, 0))
    args, specs = _inputs(config, state, spec_k, spec_v, random_start(dk, max(r, 1), config.seed), keys)
    body = functools.partial(
        kernel, bits=config.bits, rank=r, window=p, dk=dk, dv=dv, per_channel=state.per_channel_decay,
        smoothing=config.smoothing, warm_start=config.warm_start, fit_iters=config.fit_iters, only_full=only_full,
        **options)
    res = pl.pallas_call(
        body, grid=(bsz, h), in_specs=specs, out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outs],
        input_output_aliases={2 + i: i for i in range(len(outs))},
        compiler_params=compiler_params(num_warps=num_warps),
        interpret=interpret, name=_name(config, state, stage),
    )(*args)
    return _new_state(config, state, res, only_full)


@functools.partial(jax.jit, static_argnames=("config", "only_full", "num_warps", "interpret"))
def flush_fused(config: LeapQuantConfig, state: LeapQuantState, *, only_full: bool = False, num_warps: int | None = None,
                interpret: bool | None = None) -> LeapQuantState:
    """The fused flush: one kernel, one program per (sequence, head) (``leapquant_flush``'s
    contract, module docstring). ``num_warps``: 8 for GDN, 4 for KDA by default."""
    why = fused_unsupported_reason(config, state)
    if why is not None:
        raise ValueError(f"leapquant_flush kernel cannot run: {why}")
    interpret = default_interpret() if interpret is None else interpret
    return _per_head_flush(config, state, _fused_kernel, "fused", only_full=only_full, interpret=interpret,
                           num_warps=num_warps or (4 if state.per_channel_decay else 8))


def default_reconstruct_block(per_channel: bool, dv: int) -> int:
    """Value columns per program of the split flush's first kernel: 32 for GDN, 64 for KDA (the
    fastest measured, docs/performance.md), at most ``dv``."""
    return min(64 if per_channel else 32, dv)


def split_reconstruct(config, state, *, only_full, block_v=None, interpret=None):
    """Split flush, stage 1: ``(S [B, H, dk, dv] fp32, Y [B, H, nvb, r, dk] fp32 or None)``, ``Y``
    the value blocks' parts of the first round's ``(S S^T Q_0)^T`` (``nvb = dv / block_v``).

    Blocks of sequences skipped by ``only_full`` are left unwritten (their values are unspecified).
    An fp32 checkpoint (``fp32-w``): ``S`` is written over it in place (each program reads its
    block before writing it), so a skipped sequence's ``S`` is its checkpoint; the records' dot
    runs in IEEE fp32 (``F32_F32_F32``): the flush rounds nothing beyond fp32 sums.
    """
    interpret = default_interpret() if interpret is None else interpret
    bsz, h, dk, dv = state.shape
    p, r = config.window, config.effective_rank
    bv = block_v or default_reconstruct_block(state.per_channel_decay, dv)
    if not is_pow2(bv) or dv % bv or bv < 16:
        raise ValueError(f"block_v={bv} must be a power of two >= 16 dividing dv={dv}")

    def spec_k(*lead, vec=True):
        shape = lead + ((dk,) if vec else ())
        return pl.BlockSpec((None, None) + shape, lambda i, j, c: (i, j) + (0,) * len(shape))

    def spec_v(*lead):
        return pl.BlockSpec((None, None) + lead + (bv,), lambda i, j, c: (i, j) + (0,) * len(lead) + (c,))

    group = _group(state)
    keys = pl.BlockSpec((None, None, p, dk), lambda i, j, c: (i, j // group, 0, 0))
    args, specs = _inputs(config, state, spec_k, spec_v, random_start(dk, max(r, 1), config.seed), keys)
    shapes, out_specs = [jax.ShapeDtypeStruct((bsz, h, dk, dv), f32)], [spec_v(dk)]
    if r:
        shapes.append(jax.ShapeDtypeStruct((bsz, h, dv // bv, r, dk), f32))
        out_specs.append(pl.BlockSpec((None, None, None, r, dk), lambda i, j, c: (i, j, c, 0, 0)))
    fp32 = tile_bits(config) == FP32_TILE
    if interpret:
        precision = jax.lax.Precision.HIGHEST
    else:
        precision = jax.lax.DotAlgorithmPreset.F32_F32_F32 if fp32 else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    kernel = functools.partial(
        _reconstruct_kernel, bits=tile_bits(config), rank=r, window=p, dk=dk, per_channel=state.per_channel_decay,
        smoothing=config.smoothing, warm_start=config.warm_start, only_full=only_full, precision=precision)
    res = pl.pallas_call(
        kernel, grid=(bsz, h, dv // bv), in_specs=specs, out_specs=out_specs, out_shape=shapes,
        input_output_aliases={2: 0} if fp32 else {},
        compiler_params=compiler_params(num_warps=4), interpret=interpret, name=_name(config, state, "reconstruct"),
    )(*args)
    return res[0], (res[1] if r else None)


def split_fit(config, dense, first_y):
    """Split flush, stage 2 (XLA): the reference's ``fit_subspace`` from ``S`` and the value
    blocks' parts of the first round's ``(S S^T Q_0)^T`` (``[B, H, nvb, r, dk]``, summed here).
    Returns fp16 ``(K [B, H, r, dk], U [B, H, r, dv])``."""
    return fit_subspace(dense, config.effective_rank, iters=config.fit_iters, first_y=jnp.sum(first_y, axis=2))


def split_quantize(config, state, dense, comp_k, comp_u, *, only_full, num_warps=None, interpret=None):
    """Split flush, stage 3: residual, smoothing, quantization, in-place checkpoint writes."""
    interpret = default_interpret() if interpret is None else interpret
    r = config.effective_rank
    bsz, h, dk, dv = state.shape
    outs, out_specs, spec = _checkpoint_io(config, state)
    extra, extra_specs = ([comp_k, comp_u], [spec(r, dk), spec(r, dv)]) if r else ([], [])
    kernel = functools.partial(_quantize_kernel, bits=config.bits, rank=r, window=config.window, dk=dk, dv=dv,
                               smoothing=config.smoothing, only_full=only_full)
    n_in = 2 + len(extra)
    res = pl.pallas_call(
        kernel, grid=(bsz, h),
        in_specs=[pl.BlockSpec((None,), lambda i, j: (i,)), spec(dk, dv)] + extra_specs + out_specs,
        out_specs=out_specs, out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outs],
        input_output_aliases={n_in + i: i for i in range(len(outs))},
        compiler_params=compiler_params(num_warps=num_warps or 8),
        interpret=interpret, name=_name(config, state, "quantize"),
    )(state.pos.astype(jnp.int32), dense, *extra, *outs)
    return _new_state(config, state, res, only_full)


@functools.partial(jax.jit, static_argnames=("config", "only_full", "block_v", "num_warps", "interpret"))
def flush_split(config: LeapQuantConfig, state: LeapQuantState, *, only_full: bool = False, block_v: int | None = None,
                num_warps: int | None = None, interpret: bool | None = None) -> LeapQuantState:
    """The split flush: the three stages above (``leapquant_flush``'s contract, module docstring).
    ``block_v``: value columns per program of stage 1 (``default_reconstruct_block``);
    ``num_warps``: of stage 3 (8 by default). An fp32 checkpoint (``fp32-w``): stage 1 alone,
    ``S_p`` kept as the next checkpoint as it is (``split_reconstruct``: no fit, no rounding)."""
    _check(config, state)
    if tile_bits(config) == FP32_TILE:
        dense, _ = split_reconstruct(config, state, only_full=only_full, block_v=block_v, interpret=interpret)
        return state.replace(checkpoint=state.checkpoint.replace(residual=FloatTensor(values=dense)),
                             pos=_flushed_pos(config, state, only_full))
    dense, first_y = split_reconstruct(config, state, only_full=only_full, block_v=block_v, interpret=interpret)
    comp_k, comp_u = split_fit(config, dense, first_y) if config.effective_rank else (None, None)
    return split_quantize(config, state, dense, comp_k, comp_u, only_full=only_full, num_warps=num_warps,
                          interpret=interpret)


def flush_bytes(config: LeapQuantConfig, dk: int, dv: int, per_channel: bool, impl: str = "split",
                group: int = 1) -> float:
    """Bytes one flushed value head moves: read the checkpoint and the ``p`` records, write the
    checkpoint (the fused count); ``impl="split"`` adds the fp32 state written once and read twice
    (``12 dk dv``, two more reads per further fit round), stage 1's parts of ``Y`` and the factors.
    ``group``: value heads per key head (GVA), whose shared key records count ``1 / group`` per
    value head. An ``int`` when ``group`` divides them. An fp32 checkpoint (``fp32-w``): the
    fused count, its split flush being stage 1 writing the checkpoint in place."""
    e = jnp.dtype(config.record_dtype).itemsize
    r = config.effective_rank
    bits = tile_bits(config)
    ckpt = dk * dv * bits // 8 + (4 * dv if bits != FP32_TILE else 0) + (4 * dk if config.smoothing else 0)
    ckpt += 2 * r * (dk + dv)
    keys = e * config.window * dk
    records = e * config.window * (dv + (dk if per_channel else 1)) + (keys // group if keys % group == 0
                                                                        else keys / group)
    n = 2 * ckpt + records + 4 * r * dk + 4
    if impl == "split" and bits != FP32_TILE:
        # S written once, read by U = S^T K^T and stage 3 (two more reads per extra fit round),
        # stage 1's parts of Y written and read (one per value block of the default width), the
        # factors written and read
        nvb = dv // default_reconstruct_block(per_channel, dv)
        n += 4 * dk * dv * (3 + 2 * (config.fit_iters - 1)) + 2 * 4 * nvb * r * dk + 2 * 2 * r * (dk + dv)
    return n


# ----------------------------------------------------------------------------- reference


def leapquant_flush_reference(config: LeapQuantConfig, state: LeapQuantState, *, only_full: bool = False, **_unused):
    """The oracle: ``windowed.flush_reference`` (every sequence) or ``maybe_flush`` (full ones)."""
    if only_full:
        return windowed.maybe_flush(config, state)
    return windowed.flush_reference(config, state)


__all__ = ["default_reconstruct_block", "flush_bytes", "flush_fused", "flush_split", "fused_unsupported_reason",
           "leapquant_flush_reference", "split_fit", "split_quantize", "split_reconstruct"]
