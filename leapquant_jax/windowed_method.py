"""The windowed recurrence as a state method: ``bf16-w``, ``int8-w``, ``leapquant`` and ``fp32-w``
are this class with their ``LeapQuantConfig`` (``methods.make_method`` builds them by name). The
state is a ``LeapQuantState``: a rounded checkpoint plus a window of exact token records,
flushed into the checkpoint when the window fills (``dispatch`` picks the kernels).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from . import dispatch, windowed
from .recurrence import Token
from .runner import Runner, check_dense, check_dims, check_token
from .state import LeapQuantConfig, LeapQuantState

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class WindowedMethod(Runner):
    """The windowed recurrence with a ``LeapQuantConfig`` (``bf16-w``, ``int8-w``, ``leapquant``,
    ``fp32-w``)."""

    config: LeapQuantConfig = LeapQuantConfig()
    label: str = "leapquant"

    @property
    def name(self) -> str:
        return self.label

    @property
    def window(self) -> int:  # type: ignore[override]
        return self.config.window

    def init(self, batch: int, heads: int, dk: int, dv: int, per_channel_decay: bool = False, *,
             key_heads: Optional[int] = None) -> LeapQuantState:
        """An all-zero live stream ``[batch, heads]`` of ``dk x dv`` heads.

        per_channel_decay: lay the window buffer out for KDA's per-channel decays
        (``g [B, H, dk]``). A scalar-decay stream met by KDA tokens is widened on the fly
        (exactly: a scalar decay is the same decay on every channel) by ``step``, ``decode``
        and ``prefill``; inside a ``lax.scan`` of your own, whose carry must keep its shapes,
        pass ``per_channel_decay=True`` for KDA.
        key_heads: GVA's key heads ``Hk`` (dividing ``heads``): the window buffer keeps one key
        record per key head (``k [batch, Hk, p, dk]``) and ``step``/``decode`` then take ``k``
        at ``Hk`` heads. ``None`` keeps one per value head (``Hk = heads``), which takes keys at
        any head count dividing ``heads``.
        """
        check_dims(batch, heads, dk, dv)
        self.config.check_head_size(dk, dv)
        return windowed.init_state(self.config, batch, heads, dk, dv, per_channel_decay, key_heads=key_heads)

    def from_dense(self, state: Array, *, per_channel_decay: bool = False,
                   key_heads: Optional[int] = None) -> LeapQuantState:
        """Rounds ``[B, H, dk, dv]`` fp32 into a checkpoint with an empty window
        (``per_channel_decay`` and ``key_heads`` as in ``init``)."""
        _, _, dk, dv = check_dense(state)
        self.config.check_head_size(dk, dv)
        return windowed.from_dense(self.config, state, per_channel_decay=per_channel_decay, key_heads=key_heads)

    def per_channel_state(self, state: LeapQuantState) -> bool:
        return state.per_channel_decay

    def state_key_heads(self, state: LeapQuantState) -> int:
        """``Hk``, the key heads whose records the window buffer keeps."""
        return state.key_heads

    def with_decay_layout(self, state: LeapQuantState, per_channel: bool) -> LeapQuantState:
        """Widens a scalar-decay window buffer ``g [B, H, p]`` to ``[B, H, p, dk]`` when
        ``per_channel`` (exact); otherwise returns ``state`` unchanged."""
        if not per_channel or state.per_channel_decay:
            return state
        g, dk = state.buffer.g, state.buffer.k.shape[-1]
        return state.replace(buffer=state.buffer.replace(g=jnp.broadcast_to(g[..., None], g.shape + (dk,))))

    def to_dense(self, state: LeapQuantState) -> Array:
        """Reconstructs the represented state ``[B, H, dk, dv]`` fp32 (checkpoint plus records)."""
        return windowed.reconstruct_reference(self.config, state)

    def records_held(self, state: LeapQuantState) -> Array:
        return state.pos

    def step_token(self, state: LeapQuantState, token: Token, *, active: Optional[Array] = None):
        """Read, append the record, output; flush the sequences whose window filled."""
        token = windowed.match_key_heads(token, state.key_heads)
        check_token(state.shape, token, active, key_heads=state.key_heads)
        if token.per_channel_decay:
            state = self.with_decay_layout(state, True)
        elif state.per_channel_decay:
            token = token.replace(g=jnp.broadcast_to(token.g[..., None], token.q.shape))
        o, new = dispatch.leapquant_step(self.config, state, token)
        if active is not None:
            new = windowed.select_batch(active, new, state)
        return o, dispatch.leapquant_flush(self.config, new, only_full=True)


__all__ = ["WindowedMethod"]
