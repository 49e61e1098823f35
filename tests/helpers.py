"""Shared test inputs: realistic heads (L2-normalised keys, decays near 1, outlier channels)."""

import jax
import jax.numpy as jnp
import numpy as np

from leapquant_jax.synthetic import SyntheticSpec, synthetic_batch


def random_inputs(seed, *, batch=2, tokens=64, heads=2, dk=16, dv=16, kda=False, key_heads=None, decay=(0.9, 0.999)):
    """``[B, T, H, ...]`` inputs; ``key_heads`` < heads gives GVA."""
    spec = SyntheticSpec(tokens=tokens, heads=heads, dk=dk, dv=dv, per_channel_decay=kda, decay_range=decay,
                         beta_range=(0.1, 0.9), outlier_keys=min(2, dk), outlier_values=min(2, dv))
    x = synthetic_batch(seed, batch, spec)
    if key_heads is not None:
        x["q"] = x["q"][:, :, :key_heads]
        x["k"] = x["k"][:, :, :key_heads]
    return x


def numpy_reference(q, k, v, g, beta, s0=None):
    """The dense delta rule written out token by token in float64 NumPy (an independent oracle).

    q, k [B, T, Hk, dk]; v [B, T, H, dv]; g [B, T, H] or [B, T, H, dk]; beta [B, T, H].
    """
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    b, t, h, dv = v.shape
    dk = q.shape[-1]
    rep = h // q.shape[2]
    s = np.zeros((b, h, dk, dv)) if s0 is None else np.array(s0, np.float64)
    o = np.zeros((b, t, h, dv))
    for bi in range(b):
        for hi in range(h):
            S = s[bi, hi]
            for ti in range(t):
                kk = k[bi, ti, hi // rep]
                qq = q[bi, ti, hi // rep]
                alpha = np.exp(g[bi, ti, hi])
                S = (alpha[:, None] if np.ndim(alpha) else alpha) * S
                u = beta[bi, ti, hi] * (v[bi, ti, hi] - S.T @ kk)
                S = S + np.outer(kk, u)
                o[bi, ti, hi] = S.T @ qq
            s[bi, hi] = S
    return o, s


def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


__all__ = ["numpy_reference", "random_inputs", "rel", "jax", "jnp"]
