"""Decode inputs for the kernel benchmarks and the kernel tests alike, and their error measure.

Needs only JAX and the core (no torch, triton or GPU), so the CPU test suite imports it too.
Shapes: sequences ``[B, T, H, ...]``, dense states ``[B, H, dk, dv]``, tokens ``[B, H, ...]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from leapquant_jax.recurrence import delta_rule_token


def random_sequence(key, bsz, t, h, dk, dv, kda, *, log_decay=None):
    """Realistic decode inputs ``[B, T, H, ...]``: L2-normalised keys with three outlier channels
    (x6 before normalising), queries likewise carrying ``1/sqrt(dk)``, values standard normal,
    log-decays ``-softplus(N(0, 1) - 4)`` (about -0.02, so alpha near 1) or all ``log_decay``
    where given, ``beta = sigmoid(N(0, 1))``. KDA (``kda``) takes ``g [B, T, H, dk]``."""
    ks = jax.random.split(key, 6)
    chan = jnp.ones((dk,)).at[jnp.array([3, 17, dk - 5])].set(6.0)               # outlier channels
    k = jax.random.normal(ks[0], (bsz, t, h, dk)) * chan
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    q = jax.random.normal(ks[1], (bsz, t, h, dk)) * chan
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True) / np.sqrt(dk)
    v = jax.random.normal(ks[2], (bsz, t, h, dv))
    gshape = (bsz, t, h, dk) if kda else (bsz, t, h)
    if log_decay is None:
        g = -jax.nn.softplus(jax.random.normal(ks[3], gshape) - 4.0)
    else:
        g = jnp.full(gshape, log_decay, jnp.float32)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (bsz, t, h)))
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def random_state(key, bsz, h, dk, dv):
    """A dense fp32 state ``[B, H, dk, dv]`` with the scale of a decoded one (0.3 N(0, 1)) and
    three outlier value columns (x5)."""
    s = jax.random.normal(key, (bsz, h, dk, dv)) * 0.3
    return s.at[..., :3].multiply(5.0)


def token_at(seq, t, key_heads=None):
    """Token ``t`` of ``seq`` as a ``Token`` of ``[B, H, ...]`` fields; with ``key_heads`` (GVA),
    q and k cut to that many heads and the key kept per key head, as a stream storing its key
    records once per key head takes it."""
    x = {n: v[:, t] for n, v in seq.items()}
    if key_heads is not None:
        x["q"], x["k"] = x["q"][:, :key_heads], x["k"][:, :key_heads]
    return delta_rule_token(**x, key_heads=key_heads)


def window_tokens(bsz, h, dk, dv, kda, p, seed=0):
    """The ``p`` tokens of one window of ``random_sequence``, for the timed loops."""
    seq = random_sequence(jax.random.PRNGKey(seed), bsz, p, h, dk, dv, kda)
    return [token_at(seq, i) for i in range(p)]


def copy_tree(tree):
    """A copy of every leaf (the kernels donate their state)."""
    return jax.tree_util.tree_map(jnp.copy, tree)


def rel(a, b) -> float:
    """``||a - b|| / ||b||`` in float64 (the error every check reports; 0-safe)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
