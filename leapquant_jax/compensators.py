"""Compensator Tokens: the rank-``r`` dominant part of a state, kept in fp16 (paper eq. 5-6).

``S [.., dk, dv] ~ K U^T + R`` with ``K [.., r, dk]`` orthonormal rows and ``U = S^T K^T``
``[.., r, dv]`` (stored row-major as ``r`` records, the layout of the window buffer).
Two fits with one signature:

* ``fit_svd``: exact truncated SVD, the reference.
* ``fit_subspace``: subspace iteration ``Y = S (S^T Q)`` orthonormalised by CholeskyQR2,
  from a fixed seeded Gaussian start or warm-started from the previous window's ``K``.

What a fit misses lands in the residual, which is quantized anyway, so an approximate fit
costs accuracy only through the residual's range, never correctness. The fit's three products
(``S^T Q``, ``S Z``, ``S^T K^T``) go through ``product``, fp32 at full precision by default
(``hi_product``); a study can pass reduced-precision operands (``bench.fit_precision``).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

Array = jax.Array
HI = jax.lax.Precision.HIGHEST
FP16_MAX = 65504.0


def hi_product(eq: str, a: Array, b: Array) -> Array:
    """``einsum(eq, a, b)`` in fp32 at full precision: the fit's products unless a caller passes its own."""
    return jnp.einsum(eq, a, b, precision=HI)


Product = Callable[[str, Array, Array], Array]


def random_start(dk: int, rank: int, seed: int = 0) -> Array:
    """The fixed Gaussian start ``[rank, dk]`` of subspace iteration (same for every head)."""
    return jax.random.normal(jax.random.PRNGKey(seed), (rank, dk), jnp.float32)


UNROLLED_RANK = 8   # up to this rank the r x r Cholesky factor is unrolled into elementwise ops
CHOLESKY_SHIFT = 1e-6   # diagonal shift of the Gram matrix, relative to its mean diagonal entry
CHOLESKY_KEEP = 1e-5    # a column is kept when its part orthogonal to the columns before it holds more
                        # than this fraction of its squared norm (far above rounding, ~1e-7)
NORMAL_TINY = 1e-30     # magnitudes below this count as zero: well inside fp32's normal range, so
                        # GPUs that flush denormals to zero and CPUs that keep them agree
WARM_START_TOPUP = 1e-3  # weight of the seeded start added to a warm-start row that is all zero
SMOOTH_FLOOR = 1e-12    # least smoothing scale c_i (an all-zero residual row)


def gram_shift(trace: Array, rank: int) -> Array:
    """The diagonal shift CholeskyQR2 adds to a ``rank x rank`` Gram matrix of trace ``trace`` (any shape)."""
    return CHOLESKY_SHIFT * trace / rank + NORMAL_TINY


def unrolled_cholesky(gram, shift, sqrt=jnp.sqrt):
    """Lower Cholesky factor of ``gram + shift I`` from elementwise entries, unrolled.

    gram: nested lists, ``gram[i][j]`` for ``j <= i`` (arrays of any common shape, or scalars
    inside a kernel); shift: the same shape; ``sqrt``: the square root (a kernel backend without
    one passes its own). Returns ``(chol, keep)``: ``chol[i][j]`` for ``j <= i``, and ``keep[i]``
    (bool) where column ``i`` brings a direction of its own.

    In exact arithmetic every pivot (a Schur complement of ``G + shift I``, ``G`` positive
    semi-definite) is at least ``shift``, and the part ``pivot - shift`` is the squared norm of
    column ``i`` orthogonal to the columns before it. A nearly rank-deficient ``G`` (a fully
    decayed head's state is one outer product) loses that margin to rounding, which differs
    between devices (FMA contraction, summation order): a pivot rounded below zero would turn
    the whole state into NaN through ``sqrt``. So pivots are clamped at ``shift``, and a column
    whose own part is not above ``CHOLESKY_KEEP`` of its squared norm (about 0.3% of its
    length: numerically in the span of the columns before it) is marked for dropping (``keep``
    false): its own part is rounding noise, which the triangular solve would otherwise blow up
    into a factor of arbitrary direction and length.
    """
    r = len(gram)
    chol = [[None] * r for _ in range(r)]
    keep = [None] * r
    for i in range(r):
        for j in range(i + 1):
            acc = gram[i][j]
            for k in range(j):
                acc = acc - chol[i][k] * chol[j][k]
            if i == j:
                keep[i] = acc > CHOLESKY_KEEP * gram[i][i]
                chol[i][i] = sqrt(jnp.maximum(acc + shift, shift))
            else:
                chol[i][j] = acc / chol[j][j]
    return chol, keep


def scale_to_unit_max(y: Array) -> Array:
    """``y [.., n, r]`` divided by its largest magnitude (an all-zero ``y`` is left as it is).

    The orthonormal basis does not depend on the scale; dividing first keeps the Gram matrix far
    from fp32 overflow for huge states and the shift floor meaningful for tiny ones.
    """
    m = jnp.max(jnp.abs(y), axis=(-2, -1), keepdims=True)
    return y / jnp.where(m > NORMAL_TINY, m, 1.0)


def cholesky_qr2(y: Array) -> Array:
    """Orthonormalises the columns of ``y [.., n, r]`` by two rounds of Cholesky QR.

    A shift proportional to the Gram matrix's trace (``gram_shift``) and pivots clamped at it
    (``unrolled_cholesky``) keep the factorisation finite for a rank-deficient or zero ``y``:
    columns without a direction of their own come out zero (a zero state gives zero columns, a
    rank-one state one unit column), never NaN. For ``r <= UNROLLED_RANK`` the factorisation
    and the triangular solve are unrolled over the ``r (r + 1) / 2`` entries: elementwise ops
    over the batch that XLA fuses, where batched solver calls on thousands of tiny matrices are
    launch- and latency-bound on a GPU. Larger ranks use Householder QR (unconditionally
    stable; a rank-deficient ``y`` gets unit columns in arbitrary spare directions), signed
    like Cholesky QR's (non-negative diagonal of ``R``).
    """
    y = scale_to_unit_max(y)
    r = y.shape[-1]
    if r > UNROLLED_RANK:
        q, rr = jnp.linalg.qr(y)
        sign = jnp.where(jnp.diagonal(rr, axis1=-2, axis2=-1) < 0, -1.0, 1.0)
        return q * sign[..., None, :]

    def one_round(a):
        gram = jnp.einsum("...nr,...ns->...rs", a, a, precision=HI)
        shift = gram_shift(jnp.trace(gram, axis1=-2, axis2=-1), r)
        chol, keep = unrolled_cholesky([[gram[..., i, j] for j in range(i + 1)] for i in range(r)], shift)
        cols = []
        for i in range(r):   # forward substitution, column by column; dropped columns are zero
            c = a[..., i] - sum(chol[i][j][..., None] * cols[j] for j in range(i))
            cols.append(jnp.where(keep[i][..., None], c / chol[i][i][..., None], 0.0))
        return jnp.stack(cols, axis=-1)

    return one_round(one_round(y))


def _finish(state: Array, k_rows: Array, product: Product = hi_product) -> tuple[Array, Array]:
    # U = S^T K^T, clipped so that the fp16 factors stay finite on huge states; the residual
    # is computed from the rounded factors, so the split stays exact whatever the clipping.
    u_rows = product("...kv,...rk->...rv", state, k_rows)
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
    first_z: Array | None = None, first_y: Array | None = None, product: Product = hi_product,
) -> tuple[Array, Array]:
    """Subspace-iteration fit with CholeskyQR2.

    state ``[.., dk, dv]``; start ``[.., r, dk]`` (warm start, e.g. the previous ``K``) or
    ``None`` for the seeded Gaussian start. ``first_z [.., r, dv]``: the first round's
    ``(S^T Q_0)^T``, or ``first_y [.., r, dk]`` its ``(S S^T Q_0)^T``, when the caller already
    has it (the split flush kernel computes it while the state is on chip); the start is then
    unused. ``product(eq, a, b)``: the three products' einsum (``hi_product``). Returns
    ``(K [.., r, dk], U [.., r, dv])`` fp16.
    """
    s = state.astype(jnp.float32)
    k_rows = subspace_basis(s, rank, iters=iters, start=start, seed=seed, first_z=first_z, first_y=first_y,
                            product=product)
    return _finish(s, k_rows, product)


def subspace_basis(
    state: Array, rank: int, *, iters: int = 1, start: Array | None = None, seed: int = 0,
    first_z: Array | None = None, first_y: Array | None = None, product: Product = hi_product,
) -> Array:
    """The orthonormal rows ``K [.., r, dk]`` (fp32, before rounding) of ``fit_subspace``, same arguments."""
    s = state.astype(jnp.float32)
    dk = s.shape[-2]
    if first_z is not None or first_y is not None:
        q = None
    elif start is None:
        q = jnp.broadcast_to(random_start(dk, rank, seed).T, s.shape[:-2] + (dk, rank))
    else:
        q = jnp.swapaxes(start.astype(jnp.float32), -1, -2)
        # A warm start that lost rank (a zero previous window) is topped up from the seeded start.
        q = q + WARM_START_TOPUP * random_start(dk, rank, seed).T * (jnp.linalg.norm(q, axis=-2, keepdims=True) == 0)
    for i in range(iters):
        if i == 0 and first_y is not None:
            y = jnp.swapaxes(first_y.astype(jnp.float32), -1, -2)
        else:
            if i == 0 and first_z is not None:
                z = jnp.swapaxes(first_z.astype(jnp.float32), -1, -2)
            else:
                z = product("...kv,...kr->...vr", s, q)   # S^T Q  [.., dv, r]
            y = product("...kv,...vr->...kr", s, z)       # S S^T Q  [.., dk, r]
        q = cholesky_qr2(y)
    return jnp.swapaxes(q, -1, -2)


def compensator_matrix(k_rows: Array, u_rows: Array) -> Array:
    """``K U^T`` in fp32: ``[.., r, dk], [.., r, dv] -> [.., dk, dv]``."""
    return jnp.einsum("...rk,...rv->...kv", k_rows.astype(jnp.float32), u_rows.astype(jnp.float32), precision=HI)


def smoothing_scales(residual: Array, floor: float = SMOOTH_FLOOR) -> Array:
    """Residual smoothing (paper eq. 7): ``c_i = sqrt(mean_j |R_ij|)``, floored. ``[.., dk, dv] -> [.., dk]``."""
    return jnp.maximum(jnp.sqrt(jnp.mean(jnp.abs(residual), axis=-1)), floor)


__all__ = [
    "CHOLESKY_KEEP",
    "CHOLESKY_SHIFT",
    "NORMAL_TINY",
    "Product",
    "SMOOTH_FLOOR",
    "WARM_START_TOPUP",
    "cholesky_qr2",
    "compensator_matrix",
    "fit_subspace",
    "fit_svd",
    "gram_shift",
    "hi_product",
    "scale_to_unit_max",
    "random_start",
    "smoothing_scales",
    "subspace_basis",
    "unrolled_cholesky",
]
