"""State methods: one interface for the per-step baselines and the windowed recurrence.

A method is a frozen, hashable dataclass (a static argument to ``jit``) with

    state = method.init(batch, heads, dk, dv, per_channel_decay=False, key_heads=None)
    state = method.from_dense(S)                     # S [B, H, dk, dv] fp32, rounded once
    o, state = method.step(state, q=, k=, v=, g=, beta=, active=None)   # [B, H, ...]
    S = method.to_dense(state)                       # [B, H, dk, dv] fp32
    o, state = method.decode(state, q=, k=, v=, g=, beta=)              # [B, T, H, ...], lax.scan
    o, state = method.prefill(q=, k=, v=, g=, beta=, lengths=, state=None)

``make_method(name, **options)`` builds one from a docs/design.md §5 name: per-step ``fp32``,
``bf16``, ``fp16``, ``int8``, ``fp8``, ``int6``, ``int4`` and the formats of ``formats`` (eq. 2:
re-quantize after every token), the stateful per-step methods of ``feedback``; windowed
``bf16-w``, ``int8-w`` (no compensators, no smoothing), ``leapquant`` and the lossless ``fp32-w``
(an fp32 checkpoint, ``fp32w``); the lifetime-calibrated ``stepquant-6/-4`` (``stepquant``),
``leapquant-alloc-6/-4`` (``leapquant_alloc``) and ``leapquant-dual-6/-4`` (``leapquant_dual``).
The shared drivers (``decode``, ``prefill``) live in ``runner``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax

from .damp import DampCalibration, DampMethod
from .feedback import METHODS as STATEFUL_PER_STEP
from .fp32w import fp32w_config
from .leapquant_alloc import NAMES as ALLOC_NAMES
from .leapquant_alloc import AllocMethod
from .leapquant_dual import NAMES as DUAL_NAMES
from .leapquant_dual import DualMethod
from .per_step import DENSE_KERNEL_FORMATS, PER_STEP_METHODS, PerStepMethod
from .state import LeapQuantConfig
from .stepquant import NAMES as STEPQUANT_NAMES
from .stepquant import StepQuantMethod
from .windowed_method import WindowedMethod

Array = jax.Array

WINDOWED_METHODS = ("bf16-w", "int8-w", "leapquant", "fp32-w")
# The per-step formats, then the per-step methods whose state carries more than the rounded
# values (error feedback, stochastic rounding), then DAMP (calibrated per layer), then the windowed ones,
# then those calibrated for their lifetime-aware widths (``lifetime``: one calibration file for all).
LIFETIME_METHODS = tuple(STEPQUANT_NAMES) + tuple(ALLOC_NAMES) + tuple(DUAL_NAMES)
WINDOWED_LIFETIME_METHODS = tuple(ALLOC_NAMES) + tuple(DUAL_NAMES)    # these take window and impl
METHOD_NAMES = PER_STEP_METHODS + tuple(STATEFUL_PER_STEP) + ("damp",) + WINDOWED_METHODS + LIFETIME_METHODS


def make_method(
    name: str,
    *,
    bits: Optional[int] = None,
    window: Optional[int] = None,
    rank: Optional[int] = None,
    compensators: Optional[bool] = None,
    smoothing: Optional[bool] = None,
    calibration=None,
    **config_options,
):
    """Builds a state method from its docs/design.md §5 name.

    name: ``fp32``, ``bf16``, ``fp16``, ``int8``, ``fp8`` (per step), ``bf16-w``, ``int8-w``,
    ``leapquant`` or ``fp32-w`` (which takes ``window``, ``record_dtype`` and ``impl`` alone:
    ``fp32w.fp32w_config``). The options (``bits``, ``window``, ``rank``, ``compensators``,
    ``smoothing`` and any other ``LeapQuantConfig`` field) apply to windowed methods; ``None``
    keeps the default. Giving one to a per-step method is an error, but for ``impl`` (``impls``:
    which implementation runs the dense step) on ``fp32`` and ``bf16``. ``calibration`` (a
    ``damp.DampCalibration`` or the path of its file) is ``damp``'s only option. The
    ``LIFETIME_METHODS`` take a ``lifetime.LifetimeCalibration`` (or its path), and
    ``leapquant-alloc-*`` and ``leapquant-dual-*`` also ``window`` and ``impl``.
    """
    if name in LIFETIME_METHODS:
        given = {k: v for k, v in dict(bits=bits, window=window, rank=rank, compensators=compensators,
                                       smoothing=smoothing, **config_options).items() if v is not None}
        allowed = {"window", "impl"} if name in WINDOWED_LIFETIME_METHODS else set()
        if set(given) - allowed:
            takes = "a calibration, window and impl" if allowed else "only a calibration"
            raise ValueError(f"method {name!r} takes {takes} (its widths come from the calibration), got "
                             f"{sorted(set(given) - allowed)}")
        if name in ALLOC_NAMES:
            return AllocMethod(plan=name, calibration=calibration, **given)
        if name in DUAL_NAMES:
            return DualMethod(plan=name, calibration=calibration, **given)
        return StepQuantMethod(plan=name, calibration=calibration)
    if name == "damp":
        others = {k: v for k, v in dict(bits=bits, window=window, rank=rank, compensators=compensators,
                                         smoothing=smoothing, **config_options).items() if v is not None}
        if others:
            raise ValueError(f"method 'damp' is per-step and takes only a calibration, got {sorted(others)}")
        if calibration is not None and not isinstance(calibration, DampCalibration):
            calibration = DampCalibration.load(str(calibration))
        return DampMethod(calibration=calibration)
    if calibration is not None:
        raise ValueError(f"only method 'damp' takes a calibration (and the lifetime-calibrated "
                         f"{', '.join(LIFETIME_METHODS)}), not {name!r}")
    opts = dict(bits=bits, window=window, rank=rank, compensators=compensators, smoothing=smoothing, **config_options)
    given = {k: v for k, v in opts.items() if v is not None}
    if name in DENSE_KERNEL_FORMATS and set(given) == {"impl"}:
        return PerStepMethod(name, impl=given["impl"])
    if name in PER_STEP_METHODS or name in STATEFUL_PER_STEP:
        if given:
            raise ValueError(f"method {name!r} is per-step and takes no options, got {sorted(given)}")
        return PerStepMethod(name) if name in PER_STEP_METHODS else STATEFUL_PER_STEP[name]()
    if name not in WINDOWED_METHODS:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHOD_NAMES)}")
    if name == "fp32-w":
        return WindowedMethod(fp32w_config(**given), label=name)
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


__all__ = ["DENSE_KERNEL_FORMATS", "LIFETIME_METHODS", "METHOD_NAMES", "PER_STEP_METHODS", "PerStepMethod",
           "WINDOWED_LIFETIME_METHODS", "WINDOWED_METHODS", "WindowedMethod", "make_method"]
