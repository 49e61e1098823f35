"""LeapQuant with a dual-axis checkpoint (``leapquant-dual-6``, ``leapquant-dual-4``).

The window and its exact records are LeapQuant's; the window-boundary checkpoint is rounded once
per flush into STEPQuant's calibrated layout (``stepquant.encode``): a width per unit (a head for
GDN, a key row for KDA) among 2, 4, 6 and 8 bits or an fp16 pivot, key-row factors weighted by
each row's read-out impact and fp16 column scales refitted by least squares. No Compensator
Tokens and no separate smoothing (the row factors are the smoothing). The plan is the one
``stepquant.stepquant_plan`` solves at the name's nominal budget (per unit: calibration error
energy of the fit times lifetime), so the checkpoint holds exactly the bytes of ``stepquant-<b>``'s
state (fp16 pivots and scales included), where a live stream adds its window records; what differs
is one rounding per window of ``p`` tokens instead of one per token.

``DualConfig`` is a ``LeapQuantConfig`` whose residual format is the layout; the reference step
and flush (``windowed``) run it as they are. The Pallas kernels read integer residuals only and
refuse this checkpoint (``pallas_kernels.support``), so ``impl="auto"`` runs the reference.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax

from . import stepquant
from .lifetime import WindowedPlanMethod
from .recurrence import Token
from .runner import Runner, check_dense, check_dims
from .state import LeapQuantConfig, LeapQuantState
from .windowed_method import WindowedMethod

Array = jax.Array

NAMES = {"leapquant-dual-6": 6, "leapquant-dual-4": 4}
FORMAT_NAME = "stepquant-layout"


@dataclasses.dataclass(frozen=True, eq=False)
class LayoutFormat:
    """The residual format of a dual-axis checkpoint: ``stepquant.encode``/``decode`` with ``layout``."""

    layout: stepquant.Layout

    @property
    def name(self) -> str:
        return FORMAT_NAME

    def quantize(self, x: Array) -> stepquant.StepQuantState:
        """``x [B, H, dk, dv]`` -> the layout's state."""
        return stepquant.encode(x, self.layout)

    def dequantize(self, t: stepquant.StepQuantState) -> Array:
        return stepquant.decode(t, self.layout)


@dataclasses.dataclass(frozen=True)
class DualConfig(LeapQuantConfig):
    """A ``LeapQuantConfig`` whose checkpoint residual is stored in ``layout`` (a
    ``stepquant.Layout``, compared by identity), without Compensator Tokens or smoothing."""

    layout: Optional[stepquant.Layout] = None

    def __post_init__(self):
        super().__post_init__()
        if self.layout is None or self.effective_rank or self.smoothing or self.residual_format is not None:
            raise ValueError("a dual-axis checkpoint takes a stepquant.Layout, no Compensator Tokens, no smoothing and "
                             "no residual_format")

    @property
    def format_name(self) -> str:
        return FORMAT_NAME

    @property
    def format(self) -> LayoutFormat:
        return LayoutFormat(self.layout)


@functools.lru_cache(maxsize=256)
def _windowed(method: "DualMethod", heads: int, dk: int, dv: int, need_plan: bool) -> WindowedMethod:
    # cached: one Layout object per (method, shape), so that the configs of one layer compare equal
    layout = stepquant.method_layout(method, NAMES[method.plan], heads, dk, dv, need_plan=need_plan)
    config = DualConfig(bits=8, rank=0, smoothing=False, window=method.window, impl=method.impl, layout=layout)
    return WindowedMethod(config, label=method.plan)


@dataclasses.dataclass(frozen=True)
class DualMethod(WindowedPlanMethod, Runner):
    """``leapquant-dual-*``: LeapQuant whose checkpoint takes the plan named ``plan`` of a
    ``LifetimeCalibration`` (module docstring), specialised to a layer with ``for_layer``.
    window: records per window ``p``; impl: as ``LeapQuantConfig.impl``. Without a calibration
    the layout is the name's width on every row (for ``leapquant memory``), and rounding is refused."""

    plan: str = "leapquant-dual-4"

    NAMES = NAMES

    def windowed(self, heads: int, dk: int, dv: int, *, need_plan: bool = True) -> WindowedMethod:
        """The layer's ``WindowedMethod`` (its ``DualConfig``) for ``heads x dk x dv`` states."""
        stepquant.check_size(dk, dv)
        return _windowed(self, heads, dk, dv, need_plan)

    def init(self, batch: int, heads: int, dk: int, dv: int, per_channel_decay: bool = False, *,
             key_heads: Optional[int] = None) -> LeapQuantState:
        """An all-zero live stream (``WindowedMethod.init``)."""
        check_dims(batch, heads, dk, dv)
        return self.windowed(heads, dk, dv, need_plan=False).init(batch, heads, dk, dv, per_channel_decay,
                                                                  key_heads=key_heads)

    def from_dense(self, state: Array, *, per_channel_decay: bool = False,
                   key_heads: Optional[int] = None) -> LeapQuantState:
        """Rounds ``[B, H, dk, dv]`` fp32 into the layer's checkpoint, with an empty window."""
        _, h, dk, dv = check_dense(state)
        return self.windowed(h, dk, dv).from_dense(state, per_channel_decay=per_channel_decay, key_heads=key_heads)

    def _of(self, state: LeapQuantState) -> WindowedMethod:
        _, h, dk, dv = state.shape
        return self.windowed(h, dk, dv, need_plan=self.calibration is not None)

    def to_dense(self, state: LeapQuantState) -> Array:
        """The represented state ``[B, H, dk, dv]`` fp32 (checkpoint plus records)."""
        return self._of(state).to_dense(state)

    def records_held(self, state: LeapQuantState) -> Array:
        return state.pos

    def per_channel_state(self, state: LeapQuantState) -> bool:
        return state.per_channel_decay

    def state_key_heads(self, state: LeapQuantState) -> int:
        return state.key_heads

    def with_decay_layout(self, state: LeapQuantState, per_channel: bool) -> LeapQuantState:
        return self._of(state).with_decay_layout(state, per_channel)

    def step_token(self, state: LeapQuantState, token: Token, *, active: Optional[Array] = None):
        """LeapQuant's step (read, append, flush when full). Returns ``(o [B, H, dv], state)``."""
        _, h, dk, dv = state.shape
        return self.windowed(h, dk, dv).step_token(state, token, active=active)


__all__ = ["DualConfig", "DualMethod", "FORMAT_NAME", "LayoutFormat", "NAMES"]
