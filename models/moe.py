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

Over a device mesh's model axis the experts are split in ``G`` groups of ``E / G``: the weights
``[G, E/G, ...]`` (``group_experts``, at placement), each device computing its own experts' share
of every token and the groups' sums added (one all-reduce), so no device reads another's weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models import layers as L
from models.base import STACKED_SECTIONS

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

    x ``[N, D]``; weights, idx ``[N, k]``; w1, w3 ``[E, D, I]``; w2 ``[E, I, D]``, or grouped
    ``[G, E/G, ...]`` (``group_experts``). Few tokens (``N k < E``, short decode batches) gather
    their chosen experts' weights; more tokens run ``algorithm`` (module docstring; grouped:
    ``scan``). Returns ``[N, D]`` float32.
    """
    n, k = idx.shape
    algorithm = pick_algorithm(algorithm)
    if w1.ndim == 4:
        return _grouped_experts(x, weights, idx, w1=w1, w3=w3, w2=w2, compute=compute, algorithm=algorithm)
    e = w1.shape[0]
    if n * k < e:
        g1, g3, g2 = (w[idx] for w in (w1, w3, w2))  # [N, k, ...]
        hid = jax.nn.silu(L.einsum("nd,nkdi->nki", x, g1, compute=compute)) * L.einsum(
            "nd,nkdi->nki", x, g3, compute=compute)
        return L.einsum("nki,nkid->nd", hid * weights[..., None], g2, compute=compute)
    if algorithm == "scan":
        dense_w = L.set_rows(jnp.zeros((n, e), F32), idx, weights)  # [N, E]

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


def _grouped_experts(x: Array, weights: Array, idx: Array, *, w1: Array, w3: Array, w2: Array, compute: str,
                     algorithm: str) -> Array:
    # ``routed_experts`` over [G, E/G, ...] weights: every group's experts on every token, batched
    # over the groups (the axis a mesh splits), then the groups' sums added.
    n, k = idx.shape
    g, per = w1.shape[:2]
    if n * k < g * per:
        local = idx[None] - per * jnp.arange(g)[:, None, None]              # [G, N, k]
        mine = (local >= 0) & (local < per)
        local = jnp.clip(local, 0, per - 1)
        g1, g3, g2 = (jax.vmap(lambda w, i: w[i])(w, local) for w in (w1, w3, w2))  # [G, N, k, ...]
        hid = jax.nn.silu(L.einsum("nd,gnkdi->gnki", x, g1, compute=compute)) * L.einsum(
            "nd,gnkdi->gnki", x, g3, compute=compute)
        hid = hid * jnp.where(mine, weights[None], 0.0)[..., None]
        return jnp.sum(L.einsum("gnki,gnkid->gnd", hid, g2, compute=compute), axis=0)
    dense_w = L.set_rows(jnp.zeros((n, g * per), F32), idx, weights)
    dense_w = jnp.moveaxis(dense_w.reshape(n, g, per), 0, -1)                # [G, E/G, N]

    def one_expert(acc, j):
        a, b, c = (jax.lax.dynamic_index_in_dim(w, j, axis=1, keepdims=False) for w in (w1, w3, w2))  # [G, ...]
        hid = jax.nn.silu(L.einsum("nd,gdi->gni", x, a, compute=compute)) * L.einsum("nd,gdi->gni", x, b,
                                                                                        compute=compute)
        w = jax.lax.dynamic_index_in_dim(dense_w, j, axis=1, keepdims=False)  # [G, N]
        return acc + w[..., None] * L.einsum("gni,gid->gnd", hid, c, compute=compute), None

    out, _ = jax.lax.scan(one_expert, jnp.zeros((g,) + x.shape, F32), jnp.arange(per))
    return jnp.sum(out, axis=0)


EXPERT_WEIGHTS = ("w1", "w2", "w3")


def group_experts(params, model: int):
    """``params`` with every routed-expert weight (``w1``, ``w2``, ``w3`` under ``moe``) ``[E, ...]``
    reshaped to ``[model, E/model, ...]`` (``routed_experts`` reads either; a scanned section's
    leaves keep their leading repeats axis); the identity for ``model`` 1."""
    if model == 1:
        return params

    def regroup(path, x):
        keys = [str(getattr(key, "key", key)) for key in path]
        if "moe" not in keys or keys[-1] not in EXPERT_WEIGHTS:
            return x
        axis = 1 if keys[0] in STACKED_SECTIONS else 0
        if np.ndim(x) != axis + 3:
            raise ValueError(f"{'.'.join(keys)}: expected [E, ...] expert weights, got shape {np.shape(x)}")
        e = np.shape(x)[axis]
        if e % model:
            raise ValueError(f"a model axis of {model} does not divide the {e} routed experts ({'.'.join(keys)})")
        return x.reshape(x.shape[:axis] + (model, e // model) + x.shape[axis + 1:])

    return jax.tree_util.tree_map_with_path(regroup, params)


# HF's names for a SwiGLU's three projections: (gate, up, down).
HF_SWIGLU_NAMES = ("gate_proj", "up_proj", "down_proj")


def swiglu_specs(prefix: str, inner: int, hidden: int, names: tuple[str, str, str] = HF_SWIGLU_NAMES) -> dict:
    """HF tensor name -> shape of one SwiGLU under ``prefix``: ``{gate}.weight``, ``{up}.weight``
    ``[inner, hidden]`` and ``{down}.weight`` ``[hidden, inner]`` for ``names = (gate, up, down)``."""
    gate, up, down = names
    return {prefix + gate + ".weight": (inner, hidden), prefix + up + ".weight": (inner, hidden),
            prefix + down + ".weight": (hidden, inner)}


def expert_specs(prefix: str, experts: int, inner: int, hidden: int, *, fused: bool,
                 names: tuple[str, str, str] = HF_SWIGLU_NAMES) -> dict:
    """HF tensor name -> shape of ``experts`` routed SwiGLU experts under ``prefix``: transformers'
    fused ``experts.gate_up_proj [E, 2 inner, hidden]`` and ``experts.down_proj [E, hidden, inner]``,
    or per expert ``j`` the ``swiglu_specs`` of ``experts.{j}.`` with ``names``."""
    if fused:
        return {prefix + "experts.gate_up_proj": (experts, 2 * inner, hidden),
                prefix + "experts.down_proj": (experts, hidden, inner)}
    specs = {}
    for j in range(experts):
        specs.update(swiglu_specs(f"{prefix}experts.{j}.", inner, hidden, names))
    return specs


__all__ = ["ALGORITHMS", "EXPERT_WEIGHTS", "HF_SWIGLU_NAMES", "expert_specs", "group_experts", "pick_algorithm",
           "routed_experts", "swiglu_specs"]
