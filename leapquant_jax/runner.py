"""What every state method shares: argument checks and the sequence-level drivers (``decode``,
``prefill``) built on a method's ``step_token``, ``from_dense``, ``to_dense`` and ``init``; and
``PerStepRunner``, the step of every method whose state is re-quantized after each token."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from . import windowed
from .checks import check_positive
from .chunked import chunk_delta_rule
from .recurrence import Token, check_lengths, check_sequence, delta_rule_token, recurrent_step_general, time_major
from .state import resolve_key_heads

Array = jax.Array


def check_dims(batch: int, heads: int, dk: int, dv: int) -> None:
    """Raises ``ValueError`` naming the first of ``batch, heads, dk, dv`` that is not a positive integer."""
    for name, n in (("batch", batch), ("heads", heads), ("dk", dk), ("dv", dv)):
        check_positive(name, n)


def check_dense(state: Array) -> tuple[int, int, int, int]:
    if state.ndim != 4:
        raise ValueError(f"state must be [B, H, dk, dv], got shape {state.shape}")
    if not jnp.issubdtype(state.dtype, jnp.floating):
        raise ValueError(f"state must be floating point, got dtype {state.dtype}")
    check_dims(*state.shape)
    return state.shape


def check_token(state_shape: tuple, token: Token, active: Optional[Array], key_heads: Optional[int] = None) -> None:
    """Raises ``ValueError`` unless ``token`` fits a state of ``state_shape = (B, H, dk, dv)``
    whose key records are kept for ``key_heads`` key heads (``None``: ``H``, a state that keeps
    none or one per value head): ``token.w [B, key_heads, dk]``, ``active`` bool ``[B]``."""
    b, h, dk = token.q.shape
    got = (b, h, dk, token.v.shape[-1])
    if tuple(state_shape) != got:
        raise ValueError(f"the state holds [B, H, dk, dv] = {tuple(state_shape)} but the inputs give {got} "
                         f"(q {tuple(token.q.shape)} after GVA, v {tuple(token.v.shape)})")
    want = (b, h if key_heads is None else key_heads, dk)
    if tuple(token.w.shape) != want:
        raise ValueError(f"token.w (the key) must be [B, Hk, dk] = {want} for this state, got {tuple(token.w.shape)}")
    if active is not None and (jnp.shape(active) != (b,) or jnp.asarray(active).dtype != jnp.bool_):
        raise ValueError(f"active must be bool [B] = ({b},), got {jnp.asarray(active).dtype} {jnp.shape(active)}")


class Runner:
    """Sequence-level drivers shared by every method (built on ``step_token``/``from_dense``)."""

    window: int = 1

    def for_layer(self, layer: int) -> "Runner":
        """This method as used by model layer ``layer``. Every method but ``damp`` (whose
        calibrated channels differ between layers) is the same in every layer."""
        return self

    def per_channel_state(self, state) -> bool:
        """Whether ``state`` keeps per-channel (KDA) decays; per-step states keep no decays."""
        return False

    def with_decay_layout(self, state, per_channel: bool):
        """``state`` ready for tokens with per-channel decays when ``per_channel`` (see the
        windowed method); per-step states serve both decay kinds as they are."""
        return state

    def state_key_heads(self, state) -> Optional[int]:
        """The key heads whose records ``state`` keeps, ``None`` when it keeps none per key head
        (per-step states: tokens come with keys repeated to the value heads)."""
        return None

    def step(self, state, *, q: Array, k: Array, v: Array, g: Array, beta: Array, active: Optional[Array] = None):
        """One decode step. q, k ``[B, Hk, dk]``; v ``[B, H, dv]``; g ``[B, H]`` or ``[B, H, dk]``;
        beta ``[B, H]``; active ``[B]`` bool or ``None``. Returns ``(o [B, H, dv], state)``;
        inactive sequences keep their state. A state keeping key records per key head
        (``state_key_heads``) takes ``k`` at those heads, or at a number dividing them."""
        token = delta_rule_token(q=q, k=k, v=v, g=g, beta=beta, key_heads=self.state_key_heads(state))
        return self.step_token(state, token, active=active)

    def decode(self, state, *, q: Array, k: Array, v: Array, g: Array, beta: Array):
        """Token-serial decode as a ``lax.scan``. Inputs ``[B, T, H, ...]``;
        returns ``(o [B, T, H, dv], final state)``."""
        check_sequence(q=q, k=k, v=v, g=g, beta=beta)
        # Widened before the scan, whose carry must keep one structure.
        state = self.with_decay_layout(state, g.ndim == 4)

        def body(s, xs):
            o, s = self.step(s, **dict(zip(("q", "k", "v", "g", "beta"), xs)))
            return s, o

        state, o = jax.lax.scan(body, state, tuple(time_major(x) for x in (q, k, v, g, beta)))
        return time_major(o), state

    def prefill(
        self, *, q: Array, k: Array, v: Array, g: Array, beta: Array,
        lengths: Optional[Array] = None, state=None,
    ):
        """Prompt processing (docs/design.md §3): exact fp32 up to each sequence's last window boundary
        (``chunk_delta_rule``, chunkwise-parallel), rounded once there; the fewer than ``window``
        tokens after it become records of the open window.

        Inputs ``[B, T, H, ...]`` right-padded (q, k ``[B, T, Hk, dk]``); lengths ``[B]`` int32
        (default ``T``); state an existing stream or ``None`` (zeros, with key records, where the
        method keeps them, for the ``Hk`` key heads of ``k``). Returns ``(o [B, T, H, dv], state)``;
        outputs of padding positions are unspecified.
        """
        bsz, t, h = check_sequence(q=q, k=k, v=v, g=g, beta=beta)
        dk, dv = q.shape[-1], v.shape[-1]
        per_channel = g.ndim == 4
        if lengths is not None:
            check_lengths(lengths, bsz, t)
        lengths = jnp.full((bsz,), t, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        if state is None:
            state = self.init(bsz, h, dk, dv, per_channel_decay=per_channel, key_heads=k.shape[2])
        else:
            state = self.with_decay_layout(state, per_channel)
            per_channel = self.per_channel_state(state)
        key_heads = self.state_key_heads(state)
        held = self.records_held(state)                                   # [B]
        boundary = jnp.maximum((held + lengths) // self.window * self.window - held, 0)
        # Exact fp32 up to each boundary in chunkwise-parallel form: the state after boundary[b] tokens.
        o, at_boundary = chunk_delta_rule(q=q, k=k, v=v, g=g, beta=beta, initial_state=self.to_dense(state),
                                          lengths=boundary)
        rounded = self.from_dense(at_boundary, per_channel_decay=per_channel, key_heads=key_heads)
        state = windowed.select_batch(boundary > 0, rounded, state)
        if self.window == 1:
            return o, state

        # Fewer than `window` tokens of each sequence follow its boundary: gather just those and
        # step them token by token into the open window.
        pos = boundary[:, None] + jnp.arange(self.window - 1)[None, :]             # [B, p-1]
        active = pos < lengths[:, None]
        rows = jnp.arange(bsz)[:, None]
        tail = tuple(time_major(x[rows, jnp.minimum(pos, t - 1)]) for x in (q, k, v, g, beta))

        def rest(s, xs):
            *tok, act = xs
            o_i, s = self.step(s, **dict(zip(("q", "k", "v", "g", "beta"), tok)), active=act)
            return s, o_i

        state, o_rest = jax.lax.scan(rest, state, tail + (time_major(active),))
        # inactive slots point past the end and are dropped
        return o.at[rows, jnp.where(active, pos, t)].set(time_major(o_rest), mode="drop"), state


class PerStepRunner(Runner):
    """A method whose state is re-quantized after every token (eq. 2): it holds no records, its
    zero state is ``from_dense`` of zeros, and ``step_token`` dequantizes (``to_dense``), takes the
    dense fp32 delta-rule step and rounds the new state (``requantize``); inactive sequences keep
    their whole state."""

    def init(self, batch: int, heads: int, dk: int, dv: int, per_channel_decay: bool = False, *,
             key_heads: Optional[int] = None):
        """A zero state ``[batch, heads, dk, dv]`` (for GDN and KDA tokens alike; ``key_heads`` is
        checked, and the state keeps no keys)."""
        check_dims(batch, heads, dk, dv)
        resolve_key_heads(heads, key_heads)
        # opaque zeros: under jit, XLA would otherwise fold their quantization at compile time
        return self.from_dense(jax.lax.optimization_barrier(jnp.zeros((batch, heads, dk, dv), jnp.float32)))

    def records_held(self, state) -> Array:
        return jnp.zeros((state.shape[0],), jnp.int32)

    def requantize(self, state, dense: Array):
        """The state after a step of ``state`` whose dense fp32 result is ``dense [B, H, dk, dv]``:
        ``from_dense(dense)`` unless the method carries more from one step to the next."""
        return self.from_dense(dense)

    def step_token(self, state, token: Token, *, active: Optional[Array] = None):
        """Dequantize, dense fp32 update, re-quantize. Returns ``(o [B, H, dv], state)``."""
        check_token(state.shape, token, active)
        o, dense = recurrent_step_general(self.to_dense(state), token)
        new = self.requantize(state, dense)
        if active is not None:
            new = windowed.select_batch(active, new, state)
        return o, new


__all__ = ["PerStepRunner", "Runner", "check_dense", "check_dims", "check_token"]
