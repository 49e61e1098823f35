"""Routed SwiGLU experts: the one mixture-of-experts layout and computation every model uses.

Weights ``w1`` (gate), ``w3`` (up) ``[E, D, I]`` and ``w2`` (down) ``[E, I, D]``, stored
input-major so that ``lax.ragged_dot`` reads them as they are. The converters bring each
checkpoint's layout here once, at load (Qwen's per-expert ``gate_proj``/``up_proj``/``down_proj``,
Kimi's ``w1``/``w3``/``w2``, transformers' fused ``gate_up_proj``); the routers stay with their
models.

Many tokens (prefill, large decode batches) run one of two algorithms over the same weights:
``"scan"`` visits the experts one at a time in a ``lax.scan`` over all tokens and masks by the
routing weights (``E / k`` times the arithmetic of the routed pairs, in plain dense matmuls);
``"ragged"`` sorts the (token, expert) pairs by expert and runs one ``lax.ragged_dot`` per
projection (only the routed pairs computed). ``"auto"`` is ``scan``: in ``python -m bench.moe``
it was as fast or faster at every size measured, on a GPU and on the CPU (figures in
docs/performance.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models import layers as L

Array = jax.Array
F32 = jnp.float32


ALGORITHMS = ("auto", "ragged", "scan")


def pick_algorithm(algorithm: str) -> str:
    """``"ragged"`` or ``"scan"`` for ``algorithm`` (``"auto"``: ``scan``, module docstring)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"MoE algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    return "scan" if algorithm == "auto" else algorithm


def routed_experts(x: Array, weights: Array, idx: Array, *, w1: Array, w3: Array, w2: Array,
                   compute: str = L.EXACT, algorithm: str = "auto") -> Array:
    """``sum_j weights[n, j] * expert_{idx[n, j]}(x[n])`` for SwiGLU experts.

    x ``[N, D]``; weights, idx ``[N, k]``; w1, w3 ``[E, D, I]``; w2 ``[E, I, D]``. Few tokens
    (``N k < E``, short decode batches) gather their chosen experts' weights; more tokens run
    ``algorithm`` (module docstring). Returns ``[N, D]`` float32.
    """
    n, k = idx.shape
    e = w1.shape[0]
    algorithm = pick_algorithm(algorithm)
    if n * k < e:
        g1, g3, g2 = (w[idx] for w in (w1, w3, w2))  # [N, k, ...]
        hid = jax.nn.silu(L.einsum("nd,nkdi->nki", x, g1, compute=compute)) * L.einsum(
            "nd,nkdi->nki", x, g3, compute=compute)
        return L.einsum("nki,nkid->nd", hid * weights[..., None], g2, compute=compute)
    if algorithm == "scan":
        dense_w = jnp.zeros((n, e), F32).at[jnp.arange(n)[:, None], idx].set(weights)  # [N, E]

        def one_expert(acc, xs):
            a, b, c, w = xs
            hid = jax.nn.silu(L.einsum("nd,di->ni", x, a, compute=compute)) * L.einsum("nd,di->ni", x, b,
                                                                                          compute=compute)
            return acc + w[:, None] * L.einsum("ni,id->nd", hid, c, compute=compute), None

        out, _ = jax.lax.scan(one_expert, jnp.zeros(x.shape, F32), (w1, w3, w2, dense_w.T))
        return out
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x[token]  # [N*k, D], grouped by expert

    def dot(a, w):
        if compute == L.EXACT:
            return jax.lax.ragged_dot(a.astype(F32), w.astype(F32), sizes, precision=jax.lax.Precision.HIGHEST)
        return jax.lax.ragged_dot(*L.fast_operands(a, w), sizes, preferred_element_type=F32,
                                  precision=jax.lax.Precision.HIGHEST)

    hid = jax.nn.silu(dot(xs, w1)) * dot(xs, w3)
    ys = dot(hid, w2) * weights.reshape(-1)[order][:, None]
    return jnp.zeros(x.shape, F32).at[token].add(ys)


__all__ = ["ALGORITHMS", "pick_algorithm", "routed_experts"]
