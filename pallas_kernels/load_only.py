"""The LeapQuant step's memory traffic with no arithmetic: the step's bandwidth ceiling.

``load_only_step`` reads exactly what ``leapquant_step`` reads and writes what it writes (one
program per (sequence, head)): the codes ``[B, H, rows, dv]``, scales ``[B, H, dv]``, smoothing
``[B, H, dk]``, Compensator Tokens ``[B, H, r, dk]`` / ``[B, H, r, dv]``, the first ``pos`` records
of ``k [B, H, p, dk]``, ``u [B, H, p, dv]``, ``g [B, H, p]`` (KDA ``[B, H, p, dk]``), the token, then
the output ``[B, H, dv]`` and one record. Each load feeds a trivial reduction (so none is dead
code):

    s = sum(q + w + b) + sum(g) + beta + sum(smooth) + sum(comp_k) + sum(live k) + sum(live g)
    o = colsum(codes) * scale + colsum(comp_u) + colsum(live u) + v + s

and ``(w, o, g)`` is stored (record dtype) at slot ``pos`` when ``pos < p``. Bytes per head are
``leapquant_step.step_bytes(config, dk, dv, pos, per_channel)``: a step that cannot reach the copy
bandwidth on this access pattern is bound by the pattern, not by its arithmetic. Used by
``bench.kernels --load-only``; the output means nothing beyond the formula above. Pallas Triton
(interpret mode off the GPU); tested with JAX 0.10.2 (interpret mode) and 0.11.2 (compiled, H200).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from leapquant_jax.quantizers import packed_rows
from leapquant_jax.state import LeapQuantConfig, LeapQuantState, WindowBuffer

from ._compat import compiler_params, default_interpret, is_pow2, load, pl
from .leapquant_step import step_operands, step_refs
from .shared import num_parts
from .support import check_token


def _load_only_kernel(*refs, rank, window, chunk, per_channel, smoothing, rec_dtype):
    (pos_ref, q_ref, w_ref, b_ref, v_ref, g_ref, beta_ref, codes_ref, scale_ref, smooth_ref, ck_ref, cu_ref,
     bk_ref, bu_ref, bg_ref, o_ref, bk_out, bu_out, bg_out) = step_refs(refs, smoothing=smoothing, rank=rank)

    f32 = jnp.float32
    pos = pos_ref[...]
    live = jnp.arange(window) < pos                                      # [p]
    rows = codes_ref.shape[0]
    # int32 column sums of the codes, ``chunk`` packed rows at a time (bounds the registers)
    zsum = jnp.zeros(o_ref.shape, jnp.int32)
    for c in range(rows // chunk):
        zsum = zsum + jnp.sum(codes_ref[pl.ds(c * chunk, chunk), :].astype(jnp.int32), axis=0)
    col = zsum.astype(f32) * scale_ref[...]                               # [dv]
    s = jnp.sum(q_ref[...] + w_ref[...] + b_ref[...]) + jnp.sum(g_ref[...]) + beta_ref[...]
    if smoothing:
        s = s + jnp.sum(smooth_ref[...])
    if rank and is_pow2(rank):
        s = s + jnp.sum(ck_ref[...].astype(f32))
        col = col + jnp.sum(cu_ref[...].astype(f32), axis=0)
    elif rank:   # a [r, n] block needs r a power of two in Triton: one row at a time
        for c in range(rank):
            s = s + jnp.sum(ck_ref[c, :].astype(f32))
            col = col + cu_ref[c, :].astype(f32)
    # only the live records: masked loads fetch nothing for dead slots, as in the step
    s = s + jnp.sum(load(bk_ref, mask=live[:, None], other=0.0).astype(f32))
    col = col + jnp.sum(load(bu_ref, mask=live[:, None], other=0.0).astype(f32), axis=0)
    s = s + jnp.sum(load(bg_ref, mask=live[:, None] if per_channel else live, other=0.0).astype(f32))
    o = col + v_ref[...] + s
    o_ref[...] = o
    rec = jnp.dtype(rec_dtype)

    @pl.when(pos < window)
    def _append():
        bk_out[pos, :] = w_ref[...].astype(rec)
        bu_out[pos, :] = o.astype(rec)
        if per_channel:
            bg_out[pos, :] = g_ref[...].astype(rec)
        else:
            bg_out[pos] = g_ref[...].astype(rec)


@functools.partial(jax.jit, static_argnames=("config", "num_warps", "num_stages", "chunk", "interpret"))
def load_only_step(config: LeapQuantConfig, state: LeapQuantState, token, *, num_warps: int = 2, num_stages: int = 1,
                   chunk: int | None = None, interpret: bool | None = None):
    """``(o [B, H, dv] fp32, state with pos + 1)``: the module docstring's reduction over what
    ``leapquant_step`` reads. ``token``: a ``Token`` of ``[B, H, ...]`` fields (one key record per
    value head). ``chunk``: packed code rows per load, a power of two dividing a code part (default
    the whole part: the fewest loads)."""
    check_token(state, token)
    if state.key_heads != state.shape[1]:
        raise ValueError(f"the load-only kernel reads one key record per value head; the state keeps them for "
                         f"{state.key_heads} key heads of {state.shape[1]}")
    interpret = default_interpret() if interpret is None else interpret
    bsz, h, dk, dv = state.shape
    ckpt, buf = state.checkpoint, state.buffer
    per_channel = state.per_channel_decay
    p, r = config.window, config.effective_rank
    rows = packed_rows(dk, config.bits)
    n = dk // num_parts(config.bits)
    ch = n if chunk is None else chunk
    if not is_pow2(ch) or n % ch:
        raise ValueError(f"chunk={ch} must be a power of two dividing the {n} rows of a code part")
    f32 = jnp.float32

    def spec(*shape):
        return pl.BlockSpec((None, None) + shape, lambda i, j: (i, j) + (0,) * len(shape))

    scalar = pl.BlockSpec((None, None), lambda i, j: (i, j))
    args, first_record = step_operands(config, state, token)
    specs = [pl.BlockSpec((None,), lambda i, j: (i,)), spec(dk), spec(dk), spec(dk), spec(dv),
             spec(dk) if per_channel else scalar, scalar, spec(rows, dv), spec(dv)]
    if config.smoothing:
        specs.append(spec(dk))
    if r:
        specs += [spec(r, dk), spec(r, dv)]
    records = (buf.k, buf.u, buf.g)
    record_specs = [spec(p, dk), spec(p, dv), spec(p, dk) if per_channel else spec(p)]
    specs += record_specs
    kernel = functools.partial(_load_only_kernel, rank=r, window=p, chunk=ch, per_channel=per_channel,
                               smoothing=config.smoothing, rec_dtype=config.record_dtype)
    o, bk, bu, bg = pl.pallas_call(
        kernel,
        grid=(bsz, h),
        in_specs=specs,
        out_specs=[spec(dv)] + record_specs,
        out_shape=[jax.ShapeDtypeStruct((bsz, h, dv), f32)] + [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in records],
        input_output_aliases={first_record + i: 1 + i for i in range(3)},
        compiler_params=compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"leapquant_load_only_{'kda' if per_channel else 'gdn'}_int{config.bits}",
    )(*args)
    return o, LeapQuantState(checkpoint=ckpt, buffer=WindowBuffer(k=bk, u=bu, g=bg), pos=state.pos + 1)
