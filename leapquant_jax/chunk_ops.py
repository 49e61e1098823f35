"""The chunked delta rule's two kernel-backed ops in pure JAX: the serial scan over chunks and KDA's
decayed pair scores (the references ``pallas_kernels.chunk_scan`` and ``pallas_kernels.kda_scores``
are checked against, with the same contract).

* ``scan_chunks(state, w, uv, k_end, decay, q_start, p)``: per chunk ``n``,
  ``U_n = uv_n - w_n S_n``, ``o_n = q_n S_n + p_n U_n``, ``S_{n+1} = Diag(decay_n) S_n + k_end_n^T U_n``;
  chunks lead, ``state [..., dk, dv]``.
* ``pair_scores_kda(q, k, G)``: ``sum_c [k_ic, q_ic] k_jc e^{G_ic - G_jc}`` for ``j <= i``, 0
  above, from the chunk-relative cumulative log-decay ``G`` (``kda_cumulative``).

Numerics: every exponent is ``<= 0`` and masked before ``exp`` (``masked_exp``): neither a value
nor a gradient can overflow, and no product of decays is divided by. Pairs inside a sub-chunk of
``SUB_CHUNK`` tokens are reduced elementwise (fp32 sums); pairs across sub-chunks factor through
the sub-chunk boundary into two factors ``<= 1`` and go through a matmul at ``precision``.

A leaf module: it imports only JAX, so that the kernels can take this contract from it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
HI = jax.lax.Precision.HIGHEST

# Tokens per sub-chunk of KDA's pair scores: 16, a Triton dot's least size, so the kernel's
# diagonal blocks are whole tiles, and short enough that the elementwise part stays small.
SUB_CHUNK = 16


def masked_exp(x: Array, mask: Array) -> Array:
    """``exp(x)`` where ``mask``, 0 elsewhere; the argument is masked first, so a large positive
    ``x`` outside the mask overflows neither the value nor the gradient."""
    return jnp.exp(jnp.where(mask, x, -jnp.inf))


def kda_cumulative(g: Array) -> Array:
    """KDA: the chunk-relative cumulative log-decay ``G [..., C, dk]`` (inclusive) of per-token
    log-decays ``g [..., C, dk]``, summed inside sub-chunks of ``SUB_CHUNK`` tokens and then
    across them (shorter sums than one running sum over the chunk)."""
    *lead, c, dk = g.shape
    s = min(SUB_CHUNK, c)
    L = jnp.cumsum(g.reshape(tuple(lead) + (c // s, s, dk)), axis=-2)          # [.., n, s, dk] local inclusive
    ctot = jnp.cumsum(L[..., -1, :], axis=-2)                                  # through the end of each sub-chunk
    start = jnp.concatenate([jnp.zeros_like(ctot[..., :1, :]), ctot[..., :-1, :]], axis=-2)
    return (start[..., :, None, :] + L).reshape(g.shape)


def pair_scores_kda(q: Array, k: Array, G: Array, precision=HI) -> Array:
    """KDA: ``sum_c [k_ic, q_ic] k_jc e^{G_ic - G_jc}`` for ``j <= i``, 0 above.

    q, k ``[..., C, dk]``; G ``[..., C, dk]`` (``kda_cumulative``). Returns ``[..., 2, C, C]``
    (``k k^T`` then ``q k^T``, decayed).

    With sub-chunks of ``s`` tokens and ``S_a`` the cumulative log-decay at the last token
    before sub-chunk ``a``: for ``i`` in ``a`` and ``j`` before it, ``G_i - G_j = (G_i - S_a) +
    (S_a - G_j)``, two non-positive terms, so the pair is a matmul of ``x_i e^{G_i - S_a}`` by
    ``k_j e^{S_a - G_j}``, factors ``<= 1``. Pairs inside one sub-chunk use ``e^{G_i - G_j}``
    directly: an elementwise product reduced over ``dk``.
    """
    *lead, c, dk = k.shape
    lead = tuple(lead)
    s = min(SUB_CHUNK, c)
    n = c // s
    rows = jnp.stack([k, q], axis=-3)                                         # [.., 2, C, dk]
    Gs, ks = G.reshape(lead + (n, s, dk)), k.reshape(lead + (n, s, dk))
    rows_s = rows.reshape(lead + (2, n, s, dk))

    # within a sub-chunk
    causal = jnp.tril(jnp.ones((s, s), bool))[..., None]
    decay = masked_exp(Gs[..., :, None, :] - Gs[..., None, :, :], causal)              # [.., n, s, s, dk]
    inner = jnp.sum(rows_s[..., :, None, :] * (ks[..., None, :, :] * decay)[..., None, :, :, :, :], axis=-1)
    # block-diagonal placement [.., 2, n, s, n, s]: elementwise, so no matmul rounds it
    scores = (inner[..., :, :, None, :] * jnp.eye(n, dtype=k.dtype)[:, None, :, None]).reshape(lead + (2, n, s, c))
    if n > 1:
        # across sub-chunks: sub-chunk a >= 1 (rows) reads the tokens before its start (columns)
        S = G[..., s - 1:c - 1:s, :]                                                       # [.., n-1, dk]
        before = (jnp.arange(c)[None, :] < (jnp.arange(1, n) * s)[:, None])[..., None]     # [n-1, C, 1]
        right = jnp.where(before, k[..., None, :, :] * masked_exp(S[..., :, None, :] - G[..., None, :, :], before),
                          0.0)                                                             # [.., n-1, C, dk]
        left = rows_s[..., 1:, :, :] * jnp.exp(Gs[..., 1:, :, :] - S[..., :, None, :])[..., None, :, :, :]
        cross = jnp.einsum("...xaic,...ajc->...xaij", left, right, precision=precision)    # [.., 2, n-1, s, C]
        scores = scores + jnp.concatenate([jnp.zeros_like(scores[..., :1, :, :]), cross], axis=-3)
    return scores.reshape(lead + (2, c, c))


def scan_chunks(state: Array, w, uv, k_end, decay, q_start, p, *, precision=HI) -> tuple[Array, Array]:
    """The chunks' serial part, chunk after chunk: ``U_n = uv_n - w_n S_n``,
    ``o_n = q_n S_n + p_n U_n``, ``S_{n+1} = Diag(decay_n) S_n + k_end_n^T U_n``.

    state ``[..., dk, dv]``; per chunk (chunks first): w, k_end, q_start ``[N, ..., C, dk]``,
    uv ``[N, ..., C, dv]``, decay ``[N, ..., dk]``, p ``[N, ..., C, C]``. Returns
    ``(o [N, ..., C, dv], S_N [..., dk, dv])``. Four matmuls of at most ``C x dk x dv`` per chunk,
    and nothing of size ``dk x dk`` is ever formed: the form with the least memory traffic when
    many heads and rows share each step.
    """
    def step(s, xs):
        w_n, uv_n, k_n, d_n, q_n, p_n = xs
        u = uv_n - jnp.matmul(w_n, s, precision=precision)
        o = jnp.matmul(q_n, s, precision=precision) + jnp.matmul(p_n, u, precision=precision)
        s_next = d_n[..., :, None] * s + jnp.einsum("...ck,...cv->...kv", k_n, u, precision=precision)
        return s_next, o

    state, o = jax.lax.scan(step, state, (w, uv, k_end, decay, q_start, p), unroll=min(2, w.shape[0]))
    return o, state


__all__ = ["SUB_CHUNK", "kda_cumulative", "masked_exp", "pair_scores_kda", "scan_chunks"]
