"""State methods: one interface for the per-step baselines and the windowed recurrence.

A method is a frozen, hashable dataclass (a static argument to ``jit``) with

    state = method.init(batch, heads, dk, dv, per_channel_decay=False)
    state = method.from_dense(S)                     # S [B, H, dk, dv] fp32, rounded once
    o, state = method.step(state, q=, k=, v=, g=, beta=, active=None)   # [B, H, ...]
    S = method.to_dense(state)                       # [B, H, dk, dv] fp32
    o, state = method.decode(state, q=, k=, v=, g=, beta=)              # [B, T, H, ...], lax.scan
    o, state = method.prefill(q=, k=, v=, g=, beta=, lengths=, state=None)

``make_method(name, **options)`` builds one from a docs/design.md §5 name: per-step ``fp32``,
``bf16``, ``fp16``, ``int8``, ``fp8`` (eq. 2: re-quantize after every token); windowed
``bf16-w``, ``int8-w`` (no compensators, no smoothing) and ``leapquant``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import windowed
from .chunked import chunk_delta_rule
from .quantizers import QTensor, get_format
from .recurrence import Token, check_lengths, check_sequence, delta_rule_token, recurrent_step_general, time_major
from .state import LeapQuantConfig, LeapQuantState

Array = jax.Array

PER_STEP_METHODS = ("fp32", "bf16", "fp16", "int8", "fp8")
WINDOWED_METHODS = ("bf16-w", "int8-w", "leapquant")
METHOD_NAMES = PER_STEP_METHODS + WINDOWED_METHODS


def check_dims(batch: int, heads: int, dk: int, dv: int) -> None:
    """Raises ``ValueError`` naming the first of ``batch, heads, dk, dv`` that is not a positive integer."""
    for name, n in (("batch", batch), ("heads", heads), ("dk", dk), ("dv", dv)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{name} must be a positive integer, got {n!r}")


def _check_dense(state: Array) -> tuple[int, int, int, int]:
    if state.ndim != 4:
        raise ValueError(f"state must be [B, H, dk, dv], got shape {state.shape}")
    if not jnp.issubdtype(state.dtype, jnp.floating):
        raise ValueError(f"state must be floating point, got dtype {state.dtype}")
    check_dims(*state.shape)
    return state.shape


def _check_token(state_shape: tuple, token: Token, active: Optional[Array]) -> None:
    b, h, dk = token.w.shape
    got = (b, h, dk, token.v.shape[-1])
    if tuple(state_shape) != got:
        raise ValueError(f"the state holds [B, H, dk, dv] = {tuple(state_shape)} but the inputs give {got} "
                         f"(q/k {tuple(token.w.shape)} after GVA, v {tuple(token.v.shape)})")
    if active is not None and (jnp.shape(active) != (b,) or jnp.asarray(active).dtype != jnp.bool_):
        raise ValueError(f"active must be bool [B] = ({b},), got {jnp.asarray(active).dtype} {jnp.shape(active)}")


class _Runner:
    """Sequence-level drivers shared by every method (built on ``step_token``/``from_dense``)."""

    window: int = 1

    def per_channel_state(self, state) -> bool:
        """Whether ``state`` keeps per-channel (KDA) decays; per-step states keep no decays."""
        return False

    def with_decay_layout(self, state, per_channel: bool):
        """``state`` ready for tokens with per-channel decays when ``per_channel`` (see the
        windowed method); per-step states serve both decay kinds as they are."""
        return state

    def step(self, state, *, q: Array, k: Array, v: Array, g: Array, beta: Array, active: Optional[Array] = None):
        """One decode step. q, k ``[B, Hk, dk]``; v ``[B, H, dv]``; g ``[B, H]`` or ``[B, H, dk]``;
        beta ``[B, H]``; active ``[B]`` bool or ``None``. Returns ``(o [B, H, dv], state)``;
        inactive sequences keep their state."""
        return self.step_token(state, delta_rule_token(q=q, k=k, v=v, g=g, beta=beta), active=active)

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

        Inputs ``[B, T, H, ...]`` right-padded; lengths ``[B]`` int32 (default ``T``); state an
        existing stream or ``None`` (zeros). Returns ``(o [B, T, H, dv], state)``; outputs of
        padding positions are unspecified.
        """
        bsz, t, h = check_sequence(q=q, k=k, v=v, g=g, beta=beta)
        dk, dv = q.shape[-1], v.shape[-1]
        per_channel = g.ndim == 4
        if lengths is not None:
            check_lengths(lengths, bsz, t)
        lengths = jnp.full((bsz,), t, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        if state is None:
            state = self.init(bsz, h, dk, dv, per_channel_decay=per_channel)
        else:
            state = self.with_decay_layout(state, per_channel)
            per_channel = self.per_channel_state(state)
        held = self.records_held(state)                                   # [B]
        boundary = jnp.maximum((held + lengths) // self.window * self.window - held, 0)
        # Exact fp32 up to each boundary in chunkwise-parallel form: the state after boundary[b] tokens.
        o, at_boundary = chunk_delta_rule(q=q, k=k, v=v, g=g, beta=beta, initial_state=self.to_dense(state),
                                          lengths=boundary)
        rounded = self.from_dense(at_boundary, per_channel_decay=per_channel)
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


@dataclasses.dataclass(frozen=True)
class PerStepMethod(_Runner):
    """Per-step baseline (eq. 2): the state lives in ``format`` and is re-quantized after every token."""

    format_name: str = "fp32"

    def __post_init__(self):
        if self.format_name not in PER_STEP_METHODS:
            raise ValueError(f"per-step formats are {PER_STEP_METHODS}, got {self.format_name!r}")

    @property
    def name(self) -> str:
        return self.format_name

    def init(self, batch: int, heads: int, dk: int, dv: int, per_channel_decay: bool = False) -> QTensor:
        """A zero state ``[batch, heads, dk, dv]`` in this format (for GDN and KDA tokens alike)."""
        check_dims(batch, heads, dk, dv)
        return self.from_dense(jnp.zeros((batch, heads, dk, dv), jnp.float32))

    def from_dense(self, state: Array, *, per_channel_decay: bool = False) -> QTensor:
        """Rounds ``[B, H, dk, dv]`` fp32 into the format."""
        _check_dense(state)
        return get_format(self.format_name).quantize(state)

    def to_dense(self, state: QTensor) -> Array:
        """``[B, H, dk, dv]`` fp32."""
        return get_format(self.format_name).dequantize(state)

    def records_held(self, state: QTensor) -> Array:
        return jnp.zeros((state.shape[0],), jnp.int32)

    def step_token(self, state: QTensor, token: Token, *, active: Optional[Array] = None):
        """General-form step: dequantize, dense fp32 update, re-quantize. Returns ``(o, state)``."""
        _check_token(state.shape, token, active)
        fmt = get_format(self.format_name)
        o, dense = recurrent_step_general(fmt.dequantize(state), token)
        new = fmt.quantize(dense)
        if active is not None:
            new = windowed.select_batch(active, new, state)
        return o, new


@dataclasses.dataclass(frozen=True)
class WindowedMethod(_Runner):
    """The windowed recurrence with a ``LeapQuantConfig`` (``bf16-w``, ``int8-w``, ``leapquant``)."""

    config: LeapQuantConfig = LeapQuantConfig()
    label: str = "leapquant"

    @property
    def name(self) -> str:
        return self.label

    @property
    def window(self) -> int:  # type: ignore[override]
        return self.config.window

    def init(self, batch: int, heads: int, dk: int, dv: int, per_channel_decay: bool = False) -> LeapQuantState:
        """An all-zero live stream ``[batch, heads]`` of ``dk x dv`` heads.

        per_channel_decay: lay the window buffer out for KDA's per-channel decays
        (``g [B, H, dk]``). A scalar-decay stream met by KDA tokens is widened on the fly
        (exactly: a scalar decay is the same decay on every channel) by ``step``, ``decode``
        and ``prefill``; inside a ``lax.scan`` of your own, whose carry must keep its shapes,
        pass ``per_channel_decay=True`` for KDA.
        """
        check_dims(batch, heads, dk, dv)
        self.config.check_head_size(dk, dv)
        return windowed.init_state(self.config, batch, heads, dk, dv, per_channel_decay)

    def from_dense(self, state: Array, *, per_channel_decay: bool = False) -> LeapQuantState:
        """Rounds ``[B, H, dk, dv]`` fp32 into a checkpoint with an empty window
        (``per_channel_decay`` as in ``init``)."""
        _, _, dk, dv = _check_dense(state)
        self.config.check_head_size(dk, dv)
        return windowed.from_dense(self.config, state, per_channel_decay=per_channel_decay)

    def per_channel_state(self, state: LeapQuantState) -> bool:
        return state.per_channel_decay

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
        from .dispatch import leapquant_maybe_flush, leapquant_step

        _check_token(state.shape, token, active)
        if token.per_channel_decay:
            state = self.with_decay_layout(state, True)
        elif state.per_channel_decay:
            token = token.replace(g=jnp.broadcast_to(token.g[..., None], token.w.shape))
        o, new = leapquant_step(self.config, state, token)
        if active is not None:
            new = windowed.select_batch(active, new, state)
        return o, leapquant_maybe_flush(self.config, new)


def make_method(
    name: str,
    *,
    bits: Optional[int] = None,
    window: Optional[int] = None,
    rank: Optional[int] = None,
    compensators: Optional[bool] = None,
    smoothing: Optional[bool] = None,
    **config_options,
):
    """Builds a state method from its docs/design.md §5 name.

    name: ``fp32``, ``bf16``, ``fp16``, ``int8``, ``fp8`` (per step), ``bf16-w``, ``int8-w``
    or ``leapquant``. The options (``bits``, ``window``, ``rank``, ``compensators``,
    ``smoothing`` and any other ``LeapQuantConfig`` field) apply to windowed methods; ``None``
    keeps the default. Giving one to a per-step method is an error.
    """
    opts = dict(bits=bits, window=window, rank=rank, compensators=compensators, smoothing=smoothing, **config_options)
    given = {k: v for k, v in opts.items() if v is not None}
    if name in PER_STEP_METHODS:
        if given:
            raise ValueError(f"method {name!r} is per-step and takes no options, got {sorted(given)}")
        return PerStepMethod(name)
    if name not in WINDOWED_METHODS:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHOD_NAMES)}")
    fields = {f.name for f in dataclasses.fields(LeapQuantConfig)}
    unknown = set(given) - fields
    if unknown:
        raise ValueError(f"unknown option(s) for {name!r}: {sorted(unknown)}")
    if name == "leapquant":
        return WindowedMethod(LeapQuantConfig(**given), label=name)
    if "compensators" in given or "smoothing" in given or "rank" in given:
        raise ValueError(f"{name!r} has neither compensators nor smoothing; use 'leapquant' with options")
    base = dict(compensators=False, smoothing=False)
    if name == "bf16-w":
        if "bits" in given:
            raise ValueError("'bf16-w' stores its residual in bf16 and takes no bits")
        base["residual_format"] = "bf16"
    elif given.get("bits", 8) != 8:
        raise ValueError("'int8-w' is 8-bit; use 'leapquant --bits N --no-compensators --no-smoothing'")
    return WindowedMethod(LeapQuantConfig(**{**base, **given}), label=name)


__all__ = ["METHOD_NAMES", "PER_STEP_METHODS", "PerStepMethod", "WINDOWED_METHODS", "WindowedMethod", "make_method"]
