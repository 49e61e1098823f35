"""Long-memory results: recall accuracy against length and free-running generation, per state format.

    python -m bench.tasks --recall models/checkpoints/recall-gdn models/checkpoints/recall-kda
                          --lms models/checkpoints/stdlib-gdn models/checkpoints/stdlib-kda --lm-data HELDOUT.npy
                          [--lengths 1024 2048 4096 8192 16384] [--samples 32] [--fillers pairs noise]
                          [--states ...] [--processes 1] [--generate 2048] [--prompts 8] [--context 256]
                          [--gen-states ...] [--time-budget 480] [--commit HASH] [--out bench/results] [--tiny]

Jobs, all started at once as separate processes sharing the accelerator (a decode step of these
small models is latency-bound, so they overlap; ``XLA_PYTHON_CLIENT_PREALLOCATE=false``):

* per recall checkpoint and filler, ``--processes`` runs of ``leapquant task CKPT --task mqar
  --filler F --lengths ... --states ... --progress --json``, the states dealt out among them (each
  also runs fp32, its reference; a run calibrates the ``damp``, ``stepquant-*`` and
  ``leapquant-alloc-*`` it was dealt, on the same rows): accuracy per state method and length,
  merged into one table;
* per language model, ``leapquant eval LM --data HELDOUT --context C --batch P --generate G
  --states ... --json``: first divergence from fp32, KL along fp32's continuation, repetition.

Each job gets what is left of ``--time-budget`` (seconds from the start); a task job cut short
keeps the (method, length) cells it printed (``--progress`` lines), the rest read "not run". The
report, ``<out>/tasks-<UTC>.md`` and ``.json`` (date, device, JAX, commit, every command), has
one accuracy table per recall checkpoint and filler (fp32 from the first of its runs), the
targets evaluated on it, and one generation table per language model; the accuracy plots
(``models.task_eval.plot_task``) are ``tasks-<UTC>-<ckpt>-<filler>.png``.
``--tiny`` is a CPU smoke run of the whole pipeline (short lengths, few rows and methods).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK_STATES = "fp32,bf16,fp16,int8,fp8,bf16-w,int8-w,leapquant,leapquant-b6,leapquant-b4,damp"
GEN_STATES = "fp32,bf16,int8,fp8,int8-w,leapquant,leapquant-b6,leapquant-b4"
PROGRESS = re.compile(r"^(?P<label>\S+) at (?P<length>\d+): accuracy (?P<acc>[0-9.]+) ")


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def task_command(ckpt, filler, args, states: str) -> list:
    return [sys.executable, "-m", "leapquant_cli", "task", str(ckpt), "--task", "mqar", "--filler", filler,
            "--lengths", *map(str, args.lengths), "--samples", str(args.samples), "--states", states,
            "--progress", "--json"] + (["--pairs", str(args.pairs)] if args.pairs else [])


def deal_states(states: str, processes: int) -> list[str]:
    """The state list dealt out round-robin among ``processes`` runs (fp32 left to each run,
    which adds it as its reference); runs left without a state are dropped."""
    labels = [x for x in states.split(",") if x != "fp32"]
    groups = [labels[i::processes] for i in range(processes)]
    out = [",".join(["fp32"] + g) for g in groups if g]
    return out or ["fp32"]


def merge_task_jobs(jobs: list, args) -> dict:
    """One report entry from the runs of one checkpoint and filler: their results merged (each
    (method, length) from the first run that has it; a calibration made in any run marked as made
    here), plotted, partial if any run was."""
    from models.task_eval import checkpoint_task, plot_task

    first = jobs[0]
    results, partial, full = {}, [], None
    here = dict.fromkeys(("damp_calibrated_here", "stepquant_calibrated_here"), False)
    for job in jobs:
        r = task_result(job)
        for label, row in r["results"].items():
            for length, acc in row.items():
                results.setdefault(label, {}).setdefault(length, acc)
        here = {flag: made or bool(r.get(flag)) for flag, made in here.items()}
        if r.get("partial"):
            partial.append(r["status"])
        elif full is None:
            full = r
    merged = dict(full or {}, task="mqar", results=results, lengths=args.lengths, **here)
    if partial:
        merged.update(partial=True, status="; ".join(partial))
    if full is None:
        mix, train_length = checkpoint_task(first["ckpt"])
        merged.update(checkpoint=str(first["ckpt"]), samples=args.samples, train_length=train_length,
                      spec={"pairs": args.pairs or (max(mix.pairs) if mix else "?"), "filler": first["filler"]})
    entry = dict(name=first["name"], kind="task", returncode=max(j["returncode"] for j in jobs),
                 timed_out=any(j["timed_out"] for j in jobs), seconds=max(j["seconds"] for j in jobs),
                 command=" + ".join(f"`{_shown(j['cmd'])}`" for j in jobs)[1:-1], result=merged)
    if results:
        plot_task(merged, first["plot"])
        entry["plot"] = first["plot"]
    return entry


def generation_command(lm, args) -> list:
    return [sys.executable, "-m", "leapquant_cli", "eval", str(lm), "--data", str(args.lm_data), "--context",
            str(args.context), "--batch", str(args.prompts), "--generate", str(args.generate), "--states",
            args.gen_states, "--json"]


def _shown(cmd: list) -> str:
    return " ".join(["python -m" if c == sys.executable else c for c in cmd]).replace("python -m -m", "python -m")


def run_jobs(jobs: list, *, deadline: float) -> list:
    """Starts every job (``{"name", "cmd"}``) at once; waits until each ends or the deadline.
    Adds ``returncode``, ``stdout``, ``stderr``, ``seconds`` and ``timed_out`` to each."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for job in jobs:
        job["out_file"] = tempfile.TemporaryFile(mode="w+")
        job["err_file"] = tempfile.TemporaryFile(mode="w+")
        job["proc"] = subprocess.Popen(job["cmd"], cwd=ROOT, env=env, stdout=job["out_file"], stderr=job["err_file"],
                                       text=True)
        job["start"] = time.time()
        _log(f"started {job['name']}: {_shown(job['cmd'])}")
    pending = list(jobs)
    while pending:
        time.sleep(2.0)
        for job in list(pending):
            code = job["proc"].poll()
            timed_out = code is None and time.time() > deadline
            if timed_out:
                job["proc"].kill()
                code = job["proc"].wait()
            if code is None:
                continue
            pending.remove(job)
            job.update(returncode=code, timed_out=timed_out, seconds=round(time.time() - job["start"], 1))
            for stream in ("out", "err"):
                f = job.pop(f"{stream}_file")
                f.seek(0)
                job[f"std{stream}"] = f.read()
                f.close()
            job.pop("proc")
            _log(f"{job['name']}: {'cut at the time budget' if timed_out else f'exit {code}'} after {job['seconds']} s")
    return jobs


def task_result(job: dict) -> dict:
    """The task job's JSON, or what its progress lines saved when it was cut short."""
    if job["returncode"] == 0:
        return json.loads(job["stdout"].strip().splitlines()[-1])
    results = {}
    for line in job["stderr"].splitlines():
        m = PROGRESS.match(line.strip())
        if m:
            results.setdefault(m["label"], {})[m["length"]] = float(m["acc"])
    lines = [x.strip() for x in job["stderr"].splitlines() if x.strip()]
    error = [x for x in lines if x.startswith("leapquant: error")] or lines[-1:]
    if job["timed_out"]:
        status = "cut at the time budget"
    elif job["returncode"] < 0:
        status = f"stopped by signal {-job['returncode']}"
    else:
        status = f"exit {job['returncode']}" + (f": {error[-1]}" if error else "")
    return {"task": "mqar", "results": results, "partial": True, "status": status}


def targets(result: dict, lengths: list) -> list:
    """The issue's targets on one accuracy table (points, fp32 minus method, at each length run)."""
    res = result["results"]
    if "fp32" not in res:
        return ["fp32 did not run: no target can be evaluated"]
    out = []
    fp32 = res["fp32"]
    done = [n for n in map(str, lengths) if n in fp32]
    for label in ("int8", "fp8"):
        if label in res:
            drops = {n: 100 * (fp32[n] - res[label][n]) for n in done if n in res[label]}
            worst = max(drops, key=drops.get) if drops else None
            ok = worst is not None and drops[worst] >= 10
            out.append(f"**{'met' if ok else 'not met'}**: per-step {label} loses >= 10 points at some length "
                       + (f"(largest loss {drops[worst]:+.1f} points at {worst})" if worst else "(not run)"))
    for label, bound in (("leapquant", 1.0), ("leapquant-b6", 2.0)):
        if label in res:
            drops = {n: 100 * (fp32[n] - res[label][n]) for n in done if n in res[label]}
            worst = max(drops, key=drops.get) if drops else None
            ok = worst is not None and drops[worst] <= bound and len(drops) == len(done)
            out.append(f"**{'met' if ok else 'not met'}**: {label} within {bound:g} point(s) of fp32 at every length "
                       + (f"(largest loss {drops[worst]:+.1f} points at {worst})" if worst else "(not run)"))
    # lifetime-aware LeapQuant against STEPQuant: alloc-4 ahead at every length, alloc-6 at least level
    for ours, rival, strict in (("leapquant-alloc-4", "stepquant-4", True), ("leapquant-alloc-6", "stepquant-6", False)):
        if ours in res and rival in res:
            both = [n for n in done if n in res[ours] and n in res[rival]]
            gaps = {n: 100 * (res[ours][n] - res[rival][n]) for n in both}
            ok = len(both) == len(done) and all(g > 0 if strict else g >= 0 for g in gaps.values())
            worst = min(gaps, key=gaps.get) if gaps else None
            out.append(f"**{'met' if ok else 'not met'}**: {ours} {'above' if strict else 'at least'} {rival} at every "
                       "length " + (f"(smallest margin {gaps[worst]:+.1f} points at {worst})" if worst else "(not run)"))
    return out


def render(report: dict) -> str:
    env = report["environment"]
    lines = [f"# Long-memory tasks and free-running generation ({env['device']})", "",
             f"date {report['date']}; jax {env['jax']}; commit {report['commit']}; command `{report['command']}`", "",
             "Recall: `leapquant task` (MQAR, every token a teacher-forced decode step through the state method; "
             "accuracy of the argmax on the queried values; the same rows for every method). Generation: "
             "`leapquant eval --generate` (greedy continuation of held-out prompts; first token unlike fp32's, "
             "KL to fp32 along fp32's continuation, share of repeated 4-grams of the method's own text).", ""]
    for job in report["jobs"]:
        lines += [f"## {job['name']}", "", f"`{job['command']}` ({job['seconds']} s"
                  + (", cut at the time budget" if job["timed_out"] else "") + ")", ""]
        r = job.get("result")
        if r is None:
            lines += [f"failed: {job['error']}", ""]
            continue
        if job["kind"] == "task":
            lengths = report["lengths"]
            lines += ["| method | " + " | ".join(str(n) for n in lengths) + " |",
                      "| --- |" + " --- |" * len(lengths)]
            for label in report["task_states"]:
                row = r["results"].get(label)
                cells = [f"{row[str(n)]:.3f}" if row and str(n) in row else "not run" for n in lengths]
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
            if r.get("partial"):
                lines += ["", f"Partial: {r['status']}."]
            if r.get("nonfinite_rows"):
                lines += ["", "Non-finite logits (rows counted wrong): " + "; ".join(
                    f"{k} at {', '.join(v)}" for k, v in r["nonfinite_rows"].items()) + "."]
            lines += ["", "Targets (points lost against fp32):", ""] + [f"- {t}" for t in targets(r, lengths)]
            if job.get("plot"):
                lines += ["", f"![accuracy against length]({Path(job['plot']).name})"]
            lines.append("")
        else:
            lines += ["| method | first divergence: median [p25, p75] (min-max) | KL to fp32 | repetition |",
                      "| --- | --- | --- | --- |"]
            for label, m in r["methods"].items():
                d = m["first_divergence"]
                lines.append(f"| {label} | {d['median']:.0f} [{d['p25']:.0f}, {d['p75']:.0f}] ({d['min']:.0f}-"
                             f"{d['max']:.0f}) | {m['kl_to_fp32']:.2e} | {m['repetition_rate']:.4f} |")
            ms = r["methods"]
            if "leapquant" in ms and "int8" in ms:
                lq, i8 = ms["leapquant"]["first_divergence"]["median"], ms["int8"]["first_divergence"]["median"]
                ok = lq >= 4 * max(i8, 1e-9)
                lines += ["", f"Target: **{'met' if ok else 'not met'}**: LeapQuant-8's median first divergence "
                          f"({lq:.0f}) at least 4 times per-step int8's ({i8:.0f})"
                          + (f"; both at the {r['generate']}-token horizon: the continuation never left fp32's"
                             if lq == i8 == r["generate"] else "") + "."]
            lines += ["", f"{r['prompts']} prompts of {r['context']} tokens, {r['generate']} tokens each.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tasks", description=__doc__.split("\n")[0])
    p.add_argument("--recall", nargs="*", type=Path, default=[], help="recall checkpoints (leapquant task)")
    p.add_argument("--lms", nargs="*", type=Path, default=[], help="language models (eval --generate)")
    p.add_argument("--lm-data", type=Path, help="held-out token ids (.npy) or text for the prompts")
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--samples", type=int, default=32, help="rows per length")
    p.add_argument("--pairs", type=int, help="pairs per row (default: the checkpoint's largest training count)")
    p.add_argument("--fillers", nargs="+", default=["pairs", "noise"], choices=("pairs", "noise"))
    p.add_argument("--states", default=TASK_STATES)
    p.add_argument("--processes", type=int, default=1,
                   help="runs per recall checkpoint and filler, the states dealt out among them (a decode step of "
                        "these models is latency-bound: runs side by side overlap on one GPU)")
    p.add_argument("--generate", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--context", type=int, default=256, help="prompt tokens")
    p.add_argument("--gen-states", default=GEN_STATES)
    p.add_argument("--time-budget", type=float, default=480.0, help="seconds from the start for every job")
    p.add_argument("--commit", default=None)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: short lengths, few rows and methods")
    args = p.parse_args(argv)
    if args.tiny:
        args.lengths, args.samples, args.generate, args.prompts, args.context = [64, 128], 4, 16, 2, 16
        args.states, args.gen_states = "fp32,int8,leapquant", "fp32,int8,leapquant"
    if args.lms and args.lm_data is None:
        p.error("--lms needs --lm-data")
    t0 = time.time()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = []
    for ckpt in args.recall:
        for filler in args.fillers:
            plot = args.out / f"tasks-{stamp}-{ckpt.name}-{filler}.png"
            for states in deal_states(args.states, args.processes):
                jobs.append(dict(name=f"{ckpt.name}, {filler} filler", kind="task", plot=str(plot), ckpt=ckpt,
                                 filler=filler, cmd=task_command(ckpt, filler, args, states)))
    for lm in args.lms:
        jobs.append(dict(name=f"{lm.name}, free-running generation", kind="generate", cmd=generation_command(lm, args)))
    run_jobs(jobs, deadline=t0 + args.time_budget)
    import jax

    out_jobs, groups = [], {}
    for job in jobs:
        if job["kind"] == "task":
            groups.setdefault(job["name"], []).append(job)
    for name, group in groups.items():
        out_jobs.append(merge_task_jobs(group, args))
    for job in jobs:
        if job["kind"] == "task":
            continue
        entry = {k: job[k] for k in ("name", "kind", "returncode", "timed_out", "seconds")}
        entry["command"] = _shown(job["cmd"])
        try:
            if job["returncode"] == 0:
                entry["result"] = json.loads(job["stdout"].strip().splitlines()[-1])
            else:
                raise ValueError("cut at the time budget" if job["timed_out"] else
                                 (job["stderr"].strip().splitlines() or [f"exit {job['returncode']}"])[-1])
        except (ValueError, IndexError) as err:
            entry["error"] = str(err)
        out_jobs.append(entry)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": args.commit or "unknown",
              "command": "python -m bench.tasks " + " ".join(sys.argv[1:] if argv is None else argv),
              "environment": {"device": f"{jax.devices()[0].device_kind} x{len(jax.devices())}", "jax": jax.__version__},
              "lengths": args.lengths, "task_states": args.states.split(","), "jobs": out_jobs,
              "seconds": round(time.time() - t0, 1)}
    (args.out / f"tasks-{stamp}.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / f"tasks-{stamp}.md").write_text(render(report))
    _log(f"wrote {args.out / f'tasks-{stamp}.md'} and .json ({report['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
