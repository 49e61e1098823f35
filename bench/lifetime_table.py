"""The 6- and 4-bit methods side by side: ``leapquant eval --json`` results with each method's bytes.

    python -m bench.lifetime_table EVAL.json [EVAL.json ...] --out bench/results/lifetime-<stamp>

Each ``EVAL.json`` is one ``leapquant eval ... --json`` run (its checkpoint, states and calibration
files are read from it). Per method the table gives the recurrent state of the whole model per
decoding stream, measured on the state pytrees of ``arch.init_cache`` (``jax.eval_shape``): bytes
per state element of the window-boundary checkpoint (for per-step methods the state itself) and
of a live stream (windowed methods: with their window buffer of records), then the perplexity
change against fp32, KL to fp32, top-1 agreement and the mean final relative state error. Writes
``<out>.md`` and ``<out>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np


def state_bytes(checkpoint: str, methods: dict) -> dict:
    """``{label: {"live", "checkpoint"}}`` bytes per state element of the model at ``checkpoint``."""
    import jax

    from leapquant_jax import make_method
    from leapquant_jax.quantizers import tree_bytes
    from leapquant_jax.studies.memory import boundary_state
    from models.base import layer_caches
    from models.checkpoint import load_model

    arch, config, _, _ = load_model(checkpoint)

    def states(method):
        cache = jax.eval_shape(lambda: arch.init_cache(config, batch=1, max_len=1, method=method))
        return [c["state"] for c in layer_caches(cache, config) if isinstance(c, dict) and "state" in c]

    elements = sum(int(np.prod(s.values.shape)) for s in states(make_method("fp32")))     # [1, H, dk, dv] each
    out = {}
    for label, method in methods.items():
        found = states(method)
        out[label] = {"live": tree_bytes(found) / elements,
                      "checkpoint": tree_bytes([boundary_state(s) for s in found]) / elements}
    return out


def rows_of(result: dict) -> list:
    from leapquant_jax.method_names import methods_for_labels

    labels = list(result["methods"])
    methods = methods_for_labels(labels, result.get("state_options"))
    nbytes = state_bytes(result["checkpoint"], methods)
    ref = result["methods"]["fp32"]["perplexity"]
    rows = []
    for label, m in result["methods"].items():
        rows.append({"checkpoint": Path(result["checkpoint"]).name, "method": label,
                     "checkpoint_bytes_per_element": nbytes[label]["checkpoint"],
                     "live_bytes_per_element": nbytes[label]["live"],
                     "perplexity": m["perplexity"], "delta_perplexity_percent": 100 * (m["perplexity"] / ref - 1),
                     "kl_to_fp32": m["kl_to_fp32"], "top1_agreement": m["top1_agreement"],
                     "state_rel_error": float(np.mean(list(m["state_rel_error"].values()))),
                     "kl_per_row": m["per_row"]["kl_to_fp32"]})
    return rows


def markdown(rows: list, header: list) -> str:
    lines = header + ["", "| checkpoint | method | B/element checkpoint / live | bits/value (ckpt) | Δ perplexity | "
                      "KL to fp32 (rows) | top-1 agreement | final state error |",
                      "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        kl_rows = " / ".join(f"{x:.2e}" for x in r["kl_per_row"])
        lines.append(f"| {r['checkpoint']} | {r['method']} | {r['checkpoint_bytes_per_element']:.3f} / "
                     f"{r['live_bytes_per_element']:.3f} | {8 * r['checkpoint_bytes_per_element']:.2f} | "
                     f"{r['delta_perplexity_percent']:+.3f} % | {r['kl_to_fp32']:.2e} ({kl_rows}) | "
                     f"{r['top1_agreement']:.4f} | {r['state_rel_error']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lifetime_table",
                                description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("evals", nargs="+", type=Path, help="leapquant eval --json outputs")
    p.add_argument("--out", required=True, type=Path, help="output path without extension (.md and .json)")
    args = p.parse_args(argv)
    import jax

    results = [json.loads(path.read_text()) for path in args.evals]
    rows = [r for result in results for r in rows_of(result)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    header = ["# The 6- and 4-bit state methods on the trained checkpoints (CPU)", "",
              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or 'CPU'}, "
              f"JAX {jax.__version__}, commit {commit}; "
              + "; ".join(f"{Path(r['checkpoint']).name}: context {r['context']}, {r['batch']} rows, "
                          f"{r['tokens']} scored tokens, {r['seconds']:.0f} s" for r in results),
              "", "Commands: `python -m leapquant_cli eval CKPT --data HELDOUT.npy --context C --batch B --states "
              "... --damp-calibration CKPT/damp-calibration.json --stepquant-calibration "
              "CKPT/stepquant-calibration.json --json`, then `python -m bench.lifetime_table " +
              " ".join(str(x) for x in args.evals) + f" --out {args.out}`."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(markdown(rows, header))
    args.out.with_suffix(".json").write_text(json.dumps({"rows": rows, "evals": [str(x) for x in args.evals],
                                                         "commit": commit}, indent=1))
    print(markdown(rows, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
