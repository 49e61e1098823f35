"""What the amortised LeapQuant window could reach, from the rows of one ``bench.kernels`` run.

    python -m bench.ceilings bench/results/kernels-A.json [kernels-B.json ...] [--flush-target-us 600]
                             [--load-only-from kernels-C.json] [--out FILE.md]

The amortised per-token time of a window is ``(p steps + 1 flush) / p``. Each row below replaces
one part of a measured window by a bound and recomputes its ratio to FLA's fp32 kernel timed in
the same run (against the ``bench.kernels`` ``TARGETS`` ratios for the amortised window):

* ``measured``: the window as timed;
* ``last step free``: the window less one step's time, the most that doing the window's last step
  inside the flush kernel (the codes already loaded) can save, whatever that kernel costs;
* ``flush at target``: the measured steps with the flush at ``--flush-target-us`` (the issue's
  0.6 ms) and, with it, the last step free;
* ``load-only step``: the step replaced by the load-only kernel of the same run (``--load-only``:
  a Pallas kernel that reads exactly the bytes the step needs and does no arithmetic, the fastest
  of its variants; ``--load-only-from`` also takes those of another run, where they moved exactly
  the step's bytes of this one), with the flush as measured, at its target, and free.

Also, per mode: the flush time that the target ratio leaves with the measured step, and the step
time it leaves with the flush at its target. Everything is taken from the run's rows at its
largest batch (FLA, the amortised window, the step alone, the flush alone, the load-only rows);
a mode without them is skipped with a line saying which row is missing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from bench.kernel_report import TARGETS, row_kind

WANTED = {mode: wanted for what, mode, kind, key, sense, wanted in TARGETS if kind == "lq-window"}


def _rows(results, mode, load_rows=None):
    """``(fla_us, window_us, step_us, flush_us, p, load_only_us | None)`` at the run's largest batch
    for ``mode`` (the int8 rows: the run's ``bits``), or a string naming the missing row.
    ``load_rows``: load-only rows of another run, used where they moved the step's bytes of this one."""
    timings = results.get("timings") or []
    if not timings:
        return "the run has no timing rows"
    bsz = max(r["batch"] for r in timings)
    bits = results.get("bits", 8)
    pick = {}
    for r in timings:
        if r["batch"] != bsz or r["mode"] != mode:
            continue
        kind = row_kind(r)
        if kind == "fla" or (kind in ("lq-window", "lq-steps", "lq-flush") and r.get("bits", bits) == bits):
            pick.setdefault(kind, r)
    missing = [k for k in ("fla", "lq-window", "lq-steps", "lq-flush") if k not in pick]
    if missing:
        return f"no {', '.join(missing)} row at batch {bsz}"
    window = pick["lq-window"]
    p = re.search(r"\bp=(\d+)", window["impl"])     # the row's name says its window ("p=16")
    if p is None:
        return f"the window row ({window['impl']!r}) does not say its window"
    p = int(p.group(1))
    step_bytes = pick["lq-steps"].get("bytes")
    loads = [r["us"] for r in list(results.get("load_only") or []) + list(load_rows or [])
             if r["mode"] == mode and r["batch"] == bsz and r.get("us") == r.get("us") and not r.get("interpret")
             and r.get("bytes") == step_bytes]
    return (pick["fla"]["us"], window["us"], pick["lq-steps"]["us"], pick["lq-flush"]["us"], p,
            min(loads) if loads else None)


def ceilings(results, flush_target_us: float = 600.0, load_rows=None) -> dict:
    """Per mode: ``dict(fla_us, p, step_us, flush_us, load_only_us, wanted, rows=[(label, us, ratio)],
    flush_us_for_target, step_us_for_target)``, or ``dict(skipped=reason)``. The load-only step is
    the fastest load-only row (of the run, or of ``load_rows``) that moved the step's bytes."""
    out = {}
    for mode, wanted in WANTED.items():
        got = _rows(results, mode, load_rows)
        if isinstance(got, str):
            out[mode] = dict(skipped=got)
            continue
        fla, window, step, flush, p, load = got
        # The window's own time less its p steps: the flush as the window timed it (its donation,
        # its cond), which the flush row alone times too.
        rows = [("measured", window),
                ("last step free", window - step / p),
                (f"flush at {flush_target_us:.0f} µs", (p * step + flush_target_us) / p),
                (f"flush at {flush_target_us:.0f} µs, last step free", ((p - 1) * step + flush_target_us) / p)]
        if load is not None:
            rows += [("load-only step, flush as measured", (p * load + flush) / p),
                     (f"load-only step, flush at {flush_target_us:.0f} µs", (p * load + flush_target_us) / p),
                     ("load-only step, no flush", load)]
        goal = fla / wanted     # the amortised µs the target asks for
        out[mode] = dict(fla_us=fla, p=p, step_us=step, flush_us=flush, load_only_us=load, wanted=wanted,
                         goal_us=goal, rows=[(label, us, fla / us) for label, us in rows],
                         flush_us_for_target=p * (goal - step), step_us_for_target=goal - flush_target_us / p)
    return out


def markdown(found: dict, source: str, flush_target_us: float) -> str:
    """The tables of ``ceilings`` as markdown."""
    out = [f"# Ceilings of the amortised window ({source})", ""]
    for mode, c in found.items():
        if "skipped" in c:
            out += [f"{mode}: skipped ({c['skipped']})", ""]
            continue
        load = f"{c['load_only_us']:.1f} µs" if c["load_only_us"] is not None else "not timed"
        out += [f"## {mode}: FLA fp32 {c['fla_us']:.1f} µs; target ≥ {c['wanted']:.1f}× = ≤ {c['goal_us']:.1f} µs "
                f"per token-step", "",
                f"p = {c['p']}; step {c['step_us']:.1f} µs, flush {c['flush_us']:.1f} µs, load-only step {load}.", "",
                "| window | µs per token-step | × FLA fp32 | meets the target |", "| --- | --- | --- | --- |"]
        out += [f"| {label} | {us:.1f} | {ratio:.2f} | {'yes' if ratio >= c['wanted'] else 'no'} |"
                for label, us, ratio in c["rows"]]
        fl = c["flush_us_for_target"]
        out += ["", f"With the measured step, the target leaves the flush "
                    f"{'no time at all' if fl <= 0 else f'{fl:.0f} µs per window'}; with the flush at "
                    f"{flush_target_us:.0f} µs it leaves the step {c['step_us_for_target']:.1f} µs.", ""]
    return "\n".join(out)


def _read(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        sys.exit(f"cannot read {path}: {err}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="bench.kernels JSON files (their modes are read from each)")
    ap.add_argument("--flush-target-us", type=float, default=600.0, help="the flush time of the bounds (µs)")
    ap.add_argument("--load-only-from", default=None,
                    help="a bench.kernels JSON whose load-only rows to use too (those that moved the step's bytes)")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    args = ap.parse_args(argv)
    load_rows = _read(args.load_only_from).get("load_only") if args.load_only_from else None
    text = []
    for path in args.runs:
        found = {m: c for m, c in ceilings(_read(path), args.flush_target_us, load_rows).items()
                 if "skipped" not in c or len(args.runs) == 1}
        source = path + (f"; load-only rows also from {args.load_only_from}" if args.load_only_from else "")
        text.append(markdown(found, source, args.flush_target_us))
    print("\n".join(text))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
