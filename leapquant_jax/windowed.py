"""The windowed recurrence (paper §3.2-3.4): the pure-JAX reference of the LeapQuant step and flush.

Within a window the quantized boundary state ``S0`` stays fixed and every token only appends
its record ``(g_j, k_j, u_j)``. With ``G_l`` the running sum of log-decays over the first
``l`` records, the read of the state after ``l`` records is (eq. 10)

    S_l^T x = S0^T (e^{G_l} * x) + sum_{j<=l} u_j (k_j^T (e^{G_l - G_j} * x))

and ``S0^T y = B (Z^T/qmax) (C y) + U (K y)`` (B.3): column scales ``B``, codes ``Z``,
smoothing ``C``, Compensator Tokens ``K, U``. Decays stay in log space; no cumulative
product is ever divided by, so a fully decayed head reads zeros, not NaN.

After ``p`` records the window *flushes*: ``S_p`` is materialised in fp32, Compensator
Tokens are fitted, the residual smoothed and quantized into the next checkpoint.

The functions here are written for ``[B, H, ...]`` batches and are the oracle the Pallas
kernels in ``pallas_kernels/`` are tested against (same signatures). With GVA the buffer keeps
one key record per key head (``k [B, Hk, p, dk]``, ``H = n Hk``); the reads repeat them to the
value heads (``expand_heads``: value head ``j`` reads key head ``j // n``), which gives the same
numbers as a buffer holding every value head's copy.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from .compensators import Product, compensator_matrix, fit_subspace, fit_svd, hi_product, smoothing_scales
from .recurrence import Token, decay_rows, expand_heads
from .state import Checkpoint, LeapQuantConfig, LeapQuantState, WindowBuffer, empty_buffer

Array = jax.Array
HI = jax.lax.Precision.HIGHEST

# Least log-decay a record stores. Any window decay that includes it is below -1e4, and exp of
# that is exactly 0 in fp32, as exp(-inf) is: clamping changes no value. It keeps a fully decayed
# head's log-decay (-inf, or beyond fp16's range, which rounds to -inf) finite in the record
# dtype, so that differences G_l - G_j of the window's cumulative decays never meet inf - inf.
RECORD_LOG_DECAY_MIN = -1.0e4


def select_batch(mask: Array, new, old):
    """Per-sequence select over pytrees whose leaves lead with the batch axis ``[B, ...]``."""
    def pick(a, b):
        return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b)

    return jax.tree_util.tree_map(pick, new, old)


# ----------------------------------------------------------------------------- checkpoint


def encode_checkpoint(config: LeapQuantConfig, state: Array, previous_k: Optional[Array] = None, *,
                      product: Product = hi_product) -> Checkpoint:
    """Rounds a dense fp32 state ``[B, H, dk, dv]`` once into a checkpoint.

    Fits ``r`` Compensator Tokens, smooths the residual's key rows and quantizes it with one
    scale per value column. ``previous_k [B, H, r, dk]`` warm-starts the fit when the config
    asks for it; ``product``: the subspace fit's products (``compensators.fit_subspace``).
    """
    s = state.astype(jnp.float32)
    r = config.effective_rank
    if r:
        if config.fit == "svd":
            comp_k, comp_u = fit_svd(s, r)
        else:
            start = previous_k if config.warm_start else None
            comp_k, comp_u = fit_subspace(s, r, iters=config.fit_iters, start=start, seed=config.seed,
                                          product=product)
        residual = s - compensator_matrix(comp_k, comp_u)
    else:
        shape = s.shape[:-2]
        comp_k = jnp.zeros(shape + (0, s.shape[-2]), jnp.float16)
        comp_u = jnp.zeros(shape + (0, s.shape[-1]), jnp.float16)
        residual = s
    smooth = None
    if config.smoothing:
        smooth = smoothing_scales(residual)
        residual = residual / smooth[..., :, None]
    return Checkpoint(residual=config.format.quantize(residual), smooth=smooth, comp_k=comp_k, comp_u=comp_u)


def decode_checkpoint(config: LeapQuantConfig, ckpt: Checkpoint) -> Array:
    """The dense fp32 state ``[B, H, dk, dv]`` a checkpoint stands for: ``C deq(Z) + K^T U``."""
    s = config.format.dequantize(ckpt.residual)
    if ckpt.smooth is not None:
        s = ckpt.smooth[..., :, None] * s
    return s + compensator_matrix(ckpt.comp_k, ckpt.comp_u)


def checkpoint_read(config: LeapQuantConfig, ckpt: Checkpoint, y: Array) -> Array:
    """``S0^T y`` for ``y [B, H, dk]`` -> ``[B, H, dv]`` (reference: dequantize, then read)."""
    return jnp.einsum("bhkv,bhk->bhv", decode_checkpoint(config, ckpt), y, precision=HI)


# ----------------------------------------------------------------------------- window reads


def cumulative_log_decay(buf: WindowBuffer, pos: Array) -> Array:
    """``G_j`` for every slot: ``[B, H, p]`` or ``[B, H, p, dk]`` fp32, records past ``pos`` zeroed."""
    p = buf.g.shape[2]
    live = jnp.arange(p)[None, :] < pos[:, None]                      # [B, p]
    live = live.reshape(live.shape[:1] + (1, p) + (1,) * (buf.g.ndim - 3))
    return jnp.cumsum(jnp.where(live, buf.g.astype(jnp.float32), 0.0), axis=2)


def window_decays(buf: WindowBuffer, pos: Array, dk: int) -> tuple[Array, Array]:
    """Decays of a read after ``l = pos`` records, in log space.

    Returns ``(G_l [B, H, dk], w [B, H, p, dk])``: ``G_l`` the summed log-decay of the
    live records (0 for an empty window) and ``w_j = exp(G_l - G_j)`` for live slots, 0 for
    the rest.
    """
    p = buf.k.shape[2]
    G = cumulative_log_decay(buf, pos)
    G_full = G if G.ndim == 4 else jnp.broadcast_to(G[..., None], G.shape + (dk,))   # [B, H, p, dk]
    idx = jnp.clip(pos - 1, 0, p - 1)
    G_l = jnp.take_along_axis(G_full, idx[:, None, None, None], axis=2)[:, :, 0]     # [B, H, dk]
    G_l = jnp.where((pos > 0)[:, None, None], G_l, 0.0)
    live = (jnp.arange(p)[None, :] < pos[:, None])[:, None, :, None]                 # [B, 1, p, 1]
    # exp of a difference, masked before exp so that dead slots cannot overflow.
    w = jnp.exp(jnp.where(live, G_l[:, :, None, :] - G_full, -jnp.inf))
    return G_l, w


def record_keys(buf: WindowBuffer) -> Array:
    """The records' keys per value head: ``[B, Hk, p, dk]`` repeated to ``[B, H, p, dk]`` fp32."""
    return expand_heads(buf.k.astype(jnp.float32), buf.u.shape[1], axis=1, name="the window buffer's k")


def window_read(config: LeapQuantConfig, ckpt: Checkpoint, buf: WindowBuffer, pos: Array, x: Array) -> Array:
    """``S_l^T x`` after ``l = pos`` records (eq. 10): ``x [B, H, dk]`` -> ``[B, H, dv]``."""
    G_l, w = window_decays(buf, pos, x.shape[-1])
    out = checkpoint_read(config, ckpt, jnp.exp(G_l) * x)
    coef = jnp.einsum("bhpk,bhpk,bhk->bhp", record_keys(buf), w, x, precision=HI)
    return out + jnp.einsum("bhp,bhpv->bhv", coef, buf.u.astype(jnp.float32), precision=HI)


def append_record(buf: WindowBuffer, pos: Array, *, k: Array, u: Array, g: Array) -> WindowBuffer:
    """Writes one record per sequence at slot ``pos [B]``: k ``[B, Hk, dk]`` (the buffer's key
    heads), u ``[B, H, dv]``, g ``[B, H(, dk)]``.

    The log-decay is stored clamped at ``RECORD_LOG_DECAY_MIN`` (see there).
    """
    p = buf.k.shape[2]
    g = jnp.maximum(g, RECORD_LOG_DECAY_MIN)
    hot = jnp.arange(p)[None, :] == pos[:, None]                       # [B, p]

    def put(slots, x):
        m = hot.reshape(hot.shape[:1] + (1, p) + (1,) * (slots.ndim - 3))
        return jnp.where(m, x[:, :, None].astype(slots.dtype), slots)

    return WindowBuffer(k=put(buf.k, k), u=put(buf.u, u), g=put(buf.g, g))


def match_key_heads(token: Token, key_heads: int) -> Token:
    """``token`` with its write vector at the ``key_heads`` heads a window buffer stores.

    ``token.w`` comes per stored key head (``[B, key_heads, dk]``, kept as it is) or with fewer
    heads dividing ``key_heads`` (repeated up to them by ``expand_heads``; a buffer without GVA
    stores every value head's copy). Raises ``ValueError`` for any other head count: keys that
    differ between value heads cannot share one record.
    """
    hw = token.w.shape[1]
    if hw == key_heads:
        return token
    if hw > key_heads or key_heads % hw:
        raise ValueError(f"token.w has {hw} key heads but the window buffer stores key records for {key_heads} "
                         f"key heads: pass k with {key_heads} heads (or a number dividing it), one per stored key "
                         "head; keys that differ between value heads cannot share one record")
    return token.replace(w=expand_heads(token.w, key_heads, axis=1, name="token.w"))


# ----------------------------------------------------------------------------- step / flush


def step_reference(config: LeapQuantConfig, state: LeapQuantState, token: Token) -> tuple[Array, LeapQuantState]:
    """One decode step inside a window, no flush: computes ``u``, reads ``o``, appends the record.

    Both reads are at ``l = pos`` records: ``u = beta (v - S_l^T b)`` and, since
    ``S_{l+1} = Diag(alpha) S_l + k u^T``, ``o = S_l^T (alpha q) + u (k . q)``. The token's own
    term is exact fp32; its record is rounded to the record dtype only for later tokens.

    state: ``LeapQuantState`` with ``pos < p`` for every sequence; token: general-form
    ``Token`` (``[B, H, ...]``; ``w`` may carry the buffer's ``Hk`` key heads, ``match_key_heads``).
    Returns ``(o [B, H, dv] fp32, state with pos + 1)``.
    """
    ckpt, buf, pos = state.checkpoint, state.buffer, state.pos
    token = match_key_heads(token, state.key_heads)
    w = expand_heads(token.w, token.v.shape[1], axis=1, name="token.w")
    alpha = decay_rows(token.g, w.shape[-1])
    u = token.beta[..., None] * (token.v - window_read(config, ckpt, buf, pos, token.b))
    own = jnp.sum(w * token.q, axis=-1, keepdims=True)
    o = window_read(config, ckpt, buf, pos, alpha * token.q) + u * own
    buf = append_record(buf, pos, k=token.w, u=u, g=token.g)
    return o, LeapQuantState(checkpoint=ckpt, buffer=buf, pos=pos + 1)


def reconstruct_reference(config: LeapQuantConfig, state: LeapQuantState) -> Array:
    """The dense fp32 state ``[B, H, dk, dv]`` after ``pos`` records (eq. 7 at ``l = pos``)."""
    ckpt, buf = state.checkpoint, state.buffer
    G_l, w = window_decays(buf, state.pos, buf.k.shape[-1])
    records = jnp.einsum("bhpk,bhpv->bhkv", w * record_keys(buf), buf.u.astype(jnp.float32), precision=HI)
    return jnp.exp(G_l)[..., None] * decode_checkpoint(config, ckpt) + records


def flush_reference(config: LeapQuantConfig, state: LeapQuantState) -> LeapQuantState:
    """Flushes every sequence: reconstruct ``S_pos`` in fp32, refit, smooth, quantize, clear the buffer."""
    dense = reconstruct_reference(config, state)
    ckpt = encode_checkpoint(config, dense, state.checkpoint.comp_k)
    b, h, dk, dv = state.shape
    buf = empty_buffer(config, b, h, dk, dv, state.per_channel_decay, key_heads=state.key_heads)
    return LeapQuantState(checkpoint=ckpt, buffer=buf, pos=jnp.zeros_like(state.pos))


def maybe_flush(config: LeapQuantConfig, state: LeapQuantState) -> LeapQuantState:
    """Flushes the sequences whose window is full (``pos == p``); the rest are untouched."""
    full = state.pos >= config.window
    return jax.lax.cond(
        jnp.any(full),
        lambda s: select_batch(full, flush_reference(config, s), s),
        lambda s: s,
        state,
    )


def init_state(config: LeapQuantConfig, batch: int, heads: int, dk: int, dv: int, per_channel_decay: bool = False,
               *, key_heads: Optional[int] = None) -> LeapQuantState:
    """An all-zero live stream for ``[batch, heads]`` heads of ``dk x dv``, its key records kept
    for ``key_heads`` key heads (dividing ``heads``; ``None`` means ``heads``)."""
    # opaque zeros: under jit, XLA would otherwise fold their checkpoint's encoding at compile time
    zero = jax.lax.optimization_barrier(jnp.zeros((batch, heads, dk, dv), jnp.float32))
    return from_dense(config, zero, per_channel_decay=per_channel_decay, key_heads=key_heads)


def from_dense(config: LeapQuantConfig, state: Array, *, per_channel_decay: bool = False,
               key_heads: Optional[int] = None) -> LeapQuantState:
    """Rounds a dense fp32 state ``[B, H, dk, dv]`` once into a live stream with an empty window
    (key records for ``key_heads`` key heads, ``None`` meaning ``H``)."""
    if state.ndim != 4:
        raise ValueError(f"state must be [B, H, dk, dv], got shape {state.shape}")
    b, h, dk, dv = state.shape
    buf = empty_buffer(config, b, h, dk, dv, per_channel_decay, key_heads=key_heads)
    ckpt = encode_checkpoint(config, state)
    return LeapQuantState(
        checkpoint=ckpt,
        buffer=buf,
        pos=jnp.zeros((b,), jnp.int32),
    )


__all__ = [
    "RECORD_LOG_DECAY_MIN",
    "append_record",
    "checkpoint_read",
    "cumulative_log_decay",
    "decode_checkpoint",
    "encode_checkpoint",
    "flush_reference",
    "from_dense",
    "init_state",
    "match_key_heads",
    "maybe_flush",
    "reconstruct_reference",
    "record_keys",
    "select_batch",
    "step_reference",
    "window_decays",
    "window_read",
]
