"""Kimi-Linear's own small pieces: the KDA forget gates and the sigmoid (``noaux_tc``) router.

Each function is matched to the checkpoint's own code (transformers' ``kimi_linear`` port,
fla's ``naive_kda_gate`` / ``naive_kda_lowerbound_gate``, vLLM's ``fused_kda_gate``) and
computes in float32. The pieces Kimi shares with the other models (plain RMSNorm, the sigmoid
gated RMSNorm, l2norm, the short convolution, the SwiGLU MLP) live in ``models/layers.py``.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from models import layers as L

Array = jax.Array
F32 = jnp.float32


def kda_log_decay(f: Array, *, a_log: Array, dt_bias: Array) -> Array:
    """KDA per-channel log-decay ``g = -exp(A_log[h]) * softplus(f + dt_bias)`` (fla ``naive_kda_gate``).

    f: ``[..., H, dk]`` the forget-gate projection ``f_b(f_a(x))``; a_log ``[H]``; dt_bias
    ``[H, dk]``. Returns ``g [..., H, dk]`` float32; the decay of key channel ``c`` is ``exp(g)``.
    (The HF port writes softplus as ``where(x > 20, x, log(1 + exp(x)))``; both agree to fp32
    rounding.)
    """
    x = f.astype(F32) + dt_bias.astype(F32)
    return -jnp.exp(a_log.astype(F32))[:, None] * jax.nn.softplus(x)


def kda_lower_bound_log_decay(f: Array, *, a_log: Optional[Array], dt_bias: Array, lower_bound: float) -> Array:
    """The bounded KDA gate of newer configs (``gate_lower_bound``, e.g. -5): fla
    ``naive_kda_lowerbound_gate``, ``g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))``,
    so ``g`` lies in ``(lower_bound, 0)``. Without ``A_log``: ``lower_bound * sigmoid(f + dt_bias)``.

    Shapes as in ``kda_log_decay``.
    """
    x = f.astype(F32) + dt_bias.astype(F32)
    if a_log is not None:
        x = jnp.exp(a_log.astype(F32))[:, None] * x
    return lower_bound * jax.nn.sigmoid(x)


def route_sigmoid_grouped(
    router_logits: Array,
    *,
    correction_bias: Array,
    top_k: int,
    num_groups: int,
    top_k_groups: int,
    normalize: bool,
    scaling: float,
    activation: str = "sigmoid",
) -> tuple[Array, Array]:
    """DeepSeek-V3 / Kimi ``noaux_tc`` routing (HF ``KimiLinearTopkRouter``).

    ``scores = sigmoid(logits)``; experts are *chosen* by ``scores + e_score_correction_bias``
    (within the ``top_k_groups`` best groups, a group scored by the sum of its two best biased
    scores), but *weighted* by the unbiased ``scores``, renormalised to sum 1 when ``normalize``
    (denominator ``+ 1e-20``), then multiplied by ``routed_scaling_factor``.

    router_logits ``[N, E]`` float32. Returns ``(weights [N, k] f32, indices [N, k] int32)``.
    """
    logits = router_logits.astype(F32)
    if activation == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    elif activation == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        raise ValueError(f"router activation {activation!r} is not supported (sigmoid or softmax)")
    n, e = scores.shape
    choice = scores + correction_bias.astype(F32)[None, :]
    if num_groups > 1 and top_k_groups < num_groups:
        grouped = choice.reshape(n, num_groups, e // num_groups)
        group_scores = jnp.sum(L.top_k(grouped, min(2, e // num_groups))[0], axis=-1)  # [N, G]
        _, best = L.top_k(group_scores, top_k_groups)
        keep = L.set_rows(jnp.zeros((n, num_groups), bool), best, jnp.ones(best.shape, bool))
        choice = jnp.where(jnp.repeat(keep, e // num_groups, axis=1), choice, -jnp.inf)
    _, idx = L.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scaling, idx.astype(jnp.int32)


__all__ = ["kda_log_decay", "kda_lower_bound_log_decay", "route_sigmoid_grouped"]
