"""STEPQuant and LeapQuant with lifetime-aware widths at matched bytes, on one checkpoint.

    python -m bench.lifetime_matched CKPT --calibration-data TRAIN.npy --data HELDOUT.npy
        [--context 2048] [--batch 2] [--stepquant 5.75,8] [--alloc 6.5] --out OUT.json

The named methods are fixed budgets (``stepquant-6/-4``: nominal bits; ``leapquant-alloc-6/-4``: the
bytes of the per-step ``int6`` / ``int4`` formats, ``leapquant_alloc.default_budget``). This runs the other budgets, to compare the two
at equal bytes: ``--stepquant`` nominal budgets (``stepquant@B``) and ``--alloc`` checkpoint bits per
value (``leapquant-alloc@B``), calibrated as ``leapquant calibrate-stepquant`` does (16 segments of
1,024 tokens of ``--calibration-data``, a state every 32 tokens, 64 kept per layer), then scored by
``models.evaluate`` against fp32 on ``--data``, each with its bytes per state element measured on
the model's state pytrees (``bench.lifetime_table.state_bytes``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lifetime_matched",
                                description=__doc__.splitlines()[0].replace("``", ""))
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--calibration-data", required=True, type=Path, help=".npy token ids of the calibration text")
    p.add_argument("--data", required=True, type=Path, help=".npy held-out token ids")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--stepquant", default="5.75,8", help="nominal budgets of stepquant@B")
    p.add_argument("--alloc", default="6.5", help="checkpoint bits per value of leapquant-alloc@B")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)

    from bench.lifetime_table import state_bytes
    from leapquant_jax.leapquant_alloc import AllocMethod
    from leapquant_jax.stepquant import StepQuantMethod
    from models.calibrate import model_fingerprint, record_traces
    from models.calibrate_stepquant import calibrate_traces
    from models.loading import load_checkpoint
    from models.evaluate import EvalConfig, reference_run, score_method, segment_rows

    t0 = time.time()
    arch, config, params, _ = load_checkpoint(args.checkpoint)
    cal_rows = segment_rows(np.load(args.calibration_data), EvalConfig(context=1024, batch=16))
    sq = {f"stepquant@{b}": float(b) for b in args.stepquant.split(",") if b}
    al = {f"leapquant-alloc@{b}": float(b) for b in args.alloc.split(",") if b}
    cal, _ = calibrate_traces(record_traces(arch, params, config, cal_rows), every=32, samples=64,
                              model=model_fingerprint(config, params), stepquant_budgets=sq, alloc_budgets=al)
    methods = {"fp32": None}
    methods.update({n: StepQuantMethod(plan=n, calibration=cal) for n in sq})
    methods.update({n: AllocMethod(plan=n, calibration=cal) for n in al})
    from leapquant_jax import make_method

    methods["fp32"] = make_method("fp32")
    cfg = EvalConfig(context=args.context, batch=args.batch)
    rows = segment_rows(np.load(args.data), cfg)
    ref = reference_run(arch, params, config, rows, cfg, method=methods["fp32"])
    nbytes = state_bytes(str(args.checkpoint), methods)
    out = {"checkpoint": str(args.checkpoint), "context": args.context, "batch": args.batch,
           "calibration_seconds": round(time.time() - t0, 1), "methods": {}}
    for label, method in methods.items():
        entry = score_method(arch, params, config, ref, method, label=label)
        out["methods"][label] = {"checkpoint_bytes_per_element": nbytes[label]["checkpoint"],
                                 "live_bytes_per_element": nbytes[label]["live"],
                                 "perplexity": entry["perplexity"], "kl_to_fp32": entry["kl_to_fp32"],
                                 "kl_per_row": entry["per_row"]["kl_to_fp32"],
                                 "top1_agreement": entry["top1_agreement"],
                                 "state_rel_error": float(np.mean(list(entry["state_rel_error"].values())))}
        print(label, json.dumps(out["methods"][label]), flush=True)
    out["seconds"] = round(time.time() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
