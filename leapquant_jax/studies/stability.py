"""Long decodes on heads with extreme decays: every output and state finite, errors per head.

The heads of ``synthetic.EXTREME_DECAYS`` (alpha from 0, fully decayed, to exactly 1) are
decoded chunk by chunk with a state method and with the exact fp32 recurrence side by side.
A fully decayed head's state after a window is a single outer product, the hardest input for
the Compensator Tokens' fit (a rank-deficient Gram matrix); a head with alpha = 1 never
forgets. The benchmark runs this on the GPU over 10^5 tokens and more; the tests on the CPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ..recurrence import recurrent_scan
from ..synthetic import EXTREME_DECAYS, extreme_decay_sequence

Array = jax.Array


OUT_AXES = (0, 1, 3)     # outputs [B, T, H, dv]: all but the head axis
STATE_AXES = (0, 2, 3)   # states [B, H, dk, dv]


def _head_sq(x: Array, axes: tuple[int, ...]) -> Array:
    """Per-head sum of squares ``[H]`` (finite entries only) over ``axes``."""
    x = x.astype(jnp.float32)
    return jnp.sum(jnp.square(jnp.where(jnp.isfinite(x), x, 0.0)), axis=axes)


@functools.partial(jax.jit, static_argnames=("method", "batch", "tokens", "dk", "dv", "per_channel_decay"))
def _chunk(method, state, exact, key, *, batch, tokens, dk, dv, per_channel_decay):
    x = extreme_decay_sequence(key, batch, tokens, dk=dk, dv=dv, per_channel_decay=per_channel_decay)
    o, state = method.decode(state, **x)
    o_ref, exact = recurrent_scan(exact, **x)
    finite_o = jnp.all(jnp.isfinite(o), axis=OUT_AXES)                               # [H]
    return state, exact, finite_o, _head_sq(o - o_ref, OUT_AXES), _head_sq(o_ref, OUT_AXES)


def extreme_decay_check(method, *, tokens: int, chunk: int = 4096, batch: int = 4, dk: int = 128, dv: int = 128,
                        per_channel_decay: bool = False, seed: int = 0) -> dict:
    """Decodes ``tokens`` tokens of ``extreme_decay_sequence`` with ``method`` and with fp32.

    Returns per head (``EXTREME_DECAYS`` order): ``alpha``, ``finite`` (every output and the
    final state), ``first_nonfinite_chunk`` (index of the first chunk with a non-finite output
    or state, ``None``), ``output_rel_error`` over all tokens and ``state_rel_error`` of the
    final state against the exact recurrence, plus the run's settings.
    """
    if tokens < 1 or chunk < 1 or batch < 1:
        raise ValueError(f"tokens, chunk and batch must be positive, got {tokens}, {chunk}, {batch}")
    h = len(EXTREME_DECAYS)
    state = method.init(batch, h, dk, dv, per_channel_decay=per_channel_decay)
    exact = jnp.zeros((batch, h, dk, dv), jnp.float32)
    key = jax.random.PRNGKey(seed)
    o_err, o_ref = np.zeros(h), np.zeros(h)
    first_bad = [None] * h
    n_chunks = math.ceil(tokens / chunk)
    for c in range(n_chunks):
        n = min(chunk, tokens - c * chunk)
        state, exact, finite_o, e, r = _chunk(method, state, exact, jax.random.fold_in(key, c), batch=batch, tokens=n,
                                              dk=dk, dv=dv, per_channel_decay=per_channel_decay)
        dense = method.to_dense(state)
        finite = np.asarray(finite_o) & np.asarray(jnp.all(jnp.isfinite(dense), axis=STATE_AXES))
        for i in range(h):
            if first_bad[i] is None and not finite[i]:
                first_bad[i] = c
        o_err += np.asarray(e, np.float64)
        o_ref += np.asarray(r, np.float64)
    dense = method.to_dense(state)
    s_err = np.asarray(_head_sq(dense - exact, STATE_AXES), np.float64)
    s_ref = np.asarray(_head_sq(exact, STATE_AXES), np.float64)
    heads = []
    for i, alpha in enumerate(EXTREME_DECAYS):
        heads.append(dict(alpha=alpha, finite=first_bad[i] is None, first_nonfinite_chunk=first_bad[i],
                          output_rel_error=float(np.sqrt(o_err[i] / max(o_ref[i], 1e-300))),
                          state_rel_error=float(np.sqrt(s_err[i] / max(s_ref[i], 1e-300)))))
    return dict(method=method.name, tokens=tokens, chunk=chunk, batch=batch, dk=dk, dv=dv,
                mode="KDA" if per_channel_decay else "GDN", seed=seed, heads=heads,
                all_finite=all(x["finite"] for x in heads))


__all__ = ["extreme_decay_check"]
