"""Routed-expert algorithms timed against each other (``models.moe.routed_experts``).

    python -m bench.moe [--experts 256] [--top-k 8] [--hidden 2304] [--inner 1024]
                        [--tokens 64 256 2048 8192] [--compute fast] [--repeats 5] [--out bench/results]

For each token count: ``ragged`` (sorted pairs, one ``lax.ragged_dot`` per projection) and
``scan`` (experts one by one over all tokens, masked) on the same random bf16 weights and uniform
random routing, both checked against each other; median ms over ``repeats`` calls after a
warm-up. The defaults are Kimi-Linear-48B-A3B's expert shape. Results: ``<out>/moe-<date>.json``
and ``.md``; ``models.moe.pick_algorithm("auto")`` picks the faster one measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.layers import COMPUTE_MODES, FAST
from models.moe import routed_experts


def time_call(fn, *args, repeats: int) -> float:
    """Median seconds of ``fn(*args)`` after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(args) -> list:
    key = jax.random.PRNGKey(0)
    e, d, i, k = args.experts, args.hidden, args.inner, args.top_k
    kw = jax.random.split(key, 4)
    w1, w3 = (jax.random.normal(kk, (e, d, i), jnp.bfloat16) * 0.02 for kk in kw[:2])
    w2 = jax.random.normal(kw[2], (e, i, d), jnp.bfloat16) * 0.02
    rows = []
    for n in args.tokens:
        kx, ki = jax.random.split(jax.random.fold_in(kw[3], n))
        x = jax.random.normal(kx, (n, d), jnp.float32)
        idx = jnp.argsort(jax.random.uniform(ki, (n, e)), axis=-1)[:, :k].astype(jnp.int32)
        weights = jnp.full((n, k), 1.0 / k, jnp.float32)
        row = {"tokens": n}
        outs = {}
        for algorithm in ("ragged", "scan"):
            # the weights are arguments, not constants folded into the program
            fn = jax.jit(lambda x, w, ix, a1, a3, a2, a=algorithm: routed_experts(
                x, w, ix, w1=a1, w3=a3, w2=a2, compute=args.compute, algorithm=a))
            call = (x, weights, idx, w1, w3, w2)
            row[algorithm + "_ms"] = 1e3 * time_call(fn, *call, repeats=args.repeats)
            outs[algorithm] = np.asarray(fn(*call), np.float64)
        row["rel_diff"] = float(np.linalg.norm(outs["ragged"] - outs["scan"]) / np.linalg.norm(outs["scan"]))
        row["faster"] = "ragged" if row["ragged_ms"] < row["scan_ms"] else "scan"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.moe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2304)
    ap.add_argument("--inner", type=int, default=1024)
    ap.add_argument("--tokens", nargs="+", type=int, default=[64, 256, 2048, 8192])
    ap.add_argument("--compute", default=FAST, choices=COMPUTE_MODES)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    if not 1 <= args.top_k <= args.experts or min(args.tokens) < 1:
        ap.error("need 1 <= --top-k <= --experts and positive --tokens")
    rows = run(args)
    date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    cmd = "python -m bench.moe " + " ".join(sys.argv[1:] if argv is None else argv)
    result = dict(command=cmd, date=date, device=jax.devices()[0].device_kind, jax=jax.__version__,
                  shape=dict(experts=args.experts, top_k=args.top_k, hidden=args.hidden, inner=args.inner),
                  compute=args.compute, rows=rows)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"moe-{date}")
    with open(path + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# Routed experts: ragged against scan ({date})", "", f"Command: `{cmd}`  ",
             f"Device: {result['device']}; JAX {result['jax']}; compute {args.compute}; experts {args.experts}, "
             f"top {args.top_k}, hidden {args.hidden}, inner {args.inner}", "",
             "| tokens | ragged ms | scan ms | faster | relative difference |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['tokens']} | {r['ragged_ms']:.2f} | {r['scan_ms']:.2f} | {r['faster']} | {r['rel_diff']:.1e} |"
              for r in rows]
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
