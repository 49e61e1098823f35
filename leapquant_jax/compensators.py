"""Compensator Tokens: the rank-``r`` dominant part of a state, kept in fp16 (paper eq. 5-6).

``S [.., dk, dv] ~ K U^T + R`` with ``K [.., r, dk]`` orthonormal rows and ``U = S^T K^T``
``[.., r, dv]`` (stored row-major as ``r`` records, the layout of the window buffer).
Two fits with one signature:

* ``fit_svd``: exact truncated SVD, the reference.
* ``fit_subspace``: subspace iteration ``Y = S (S^T Q)`` orthonormalised by CholeskyQR2,
  from a fixed seeded Gaussian start or warm-started from the previous window's ``K``.

What a fit misses lands in the residual, which is quantized anyway, so an approximate fit
costs accuracy only through the residual's range, never correctness.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
HI = jax.lax.Precision.HIGHEST
FP16_MAX = 65504.0


def random_start(dk: int, rank: int, seed: int = 0) -> Array:
    """The fixed Gaussian start ``[rank, dk]`` of subspace iteration (same for every head)."""
    return jax.random.normal(jax.random.PRNGKey(seed), (rank, dk), jnp.float32)


UNROLLED_RANK = 8   # up to this rank the r x r Cholesky factor is unrolled into elementwise ops


def cholesky_qr2(y: Array) -> Array:
    """Orthonormalises the columns of ``y [.., n, r]`` by two rounds of Cholesky QR.

    A shift proportional to the Gram matrix's trace keeps the factorisation finite for a
    rank-deficient or zero ``y`` (a zero state gives zero columns, not NaN). For
    ``r <= UNROLLED_RANK`` the factorisation and the triangular solve are unrolled over the
    ``r (r + 1) / 2`` entries: elementwise ops over the batch that XLA fuses, where batched
    solver calls on thousands of tiny matrices are launch- and latency-bound on a GPU.
    """
    def one_round(a):
        gram = jnp.einsum("...nr,...ns->...rs", a, a, precision=HI)
        r = gram.shape[-1]
        shift = 1e-6 * jnp.trace(gram, axis1=-2, axis2=-1)[..., None, None] / r + 1e-30
        gram = gram + shift * jnp.eye(r, dtype=gram.dtype)
        if r > UNROLLED_RANK:
            chol = jnp.linalg.cholesky(gram)
            # Solve Q L^T = A for Q: a triangular solve, never an explicit inverse.
            qt = jax.scipy.linalg.solve_triangular(chol, jnp.swapaxes(a, -1, -2), lower=True)
            return jnp.swapaxes(qt, -1, -2)
        chol = [[None] * r for _ in range(r)]
        for i in range(r):
            for j in range(i + 1):
                acc = gram[..., i, j] - sum(chol[i][k] * chol[j][k] for k in range(j))
                chol[i][j] = jnp.sqrt(acc) if i == j else acc / chol[j][j]
        cols = []
        for i in range(r):   # forward substitution, column by column
            c = a[..., i] - sum(chol[i][j][..., None] * cols[j] for j in range(i))
            cols.append(c / chol[i][i][..., None])
        return jnp.stack(cols, axis=-1)

    return one_round(one_round(y))


def _finish(state: Array, k_rows: Array) -> tuple[Array, Array]:
    # U = S^T K^T, clipped so that the fp16 factors stay finite on huge states; the residual
    # is computed from the rounded factors, so the split stays exact whatever the clipping.
    u_rows = jnp.einsum("...kv,...rk->...rv", state, k_rows, precision=HI)
    u_rows = jnp.clip(u_rows, -FP16_MAX, FP16_MAX)
    return k_rows.astype(jnp.float16), u_rows.astype(jnp.float16)


def fit_svd(state: Array, rank: int) -> tuple[Array, Array]:
    """Exact rank-``rank`` fit. state ``[.., dk, dv]`` -> ``(K [.., r, dk], U [.., r, dv])`` fp16."""
    s = state.astype(jnp.float32)
    left, _, _ = jnp.linalg.svd(s, full_matrices=False)
    k_rows = jnp.swapaxes(left[..., :, :rank], -1, -2)
    return _finish(s, k_rows)


def fit_subspace(
    state: Array, rank: int, *, iters: int = 1, start: Array | None = None, seed: int = 0,
    first_z: Array | None = None,
) -> tuple[Array, Array]:
    """Subspace-iteration fit with CholeskyQR2.

    state ``[.., dk, dv]``; start ``[.., r, dk]`` (warm start, e.g. the previous ``K``) or
    ``None`` for the seeded Gaussian start. ``first_z [.., r, dv]``: the first round's
    ``(S^T Q_0)^T`` when the caller already has it (the split flush kernel computes it while the
    state is on chip); the start is then unused. Returns ``(K [.., r, dk], U [.., r, dv])`` fp16.
    """
    s = state.astype(jnp.float32)
    return _finish(s, subspace_basis(s, rank, iters=iters, start=start, seed=seed, first_z=first_z))


def subspace_basis(
    state: Array, rank: int, *, iters: int = 1, start: Array | None = None, seed: int = 0,
    first_z: Array | None = None,
) -> Array:
    """The orthonormal rows ``K [.., r, dk]`` (fp32, before rounding) of ``fit_subspace``, same arguments."""
    s = state.astype(jnp.float32)
    dk = s.shape[-2]
    if first_z is not None:
        q = None
    elif start is None:
        q = jnp.broadcast_to(random_start(dk, rank, seed).T, s.shape[:-2] + (dk, rank))
    else:
        q = jnp.swapaxes(start.astype(jnp.float32), -1, -2)
        # A warm start that lost rank (a zero previous window) is topped up from the seeded start.
        q = q + 1e-3 * random_start(dk, rank, seed).T * (jnp.linalg.norm(q, axis=-2, keepdims=True) == 0)
    for i in range(iters):
        if i == 0 and first_z is not None:
            z = jnp.swapaxes(first_z.astype(jnp.float32), -1, -2)
        else:
            z = jnp.einsum("...kv,...kr->...vr", s, q, precision=HI)   # S^T Q  [.., dv, r]
        q = cholesky_qr2(jnp.einsum("...kv,...vr->...kr", s, z, precision=HI))
    return jnp.swapaxes(q, -1, -2)


def compensator_matrix(k_rows: Array, u_rows: Array) -> Array:
    """``K U^T`` in fp32: ``[.., r, dk], [.., r, dv] -> [.., dk, dv]``."""
    return jnp.einsum("...rk,...rv->...kv", k_rows.astype(jnp.float32), u_rows.astype(jnp.float32), precision=HI)


def smoothing_scales(residual: Array, floor: float = 1e-12) -> Array:
    """Residual smoothing (paper eq. 7): ``c_i = sqrt(mean_j |R_ij|)``, floored. ``[.., dk, dv] -> [.., dk]``."""
    return jnp.maximum(jnp.sqrt(jnp.mean(jnp.abs(residual), axis=-1)), floor)


__all__ = [
    "cholesky_qr2",
    "compensator_matrix",
    "fit_subspace",
    "fit_svd",
    "random_start",
    "smoothing_scales",
    "subspace_basis",
]
