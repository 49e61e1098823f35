"""Accuracy benchmark: the paper's Tables 1-3 and Figures 3 and 6 in miniature, on trained checkpoints.

    python -m bench.accuracy --checkpoints models/checkpoints/stdlib-gdn models/checkpoints/stdlib-kda
                             --data HELDOUT.npy [--context 16384] [--segments 3] [--workers 4]
                             [--time-budget 480] [--grace 60] [--error-every 512] [--greedy-tokens 16]
                             [--only LABELS | --groups formats,sweeps,rivals] [--damp-calibration FILE]
                             [--commit HASH] [--out bench/results] [--tiny]

``--data`` holds held-out token ids ``[N]`` (``.npy``, any integer dtype); the rows are
``--segments`` disjoint consecutive segments of ``--context`` tokens (``evaluate.segment_rows``),
and every token goes through the decode path (no prefill). Each *job* is one state method on one
checkpoint, scored by ``models.evaluate.score_method`` against the fp32 reference
(``reference_run``): perplexity, KL to fp32, top-1 agreement, greedy match, relative state error
and its curve every ``--error-every`` decoded tokens, per segment. Jobs, most important first:

1. Tables 1 and 2 at 8 bits (and the 16-bit baselines): ``fp32, bf16, fp8, int8, bf16-w, int8-w,
   int8-w+ct, int8-w+smooth, leapquant``;
2. Table 1 at 6 and 4 bits: ``leapquant-b6/-b4``, then the windowed integer state alone
   (``int6-w``), with Compensator Tokens (``int6-w+ct``) and with smoothing (``int6-w+smooth``);
3. Table 3: LeapQuant 8-bit with window ``p`` in 4, 8, 32 (``leapquant-p4`` ...) and rank ``r``
   in 2, 8, 16 (``leapquant-r2`` ...); ``p = 16, r = 4`` is ``leapquant`` itself;
4. Table 6: every other per-step method (``TABLE6``: direct and block formats, the adapted
   KVQuant/QuaRot/TurboQuant states, stochastic rounding, error feedback, fp8 tiles, int16 and
   ``damp`` with the ``damp-calibration.json`` shipped in the checkpoint folder or
   ``--damp-calibration``; ``stepquant-6/-4`` and ``leapquant-alloc-6/-4`` with its
   ``stepquant-calibration.json``), at 8, 6 and 4 bits.

The jobs form three groups (``--groups``): ``formats`` (1 and 2), ``sweeps`` (3) and ``rivals``
(4, which also runs Table 1's per-step formats and LeapQuant so that Table 6 compares within one
run); fp32 always runs. Under Table 6 the report lists, for LeapQuant at 8, 6 and 4 bits, the
per-step methods at the same or fewer bytes per element that match or beat it on KL or state error.

``--workers`` processes (``python -m bench.accuracy --worker SPEC``) share the checkpoints evenly,
each pinned to one, with ``XLA_PYTHON_CLIENT_MEM_FRACTION = 0.8 / workers`` and no preallocation:
compilation dominates (each method is a new program), so jobs run side by side. A worker computes
the fp32 reference once, then takes the next job of its checkpoint in priority order (a lock-file
queue shared by that checkpoint's workers) until none is left or ``--time-budget`` seconds have
passed since the start; then it marks the jobs left ``skipped: time budget``. Workers still running
``--grace`` seconds after the budget are stopped. Each finished job is appended at once as one
JSON line to ``<out>/accuracy-<UTC>.jsonl``, so a run cut short keeps what finished. The first
worker of each checkpoint also runs Figure 6 on the fp32 final states of its reference.

The report, ``<out>/accuracy-<UTC>.md`` and ``.json``: header (date, GPU, JAX, commit, command),
then per checkpoint Table 1 (methods by bit width, bytes per state element), Table 2 (the
ablation ladders), Table 3 (window and rank sweeps), Table 6 (rivals), every cell ``mean ± spread`` over the
segments (spread = half the min-max range), the targets evaluated from those numbers, and the
Figure 6 peak/median table. PNGs: ``accuracy-<UTC>-fig3-<checkpoint>.png`` (state error against
decoded tokens) and ``accuracy-<UTC>-fig6-<checkpoint>.png`` (outlier heat maps). ``--tiny`` is a
CPU smoke run of the whole pipeline (context 96, 2 segments, 2 workers, six jobs). ``--merge A.json
B.json ...`` runs nothing: it writes one report (``accuracy-<UTC>-merged.*``) from runs with the same
data and settings, each row from the last run that finished it (a run cut short by its budget is
completed by a second one with ``--only`` the rest).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

from bench.harness import environment, git_commit
from leapquant_jax.methods import LIFETIME_METHODS, make_method
from leapquant_jax.studies.errors import ALL_METHODS
from models.evaluate import EvalConfig, segment_rows

ROOT = Path(__file__).resolve().parents[1]
# DAMP's calibration, shipped inside each checkpoint folder (``leapquant calibrate-damp``).
DAMP_FILE = "damp-calibration.json"
# The lifetime calibration of stepquant-* and leapquant-alloc-* (``leapquant calibrate-stepquant``), beside it.
LIFETIME_FILE = "stepquant-calibration.json"
SHIPPED = (ROOT / "models" / "checkpoints" / "stdlib-gdn", ROOT / "models" / "checkpoints" / "stdlib-kda")


@dataclasses.dataclass(frozen=True)
class Job:
    """One method configuration: ``label`` (a ``study errors`` name or one of this benchmark's),
    the ``make_method`` name and options, the residual ``bits`` it is grouped under (32 and 16
    for the float states, 10 for DAMP's 9.875) and its ``group`` (``GROUPS``)."""

    label: str
    name: str
    options: tuple
    bits: int
    group: str = "formats"

    def method(self, damp_calibration: Optional[str] = None, lifetime_calibration: Optional[str] = None):
        """The state method (``impl`` left at its default: Pallas kernels on a GPU); ``damp``
        takes its calibration file ``damp_calibration``, ``stepquant-*`` and ``leapquant-alloc-*``
        theirs, ``lifetime_calibration``."""
        if self.name in LIFETIME_METHODS:
            if lifetime_calibration is None:
                raise ValueError(f"{self.name}: no calibration file ({LIFETIME_FILE} in the checkpoint; `leapquant "
                                 "calibrate-stepquant` makes one)")
            return make_method(self.name, calibration=lifetime_calibration)
        if self.name == "damp":
            if damp_calibration is None:
                raise ValueError("damp: no calibration file (--damp-calibration, or damp-calibration.json in the "
                                 "checkpoint; `leapquant calibrate-damp` makes one)")
            return make_method("damp", calibration=damp_calibration)
        return make_method(self.name, **dict(self.options))


# formats: Tables 1 and 2; sweeps: Table 3; rivals: Table 6 (every other per-step method).
GROUPS = ("formats", "sweeps", "rivals")


def _study(label: str, bits: int, group: str = "formats") -> Job:
    name, options = ALL_METHODS[label]
    return Job(label, name, tuple(sorted(options.items())), bits, group)


def _leapquant(label: str, bits: int = 8, group: str = "formats", **options) -> Job:
    return Job(label, "leapquant", tuple(sorted(dict(options, bits=bits).items())), bits, group)


# Table 6 rows by bit width: LeapQuant and the per-step methods of Table 1 with every rival.
TABLE6 = {
    16: ("bf16", "bf16+sr", "int16"),
    10: ("damp",),
    8: ("fp8", "fp8-channel", "fp8-tensor", "fp8-tile", "fp8-tile+sr", "int8", "int8-channel", "int8-tensor",
        "int8+sr", "int8+ef", "int8+ef4", "mxfp8", "kvquant", "quarot", "turboquant", "leapquant"),
    6: ("int6", "mxfp6", "nvfp6", "kvquant-b6", "quarot-b6", "turboquant-b6", "stepquant-6", "leapquant-b6",
        "leapquant-alloc-6"),
    4: ("int4", "mxfp4", "nvfp4", "kvquant-b4", "quarot-b4", "turboquant-b4", "stepquant-4", "leapquant-b4",
        "leapquant-alloc-4"),
}


def all_jobs() -> list:
    """Every job in priority order (see the module docstring); labels are unique."""
    jobs = [_study("fp32", 32), _study("bf16", 16), _study("fp8", 8), _study("int8", 8), _study("bf16-w", 16),
            _study("int8-w", 8), _study("int8-w+ct", 8), _study("int8-w+smooth", 8), _study("leapquant", 8)]
    jobs += [_study("leapquant-b6", 6), _study("leapquant-b4", 4)]
    for fix, options in (("", dict(compensators=False, smoothing=False)), ("+ct", dict(smoothing=False)),
                         ("+smooth", dict(compensators=False))):
        jobs += [_leapquant(f"int{b}-w{fix}", b, **options) for b in (6, 4)]
    jobs += [_leapquant(f"leapquant-p{p}", window=p, group="sweeps") for p in (4, 8, 32)]
    jobs += [_leapquant(f"leapquant-r{r}", window=16, rank=r, group="sweeps") for r in (2, 8, 16)]
    known = {j.label for j in jobs}
    jobs += [_study(label, bits, "rivals") for bits, labels in TABLE6.items() for label in labels if label not in known]
    return jobs


TINY_JOBS = ("fp32", "int8", "int8-w", "leapquant", "leapquant-b6", "leapquant-p8")
# Figure 3: the 8-bit (and 16-bit) methods of Tables 1 and 2, and LeapQuant at 6 and 4 bits.
FIG3_LABELS = ("bf16", "fp8", "int8", "bf16-w", "int8-w", "int8-w+ct", "int8-w+smooth", "leapquant",
               "leapquant-b6", "leapquant-b4")


def select_jobs(only: Optional[str], *, tiny: bool = False, groups: Optional[str] = None) -> list:
    """The jobs to run, in priority order: ``only`` (comma-separated labels) or, without it, those
    of ``groups`` (comma-separated ``GROUPS``; default all; ``TINY_JOBS`` with ``tiny``). Raises
    ``ValueError`` naming an unknown or repeated label or group."""
    jobs = all_jobs()
    if only is None:
        if tiny:
            return [j for j in jobs if j.label in TINY_JOBS]
        if groups is None:
            return jobs
        picked = [x.strip() for x in groups.split(",")]
        for g in picked:
            if g not in GROUPS:
                raise ValueError(f"--groups: unknown group {g!r}; known: {', '.join(GROUPS)}")
        # fp32 is every table's reference and runs whatever the groups; Table 6 (rivals) also
        # holds LeapQuant and the per-step formats of Table 1, measured in the same run.
        table6 = {x for group in TABLE6.values() for x in group} if "rivals" in picked else set()
        return [j for j in jobs if j.group in picked or j.label == "fp32" or j.label in table6]
    if groups is not None:
        raise ValueError("give --only or --groups, not both")
    labels = [x.strip() for x in only.split(",")]
    known = [j.label for j in jobs]
    for label in labels:
        if label not in known:
            raise ValueError(f"--only: unknown job {label!r}; known: {', '.join(known)}")
        if labels.count(label) > 1:
            raise ValueError(f"--only names {label!r} more than once")
    return [j for j in jobs if j.label in labels]


# ----------------------------------------------------------------------------- worker


def _locked_append(path: str, line: str) -> None:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(line + "\n")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)


def claim_jobs(queue: str, labels: list, *, rest: bool = False) -> list:
    """Takes the next unclaimed label of ``labels`` (all the unclaimed ones with ``rest``) from the
    queue file ``queue`` that a checkpoint's workers share (claimed labels, one a line, under a lock)."""
    with open(queue, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        taken = set(f.read().split())
        todo = [x for x in labels if x not in taken]
        picked = todo if rest else todo[:1]
        f.write("".join(x + "\n" for x in picked))
        f.flush()
        fcntl.flock(f, fcntl.LOCK_UN)
    return picked


def outlier_figure(final: dict, rank: int, path: str, title: str) -> dict:
    """Figure 6 on fp32 final states ``{layer: [B, H, dk, dv]}``: the (layer, segment, head) whose
    state has the largest peak/median magnitude, its peak/median before, after Compensator Tokens
    and after smoothing (``studies.outliers.run_outlier_study``), and its heat maps at ``path``."""
    from leapquant_jax.studies.outliers import peak_over_median, plot_outliers, run_outlier_study

    scores = {layer: [[peak_over_median(s[b, h]) for h in range(s.shape[1])] for b in range(s.shape[0])]
              for layer, s in final.items()}
    layer, b, h = max(((layer, b, h) for layer, rows in scores.items() for b, heads in enumerate(rows)
                       for h in range(len(heads))), key=lambda x: scores[x[0]][x[1]][x[2]])
    study = run_outlier_study(final[layer][b], rank=rank, head=h)
    plot_outliers(final[layer][b, h], rank, path, title=f"{title}: layer {layer}, segment {b}, head {h}")
    return {"layer": int(layer), "segment": b, "head": h, "rank": rank,
            "peak_over_median": study["peak_over_median"], "mean_over_heads_of_that_layer_and_segment":
            study["mean_over_heads"], "state_peak_over_median_all": {str(k): v for k, v in scores.items()},
            "figure": os.path.basename(path)}


def run_worker(spec_path: str) -> int:
    """One worker (``--worker SPEC``): the fp32 reference of its checkpoint, then jobs from the
    checkpoint's queue until none is left or the deadline has passed; one JSON line per event."""
    with open(spec_path) as f:
        spec = json.load(f)
    tag = f"[{spec['name']} w{spec['worker']}]"

    def emit(record):
        _locked_append(spec["jsonl"], json.dumps(dict(record, checkpoint=spec["name"], worker=spec["worker"])))

    def log(text):
        print(f"{tag} {time.time() - spec['start']:7.1f} s  {text}", flush=True)

    def skip_rest(reason):
        for label in claim_jobs(spec["queue"], spec["jobs"], rest=True):
            emit({"kind": "job", "label": label, "skipped": reason})
            log(f"{label}: skipped ({reason})")

    if time.time() >= spec["deadline"]:
        skip_rest("time budget")
        return 0
    import jax

    from leapquant_jax.state import LeapQuantConfig
    from leapquant_jax.studies.errors import state_bytes_per_element
    from models.checkpoint import load_model
    from models.decode import check_token_ids, to_device
    from models.evaluate import load_data, reference_run, score_method

    jobs = {j.label: j for j in all_jobs()}
    cfg = EvalConfig(**spec["cfg"])
    try:
        t0 = time.time()
        arch, config, params, _ = load_model(spec["checkpoint"])
        params = to_device(params)
        rows = segment_rows(load_data(spec["data"], None), cfg, source=f"--data {spec['data']}")
        rows = check_token_ids(rows, config.vocab_size, name=f"--data {spec['data']} ids")
        log(f"reference (fp32 greedy continuation, scoring, replay) on {jax.devices()[0]} ...")
        ref = reference_run(arch, params, config, rows, cfg)
        emit({"kind": "reference", "seconds": round(time.time() - t0, 2)})
        log(f"reference done in {time.time() - t0:.1f} s (compile + run)")
    except Exception as err:  # reported in the results; the checkpoint's other workers go on
        emit({"kind": "worker_error", "error": f"{type(err).__name__}: {str(err)[:500]}"})
        log(f"failed: {type(err).__name__}: {err}")
        return 1
    first = next(iter(ref.traces.values()))
    heads, dk, dv, kda = first["v"].shape[2], first["k"].shape[-1], first["v"].shape[-1], first["g"].ndim == 4
    if spec["fig6"]:
        t1 = time.time()
        try:
            out = outlier_figure(ref.final, LeapQuantConfig().effective_rank, spec["fig6"],
                                 f"{spec['name']}: fp32 final state after {cfg.context} tokens")
            emit(dict(out, kind="outliers"))
            log(f"Figure 6 done in {time.time() - t1:.1f} s")
        except Exception as err:
            emit({"kind": "outliers", "error": f"{type(err).__name__}: {str(err)[:500]}"})
    while True:
        if time.time() >= spec["deadline"]:
            skip_rest("time budget")
            return 0
        picked = claim_jobs(spec["queue"], spec["jobs"])
        if not picked:
            return 0
        job = jobs[picked[0]]
        t1 = time.time()
        record = {"kind": "job", "label": job.label, "method": job.name, "options": dict(job.options), "bits": job.bits}
        try:
            method = job.method(spec["damp_calibration"], spec.get("lifetime_calibration"))
            record["result"] = score_method(arch, params, config, ref, method, label=job.label)
            record["bytes_per_element"] = state_bytes_per_element(method, heads, dk, dv, kda)
            record["head"] = {"heads": heads, "dk": dk, "dv": dv, "kda": kda}
        except Exception as err:  # one failing method must not cost the others
            record["error"] = f"{type(err).__name__}: {str(err)[:500]}"
        record["seconds"] = round(time.time() - t1, 2)
        emit(record)
        log(f"{job.label}: {record['seconds']:.1f} s (compile + run)" + (f"  ERROR {record['error']}"
                                                                          if "error" in record else ""))


# ----------------------------------------------------------------------------- parent


def _tiny_data(folder: Path) -> Path:
    """The shipped checkpoints' held-out snippets, one after the other, as ``.npy`` ids."""
    ids = np.concatenate([np.asarray(json.loads((c / "heldout_snippet.json").read_text())["ids"], np.int32)
                          for c in SHIPPED])
    path = folder / "heldout-snippets.npy"
    np.save(path, ids)
    return path


def run_workers(args, cfg: EvalConfig, jobs: list, base: str, start: float, log) -> list:
    """Starts the workers, waits for them (stopping those still running ``--grace`` seconds after
    the budget) and returns notes on how each ended."""
    notes = []
    per_ckpt = args.workers // len(args.checkpoints)
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for c, ckpt in enumerate(args.checkpoints):
            queue = os.path.join(tmp, f"queue-{c}")
            open(queue, "w").close()
            for w in range(per_ckpt):
                damp = args.damp_calibration or (ckpt / DAMP_FILE if (ckpt / DAMP_FILE).is_file() else None)
                spec = dict(checkpoint=str(ckpt), name=ckpt.name, data=str(args.data), cfg=dataclasses.asdict(cfg),
                            damp_calibration=None if damp is None else str(damp),
                            lifetime_calibration=(str(ckpt / LIFETIME_FILE) if (ckpt / LIFETIME_FILE).is_file()
                                                  else None),
                            jobs=[j.label for j in jobs], queue=queue, jsonl=base + ".jsonl", worker=w, start=start,
                            deadline=start + args.time_budget,
                            fig6=f"{base}-fig6-{ckpt.name}.png" if w == 0 else None)
                path = os.path.join(tmp, f"spec-{c}-{w}.json")
                with open(path, "w") as f:
                    json.dump(spec, f)
                env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=f"{0.8 / args.workers:.3f}",
                           XLA_PYTHON_CLIENT_PREALLOCATE="false",
                           PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
                procs.append((f"{ckpt.name} w{w}", subprocess.Popen(
                    [sys.executable, "-m", "bench.accuracy", "--worker", path], cwd=ROOT, env=env)))
        log(f"started {len(procs)} workers ({per_ckpt} per checkpoint), {len(jobs)} jobs per checkpoint")
        stop_at = start + args.time_budget + args.grace
        try:
            while any(p.poll() is None for _, p in procs) and time.time() < stop_at:
                time.sleep(0.5)
        finally:  # also when this process is interrupted: no worker outlives it
            for name, p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                    notes.append(f"worker {name} was stopped {args.grace:g} s after the time budget; its job in "
                                 "progress is lost")
                elif p.returncode:
                    notes.append(f"worker {name} exited with status {p.returncode}")
    for n in notes:
        log(n)
    return notes


def read_events(path: str) -> list:
    """The JSON lines the workers wrote (none when the file does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def spread_cell(values) -> dict:
    """``{"mean", "spread", "values"}`` over segments; spread = half the min-max range."""
    v = np.asarray(values, np.float64)
    return {"mean": float(v.mean()), "spread": float((v.max() - v.min()) / 2), "values": [float(x) for x in v]}


# (key, column title, format of the mean, format of the spread)
COLUMNS = {
    "perplexity": ("perplexity", ".3f", ".3f"),
    "dppl_pct": ("Δppl %", "+.3f", ".3f"),
    "kl_to_fp32": ("KL to fp32", ".3e", ".1e"),
    "top1_agreement": ("top-1 agr.", ".4f", ".4f"),
    "greedy_match_tokens": ("greedy match", ".2f", ".2f"),
    "state_rel_error": ("state err", ".3e", ".1e"),
}


def job_cells(record: dict, fp32: Optional[dict]) -> dict:
    """The table cells of one finished job: every ``COLUMNS`` key over segments (``dppl_pct``:
    per segment ``100 (ppl / ppl_fp32 - 1)``, absent without fp32's record)."""
    rows = record["result"]["per_row"]
    cells = {k: spread_cell(rows[k]) for k in COLUMNS if k in rows}
    if fp32 is not None:
        ref = np.asarray(fp32["result"]["per_row"]["perplexity"])
        cells["dppl_pct"] = spread_cell(100 * (np.asarray(rows["perplexity"]) / ref - 1))
    return cells


# Tables list every row, a job not selected marked "not run". Table 1 by bit width.
TABLE1 = ("fp32", "bf16", "bf16-w", "fp8", "int8", "int8-w", "int8-w+ct", "int8-w+smooth", "leapquant",
          "int6-w", "int6-w+ct", "int6-w+smooth", "leapquant-b6", "int4-w", "int4-w+ct", "int4-w+smooth",
          "leapquant-b4")
TABLE2 = (("int8", "per-step int8"), ("int8-w", "+ window (int8-w)"), ("int8-w+ct", "+ Compensator Tokens"),
          ("leapquant", "+ CT + smoothing = LeapQuant"), ("int8-w+smooth", "int8-w + smoothing alone (no CT)"),
          ("bf16", "per-step bf16"), ("bf16-w", "+ window (bf16-w)"))
TABLE3_WINDOW = (("leapquant-p4", 4, 4), ("leapquant-p8", 8, 4), ("leapquant", 16, 4), ("leapquant-p32", 32, 4))
TABLE3_RANK = (("leapquant-r2", 16, 2), ("leapquant", 16, 4), ("leapquant-r8", 16, 8), ("leapquant-r16", 16, 16))


def build_tables(records: dict, labels: list) -> dict:
    """Tables 1-3 of one checkpoint from its finished job records ``{label: record}``.
    Each table: ``{"columns": [...], "rows": [{"label", "cells": {key: cell}, ...}]}``; a job
    not finished gives a row with its ``status``."""
    fp32 = records.get("fp32") if "result" in records.get("fp32", {}) else None
    by_label = {j.label: j for j in all_jobs()}

    def row(label, **extra):
        rec = records.get(label)
        out = dict(label=label, **extra)
        if rec is None or "result" not in rec:
            out["status"] = ("not run" if label not in labels else
                             f"skipped: {rec['skipped']}" if rec and "skipped" in rec else
                             f"error: {rec['error']}" if rec and "error" in rec else "not finished")
            return out
        out["cells"] = job_cells(rec, fp32)
        b = rec["bytes_per_element"]
        out["bytes"] = {"checkpoint": b["checkpoint"], "live": b["live"]}
        return out

    cols = list(COLUMNS)
    table1 = [row(x, bits=by_label[x].bits) for x in TABLE1]
    table2 = [row(x, step=step) for x, step in TABLE2]
    table3 = [row(x, sweep="window", window=p, rank=r) for x, p, r in TABLE3_WINDOW] + \
             [row(x, sweep="rank", window=p, rank=r) for x, p, r in TABLE3_RANK]
    table6 = [row(x, bits=bits) for bits, group in TABLE6.items() for x in group]
    return {"table1": {"columns": cols, "rows": table1}, "table2": {"columns": cols, "rows": table2},
            "table3": {"columns": cols, "rows": table3}, "table6": {"columns": cols, "rows": table6}}


def rival_verdicts(tables: dict) -> list:
    """Table 6's question, per LeapQuant width: which per-step methods store as few or fewer bytes
    per element (live stream) and match or beat LeapQuant on KL to fp32 or on state error.
    Returns ``[{"leapquant", "bytes", "beaten_by": [{"label", "bytes", "kl_to_fp32", "state_rel_error"}],
    "compared": n}]`` (methods not finished are left out of ``compared``)."""
    rows = {r["label"]: r for r in tables["table6"]["rows"] if "cells" in r}
    per_step = [r for label, r in rows.items() if not label.startswith("leapquant")]
    out = []
    for lq in ("leapquant", "leapquant-b6", "leapquant-b4"):
        if lq not in rows:
            continue
        mine, b = rows[lq]["cells"], rows[lq]["bytes"]["live"]
        rivals = [r for r in per_step if r["bytes"]["live"] <= b + 1e-9]
        beaten = [{"label": r["label"], "bytes": r["bytes"]["live"],
                   **{k: r["cells"][k]["mean"] for k in ("kl_to_fp32", "state_rel_error") if k in r["cells"]}}
                  for r in rivals
                  if any(k in r["cells"] and k in mine and r["cells"][k]["mean"] <= mine[k]["mean"]
                         for k in ("kl_to_fp32", "state_rel_error"))]
        out.append({"leapquant": lq, "bytes": b, "compared": len(rivals), "beaten_by": beaten})
    return out



def targets(tables: dict) -> list:
    """The accuracy targets, evaluated from Table 1: ``[{"target", "met": True/False/None, "values"}]``
    (``None``: a job it needs did not finish)."""
    rows = {r["label"]: r for r in tables["table1"]["rows"]}

    def cell(label, key):
        r = rows.get(label)
        return r["cells"].get(key) if r and "cells" in r else None

    out = []

    def add(text, needs, test, values):
        missing = [f"{label} {key}" for label, key in needs if cell(label, key) is None]
        if missing:
            out.append({"target": text, "met": None, "values": f"missing: {', '.join(missing)}"})
        else:
            out.append({"target": text, "met": bool(test()), "values": values()})

    for label, bound in (("leapquant", 0.5), ("leapquant-b6", 1.0), ("leapquant-b4", 3.0)):
        add(f"{label}: |Δppl| <= {bound}% of fp32", [(label, "dppl_pct")],
            lambda label=label, bound=bound: abs(cell(label, "dppl_pct")["mean"]) <= bound,
            lambda label=label: f"Δppl = {cell(label, 'dppl_pct')['mean']:+.4f}% "
                                f"(± {cell(label, 'dppl_pct')['spread']:.4f})")
    add("leapquant: perplexity inside fp32's own segment spread (|ppl - ppl_fp32| <= fp32's half-range)",
        [("leapquant", "perplexity"), ("fp32", "perplexity")],
        lambda: abs(cell("leapquant", "perplexity")["mean"] - cell("fp32", "perplexity")["mean"])
        <= cell("fp32", "perplexity")["spread"],
        lambda: f"|{cell('leapquant', 'perplexity')['mean']:.4f} - {cell('fp32', 'perplexity')['mean']:.4f}| = "
                f"{abs(cell('leapquant', 'perplexity')['mean'] - cell('fp32', 'perplexity')['mean']):.4f} against "
                f"fp32's spread {cell('fp32', 'perplexity')['spread']:.4f}")
    for step, window in (("int8", "int8-w"), ("bf16", "bf16-w")):
        for key, name in (("kl_to_fp32", "KL"), ("state_rel_error", "state error")):
            add(f"per-step {step} worse than {window} on {name}", [(step, key), (window, key)],
                lambda step=step, window=window, key=key: cell(step, key)["mean"] > cell(window, key)["mean"],
                lambda step=step, window=window, key=key:
                f"{step} {cell(step, key)['mean']:.3e} vs {window} {cell(window, key)['mean']:.3e}")
    return out


def _fmt_cell(cell: Optional[dict], key: str) -> str:
    if cell is None:
        return "-"
    _, fm, fs = COLUMNS[key]
    return f"{cell['mean']:{fm}} ± {cell['spread']:{fs}}"


def _fmt_bytes(row: dict) -> str:
    b = row.get("bytes")
    if b is None:
        return "-"
    return f"{b['live']:.2f}" if abs(b["live"] - b["checkpoint"]) < 1e-9 else f"{b['checkpoint']:.2f} / {b['live']:.2f}"


def _md_table(table: dict, lead: list) -> list:
    """``lead``: ``(title, row -> text)`` columns before the metric columns."""
    cols = table["columns"]
    head = [t for t, _ in lead] + [COLUMNS[k][0] for k in cols]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in table["rows"]:
        first = [f(r) for _, f in lead]
        if "cells" not in r:
            out.append("| " + " | ".join(first + [r["status"]] + [""] * (len(cols) - 1)) + " |")
        else:
            out.append("| " + " | ".join(first + [_fmt_cell(r["cells"].get(k), k) for k in cols]) + " |")
    return out


def markdown(results: dict) -> str:
    """The report (see the module docstring)."""
    env, cfg = results["environment"], results["config"]
    out = [f"# Accuracy of state formats on trained checkpoints ({env.get('gpu') or ', '.join(env['devices'])})", "",
           f"date {env['date']}; jax {env['jax']}; commit {env.get('commit')}; command `{env['command']}`", "",
           f"Held-out data `{cfg['data']}`: {cfg['segments']} disjoint segments of {cfg['context']} tokens, every "
           f"token through the decode path (no prefill); greedy continuation of {cfg['greedy_tokens']} tokens; "
           f"{cfg['workers']} workers; time budget {cfg['time_budget']} s.", "",
           "Every cell is **mean ± spread over the segments, spread = half the min-max range**. Perplexity: the "
           "mean of the per-segment perplexities; Δppl %: per segment 100 (ppl / ppl_fp32 - 1); KL to fp32 and "
           "top-1 agreement over the scored positions; greedy match: leading tokens of the greedy continuation "
           "equal to fp32's; state err: ||S - S_fp32||_F / ||S_fp32||_F of the final state after replaying "
           "each linear-attention layer's recorded fp32 inputs, mean over layers and heads. Bytes per state "
           "element (B/el) are measured on the method's state pytree for the checkpoint's heads "
           "(windowed: window-boundary checkpoint / live stream with its window buffer).", ""]
    if results.get("runs"):
        out += ["Merged from these runs (each row from the last run that finished it, else the last run's status; `rows_from_run` in the "
                "JSON says which):", ""]
        out += [f"{i}. `{r['file']}`: {r['date']}, commit {r['commit']}, `{r['command']}`"
                for i, r in enumerate(results["runs"])] + [""]
    for name, ck in results["checkpoints"].items():
        tables = ck["tables"]
        head = next((r["head"] for r in ck["jobs"].values() if "head" in r), None)
        heads = "" if head is None else (f"; {head['heads']} linear-attention heads of dk x dv = {head['dk']} x "
                                         f"{head['dv']} per layer ({'KDA' if head['kda'] else 'GDN'})")
        out += [f"## {name}", "", f"`{ck['path']}`{heads}; fp32 reference (compile + run) per worker: "
                f"{', '.join(f'{s:.0f} s' for s in ck['reference_seconds']) or 'none finished'}.", ""]
        out += ["### Table 1: every state format", ""]
        out += _md_table(tables["table1"], [("method", lambda r: r["label"]), ("bits", lambda r: str(r["bits"])),
                                            ("B/el", _fmt_bytes)])
        out += ["", "### Table 2: ablation ladders", ""]
        out += _md_table(tables["table2"], [("step", lambda r: r["step"]), ("method", lambda r: r["label"])])
        out += ["", "### Table 3: LeapQuant 8-bit, window p and rank r", ""]
        out += _md_table(tables["table3"], [("sweep", lambda r: r["sweep"]), ("p", lambda r: str(r["window"])),
                                            ("r", lambda r: str(r["rank"])), ("method", lambda r: r["label"]),
                                            ("B/el", _fmt_bytes)])
        out += ["", "### Table 6: LeapQuant against every per-step format and rival method", ""]
        out += _md_table(tables["table6"], [("method", lambda r: r["label"]),
                                            ("bits", lambda r: "9.875" if r["bits"] == 10 else str(r["bits"])),
                                            ("B/el", _fmt_bytes)])
        verdicts = ck.get("rival_verdicts") or []
        if verdicts:
            out += ["", "Per-step methods at the same or fewer bytes per element (live stream) that match or beat "
                        "LeapQuant on KL to fp32 or on state error:", ""]
            for v in verdicts:
                who = ", ".join(f"{r['label']} ({r['bytes']:.2f} B/el: KL {r.get('kl_to_fp32', float('nan')):.2e}, "
                                f"state err {r.get('state_rel_error', float('nan')):.2e})" for r in v["beaten_by"])
                out.append(f"- {v['leapquant']} ({v['bytes']:.2f} B/el), against {v['compared']} methods: "
                           + (who if who else "none"))
        out += ["", "### Targets", ""]
        for t in ck["targets"]:
            word = {True: "met", False: "not met", None: "not evaluated"}[t["met"]]
            out.append(f"- **{word}**: {t['target']} ({t['values']})")
        out += ["", "### Figure 6: outliers of the fp32 state", ""]
        o = ck.get("outliers")
        if not o or "error" in o:
            out.append(f"not available{': ' + o['error'] if o else ''}")
        else:
            pm = o["peak_over_median"]
            out += [f"The most outlier-heavy head of the fp32 final states (largest peak/median magnitude over "
                    f"layers, segments and heads): layer {o['layer']}, segment {o['segment']}, head {o['head']}; "
                    f"Compensator Tokens of rank {o['rank']}. Heat maps: `{o['figure']}`.", "",
                    "| | state S | after Compensator Tokens (R = S - K U^T) | after smoothing (C^-1 R) |",
                    "| --- | --- | --- | --- |",
                    f"| peak / median, that head | {pm['state']:.1f} | {pm['residual']:.1f} | {pm['smoothed']:.1f} |"]
            mh = o["mean_over_heads_of_that_layer_and_segment"]
            out.append(f"| mean over the heads of that layer and segment | {mh['state']:.1f} | {mh['residual']:.1f} | "
                       f"{mh['smoothed']:.1f} |")
        if ck.get("fig3"):
            out += ["", f"Figure 3 (state error against decoded tokens): `{ck['fig3']}`"]
        out.append("")
    if results["notes"]:
        out += ["## Notes", ""] + [f"- {n}" for n in results["notes"]] + [""]
    return "\n".join(out)


def plot_fig3(name: str, records: dict, path: str) -> bool:
    """Relative state error (mean over layers, segments and heads) against decoded tokens, one line
    per ``FIG3_LABELS`` method with a curve, log scale. Returns whether anything was drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from leapquant_jax.studies.errors import method_styles

    labels = [x for x in FIG3_LABELS if "state_error_curve" in records.get(x, {}).get("result", {})]
    if not labels:
        return False
    styles = method_styles(labels)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for label in labels:
        curve = records[label]["result"]["state_error_curve"]
        ax.plot(curve["tokens"], np.maximum(curve["mean"], 1e-12), markersize=3, label=label, **styles[label])
    ax.set_yscale("log")
    ax.set_xlabel("decoded tokens")
    ax.set_ylabel(r"relative state error  $\|S - S_{fp32}\|_F\, /\, \|S_{fp32}\|_F$")
    ax.set_title(f"{name}: state error along held-out text (replay of fp32's recorded inputs;\n"
                 "mean over linear-attention layers, segments and heads)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def report(args, cfg: EvalConfig, jobs: list, base: str, notes: list, command: str) -> dict:
    """Reads the JSON lines and writes ``base.json``, ``base.md`` and the Figure 3 PNGs."""
    env = environment(args.commit or git_commit())
    env["command"] = command
    events = read_events(base + ".jsonl")
    labels = [j.label for j in jobs]
    results = {"environment": env, "config": dict(data=str(args.data), context=cfg.context, segments=cfg.batch,
                                                  greedy_tokens=cfg.greedy_tokens, error_every=cfg.error_every,
                                                  workers=args.workers, time_budget=args.time_budget,
                                                  grace=args.grace, jobs=labels),
               "checkpoints": {}, "notes": list(notes)}
    for ckpt in args.checkpoints:
        mine = [e for e in events if e["checkpoint"] == ckpt.name]
        records = {e["label"]: e for e in mine if e["kind"] == "job"}
        outliers = next((e for e in mine if e["kind"] == "outliers"), None)
        for e in mine:
            if e["kind"] == "worker_error":
                results["notes"].append(f"{ckpt.name} worker {e['worker']}: {e['error']}")
        tables = build_tables(records, labels)
        entry = {"path": str(ckpt), "reference_seconds": [e["seconds"] for e in mine if e["kind"] == "reference"],
                 "jobs": {x: records.get(x, {"status": "not finished"}) for x in labels},
                 "tables": tables, "targets": targets(tables), "rival_verdicts": rival_verdicts(tables),
                 "outliers": outliers, "fig3": None}
        fig3 = f"{base}-fig3-{ckpt.name}.png"
        if cfg.error_every and plot_fig3(ckpt.name, records, fig3):
            entry["fig3"] = os.path.basename(fig3)
        results["checkpoints"][ckpt.name] = entry
    with open(base + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(results))
    return results


MERGE_KEYS = ("context", "segments", "greedy_tokens", "error_every")


def merge_reports(paths: list, base: str) -> dict:
    """One report from several runs' ``.json`` reports (``--merge``): the runs must share the
    held-out file (by name) and ``MERGE_KEYS``; a run may hold any of the checkpoints; each job's
    row comes from the last run that finished it. Writes ``base.json``, ``base.md`` and the Figure 3 PNGs; the report lists
    the runs (date, commit, command) and which rows each gave."""
    parts = []
    for p in paths:
        try:
            with open(p) as f:
                parts.append(json.load(f))
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"--merge {p}: not a readable report ({err})") from None
        if not isinstance(parts[-1], dict) or "checkpoints" not in parts[-1] or "config" not in parts[-1]:
            raise ValueError(f"--merge {p}: not a bench.accuracy report (no config or checkpoints)")
    first = parts[0]["config"]
    for p, part in zip(paths, parts):
        c = part["config"]
        diff = [k for k in MERGE_KEYS if c.get(k) != first.get(k)]
        if os.path.basename(c.get("data", "")) != os.path.basename(first.get("data", "")):
            diff.append("data")
        if diff:
            raise ValueError(f"--merge: {p} differs from {paths[0]} in {', '.join(diff)}")
    ran = {x for part in parts for x in part["config"]["jobs"]}
    labels = [j.label for j in all_jobs() if j.label in ran]
    env = dict(parts[-1]["environment"])
    env.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               commit=", ".join(dict.fromkeys(str(part["environment"].get("commit")) for part in parts)),
               command=" + ".join(f"`{part['environment']['command']}`" for part in parts).strip("`"))
    runs = [{"file": os.path.basename(p), "date": part["environment"].get("date"),
             "commit": part["environment"].get("commit"), "command": part["environment"].get("command")}
            for p, part in zip(paths, parts)]
    config = dict(first, workers=" + ".join(str(part["config"]["workers"]) for part in parts),
                  time_budget=" + ".join(f"{part['config']['time_budget']:g}" for part in parts), jobs=labels)
    results = {"environment": env, "config": config, "runs": runs, "checkpoints": {},
               "notes": [n for part in parts for n in part.get("notes", [])]}
    names = list(dict.fromkeys(name for part in parts for name in part["checkpoints"]))
    for name in names:
        mine = [(i, part["checkpoints"][name]) for i, part in enumerate(parts) if name in part["checkpoints"]]
        records, source = {}, {}
        for i, ck in mine:
            for label, rec in ck["jobs"].items():
                if "result" in rec or "result" not in records.get(label, {}):
                    records[label], source[label] = rec, i
        outliers = next((ck.get("outliers") for _, ck in reversed(mine) if ck.get("outliers")), None)
        tables = build_tables(records, labels)
        entry = {"path": mine[-1][1]["path"],
                 "reference_seconds": [x for _, ck in mine for x in ck["reference_seconds"]],
                 "jobs": {x: records.get(x, {"status": "not finished"}) for x in labels},
                 "rows_from_run": {x: source[x] for x in labels if x in source and "result" in records[x]},
                 "tables": tables, "targets": targets(tables), "rival_verdicts": rival_verdicts(tables),
                 "outliers": outliers, "fig3": None}
        fig3 = f"{base}-fig3-{name}.png"
        if first.get("error_every") and plot_fig3(name, records, fig3):
            entry["fig3"] = os.path.basename(fig3)
        results["checkpoints"][name] = entry
    with open(base + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(results))
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.accuracy", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=Path, nargs="+", default=list(SHIPPED))
    ap.add_argument("--data", type=Path, default=None, help="held-out token ids [N], .npy (with --tiny: optional)")
    ap.add_argument("--context", type=int, default=16384, help="tokens per segment")
    ap.add_argument("--segments", type=int, default=3, help="disjoint consecutive segments (rows)")
    ap.add_argument("--greedy-tokens", type=int, default=16)
    ap.add_argument("--error-every", type=int, default=512, help="decoded tokens between Figure 3's points (0: off)")
    ap.add_argument("--workers", type=int, default=4,
                    help="worker processes, shared evenly by the checkpoints (on the H200, eight compiling side by "
                         "side had not finished an fp32 reference after 300 s; one or two took 60-90 s)")
    ap.add_argument("--time-budget", type=float, default=480,
                    help="seconds after the start when workers stop taking jobs (the rest: skipped: time budget)")
    ap.add_argument("--grace", type=float, default=60, help="seconds after the budget when running workers are stopped")
    ap.add_argument("--only", default=None, help="comma-separated job labels to run (default: all)")
    ap.add_argument("--groups", default=None,
                    help=f"comma-separated job groups to run: {', '.join(GROUPS)} (default: all; fp32 always)")
    ap.add_argument("--damp-calibration", type=Path, default=None,
                    help=f"DAMP calibration file for every checkpoint (default: {DAMP_FILE} inside each)")
    ap.add_argument("--tiny", action="store_true", help="small CPU smoke run of the whole pipeline")
    ap.add_argument("--commit", default=None, help="commit hash to record (default: git rev-parse HEAD)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--merge", type=Path, nargs="+", default=None, metavar="REPORT.json",
                    help="write one report from these runs' .json reports (same data and settings); runs nothing")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    raw = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(raw)
    if args.worker:
        return run_worker(args.worker)
    if args.merge:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        args.out.mkdir(parents=True, exist_ok=True)
        base = str(args.out / f"accuracy-{stamp}-merged")
        try:
            results = merge_reports([str(p) for p in args.merge], base)
        except ValueError as err:
            ap.error(str(err))
        print(f"[accuracy] wrote {base}.md, .json from {len(args.merge)} runs", flush=True)
        return results
    if args.tiny:
        args.context, args.segments, args.workers, args.error_every, args.greedy_tokens = 96, 2, 2, 32, 4

    def log(text):
        print(f"[accuracy] {text}", flush=True)

    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if args.data is None:
                if not args.tiny:
                    raise ValueError("--data is required (held-out token ids, .npy)")
                args.data = _tiny_data(Path(tmp))
            args.checkpoints = [c.resolve() for c in args.checkpoints]
            args.data = args.data.resolve()
            names = [c.name for c in args.checkpoints]
            for c in args.checkpoints:
                if not (c / "config.json").is_file():
                    raise ValueError(f"--checkpoints: {c} is not a checkpoint directory (no config.json)")
            if len(set(names)) != len(names):
                raise ValueError(f"--checkpoints: two checkpoints share a directory name ({names})")
            if args.workers < len(args.checkpoints):
                raise ValueError(f"--workers {args.workers}: need at least one per checkpoint ({len(names)})")
            if args.error_every < 0:
                raise ValueError(f"--error-every must be >= 0, got {args.error_every}")
            if args.time_budget < 0 or args.grace < 0:
                raise ValueError("--time-budget and --grace must be >= 0")
            if args.data.suffix != ".npy":
                raise ValueError(f"--data {args.data} must be a .npy of token ids")
            cfg = EvalConfig(context=args.context, prefill=0, batch=args.segments, greedy_tokens=args.greedy_tokens,
                             error_every=args.error_every or None)
            from models.evaluate import load_data

            ids = load_data(args.data, None)
            if ids.ndim != 1:
                raise ValueError(f"--data {args.data} must hold one stream of token ids [N], got shape {ids.shape}")
            if ids.size < cfg.batch * cfg.context:
                raise ValueError(f"--segments {cfg.batch} x --context {cfg.context} = {cfg.batch * cfg.context} "
                                 f"tokens, but --data {args.data} holds {ids.size}")
            segment_rows(ids, cfg, source=f"--data {args.data}")  # the workers' own cut: fails here, not in them
            jobs = select_jobs(args.only, tiny=args.tiny, groups=args.groups)
            if args.damp_calibration is not None:
                if not args.damp_calibration.is_file():
                    raise ValueError(f"--damp-calibration {args.damp_calibration}: no such file")
                args.damp_calibration = args.damp_calibration.resolve()
        except ValueError as err:
            ap.error(str(err))
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        args.out.mkdir(parents=True, exist_ok=True)
        base = str(args.out / f"accuracy-{stamp}")
        command = " ".join([os.path.basename(sys.executable), "-m", "bench.accuracy"] + raw)
        log(f"{command}\n[accuracy] jobs: {', '.join(j.label for j in jobs)}; results: {base}.*")
        notes = run_workers(args, cfg, jobs, base, start, log)
        results = report(args, cfg, jobs, base, notes, command)
    log(f"wrote {base}.md, .json, .jsonl in {time.time() - start:.0f} s")
    return results


if __name__ == "__main__":
    main()
