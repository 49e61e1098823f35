"""The dense fp32 recurrence of delta-rule linear attention, in its general form.

One head holds a state ``S [dk, dv]`` (keys index rows, values index columns). A token
brings a log-decay ``g`` (``[]`` scalar for GDN, ``[dk]`` per channel for KDA), a write
vector ``w`` (the key), a read vector ``b``, a value ``v``, a write strength ``beta`` and
a query ``q``. The general update (LeapQuant paper, Appendix A, eq. 8) is

    u_t = beta_t (v_t - S_{t-1}^T b_t)            # the correction, [dv]
    S_t = Diag(exp(g_t)) S_{t-1} + w_t u_t^T      # [dk, dv]
    o_t = S_t^T q_t                               # [dv]

GDN and KDA are the delta rule with ``w = k`` and ``b = exp(g) * k``; plain and gated
linear attention have ``b = 0`` (and ``beta = 1``). A token is then the record
``(g_t, w_t, u_t)``: that is all the windowed recurrence needs to buffer.

Batches lead: states are ``[B, H, dk, dv]``, per-token tensors ``[B, H, ...]`` and
sequences ``[B, T, H, ...]`` (FLA's layout). GVA (more value heads than key heads, as in
Qwen3-Next and Qwen3.5) is written by passing ``q``/``k`` with ``Hk`` heads and
``v``/``beta``/``g`` with ``Hv = n * Hk`` heads: value head ``j`` reads key head ``j // n``.
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

# exp(-1e3) is exactly 0 in fp32; clamping there keeps a fully decayed head finite in
# every dtype that records may be stored in (fp16 overflows to -inf at -65520).
MIN_LOG_DECAY = -1.0e3


@flax.struct.dataclass
class Token:
    """One token of every sequence in a batch, in the general form.

    Fields (``B`` batch, ``H`` value heads):
      q: ``[B, H, dk]`` query (scale already applied).
      w: ``[B, H, dk]`` write vector (the key for GDN/KDA). A LeapQuant stream that stores its
        key records per key head (``LeapQuantState.key_heads``) also takes ``[B, Hk, dk]``,
        ``H % Hk == 0``, value head ``j`` writing ``w`` of head ``j // (H // Hk)``; the other
        methods take ``[B, H, dk]`` only.
      b: ``[B, H, dk]`` read vector (``exp(g) * k`` for the delta rule, zeros for GLA).
      v: ``[B, H, dv]`` value.
      g: ``[B, H]`` (scalar decay) or ``[B, H, dk]`` (per-channel decay), log-decay <= 0.
      beta: ``[B, H]`` write strength.
    """

    q: Array
    w: Array
    b: Array
    v: Array
    g: Array
    beta: Array

    @property
    def per_channel_decay(self) -> bool:
        return self.g.ndim == self.w.ndim


def expand_heads(x: Array, num_heads: int, *, axis: int, name: str = "tensor") -> Array:
    """Repeats key heads for GVA: ``[.., Hk, ..] -> [.., num_heads, ..]`` (repeat_interleave).

    Value head ``j`` reads key head ``j // (num_heads // Hk)``, the mapping of HF
    ``repeat_interleave`` and of FLA's ``i_h = i_hv // (HV // H)``.
    """
    hk = x.shape[axis]
    if hk == num_heads:
        return x
    if hk == 0 or num_heads % hk:
        raise ValueError(
            f"{name} has {hk} heads, which does not divide the {num_heads} value heads (GVA needs Hv % Hk == 0)"
        )
    return jnp.repeat(x, num_heads // hk, axis=axis)


def _check_float(name: str, x: Array) -> None:
    if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {jnp.asarray(x).dtype}")


def delta_rule_token(
    *, q: Array, k: Array, v: Array, g: Array, beta: Array, key_heads: Optional[int] = None
) -> Token:
    """Builds the general-form token of a GDN (``g [B, H]``) or KDA (``g [B, H, dk]``) step.

    Args (keyword-only, so ``g`` and ``beta`` cannot be swapped by position):
      q, k: ``[B, Hk, dk]``; v: ``[B, H, dv]``; g: ``[B, H]`` or ``[B, H, dk]``; beta: ``[B, H]``;
      key_heads: heads of the write vector ``w``: ``None`` (or ``H``) repeats ``k`` to the value
        heads; a multiple of ``Hk`` dividing ``H`` (``Hk`` itself: keys kept once per key head,
        for a state that stores them so) repeats it that far.
    Returns a ``Token`` with ``q`` and ``b = exp(g) * k`` per value head and ``w`` at ``key_heads``.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_float(name, x)
    if v.ndim != 3:
        raise ValueError(f"v must be [B, H, dv], got shape {v.shape}")
    bsz, h, _ = v.shape
    if q.ndim != 3 or k.ndim != 3 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [B, Hk, dk], got {q.shape} and {k.shape}")
    if q.shape[0] != bsz:
        raise ValueError(f"q has batch {q.shape[0]} but v has batch {bsz}")
    w_heads = h if key_heads is None else key_heads
    if key_heads is not None:
        if isinstance(key_heads, bool) or not isinstance(key_heads, (int, np.integer)) or key_heads < 1 \
                or h % key_heads:
            raise ValueError(f"key_heads={key_heads!r} must be a positive integer dividing the {h} value heads")
        if key_heads % k.shape[1]:
            raise ValueError(f"k has {k.shape[1]} heads but the state keeps key records for {key_heads} key heads: "
                             f"pass k with {key_heads} heads (or a number dividing it); keys that differ between "
                             f"value heads cannot share one record (k {tuple(k.shape)}, v {tuple(v.shape)})")
    q = expand_heads(q, h, axis=1, name="q")
    w = expand_heads(k, w_heads, axis=1, name="k")
    k = expand_heads(k, h, axis=1, name="k")
    dk = k.shape[-1]
    if beta.shape != (bsz, h):
        raise ValueError(f"beta must be [B, H] = {(bsz, h)}, got {beta.shape}")
    if g.shape not in ((bsz, h), (bsz, h, dk)):
        raise ValueError(f"g must be [B, H] (GDN) or [B, H, dk] (KDA) = {(bsz, h)} or {(bsz, h, dk)}, got {g.shape}")
    f32 = jnp.float32
    q, k, w, v, g, beta = (x.astype(f32) for x in (q, k, w, v, g, beta))
    g = jnp.maximum(g, MIN_LOG_DECAY)
    alpha = jnp.exp(g)
    b = (alpha[..., None] if g.ndim == 2 else alpha) * k
    return Token(q=q, w=w, b=b, v=v, g=g, beta=beta)


def linear_attention_token(*, q: Array, k: Array, v: Array, g: Optional[Array] = None) -> Token:
    """General-form token for (gated) linear attention: no delta rule (``b = 0``, ``beta = 1``).

    q, k: ``[B, Hk, dk]``; v: ``[B, H, dv]``; g: ``None`` (no decay), ``[B, H]`` or ``[B, H, dk]``.
    """
    bsz, h, _ = v.shape
    q = expand_heads(q, h, axis=1, name="q").astype(jnp.float32)
    k = expand_heads(k, h, axis=1, name="k").astype(jnp.float32)
    g = jnp.zeros((bsz, h), jnp.float32) if g is None else jnp.maximum(g.astype(jnp.float32), MIN_LOG_DECAY)
    return Token(q=q, w=k, b=jnp.zeros_like(k), v=v.astype(jnp.float32), g=g, beta=jnp.ones((bsz, h), jnp.float32))


def decay_rows(g: Array, dk: int) -> Array:
    """``exp(g)`` broadcast over key rows: ``[B, H] or [B, H, dk] -> [B, H, dk]``."""
    a = jnp.exp(g)
    return jnp.broadcast_to(a[..., None], a.shape + (dk,)) if a.ndim == 2 else a


def read_state(state: Array, x: Array) -> Array:
    """``S^T x`` for every head: state ``[B, H, dk, dv]``, x ``[B, H, dk]`` -> ``[B, H, dv]``."""
    return jnp.einsum("bhkv,bhk->bhv", state, x, precision=jax.lax.Precision.HIGHEST)


def recurrent_step_general(state: Array, token: Token) -> tuple[Array, Array]:
    """One dense fp32 step of the general recurrence.

    state: ``[B, H, dk, dv]`` float32. Returns ``(o [B, H, dv], new_state [B, H, dk, dv])``.
    """
    dk = state.shape[-2]
    u = token.beta[..., None] * (token.v - read_state(state, token.b))
    alpha = decay_rows(token.g, dk)
    new = alpha[..., None] * state + token.w[..., :, None] * u[..., None, :]
    return read_state(new, token.q), new


def recurrent_step(
    state: Array, *, q: Array, k: Array, v: Array, g: Array, beta: Array
) -> tuple[Array, Array]:
    """One dense fp32 GDN/KDA decode step.

    state ``[B, H, dk, dv]``; q, k ``[B, Hk, dk]``; v ``[B, H, dv]``; g ``[B, H]`` or
    ``[B, H, dk]``; beta ``[B, H]``. Returns ``(o [B, H, dv], new_state)``.
    """
    return recurrent_step_general(state.astype(jnp.float32), delta_rule_token(q=q, k=k, v=v, g=g, beta=beta))


def check_sequence(*, q: Array, k: Array, v: Array, g: Array, beta: Array) -> tuple[int, int, int]:
    """Validates ``[B, T, H, ...]`` inputs and returns ``(B, T, H)`` (``H`` = value heads)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_float(name, x)
    if q.ndim != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [B, T, Hk, dk], got {q.shape} and {k.shape}")
    bsz, t = q.shape[:2]
    if v.ndim != 4 or v.shape[:2] != (bsz, t):
        raise ValueError(f"v must be [B, T, H, dv] with B, T = {(bsz, t)} as in q and k, got {v.shape}")
    h = v.shape[2]
    if beta.shape != (bsz, t, h):
        raise ValueError(f"beta must be [B, T, H] = {(bsz, t, h)}, got {beta.shape}")
    if g.shape not in ((bsz, t, h), (bsz, t, h, q.shape[-1])):
        raise ValueError(
            f"g must be [B, T, H] (GDN) or [B, T, H, dk] (KDA) = {(bsz, t, h)} or {(bsz, t, h, q.shape[-1])}, got {g.shape}"
        )
    return bsz, t, h


def check_lengths(lengths, bsz: int, t: int) -> None:
    """Raises ``ValueError`` unless ``lengths`` is integer ``[B]`` with values in ``[0, T]``
    (the values are checked only when known, i.e. not traced under ``jit``)."""
    arr = jnp.asarray(lengths)
    if arr.shape != (bsz,) or not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"lengths must be integers [B] = ({bsz},), got {arr.dtype} {arr.shape}")
    try:
        values = np.asarray(lengths)
    except jax.errors.TracerArrayConversionError:
        return
    if values.size and (values.min() < 0 or values.max() > t):
        raise ValueError(f"lengths must lie in [0, T] = [0, {t}], got {values.tolist()}")


def time_major(x: Array) -> Array:
    """``[B, T, ...] -> [T, B, ...]`` for ``lax.scan``."""
    return jnp.moveaxis(x, 1, 0)


def recurrent_scan(
    state: Optional[Array], *, q: Array, k: Array, v: Array, g: Array, beta: Array
) -> tuple[Array, Array]:
    """The dense fp32 GDN/KDA recurrence over a sequence, as a ``lax.scan``.

    state: ``[B, H, dk, dv]`` or ``None`` (zeros); q, k ``[B, T, Hk, dk]``; v ``[B, T, H, dv]``;
    g ``[B, T, H]`` or ``[B, T, H, dk]``; beta ``[B, T, H]``.
    Returns ``(o [B, T, H, dv], final_state [B, H, dk, dv])``.
    """
    bsz, _, h = check_sequence(q=q, k=k, v=v, g=g, beta=beta)
    if state is None:
        state = jnp.zeros((bsz, h, q.shape[-1], v.shape[-1]), jnp.float32)
    elif state.shape != (bsz, h, q.shape[-1], v.shape[-1]):
        raise ValueError(f"initial state must be [B, H, dk, dv] = {(bsz, h, q.shape[-1], v.shape[-1])}, got {state.shape}")

    def body(s, xs):
        o, s = recurrent_step(s, **dict(zip(("q", "k", "v", "g", "beta"), xs)))
        return s, o

    xs = tuple(time_major(x) for x in (q, k, v, g, beta))
    state, o = jax.lax.scan(body, state.astype(jnp.float32), xs)
    return time_major(o), state


__all__ = [
    "MIN_LOG_DECAY",
    "Token",
    "check_sequence",
    "decay_rows",
    "delta_rule_token",
    "expand_heads",
    "linear_attention_token",
    "read_state",
    "recurrent_scan",
    "recurrent_step",
    "recurrent_step_general",
    "time_major",
]
