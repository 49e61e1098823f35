"""Synthetic linear-attention inputs with the statistics that make state quantization hard.

Long memory (decays close to 1), small writes, L2-normalised keys and queries, and a few
outlier key and value channels, the structure the paper's Figure 6 shows in real heads.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class HeadBatchSize:
    """The size of a synthetic head batch: ``tokens`` steps of ``heads`` heads, keys ``dk`` and
    values ``dv`` wide (states ``[heads, dk, dv]``); dk = dv = 128 as in the released models."""

    tokens: int = 4096
    heads: int = 4
    dk: int = 128
    dv: int = 128


@dataclasses.dataclass(frozen=True)
class SyntheticSpec(HeadBatchSize):
    """Size (``HeadBatchSize``) and statistics of a synthetic head batch. Keys and values are drawn
    near a ``subspace``-dimensional subspace because real heads write along few directions, so
    their states are close to low rank."""

    per_channel_decay: bool = False  # KDA-style g [.., dk] instead of GDN's scalar
    decay_range: tuple[float, float] = (0.995, 0.9999)  # per-token decays alpha, drawn uniformly
    beta_range: tuple[float, float] = (0.02, 0.2)  # write strengths, drawn uniformly
    outlier_keys: int = 4  # key channels made outliers
    outlier_values: int = 4  # value channels made outliers
    key_outlier_bias: float = 2.0  # added to the outlier key channels before normalising
    value_outlier_scale: float = 8.0  # factor on the outlier value channels
    subspace: int = 4  # rank of the subspace keys and values lie near; 0: isotropic draws
    noise: float = 0.3  # isotropic noise on top of the subspace draws


def l2_normalize(x: Array, eps: float = 1e-6) -> Array:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (FLA's l2norm)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _near_subspace(key: Array, lead: tuple[int, ...], dim: int, rank: int, noise: float) -> Array:
    """Gaussian vectors ``lead + [dim]`` concentrated near a random ``rank``-dim subspace (per head)."""
    if rank == 0:
        return jax.random.normal(key, lead + (dim,))
    kb, kz, kn = jax.random.split(key, 3)
    basis = jax.random.normal(kb, (lead[-1], rank, dim)) / jnp.sqrt(rank)      # one subspace per head
    z = jax.random.normal(kz, lead + (rank,))
    return jnp.einsum("...hr,hrd->...hd", z, basis) + noise * jax.random.normal(kn, lead + (dim,))


def synthetic_sequence(key: Array, spec: SyntheticSpec) -> dict[str, Array]:
    """One sequence: q, k ``[T, H, dk]``, v ``[T, H, dv]``, beta ``[T, H]``, g ``[T, H]`` or ``[T, H, dk]``."""
    t, h, dk, dv = spec.tokens, spec.heads, spec.dk, spec.dv
    kq, kk, kv, kb, kg = jax.random.split(key, 5)
    # Channels are exchangeable, so evenly spaced outlier channels lose no generality.
    out_k = jnp.arange(spec.outlier_keys) * (dk // max(spec.outlier_keys, 1)) + 1
    out_v = jnp.arange(spec.outlier_values) * (dv // max(spec.outlier_values, 1)) + 2
    bias = jnp.zeros((dk,)).at[out_k].set(spec.key_outlier_bias)
    k = _near_subspace(kk, (t, h), dk, spec.subspace, spec.noise) + bias
    k = l2_normalize(k)
    q = l2_normalize(_near_subspace(kq, (t, h), dk, spec.subspace, spec.noise) + bias) * dk ** -0.5
    vscale = jnp.ones((dv,)).at[out_v].set(spec.value_outlier_scale)
    v = _near_subspace(kv, (t, h), dv, spec.subspace, spec.noise) * vscale
    beta = jax.random.uniform(kb, (t, h), minval=spec.beta_range[0], maxval=spec.beta_range[1])
    gshape = (t, h, dk) if spec.per_channel_decay else (t, h)
    alpha = jax.random.uniform(kg, gshape, minval=spec.decay_range[0], maxval=spec.decay_range[1])
    return dict(q=q, k=k, v=v, beta=beta, g=jnp.log(alpha))


# Per-head decays spanning the hard cases: moderate, long memory, no decay at all (alpha = 1),
# one step from 1 in fp32, and fully decayed (alpha = 0, given as a log-decay of -1e4).
EXTREME_DECAYS = (0.95, 0.999, 0.99999, 1.0 - 1e-7, 1.0, 0.0, 0.9999, 0.99)
FULLY_DECAYED_LOG_DECAY = -1.0e4


def extreme_decay_log_decays() -> np.ndarray:
    """Log-decays ``[len(EXTREME_DECAYS)]`` fp32 of ``EXTREME_DECAYS`` (computed in fp64, so
    ``1 - 1e-7`` keeps its distance from 1; alpha = 0 maps to ``FULLY_DECAYED_LOG_DECAY``)."""
    a = np.asarray(EXTREME_DECAYS, np.float64)
    with np.errstate(divide="ignore"):
        g = np.where(a > 0, np.log(np.where(a > 0, a, 1.0)), FULLY_DECAYED_LOG_DECAY)
    return g.astype(np.float32)


def extreme_decay_sequence(key: Array, batch: int, tokens: int, *, dk: int = 128, dv: int = 128,
                           per_channel_decay: bool = False) -> dict[str, Array]:
    """Decode inputs ``[B, T, H, ...]`` with one head per ``EXTREME_DECAYS`` entry (``H = 8``).

    Keys L2-normalised after scaling three channels by 6 (outliers), queries likewise with
    ``dk**-0.5``, values near a random rank-4 subspace plus 0.3 noise, ``beta = sigmoid(normal)``;
    KDA heads (``per_channel_decay``) take their head's log-decay on every channel.
    """
    h = len(EXTREME_DECAYS)
    kq, kk, kv, kb = jax.random.split(key, 4)
    chan = jnp.ones((dk,)).at[jnp.array([3, dk // 2, dk - 5])].set(6.0)
    k = l2_normalize(jax.random.normal(kk, (batch, tokens, h, dk)) * chan)
    q = l2_normalize(jax.random.normal(kq, (batch, tokens, h, dk)) * chan) * dk ** -0.5
    v = _near_subspace(kv, (batch, tokens, h), dv, 4, 0.3)
    beta = jax.nn.sigmoid(jax.random.normal(kb, (batch, tokens, h)))
    g = jnp.broadcast_to(jnp.asarray(extreme_decay_log_decays()), (batch, tokens, h))
    if per_channel_decay:
        g = jnp.broadcast_to(g[..., None], (batch, tokens, h, dk))
    return dict(q=q, k=k, v=v, g=g, beta=beta)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _batch(key: Array, batch: int, spec: SyntheticSpec) -> dict[str, Array]:
    return jax.vmap(lambda k: synthetic_sequence(k, spec))(jax.random.split(key, batch))


def synthetic_batch(seed: int, batch: int, spec: SyntheticSpec) -> dict[str, Array]:
    """``batch`` independent sequences (vmapped over keys): every tensor gains a leading ``[B]``."""
    return _batch(jax.random.PRNGKey(seed), batch, spec)


__all__ = [
    "EXTREME_DECAYS",
    "FULLY_DECAYED_LOG_DECAY",
    "HeadBatchSize",
    "SyntheticSpec",
    "extreme_decay_log_decays",
    "extreme_decay_sequence",
    "l2_normalize",
    "synthetic_batch",
    "synthetic_sequence",
]
