"""KDA's decayed pair scores of a chunk (the chunkwise-parallel form's one non-matmul part) as a Pallas kernel.

Why: with a decay per key channel, ``sum_c x_ic k_jc e^{G_ic - G_jc}`` is not a plain matmul.
``leapquant_jax.chunked`` reduces pairs inside a sub-chunk of ``SUB_CHUNK`` tokens elementwise,
which XLA materialises as ``[C/s, s, s, dk]`` per chunk (half a megabyte at ``C = 64``,
``dk = 128``) and reads back. Here one program per chunk keeps it in registers:

* pairs across sub-chunks, ``i`` in sub-chunk ``a`` and ``j`` before its start ``S_a`` (the
  cumulative log-decay at the last token of sub-chunk ``a - 1``): one matmul of
  ``x_i e^{G_i - S_a}`` by ``k_j e^{S_a - G_j}``, both factors ``<= 1``;
* pairs inside sub-chunk ``a``: one column ``j`` at a time, ``e^{G_i - G_j}`` for ``i >= j``.

Every exponent is masked to ``<= 0`` before ``exp``, so fully decayed channels give zeros, not
NaN or inf. The products run at the caller's precision (three TF32 passes for ``HIGHEST`` on the
GPU, one for ``DEFAULT``); the in-sub-chunk sums are fp32. Not differentiable by itself:
``leapquant_jax.chunked`` wraps it in a ``jax.custom_jvp`` with the pure-JAX form's derivative.

Tested with JAX 0.10.2 (interpret mode, CPU) and 0.11.2 (compiled, H200).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from leapquant_jax.chunked import SUB_CHUNK, pair_scores_kda

from ._compat import compiler_params, default_interpret, is_pow2, pl, tensor_core_precision

f32 = jnp.float32
DEFAULT_NUM_WARPS = 4


def _kernel(q_ref, k_ref, G_ref, out_ref, *, chunk, sub, precision):
    # q, k, G: [C, dk]; out: [2, C, C] (k k^T then q k^T, decayed, zero above the diagonal)
    col = jax.lax.broadcasted_iota(jnp.int32, (sub, chunk), 1)
    row = jax.lax.broadcasted_iota(jnp.int32, (sub, 1), 0)
    for a in range(chunk // sub):
        lo = a * sub
        ka, qa, Ga = (r[lo:lo + sub, :] for r in (k_ref, q_ref, G_ref))                     # [s, dk]
        if a:
            S = G_ref[lo - 1, :][None, :]                                                   # [1, dk]
            before = jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0) < lo
            right = jnp.where(before, k_ref[...] * jnp.exp(jnp.where(before, S - G_ref[...], -jnp.inf)), 0.0)
            left = jnp.exp(Ga - S)

            def cross(x):
                return jax.lax.dot_general(x * left, right, (((1,), (1,)), ((), ())), precision=precision,
                                           preferred_element_type=f32)                      # [s, C]

            acc = (cross(ka), cross(qa))
        else:
            acc = (jnp.zeros((sub, chunk), f32), jnp.zeros((sub, chunk), f32))

        def column(jj, acc, ka=ka, qa=qa, Ga=Ga, lo=lo):
            kj = k_ref[lo + jj, :][None, :]
            e = jnp.exp(jnp.where(row >= jj, Ga - G_ref[lo + jj, :][None, :], -jnp.inf))   # [s, dk]
            w = kj * e
            here = col == lo + jj
            return tuple(jnp.where(here, jnp.sum(x * w, axis=1, keepdims=True), y) for x, y in zip((ka, qa), acc))

        acc_k, acc_q = jax.lax.fori_loop(0, sub, column, acc)
        out_ref[0, lo:lo + sub, :] = acc_k
        out_ref[1, lo:lo + sub, :] = acc_q


def check_score_inputs(q, k, G) -> None:
    """Raises ``ValueError`` naming the input whose shape the kernel cannot take."""
    if k.ndim != 3:
        raise ValueError(f"k must be [R, C, dk], got shape {k.shape}")
    for name, x in (("q", q), ("G", G)):
        if x.shape != k.shape:
            raise ValueError(f"{name} must be {k.shape} like k, got {x.shape}")
    _, c, dk = k.shape
    for name, size in (("chunk", c), ("dk", dk)):
        if not (is_pow2(size) and size >= 16):
            raise ValueError(f"{name}={size} must be a power of two >= 16 (Triton tiles)")


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
    """``kda_pair_scores``'s contract in pure JAX (``chunked.pair_scores_kda``): ``[R, 2, C, C]``."""
    return pair_scores_kda(q, k, G, precision)


__all__ = ["check_score_inputs", "kda_pair_scores", "kda_pair_scores_reference"]
