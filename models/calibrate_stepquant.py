"""``leapquant calibrate-stepquant``: the lifetime calibration of ``stepquant-6/-4``,
``leapquant-alloc-6/-4`` and ``leapquant-dual-6/-4`` on a checkpoint, in one file.

    leapquant calibrate-stepquant CKPT --data FILE --out CAL.json [--rows 32] [--tokens 256]
                                  [--every 8] [--samples 64] [--horizon 2048] [--pivots N] [--json]

The calibration rows go through the decode path with the fp32 state, recording every
linear-attention layer's inputs (``models.calibrate.record_traces``, as ``calibrate-damp``);
``leapquant_jax.lifetime.layer_statistics`` turns each layer's into calibration states, read-out
impacts and lifetimes; ``stepquant.stepquant_plan`` and ``leapquant_alloc.width_plan`` solve the
plans, ``leapquant-dual-<b>`` taking ``stepquant-<b>``'s (``calibrate_lifetime``: all of it on rows
in memory, which ``leapquant task`` calibrates with on the task's training rows). The file records
the model's fingerprint (``models.calibrate.model_fingerprint``) and each plan's scores. ``eval``, ``recall``, ``demo``,
``task`` (``--states``), ``generate``, ``score`` and ``replay`` (``--state``/``--method``) take it
with ``--stepquant-calibration CAL.json`` and refuse one made on another model.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Optional, Sequence

from leapquant_jax.cli_support import int_at_least
from leapquant_jax.leapquant_alloc import NAMES as ALLOC_NAMES
from leapquant_jax.leapquant_alloc import width_plan
from leapquant_jax.leapquant_dual import NAMES as DUAL_NAMES
from leapquant_jax.lifetime import (DEFAULT_EVERY, DEFAULT_HORIZON, DEFAULT_SAMPLES, LifetimeCalibration,
                                    layer_statistics, significant)
from leapquant_jax.stepquant import NAMES as STEPQUANT_NAMES
from leapquant_jax.stepquant import stepquant_plan
from models.calibrate import (add_calibration_options, calibration_rows, linear_state_layout, model_fingerprint,
                              record_traces, save_calibration)


def calibrate_traces(traces: dict, *, every: int = DEFAULT_EVERY, samples: int = DEFAULT_SAMPLES,
                     horizon: int = DEFAULT_HORIZON, pivots: Optional[int] = None, model: str = "",
                     stepquant_budgets: Optional[dict] = None,
                     alloc_budgets: Optional[dict] = None,
                     dual_names: Optional[Sequence[str]] = None) -> tuple[LifetimeCalibration, dict]:
    """The lifetime calibration of recorded fp32 inputs ``{layer: {"q", "k", "v", "g", "beta":
    [B, T, ...]}}``: one statistics pass per layer, then a plan per method name.

    stepquant_budgets: ``{name: nominal bits}`` (default ``stepquant.NAMES``); alloc_budgets:
    ``{name: checkpoint bits per value or None}`` (default ``leapquant_alloc.NAMES``' names with
    ``None``: the budget of ``leapquant`` at the name's width); an empty mapping plans none of its
    kind; dual_names: the ``leapquant-dual-*`` plans (default all), each ``stepquant_plan``'s at its
    name's budget (made once for both names). Returns ``(calibration, scores)``.
    """
    if not traces:
        raise ValueError("a lifetime calibration needs the traces of at least one linear-attention layer")
    stats = {int(layer): layer_statistics(x, every=every, max_samples=samples, horizon=horizon)
             for layer, x in sorted(traces.items())}
    first = next(iter(stats.values()))
    _, heads, dk, dv = first.samples.shape
    plans, scores = [], {}
    by_budget = {}
    for name, budget in (STEPQUANT_NAMES if stepquant_budgets is None else stepquant_budgets).items():
        plan, scores[name] = stepquant_plan(stats, budget, name=name, pivots=pivots)
        plans.append(plan)
        by_budget.setdefault(float(budget), (plan, scores[name]))
    for name in (DUAL_NAMES if dual_names is None else dual_names):
        budget = float(DUAL_NAMES[name])
        if budget not in by_budget:
            by_budget[budget] = stepquant_plan(stats, budget, name=name, pivots=pivots)
        plan, scores[name] = by_budget[budget]
        plans.append(dataclasses.replace(plan, name=name))
    for name, budget in ({n: None for n in ALLOC_NAMES} if alloc_budgets is None else alloc_budgets).items():
        plan, scores[name] = width_plan(stats, ALLOC_NAMES.get(name), budget=budget, name=name)
        plans.append(plan)
    scores["statistics"] = {str(layer): {"lifetime": significant(s.lifetime), "impact": significant(s.impact)}
                            for layer, s in stats.items()}
    cal = LifetimeCalibration(architecture=first.architecture, layers=tuple(stats), heads=heads, dk=dk, dv=dv,
                              horizon=horizon, plans=tuple(plans), model=model)
    return cal, scores


def calibrate_lifetime(arch, params, config, rows, *, every: int = DEFAULT_EVERY, samples: int = DEFAULT_SAMPLES,
                       horizon: int = DEFAULT_HORIZON, pivots: Optional[int] = None,
                       names: Optional[Sequence[str]] = None) -> tuple[LifetimeCalibration, dict]:
    """The lifetime calibration of a model on ``rows [R, T]`` token ids: its fp32 traces
    (``record_traces``), then ``calibrate_traces`` with the model's fingerprint. names: the plans
    to make (method names of ``stepquant.NAMES``, ``leapquant_alloc.NAMES`` and
    ``leapquant_dual.NAMES``; default all).
    Raises ``ValueError`` naming an unknown name or a model with no linear-attention layer."""
    if names is not None:
        known = list(STEPQUANT_NAMES) + list(ALLOC_NAMES) + list(DUAL_NAMES)
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise ValueError(f"lifetime calibration: {'unknown method ' + repr(unknown[0]) if unknown else 'no method'}"
                             f" to plan; it plans {', '.join(known)}")
    linear_state_layout(arch, config)
    traces = record_traces(arch, params, config, rows)
    stepquant = alloc = dual = None
    if names is not None:
        stepquant = {n: bits for n, bits in STEPQUANT_NAMES.items() if n in names}
        alloc = {n: None for n in ALLOC_NAMES if n in names}
        dual = [n for n in DUAL_NAMES if n in names]
    return calibrate_traces(traces, every=every, samples=samples, horizon=horizon, pivots=pivots,
                            model=model_fingerprint(config, params), stepquant_budgets=stepquant, alloc_budgets=alloc,
                            dual_names=dual)


def run_calibrate_stepquant(args) -> int:
    """The ``leapquant calibrate-stepquant`` handler."""
    arch, config, params, rows = calibration_rows(args)
    t0 = time.time()
    cal, scores = calibrate_lifetime(arch, params, config, rows, every=args.every, samples=args.samples,
                                     horizon=args.horizon, pivots=args.pivots)
    out = save_calibration(args, cal, scores, samples=args.samples)
    result = {"command": "calibrate-stepquant", "checkpoint": str(args.checkpoint), "out": str(out),
              "layers": list(cal.layers), "architecture": cal.architecture, "horizon": cal.horizon,
              "plans": {p.name: {"budget": p.budget} for p in cal.plans}, "seconds": round(time.time() - t0, 3)}
    print(json.dumps(result) if args.json else
          f"wrote {out}: plans {', '.join(cal.names)} over layers {list(cal.layers)} ({cal.architecture})")
    return 0


def add_subcommand(subparsers) -> None:
    """Registers ``calibrate-stepquant`` on an argparse subparsers object."""
    p = subparsers.add_parser("calibrate-stepquant",
                              help="lifetime calibration of stepquant-6/-4, leapquant-alloc-6/-4 and "
                                   "leapquant-dual-6/-4 (one file)")
    add_calibration_options(p, every=DEFAULT_EVERY)
    p.add_argument("--samples", type=int_at_least(1), default=DEFAULT_SAMPLES,
                   help="calibration states kept per layer (evenly spaced)")
    p.add_argument("--horizon", type=int_at_least(1), default=DEFAULT_HORIZON, help="lifetime horizon in tokens")
    p.add_argument("--pivots", type=int_at_least(0), default=None,
                   help="stepquant's fp16 units (GDN heads, KDA key rows) over the model (default: a share of them)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run_calibrate_stepquant)


__all__ = ["add_subcommand", "calibrate_lifetime", "calibrate_traces", "run_calibrate_stepquant"]
