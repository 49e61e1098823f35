"""The serial part of the chunked delta rule (prefill) as one Pallas Triton kernel.

Contract: ``leapquant_jax.chunk_ops.scan_chunks``'s. s0 ``[R, dk, dv]`` (``R`` rows x heads); per
chunk ``n`` of ``N``: w, k_end, q_start ``[N, R, C, dk]``, uv ``[N, R, C, dv]``, decay ``[N, R, dk]``,
p ``[N, R, C, C]`` -> ``(o [N, R, C, dv], S_N [R, dk, dv])``, all fp32:

    U_n = uv_n - w_n S_n,   o_n = q_n S_n + p_n U_n,   S_{n+1} = Diag(decay_n) S_n + k_n^T U_n.

Why: everything about a chunk that does not depend on its initial state is computed for all chunks
at once with matmuls; what is left is four small matmuls per chunk in a row. As a ``lax.scan``
every chunk costs several launches and writes its start state to device memory; a single long
prompt has too few heads to hide that. Here one program per (row, value block ``BV``) keeps
``S [dk, BV]`` in registers for the whole loop and writes only ``o`` and the final state.

Precision: ``HIGHEST`` is three TF32 passes per product on the GPU (about fp32 round-off);
``DEFAULT`` one TF32 pass (the math of FLA's fp32 chunk kernels); interpret mode computes in fp32.
Not differentiable by itself: ``leapquant_jax.chunked`` wraps it in a ``jax.custom_jvp`` whose
derivative is ``scan_chunks``'s.

Defaults: ``default_block_v`` (64 columns, 32 when few rows leave the GPU idle), 4 warps, one
stage (two stages need more shared memory than an SM has at 128 x 128 heads). Tested with JAX
0.10.2 (interpret mode, CPU) and 0.11.2 (compiled, H200).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from leapquant_jax.chunk_ops import scan_chunks

from ._compat import compiler_params, default_interpret, is_pow2, pl, tensor_core_precision

f32 = jnp.float32
# Value columns per program: 64 gives each program a [dk, 64] state; with few rows x heads
# (one long prompt) 32 doubles the programs that run at once.
DEFAULT_BLOCK_V = 64
SMALL_GRID_BLOCK_V = 32
# Rows x heads x value blocks below which the smaller block is taken (about two programs per
# streaming multiprocessor of an H200 at the default block).
SMALL_GRID = 264
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 1


def _kernel(s0_ref, w_ref, uv_ref, k_ref, decay_ref, q_ref, p_ref, o_ref, s_out_ref, *, chunks, precision):
    # per program: s0 [dk, BV]; w, k, q [N, C, dk]; uv [N, C, BV]; decay [N, dk]; p [N, C, C];
    # o [N, C, BV]; s_out [dk, BV]
    def dot(a, b, contract=((1,), (0,))):
        return jax.lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=f32)

    def chunk(n, s):
        u = uv_ref[n] - dot(w_ref[n], s)                                          # [C, BV]
        o_ref[n] = dot(q_ref[n], s) + dot(p_ref[n], u)
        return decay_ref[n][:, None] * s + dot(k_ref[n], u, ((0,), (0,)))         # k^T u: [dk, BV]

    s_out_ref[...] = jax.lax.fori_loop(0, chunks, chunk, s0_ref[...])


def check_chunk_inputs(s0, w, uv, k_end, decay, q_start, p, block_v: int) -> None:
    """Raises ``ValueError`` naming the first input whose shape the kernel cannot take."""
    if s0.ndim != 3:
        raise ValueError(f"s0 must be [R, dk, dv], got shape {s0.shape}")
    rows, dk, dv = s0.shape
    if w.ndim != 4:
        raise ValueError(f"w must be [N, R, C, dk], got shape {w.shape}")
    n, _, c, _ = w.shape
    for name, x, shape in (("w", w, (n, rows, c, dk)), ("uv", uv, (n, rows, c, dv)), ("k_end", k_end, (n, rows, c, dk)),
                           ("decay", decay, (n, rows, dk)), ("q_start", q_start, (n, rows, c, dk)),
                           ("p", p, (n, rows, c, c))):
        if x.shape != shape:
            raise ValueError(f"{name} must be {shape} to match s0 {s0.shape} and w {w.shape}, got {x.shape}")
    why = unsupported_reason(dk, dv, c)
    if why is not None:
        raise ValueError(why)
    if not (is_pow2(block_v) and block_v >= 16 and dv % block_v == 0):
        raise ValueError(f"block_v={block_v} must be a power of two >= 16 dividing dv={dv}")


def unsupported_reason(dk: int, dv: int, chunk: int) -> str | None:
    """Why the kernel cannot take heads of ``dk x dv`` in chunks of ``chunk`` tokens (``None`` when it can)."""
    for name, size in (("dk", dk), ("dv", dv), ("chunk", chunk)):
        if not (is_pow2(size) and size >= 16):
            return f"{name}={size} is not a power of two >= 16 (Triton tiles)"
    return None


def default_block_v(rows: int, dv: int) -> int:
    """The value block ``chunk_scan`` takes for ``rows`` rows x heads and ``dv`` columns."""
    bv = min(DEFAULT_BLOCK_V, dv)
    return min(SMALL_GRID_BLOCK_V, dv) if rows * (dv // bv) < SMALL_GRID else bv


@functools.partial(jax.jit, static_argnames=("precision", "block_v", "num_warps", "num_stages", "interpret"))
def chunk_scan(s0, w, uv, k_end, decay, q_start, p, *, precision=jax.lax.Precision.HIGHEST, block_v=None,
               num_warps=DEFAULT_NUM_WARPS, num_stages=DEFAULT_NUM_STAGES, interpret=None):
    """The chunks' serial recurrence and outputs on the kernel.

    s0 ``[R, dk, dv]`` (``R`` rows x heads); per chunk ``n`` of ``N``: w, k_end, q_start
    ``[N, R, C, dk]``, uv ``[N, R, C, dv]``, decay ``[N, R, dk]``, p ``[N, R, C, C]`` (the
    chunk terms of ``leapquant_jax.chunked``). Returns ``(o [N, R, C, dv], S_N [R, dk, dv])``, all fp32.
    ``num_stages > 1`` lets Triton load the next chunks' tiles while the current one computes,
    shared memory permitting (not at ``dk = dv = 128``: ``python -m bench.registers --what chunk``).
    """
    rows, dk, dv = s0.shape
    bv = default_block_v(rows, dv) if block_v is None else block_v
    check_chunk_inputs(s0, w, uv, k_end, decay, q_start, p, bv)
    interpret = default_interpret() if interpret is None else interpret
    n, _, c, _ = w.shape
    precision = tensor_core_precision(precision, interpret)

    def per_chunk(*tail, values=False):
        last = (bv,) if values else tail[-1:]
        return pl.BlockSpec((n, None) + tail[:-1] + last,
                            lambda i, j: (0, i) + (0,) * (len(tail) - 1) + ((j,) if values else (0,)))

    state = pl.BlockSpec((None, dk, bv), lambda i, j: (i, 0, j))
    o, s_final = pl.pallas_call(
        functools.partial(_kernel, chunks=n, precision=precision),
        grid=(rows, dv // bv),
        in_specs=[state, per_chunk(c, dk), per_chunk(c, dv, values=True), per_chunk(c, dk), per_chunk(dk),
                  per_chunk(c, dk), per_chunk(c, c)],
        out_specs=[per_chunk(c, dv, values=True), state],
        out_shape=[jax.ShapeDtypeStruct((n, rows, c, dv), f32), jax.ShapeDtypeStruct((rows, dk, dv), f32)],
        compiler_params=compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="chunk_scan",
    )(*(x.astype(f32) for x in (s0, w, uv, k_end, decay, q_start, p)))
    return o, s_final


def chunk_scan_reference(s0, w, uv, k_end, decay, q_start, p, *, precision=jax.lax.Precision.HIGHEST, **_unused):
    """``chunk_scan``'s contract in pure JAX (``chunk_ops.scan_chunks``, a ``lax.scan`` over the
    chunks): ``(o [N, R, C, dv], S_N [R, dk, dv])``."""
    return scan_chunks(s0, w, uv, k_end, decay, q_start, p, precision=precision)


__all__ = ["DEFAULT_BLOCK_V", "check_chunk_inputs", "chunk_scan", "chunk_scan_reference", "default_block_v",
           "unsupported_reason"]
