"""The ``leapquant`` command line: replay, studies and memory (models add generate/score/convert).

Every command that reports numbers takes ``--json`` and then prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional, Sequence


def _progress(iterable, *, desc: str, enabled: bool, total: Optional[int] = None):
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, disable=not enabled, file=sys.stderr, leave=False)


def add_method_options(parser: argparse.ArgumentParser, *, method_required: bool = True) -> None:
    """``--method`` plus the LeapQuant options of DESIGN §5 (shared with the model commands)."""
    from .methods import METHOD_NAMES

    if method_required:
        parser.add_argument("--method", required=True, choices=METHOD_NAMES, help="state method")
    parser.add_argument("--bits", type=int, choices=(8, 6, 4), help="residual bits (leapquant)")
    parser.add_argument("--window", type=int, help="records per window p (windowed methods; default 16)")
    parser.add_argument("--rank", type=int, help="Compensator Tokens r (default 4 at 8 bits, 6 at 6/4)")
    parser.add_argument("--no-compensators", dest="compensators", action="store_false", default=None)
    parser.add_argument("--no-smoothing", dest="smoothing", action="store_false", default=None)
    parser.add_argument("--impl", choices=("auto", "reference", "pallas"), help="kernel choice (windowed methods)")


def method_from_args(name: str, args: argparse.Namespace):
    """Builds the state method named ``name`` from parsed ``add_method_options`` flags."""
    from .methods import make_method

    return make_method(
        name, bits=args.bits, window=args.window, rank=args.rank,
        compensators=args.compensators, smoothing=args.smoothing, impl=args.impl,
    )


def _emit(args, payload: dict, human: str) -> None:
    if args.json:
        print(json.dumps(payload))
    else:
        print(human)


# ----------------------------------------------------------------------------- replay


def cmd_replay(args) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from .traces import load_trace

    trace = load_trace(args.trace)
    method = method_from_args(args.method, args)
    inputs = {k: jnp.asarray(v) for k, v in trace.batched().items()}
    h, dk, dv = trace.num_heads, trace.q.shape[-1], trace.v.shape[-1]
    if trace.s0 is not None:
        state = method.from_dense(jnp.asarray(trace.s0)[None], per_channel_decay=trace.per_channel_decay)
    else:
        state = method.init(1, h, dk, dv, per_channel_decay=trace.per_channel_decay)
    decode = jax.jit(lambda s, x: method.decode(s, **x))
    t0 = time.perf_counter()
    outs = []
    chunk = args.chunk
    starts = range(0, trace.num_tokens, chunk)
    for s in _progress(starts, desc=f"replay {method.name}", enabled=not args.json, total=len(starts)):
        o, state = decode(state, {k: v[:, s:s + chunk] for k, v in inputs.items()})
        outs.append(np.asarray(o[0]))
    o = np.concatenate(outs, axis=0) if outs else np.zeros((0, h, dv), np.float32)
    final = np.asarray(method.to_dense(state)[0], np.float32)
    if not (np.all(np.isfinite(o)) and np.all(np.isfinite(final))):
        raise FloatingPointError("replay produced non-finite values; nothing was written")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    tmp = args.out + ".tmp.npz"
    np.savez(tmp, o=o.astype(np.float32), state=final)
    os.replace(tmp, args.out)
    seconds = time.perf_counter() - t0
    payload = {"method": method.name, "tokens": trace.num_tokens, "heads": h, "dk": dk, "dv": dv,
               "out": args.out, "seconds": seconds}
    _emit(args, payload, f"replayed {trace.num_tokens} tokens x {h} heads with {method.name} in {seconds:.1f}s -> {args.out}")
    return 0


# ----------------------------------------------------------------------------- studies


def cmd_study_errors(args) -> int:
    from .studies.errors import ErrorStudyConfig, plot_error_study, run_error_study

    cfg = ErrorStudyConfig(tokens=args.tokens, heads=args.heads, seeds=args.seeds, dk=args.dk, dv=args.dv,
                           every=args.every, window=args.window, kda=args.kda)
    methods = args.methods.split(",") if args.methods else None
    result = run_error_study(cfg, methods, progress=lambda it: _progress(it, desc="methods", enabled=not args.json))
    if args.plot:
        plot_error_study(result, args.plot)
        result["plot"] = args.plot
    rows = [f"{'method':<16}{'final rel. state err':>22}{'rel. output err':>18}"]
    for name, r in result["methods"].items():
        rows.append(f"{name:<16}{r['final_rel_state_error']:>22.3e}{r['rel_output_error']:>18.3e}")
    if args.plot:
        rows.append(f"plot: {args.plot}")
    _emit(args, result, "\n".join(rows))
    return 0


def cmd_study_freeze(args) -> int:
    from .studies.freeze import run_freeze_study

    decays = tuple(float(x) for x in args.decays.split(","))
    result = run_freeze_study(decays)
    rows = [f"{'format':<8}" + "".join(f"{d:>10}" for d in result["bf16"])]
    for fmt, fr in result.items():
        rows.append(f"{fmt:<8}" + "".join(f"{v:>10.3f}" for v in fr.values()))
    rows.append("fraction of stored values in [0.01, 10] that alpha * x rounds straight back to")
    _emit(args, result, "\n".join(rows))
    return 0


def cmd_study_outliers(args) -> int:
    import numpy as np

    from .studies.outliers import final_states, plot_outliers, run_outlier_study

    if args.trace:
        from .traces import load_trace

        trace = load_trace(args.trace)
        inputs, s0, source = trace.batched(), trace.s0, args.trace
    else:
        from .synthetic import SyntheticSpec, synthetic_batch

        spec = SyntheticSpec(tokens=args.tokens, heads=args.heads, dk=args.dk, dv=args.dv)
        inputs = {k: np.asarray(v) for k, v in synthetic_batch(args.seed, 1, spec).items()}
        s0, source = None, f"synthetic ({args.tokens} tokens, seed {args.seed})"
    states = final_states(inputs, s0)
    result = run_outlier_study(states, rank=args.rank, head=args.head)
    result["source"] = source
    if args.plot:
        plot_outliers(states[result["head"]], args.rank, args.plot, title=f"{source}, head {result['head']}")
        result["plot"] = args.plot
    pm = result["peak_over_median"]
    human = (f"head {result['head']} of {source}: peak/median  state {pm['state']:.1f}  "
             f"residual (r={args.rank}) {pm['residual']:.1f}  smoothed {pm['smoothed']:.1f}")
    _emit(args, result, human + (f"\nplot: {args.plot}" if args.plot else ""))
    return 0


def cmd_memory(args) -> int:
    from .studies.memory import MemoryQuery, measure_memory

    r = measure_memory(MemoryQuery(dk=args.dk, dv=args.dv, bits=args.bits, rank=args.rank, window=args.window,
                                   layers=args.layers, heads=args.heads))
    rows = [f"{'':<12}{'B/head':>12}{'B/element':>12}{'model MiB':>12}"]
    for k, b in r["bytes_per_head"].items():
        rows.append(f"{k:<12}{b:>12.1f}{r['bytes_per_element'][k]:>12.4f}{r['model_bytes'][k] / 2**20:>12.2f}")
    q = r["query"]
    rows.append(f"({q['layers']} layers x {q['heads']} heads, dk={q['dk']} dv={q['dv']}, {q['bits']} bits, r={q['rank']}, p={q['window']})")
    _emit(args, r, "\n".join(rows))
    return 0


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The ``leapquant`` argument parser."""
    parser = argparse.ArgumentParser(prog="leapquant", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("replay", help="replay a trace file with a state method")
    p.add_argument("trace", help="trace .npz (q, k, v, beta, g[, s0])")
    add_method_options(p)
    p.add_argument("--out", required=True, help="output .npz with o [T, H, dv] and state [H, dk, dv]")
    p.add_argument("--chunk", type=int, default=1024, help="tokens per compiled chunk")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_replay)

    study = sub.add_parser("study", help="studies").add_subparsers(dest="study", required=True)
    p = study.add_parser("errors", help="relative state error vs decoded tokens (Figure 3 in miniature)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--every", type=int, default=128, help="tokens between measurements")
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--kda", action="store_true", help="per-channel decays (KDA) instead of scalar (GDN)")
    p.add_argument("--methods", help="comma-separated subset of the study's methods")
    p.add_argument("--plot", default="study_errors.png", help="PNG path ('' to skip)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_study_errors)

    p = study.add_parser("freeze", help="fraction of bf16/fp16 values that alpha * x rounds back to")
    p.add_argument("--decays", default="0.997,0.998,0.999,0.9995,0.9999")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_study_freeze)

    p = study.add_parser("outliers", help="peak/median of state, residual and smoothed residual (Figure 6)")
    p.add_argument("--trace", help="trace .npz; default: a synthetic long-memory head batch")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--head", type=int, help="head to detail (default: most outlier-heavy)")
    p.add_argument("--plot", default="study_outliers.png", help="PNG path ('' to skip)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_study_outliers)

    p = sub.add_parser("memory", help="bytes of checkpoints and live streams, measured on the pytrees")
    p.add_argument("--dk", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--bits", type=int, default=8, choices=(8, 6, 4))
    p.add_argument("--rank", type=int)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_memory)

    try:
        from models.cli import add_subcommands
    except ModuleNotFoundError as err:
        # The model commands ship with the source tree; a broken import inside them must surface.
        if err.name not in ("models", "models.cli"):
            raise
    else:
        add_subcommands(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``leapquant`` console command."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, FloatingPointError) as err:
        print(f"leapquant: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
