"""KDA's decayed pair scores of a chunk (the chunked form's one non-matmul part) on Pallas Triton.

Contract: ``leapquant_jax.chunk_ops.pair_scores_kda``'s. q, k, G ``[R, C, dk]`` (``R`` chunks, ``G``
the cumulative log-decay from each chunk's start, inclusive) -> ``[R, 2, C, C]`` fp32:
``sum_c x_ic k_jc e^{G_ic - G_jc}`` for ``j <= i`` with ``x = k`` then ``x = q``, zero above.

Why: with a decay per key channel this is not a plain matmul, and XLA materialises the
in-sub-chunk pairs as ``[C/s, s, s, dk]`` per chunk and reads them back. Here one program per
chunk writes the scores one column block of ``s = SUB_CHUNK`` columns (sub-chunk ``b``) at a
time, in a loop:

* pairs inside sub-chunk ``b`` (the diagonal ``[s, s]`` block): one column ``j`` at a time,
  ``e^{G_i - G_j}`` for ``i >= j``, over ``dk`` in ``DIAG_SLICE``-wide tiles;
* pairs of ``j`` in ``b`` with ``i`` after it: with ``T`` the cumulative log-decay at ``b``'s last
  token, a ``[C, s]`` product of ``x_i e^{G_i - T}`` by ``k_j e^{T - G_j}`` (both factors ``<= 1``),
  accumulated over ``dk`` in ``KEY_SLICE``-wide steps; the rows above the block get zeros.

``pair_scores_kda`` splits the across-sub-chunk pairs at the row's sub-chunk start instead of the
column's end; both splits are exact, so the two differ by rounding only. Every exponent is
masked or clamped to ``<= 0`` before ``exp``, so fully decayed channels give zeros, not NaN. The
products run at the caller's precision (three TF32 passes for ``HIGHEST`` on the GPU, one for
``DEFAULT``); the in-sub-chunk sums are fp32. Not differentiable by itself: ``leapquant_jax.chunked``
wraps it in a ``jax.custom_jvp`` with the pure-JAX form's derivative.

Defaults (``DEFAULT_NUM_WARPS``, ``KEY_SLICE``, ``DIAG_SLICE``): no register spills, then the
fewest registers and the fastest measured (``python -m bench.registers --what scores``;
docs/performance.md). Tested with JAX 0.10.2 (interpret mode, CPU) and 0.11.2 (compiled, H200).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from leapquant_jax.chunk_ops import SUB_CHUNK, pair_scores_kda

from ._compat import compiler_params, default_interpret, is_pow2, pl, store, tensor_core_precision

f32 = jnp.float32
DEFAULT_NUM_WARPS = 8  # no register spills, then the fewest registers (bench.registers; docs/performance.md)
KEY_SLICE = 16        # dk columns per step of the across-sub-chunk products (operands [C, 16] and [s, 16])
DIAG_SLICE = 64       # dk columns per step of the in-sub-chunk column loop (tiles [s, 64])


def _kernel(q_ref, k_ref, G_ref, out_ref, *, chunk, sub, precision):
    # q, k, G: [C, dk]; out: [2, C, C] (k k^T then q k^T, decayed, zero above the diagonal), written one
    # column block of s columns at a time: its diagonal [s, s] block, then the other C - s rows.
    n = chunk // sub
    dk = k_ref.shape[-1]
    step, dstep = min(KEY_SLICE, dk), min(DIAG_SLICE, dk)
    col = jax.lax.broadcasted_iota(jnp.int32, (sub, sub), 1)
    row = jax.lax.broadcasted_iota(jnp.int32, (sub, 1), 0)
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
    zeros = jnp.zeros((sub, sub), f32)
    dot = functools.partial(jax.lax.dot_general, dimension_numbers=(((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=f32)

    def diagonal(lo):
        # pairs inside the sub-chunk starting at lo, one column jj at a time: e^{G_i - G_j}, i >= j
        blk = pl.ds(lo, sub)

        def part(d, acc):
            cs = pl.ds(pl.multiple_of(d * dstep, dstep), dstep)
            Gb, kb, qb = G_ref[blk, cs], k_ref[blk, cs], q_ref[blk, cs]                    # [s, dstep]

            def column(jj, acc):
                e = jnp.exp(jnp.where(row >= jj, Gb - G_ref[lo + jj, cs][None, :], -jnp.inf))
                w = k_ref[lo + jj, cs][None, :] * e
                here = col == jj
                return tuple(jnp.where(here, y + jnp.sum(x * w, axis=1, keepdims=True), y)
                             for x, y in zip((kb, qb), acc))

            return jax.lax.fori_loop(0, sub, column, acc)

        acc = jax.lax.fori_loop(0, dk // dstep, part, (zeros, zeros))
        for x in range(2):
            out_ref[x, blk, blk] = acc[x]

    def column_block(b, carry):
        lo = pl.multiple_of(b * sub, sub)
        blk = pl.ds(lo, sub)
        diagonal(lo)
        # rows after the block: x_i e^{G_i - T} by k_j e^{T - G_j}, T = G at the block's last token,
        # both exponents <= 0; rows up to the block's end get zeros (their left factor is masked)
        end = lo + sub - 1
        after = rows > end

        def part(d, acc):
            cs = pl.ds(pl.multiple_of(d * step, step), step)
            T = G_ref[end, cs][None, :]                                                      # [1, step]
            left = jnp.where(after, jnp.exp(jnp.minimum(G_ref[:, cs] - T, 0.0)), 0.0)          # [C, step]
            right = k_ref[blk, cs] * jnp.exp(jnp.minimum(T - G_ref[blk, cs], 0.0))             # [s, step]
            return tuple(y + dot(r[:, cs] * left, right) for r, y in zip((k_ref, q_ref), acc))

        z = jnp.zeros((chunk, sub), f32)
        acc = jax.lax.fori_loop(0, dk // step, part, (z, z))                                  # [C, s] each
        off = (rows < lo) | after                                                             # all but the diagonal block
        for x in range(2):      # (a traced index: interpret mode cannot discharge a masked store at a Python int)
            store(out_ref.at[jnp.int32(x), :, blk], acc[x], mask=off)
        return carry

    jax.lax.fori_loop(0, n - 1, column_block, 0)
    # the last column block: its diagonal block, zeros above it
    lo = (n - 1) * sub
    diagonal(lo)
    if n > 1:
        for x in range(2):
            store(out_ref.at[jnp.int32(x), :, lo:], jnp.zeros((chunk, sub), f32), mask=rows < lo)


def check_score_inputs(q, k, G) -> None:
    """Raises ``ValueError`` naming the input whose shape the kernel cannot take."""
    if k.ndim != 3:
        raise ValueError(f"k must be [R, C, dk], got shape {k.shape}")
    for name, x in (("q", q), ("G", G)):
        if x.shape != k.shape:
            raise ValueError(f"{name} must be {k.shape} like k, got {x.shape}")
    why = unsupported_reason(k.shape[2], k.shape[1])
    if why is not None:
        raise ValueError(why)


def unsupported_reason(dk: int, chunk: int) -> str | None:
    """Why the kernel cannot take keys of ``dk`` channels in chunks of ``chunk`` tokens (``None`` when it can)."""
    for name, size in (("chunk", chunk), ("dk", dk)):
        if not (is_pow2(size) and size >= 16):
            return f"{name}={size} is not a power of two >= 16 (Triton tiles)"
    return None


@functools.partial(jax.jit, static_argnames=("precision", "num_warps", "interpret"))
def kda_pair_scores(q, k, G, *, precision=jax.lax.Precision.HIGHEST, num_warps=DEFAULT_NUM_WARPS, interpret=None):
    """Decayed pair scores of KDA chunks on the kernel.

    q, k ``[R, C, dk]`` (``R`` chunks); G ``[R, C, dk]`` the cumulative log-decay from each chunk's
    start (inclusive). Returns ``[R, 2, C, C]`` fp32: ``sum_c x_ic k_jc e^{G_ic - G_jc}`` for
    ``j <= i`` with ``x = k`` then ``x = q``, zero above the diagonal.
    """
    check_score_inputs(q, k, G)
    interpret = default_interpret() if interpret is None else interpret
    r, c, dk = k.shape
    precision = tensor_core_precision(precision, interpret)
    tile = pl.BlockSpec((None, c, dk), lambda i: (i, 0, 0))
    return pl.pallas_call(
        functools.partial(_kernel, chunk=c, sub=min(SUB_CHUNK, c), precision=precision),
        grid=(r,),
        in_specs=[tile, tile, tile],
        out_specs=pl.BlockSpec((None, 2, c, c), lambda i: (i, 0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((r, 2, c, c), f32),
        compiler_params=compiler_params(num_warps=num_warps),
        interpret=interpret,
        name="kda_pair_scores",
    )(q.astype(f32), k.astype(f32), G.astype(f32))


def kda_pair_scores_reference(q, k, G, *, precision=jax.lax.Precision.HIGHEST, **_unused):
    """``kda_pair_scores``'s contract in pure JAX (``chunk_ops.pair_scores_kda``): ``[R, 2, C, C]``."""
    return pair_scores_kda(q, k, G, precision)


__all__ = ["check_score_inputs", "kda_pair_scores", "kda_pair_scores_reference", "unsupported_reason"]
