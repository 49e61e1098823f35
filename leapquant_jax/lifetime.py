"""Lifetime-aware calibration of ``stepquant-*`` and ``leapquant-alloc-*``: the statistics of recorded
fp32 inputs and the calibration file that holds each method's plan.

Statistics of one linear-attention layer (``layer_statistics``) from its inputs
``{"q", "k", "v", "g", "beta": [B, T, ...]}`` (a model's ``record=True`` traces):

* ``samples [S, H, dk, dv]``: the exact fp32 states every ``every`` tokens (``damp.state_samples``),
  at most ``max_samples`` of them, evenly spaced (a fixed subset: calibration is deterministic);
* ``impact [H, dk]``: the read-out weight of each key row, the mean over tokens of
  ``[D (q - beta k (k^T q))]^2`` with ``D = diag(exp g)``: an error ``E`` in the state a token
  starts from reaches that token's output as ``E^T D (q - beta k (k^T q))``;
* ``lifetime [H]`` (GDN, one decay per head) or ``[H, dk]`` (KDA): ``damp.persistence`` of the
  mean log-decay, ``sum_{j < horizon} a^{2j}``, the energy an error written now keeps over the next
  ``horizon`` tokens (``horizon`` for a head that does not decay).

The file (``LifetimeCalibration``, JSON, ``format: "leapquant-lifetime-calibration"``) records the
model's fingerprint (``models.calibrate.model_fingerprint``), its linear-attention layers and head
shape, and one plan per method name: a ``StepQuantPlan`` (bits per key row, 16 for an fp16 pivot,
and the impact weights of the fit) or a ``WidthPlan`` (the residual width and Compensator Tokens of
each head). A calibration is compared by the digest of that content (its scores are not part of
it), and a method refuses a calibration whose fingerprint, layers or head shape differ from the
model's (``check_model``), naming what differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Optional, Union

import numpy as np

from .calibration_files import model_mismatches, read_json, write_json
from .checks import check_integer
from .damp import persistence, state_samples
from .state import LeapQuantConfig

FORMAT = "leapquant-lifetime-calibration"
VERSION = 1
ARCHITECTURES = ("gdn", "kda")
DEFAULT_HORIZON = 2048      # tokens an error is followed for (STEPQuant's calibration horizon)
DEFAULT_SAMPLES = 64        # calibration states kept per layer
DEFAULT_EVERY = 8           # tokens between calibration states
IMPACT_FLOOR = 1e-20
WIDTH_OPTIONS = (2, 4, 6, 8)   # residual widths of leapquant-alloc (LeapQuant's packed integer codes)


class LifetimeCalibrationError(ValueError):
    """A lifetime calibration file that cannot be read, lacks a plan, or belongs to another model."""


# ----------------------------------------------------------------------------- statistics


@dataclasses.dataclass(frozen=True, eq=False)
class LayerStatistics:
    """One layer's calibration statistics (module docstring): samples ``[S, H, dk, dv]``, impact
    ``[H, dk]``, mean_log_decay ``[H]`` or ``[H, dk]``, lifetime (same shape), horizon."""

    samples: np.ndarray
    impact: np.ndarray
    mean_log_decay: np.ndarray
    lifetime: np.ndarray
    horizon: int

    @property
    def architecture(self) -> str:
        return "kda" if self.mean_log_decay.ndim == 2 else "gdn"

    @property
    def row_lifetime(self) -> np.ndarray:
        """``[H, dk]``: the lifetime of every key row (GDN's is its head's)."""
        h, dk = self.impact.shape
        return np.broadcast_to(self.lifetime[:, None] if self.lifetime.ndim == 1 else self.lifetime, (h, dk))


def row_impact(inputs: dict) -> np.ndarray:
    """``[H, dk]`` float64: the mean over rows and tokens of ``[D (q - beta k (k^T q))]^2``."""
    q, k = (np.asarray(inputs[n], np.float64) for n in ("q", "k"))
    g, beta = np.asarray(inputs["g"], np.float64), np.asarray(inputs["beta"], np.float64)
    h = inputs["v"].shape[2]
    if q.shape[2] != h:  # keys per key head: repeated to the value heads (GVA)
        q, k = (np.repeat(x, h // x.shape[2], axis=2) for x in (q, k))
    decay = np.exp(g)[..., None] if g.ndim == 3 else np.exp(g)
    transported = decay * (q - beta[..., None] * k * np.sum(k * q, axis=-1, keepdims=True))
    return np.mean(np.square(transported), axis=(0, 1))


def layer_statistics(inputs: dict, *, every: int = DEFAULT_EVERY, max_samples: int = DEFAULT_SAMPLES,
                     horizon: int = DEFAULT_HORIZON) -> LayerStatistics:
    """The statistics of one layer's inputs ``{"q", "k", "v", "g", "beta": [B, T, ...]}``."""
    for name, value, low in (("every", every, 1), ("max_samples", max_samples, 1), ("horizon", horizon, 1)):
        check_integer(name, value, low)
    samples = state_samples(inputs, every)
    if samples.shape[0] > max_samples:
        samples = samples[np.linspace(0, samples.shape[0] - 1, max_samples).round().astype(int)]
    g = np.asarray(inputs["g"], np.float64)
    mean_g = np.minimum(g.reshape((-1,) + g.shape[2:]).mean(axis=0), 0.0)
    return LayerStatistics(samples=samples, impact=row_impact(inputs), mean_log_decay=mean_g,
                           lifetime=persistence(mean_g, horizon), horizon=int(horizon))


def significant(x, digits: int = 5):
    """``x`` (an array or number) as nested lists of floats rounded to ``digits`` significant
    digits: calibration scores in a file of readable size."""
    return np.vectorize(lambda v: float(f"{v:.{digits}g}"), otypes=[float])(np.asarray(x, np.float64)).tolist()


# ----------------------------------------------------------------------------- plans


def _nested(x, kind=int) -> tuple:
    a = np.asarray(x)
    return tuple(_nested(r, kind) for r in a) if a.ndim else kind(a)


@dataclasses.dataclass(frozen=True)
class StepQuantPlan:
    """``stepquant-*``'s plan: a width per state row (per head for GDN)."""

    name: str
    budget: float  # nominal bits per value (an fp16 pivot counted as 8, as the method counts it)
    candidates: tuple  # the integer widths
    pivots: int  # fp16 units
    bits: tuple  # [L][H][dk], each in {2, 4, 6, 8, 16}; one per head for GDN
    impact: tuple  # [L][H][dk]: the fit's row weights

    kind = "stepquant"

    def to_json(self, layers) -> dict:
        return {"kind": self.kind, "budget": self.budget, "candidates": list(self.candidates), "pivots": self.pivots,
                "layers": {str(layer): {"bits": np.asarray(b).tolist(), "impact": np.asarray(w).tolist()}
                           for layer, b, w in zip(layers, self.bits, self.impact)}}

    @classmethod
    def from_json(cls, name: str, d: dict, layers) -> "StepQuantPlan":
        return cls(name=name, budget=float(d["budget"]), candidates=tuple(int(x) for x in d["candidates"]),
                   pivots=int(d["pivots"]), bits=tuple(_nested(d["layers"][str(x)]["bits"]) for x in layers),
                   impact=tuple(_nested(d["layers"][str(x)]["impact"], float) for x in layers))

    def check(self, architecture: str, layers, heads: int, dk: int, dv: int) -> None:
        for layer, b, w in zip(layers, self.bits, self.impact):
            b, w = np.asarray(b), np.asarray(w)
            if b.shape != (heads, dk) or w.shape != (heads, dk):
                raise LifetimeCalibrationError(f"plan {self.name} layer {layer}: bits and impact must be "
                                               f"[{heads}, {dk}], got {list(b.shape)} and {list(w.shape)}")
            bad = sorted(set(np.unique(b).tolist()) - {2, 4, 6, 8, 16})
            if bad:
                raise LifetimeCalibrationError(f"plan {self.name} layer {layer}: unknown width(s) {bad}; "
                                               "stepquant rows take 2, 4, 6, 8 or 16 (fp16) bits")
            if architecture == "gdn" and np.any(b != b[:, :1]):
                raise LifetimeCalibrationError(f"plan {self.name} layer {layer}: GDN widths are one per head")
            if not np.all(np.isfinite(w)) or np.any(w <= 0):
                raise LifetimeCalibrationError(f"plan {self.name} layer {layer}: impact weights must be finite and "
                                               "positive")


@dataclasses.dataclass(frozen=True)
class WidthPlan:
    """``leapquant-alloc-*``'s plan: a residual width and a Compensator-Token rank per head."""

    name: str
    budget: float  # checkpoint bits per value solved for (codes, scales, Compensator Tokens, as the pytree holds them)
    options: tuple  # ((bits, rank), ...)
    choice: tuple  # [L][H]: each head's option index

    kind = "leapquant-alloc"

    def to_json(self, layers) -> dict:
        return {"kind": self.kind, "budget": self.budget,
                "options": [list(o) for o in self.options],
                "layers": {str(layer): {"bits": [self.options[j][0] for j in c],
                                        "rank": [self.options[j][1] for j in c]}
                           for layer, c in zip(layers, self.choice)}}

    @classmethod
    def from_json(cls, name: str, d: dict, layers) -> "WidthPlan":
        options = tuple(tuple(int(v) for v in o) for o in d["options"])
        unknown = sorted({o[0] for o in options} - set(WIDTH_OPTIONS))
        if unknown:
            raise LifetimeCalibrationError(f"plan {name}: unknown width {unknown[0]}; leapquant-alloc residuals are "
                                           f"{', '.join(map(str, WIDTH_OPTIONS))} bits")
        choice = []
        for layer in layers:
            entry = d["layers"][str(layer)]
            pairs = list(zip(entry["bits"], entry["rank"]))
            unknown = [p for p in pairs if tuple(p) not in options]
            if unknown:
                raise LifetimeCalibrationError(f"plan {name} layer {layer}: (bits, rank) {list(unknown[0])} is not "
                                               f"one of its options {[list(o) for o in options]}")
            choice.append(tuple(options.index(tuple(p)) for p in pairs))
        return cls(name=name, budget=float(d["budget"]), options=options,
                   choice=tuple(choice))

    def check(self, architecture: str, layers, heads: int, dk: int, dv: int) -> None:
        from .state import LeapQuantConfig

        for bits, rank in self.options:
            if bits not in WIDTH_OPTIONS:
                raise LifetimeCalibrationError(f"plan {self.name}: unknown width {bits}; leapquant-alloc residuals "
                                               f"are {', '.join(map(str, WIDTH_OPTIONS))} bits")
            LeapQuantConfig(bits=bits, rank=rank).check_head_size(dk, dv)
        for layer, c in zip(layers, self.choice):
            if len(c) != heads or not all(0 <= j < len(self.options) for j in c):
                raise LifetimeCalibrationError(f"plan {self.name} layer {layer}: one option per head ({heads}) "
                                               f"expected, got {list(c)}")


Plan = Union[StepQuantPlan, WidthPlan]
PLAN_KINDS = {StepQuantPlan.kind: StepQuantPlan, WidthPlan.kind: WidthPlan}


# ----------------------------------------------------------------------------- the file


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class LifetimeCalibration:
    """The plans of one model (module docstring). ``layers``: its linear-attention layer indices;
    ``heads``, ``dk``, ``dv``: their state shape; ``architecture``: ``gdn`` or ``kda``; ``horizon``:
    the lifetime horizon; ``plans``: a tuple of plans, one per method name; ``model``: the model's
    fingerprint (``""`` when made from bare traces). Equal (and hashed) by ``digest``."""

    architecture: str
    layers: tuple
    heads: int
    dk: int
    dv: int
    horizon: int
    plans: tuple
    model: str = ""

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise LifetimeCalibrationError(f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        if not self.layers:
            raise LifetimeCalibrationError("a lifetime calibration covers at least one layer")
        names = [p.name for p in self.plans]
        if len(set(names)) != len(names):
            raise LifetimeCalibrationError(f"plan names repeat: {names}")
        for plan in self.plans:
            n = len(plan.bits) if isinstance(plan, StepQuantPlan) else len(plan.choice)
            if n != len(self.layers):
                raise LifetimeCalibrationError(f"plan {plan.name} covers {n} layers, the calibration "
                                               f"{len(self.layers)}")
            plan.check(self.architecture, self.layers, self.heads, self.dk, self.dv)
        content = json.dumps(self.content(), sort_keys=True).encode()
        object.__setattr__(self, "digest", hashlib.sha256(content).hexdigest())

    def __eq__(self, other) -> bool:
        return isinstance(other, LifetimeCalibration) and self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return (f"LifetimeCalibration(model={self.model[:16]!r}, layers={list(self.layers)}, "
                f"plans={[p.name for p in self.plans]}, digest={self.digest[:16]!r})")

    @property
    def names(self) -> tuple:
        return tuple(p.name for p in self.plans)

    def plan(self, name: str) -> Plan:
        """The plan of method ``name``; ``LifetimeCalibrationError`` naming the ones it holds."""
        for p in self.plans:
            if p.name == name:
                return p
        raise LifetimeCalibrationError(f"the lifetime calibration has no plan for {name!r} (it holds "
                                       f"{', '.join(self.names)}): make one with `leapquant calibrate-stepquant`")

    def layer_index(self, layer: int) -> int:
        """The position of model layer ``layer`` in ``layers``; refused when it is not covered."""
        try:
            return self.layers.index(layer)
        except ValueError:
            raise LifetimeCalibrationError(f"the lifetime calibration has no layer {layer} (it covers linear-attention "
                                           f"layers {list(self.layers)}): it was made for another model") from None

    def check_shape(self, layer: int, heads: int, dk: int, dv: int) -> None:
        if (self.heads, self.dk, self.dv) != (heads, dk, dv):
            raise LifetimeCalibrationError(f"the lifetime calibration is for heads x dk x dv = {self.heads} x {self.dk} "
                                           f"x {self.dv}, but layer {layer}'s state is {heads} x {dk} x {dv}")

    def check_model(self, *, fingerprint: str, layers, heads: int, dk: int, dv: int,
                    source: str = "calibration") -> None:
        """Raises ``LifetimeCalibrationError`` naming ``source`` and what differs when this
        calibration was not made for the model described."""
        problems = model_mismatches(self, fingerprint=fingerprint, layers=layers, heads=heads, dk=dk, dv=dv)
        if problems:
            raise LifetimeCalibrationError(f"lifetime {source} does not match this model: " + "; ".join(problems))

    def content(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "model": self.model, "architecture": self.architecture,
                "heads": self.heads, "dk": self.dk, "dv": self.dv, "horizon": self.horizon,
                "layers": list(self.layers), "plans": {p.name: p.to_json(self.layers) for p in self.plans}}

    def save(self, path: str, extra: Optional[dict] = None) -> None:
        """Writes the JSON file atomically; ``extra`` (how it was made, scores) goes under ``calibration``."""
        out = self.content()
        if extra:
            out["calibration"] = extra
        write_json(path, out)

    @classmethod
    def load(cls, path: str) -> "LifetimeCalibration":
        """Reads a file written by ``save``; ``LifetimeCalibrationError`` naming ``path`` if it is not one."""
        where = f"lifetime calibration {path}"
        d = read_json(path, what="lifetime calibration", fmt=FORMAT, version=VERSION, error=LifetimeCalibrationError,
                      hint="; make one with `leapquant calibrate-stepquant`")
        try:
            layers = tuple(int(x) for x in d["layers"])
            plans = []
            for name, p in d["plans"].items():
                if p.get("kind") not in PLAN_KINDS:
                    raise LifetimeCalibrationError(f"plan {name}: unknown kind {p.get('kind')!r}")
                plans.append(PLAN_KINDS[p["kind"]].from_json(name, p, layers))
            return cls(architecture=str(d["architecture"]), layers=layers, heads=int(d["heads"]), dk=int(d["dk"]),
                       dv=int(d["dv"]), horizon=int(d["horizon"]), plans=tuple(plans), model=str(d.get("model", "")))
        except LifetimeCalibrationError as err:
            raise LifetimeCalibrationError(f"{where}: {err}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise LifetimeCalibrationError(f"{where}: malformed ({type(err).__name__}: {err})") from None


def as_calibration(calibration) -> Optional[LifetimeCalibration]:
    """A ``LifetimeCalibration``, the path of its file (loaded), or ``None``."""
    if calibration is None or isinstance(calibration, LifetimeCalibration):
        return calibration
    if isinstance(calibration, (str, os.PathLike)):
        return LifetimeCalibration.load(str(calibration))
    raise LifetimeCalibrationError(f"a lifetime calibration is a LifetimeCalibration or the path of its file, got "
                                   f"{type(calibration).__name__}")


class PlanMethod:
    """What a method that runs the plan named ``plan`` of its ``calibration`` (a
    ``LifetimeCalibration`` or ``None``) at model layer ``layer`` shares: its name is the plan's,
    ``for_layer`` specialises it to a layer, ``layer_plan`` finds the layer's plan. A base of the
    method's frozen dataclass, which declares those three fields."""

    @property
    def name(self) -> str:
        return self.plan

    def for_layer(self, layer: int):
        return dataclasses.replace(self, layer=int(layer))

    def layer_plan(self, heads: int, dk: int, dv: int, *, need_plan: bool, plan_type: type, kind: str,
                   differs: str) -> Optional[tuple[Plan, int]]:
        """``(plan, index of the layer in it)`` for a state of ``heads x dk x dv``; ``None`` without
        a calibration where ``need_plan`` is false. ``LifetimeCalibrationError`` without one where it
        is true, without a layer (the ``differs`` word names what differs per layer), for another
        shape, or for a plan that is not a ``plan_type`` (``kind`` names it)."""
        if self.calibration is None:
            if need_plan:
                raise LifetimeCalibrationError(f"method {self.plan!r} needs a calibration file (`leapquant "
                                               "calibrate-stepquant`; pass it with --stepquant-calibration, or "
                                               f"make_method({self.plan!r}, calibration=...))")
            return None
        if self.layer is None:
            raise LifetimeCalibrationError(f"method {self.plan!r} keeps a different {differs} per layer: specialise "
                                           "it with method.for_layer(layer) first")
        cal = self.calibration
        cal.check_shape(self.layer, heads, dk, dv)
        plan = cal.plan(self.plan)
        if not isinstance(plan, plan_type):
            raise LifetimeCalibrationError(f"plan {self.plan!r} of the calibration is not a {kind} plan")
        return plan, cal.layer_index(self.layer)


@dataclasses.dataclass(frozen=True)
class WindowedPlanMethod(PlanMethod):
    """The fields of a windowed ``PlanMethod`` (``leapquant-alloc-*``, ``leapquant-dual-*``):
    ``plan``, ``calibration`` (a ``LifetimeCalibration``, its path or ``None``), ``layer``,
    ``window`` (records per window ``p``) and ``impl`` (as ``LeapQuantConfig.impl``). A subclass
    names its plans in ``NAMES`` (a class attribute) and gives ``plan`` its default."""

    plan: str
    calibration: Optional["LifetimeCalibration"] = None
    layer: Optional[int] = None
    window: int = 16
    impl: str = "auto"

    NAMES = {}

    def __post_init__(self):
        object.__setattr__(self, "calibration", as_calibration(self.calibration))
        if self.calibration is None and self.plan not in self.NAMES:
            raise ValueError(f"unknown method {self.plan!r}; known: {', '.join(self.NAMES)}")
        LeapQuantConfig(window=self.window, impl=self.impl)    # checks both


__all__ = ["ARCHITECTURES", "DEFAULT_EVERY", "DEFAULT_HORIZON", "DEFAULT_SAMPLES", "FORMAT", "LayerStatistics",
           "LifetimeCalibration", "LifetimeCalibrationError", "Plan", "PlanMethod", "StepQuantPlan", "WidthPlan",
           "WindowedPlanMethod", "as_calibration", "layer_statistics", "row_impact", "significant"]
