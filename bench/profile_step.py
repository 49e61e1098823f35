"""Profile of compiled decode steps: where a whole model's step spends its time, kernel by kernel.

    python -m bench.profile_step [--model qwen3.5-9b] [--layers 8] [--batch 256] [--context 1024]
                                 [--states fp32 lq8] [--steps 16] [--out DIR]

For each state format: the ``bench.decode`` step (random bf16 weights, ``compute="fast"``, every
sequence at position ``context``, ``steps`` teacher-forced steps in one compiled ``lax.scan``) is
timed, then run once under ``jax.profiler`` with a Perfetto trace. The trace's device events are
summed by kernel name (per step), and the optimised HLO of the compiled program is searched for
the instructions that move bytes without computing: ``copy``, ``copy-start``, dynamic-update-slice
fusions and the custom calls (the Pallas kernels), each with its operand bytes.

Writes ``profile-<state>.json`` (per-kernel totals, HLO copies) and ``profile-<state>.hlo.txt``
under ``--out``, and prints a table of the largest kernels per state.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.decode import STATES, build_method, make_steps, model_config, random_params

_SHAPE = re.compile(r"(pred|[a-z]+\d+)\[([\d,]*)\]")


def _bytes(shape_text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(shape_text):
        size = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        bits = 1 if dtype == "pred" else int(re.sub(r"\D", "", dtype) or 32)
        total += size * max(bits // 8, 1)
    return total


def hlo_movers(text: str) -> dict:
    """Count and result bytes of the HLO instructions that move data: copies, custom calls,
    dynamic-update-slices, per kind, with the largest few listed."""
    kinds = collections.defaultdict(lambda: {"count": 0, "bytes": 0, "largest": []})
    pat = re.compile(r"^\s*(ROOT )?(%?[\w.\-]+) = (.+?) (copy|copy-start|custom-call|dynamic-update-slice|fusion)\(")
    for line in text.splitlines():
        m = pat.match(line)
        if not m:
            continue
        kind = m.group(4)
        if kind == "fusion":
            k = re.search(r"kind=(\w+)", line)
            calls = re.search(r"calls=(%?[\w.\-]+)", line)
            name = calls.group(1) if calls else ""
            if "dynamic-update-slice" in name or "dynamic_update_slice" in name:
                kind = "fusion:dus"
            elif "copy" in name:
                kind = "fusion:copy"
            else:
                continue
        nbytes = _bytes(m.group(3))
        entry = kinds[kind]
        entry["count"] += 1
        entry["bytes"] += nbytes
        target = re.search(r'custom_call_target="([^"]+)"', line)
        entry["largest"].append((nbytes, m.group(2) + (f" [{target.group(1)}]" if target else ""), m.group(3)[:120]))
    for entry in kinds.values():
        entry["largest"] = sorted(entry["largest"], reverse=True)[:8]
    return dict(kinds)


def trace_kernels(logdir: str, steps: int) -> dict:
    """Device-event totals by name (µs per step) from the Perfetto trace under ``logdir``."""
    files = glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True)
    files = files or glob.glob(os.path.join(logdir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        return {"error": f"no trace file under {logdir}: {glob.glob(os.path.join(logdir, '**'), recursive=True)[:20]}"}
    with gzip.open(sorted(files)[-1], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    pnames = {e["pid"]: e.get("args", {}).get("name", "") for e in events
              if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, name in pnames.items() if "GPU" in name or "/device:" in name}
    if not device_pids:  # no device process named: count every process but the host's
        device_pids = {pid for pid, name in pnames.items() if "host" not in name.lower()}
    totals = collections.Counter()
    counts = collections.Counter()
    first, last = None, None
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in device_pids:
            continue
        dur = float(e.get("dur", 0))
        totals[e["name"]] += dur
        counts[e["name"]] += 1
        ts = float(e["ts"])
        first = ts if first is None else min(first, ts)
        last = ts + dur if last is None else max(last, ts + dur)
    busy = sum(totals.values())
    return {"processes": {str(k): v for k, v in pnames.items()},
            "device_busy_us_per_step": busy / steps,
            "device_span_us_per_step": ((last - first) / steps) if first is not None else 0.0,
            "kernels": [{"name": n, "us_per_step": t / steps, "calls_per_step": counts[n] / steps}
                        for n, t in totals.most_common()]}


def profile_state(arch, config, params, state: str, *, batch: int, context: int, steps: int, out: str) -> dict:
    method = build_method(state)
    init = jax.jit(lambda: arch.init_cache(config, batch=batch, max_len=context + steps, method=method))
    start = lambda: jnp.full((batch,), context, jnp.int32)  # noqa: E731
    ids = jax.random.randint(jax.random.PRNGKey(0), (steps, batch), 0, config.vocab_size, jnp.int32)
    cache = dict(init(), pos=start())
    t0 = time.perf_counter()
    run = make_steps(arch, config, method).lower(params, cache, ids).compile()
    compile_s = time.perf_counter() - t0
    text = run.as_text()
    with open(os.path.join(out, f"profile-{state}.hlo.txt"), "w") as f:
        f.write(text)
    cache, tok = run(params, cache, ids)
    tok.block_until_ready()
    times = []
    for _ in range(5):
        cache = dict(cache, pos=start())
        t0 = time.perf_counter()
        cache, tok = run(params, cache, ids)
        tok.block_until_ready()
        times.append((time.perf_counter() - t0) / steps)
    logdir = os.path.join(out, f"trace-{state}")
    cache = dict(cache, pos=start())
    jax.profiler.start_trace(logdir, create_perfetto_trace=True)
    cache, tok = run(params, cache, ids)
    tok.block_until_ready()
    jax.profiler.stop_trace()
    del cache
    result = {"state": state, "method": repr(method), "ms_per_step": 1e3 * statistics.median(times),
              "all_ms": [1e3 * t for t in times], "compile_s": compile_s, "hlo": hlo_movers(text),
              "trace": trace_kernels(logdir, steps)}
    with open(os.path.join(out, f"profile-{state}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3.5-9b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--states", nargs="+", default=["fp32", "lq8"], choices=list(STATES))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="out/profile")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    arch, config, _ = model_config(args.model, args.layers, "fast", False)
    params = random_params(arch, config)
    print(f"# {args.model}, {config.num_layers} layers, batch {args.batch}, context {args.context}, "
          f"{jax.devices()[0].device_kind}, JAX {jax.__version__}", flush=True)
    for state in args.states:
        r = profile_state(arch, config, params, state, batch=args.batch, context=args.context, steps=args.steps,
                          out=args.out)
        tr = r["trace"]
        print(f"\n## {state}: {r['ms_per_step']:.3f} ms/step (all {['%.3f' % t for t in r['all_ms']]}), "
              f"compile {r['compile_s']:.0f} s; device busy {tr.get('device_busy_us_per_step', 0) / 1e3:.3f} ms/step, "
              f"span {tr.get('device_span_us_per_step', 0) / 1e3:.3f} ms/step", flush=True)
        if "error" in tr:
            print(tr["error"])
        for k in tr.get("kernels", [])[:args.top]:
            print(f"  {k['us_per_step']:9.1f} us  x{k['calls_per_step']:5.1f}  {k['name'][:110]}")
        for kind, entry in sorted(r["hlo"].items()):
            print(f"  HLO {kind}: {entry['count']} instrs, {entry['bytes'] / 1e6:.1f} MB")
            for nbytes, name, shape in entry["largest"][:4]:
                print(f"      {nbytes / 1e6:8.2f} MB {name} {shape}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
