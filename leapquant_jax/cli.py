"""The commands of the core package: ``leapquant replay``, ``study errors|freeze|outliers`` and
``memory``, registered by ``add_subcommands`` (``leapquant_cli`` gathers every package's).

``replay`` runs a trace file (``traces``) through a state method and writes the outputs and the
final state; the studies and ``memory`` work on synthetic heads or traces and need no model.
"""

from __future__ import annotations

import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from .cli_support import (add_method_options, add_plot_options, emit, int_at_least, make_folder_for,
                          method_from_args, plot_path, progress, window_size)
from .state import LeapQuantConfig
from .studies.errors import ErrorStudyConfig, format_error_table, plot_error_study, run_error_study
from .studies.freeze import format_freeze_table, run_freeze_study
from .studies.memory import MemoryQuery, measure_memory, method_memory
from .studies.outliers import final_states, plot_outliers, run_outlier_study
from .synthetic import SyntheticSpec, synthetic_batch
from .traces import load_trace

# The delta rule's step is S <- (I - beta k k^T) S + ...: with a unit key it contracts the state
# along k only while |1 - beta| <= 1.
BETA_RANGE = (0.0, 2.0)


# ----------------------------------------------------------------------------- replay


def check_beta(beta: np.ndarray, source: str) -> None:
    """Raises ``ValueError`` naming the first entry of ``beta [T, H]`` outside ``BETA_RANGE``."""
    low, high = BETA_RANGE
    bad = np.argwhere(~((beta >= low) & (beta <= high)))
    if bad.size:
        t, h = (int(i) for i in bad[0])
        raise ValueError(f"{source}: beta[{t}, {h}] = {float(beta[t, h]):g} is outside [{low:g}, {high:g}], where "
                         f"the delta rule's step contracts the state ({len(bad)} of {beta.size} values outside)")


def cmd_replay(args) -> int:
    method = method_from_args(args)
    if args.layer is not None:
        method = method.for_layer(args.layer)
    elif getattr(method, "calibration", None) is not None:
        found = re.fullmatch(r"layer(\d+)(_b\d+)?\.npz", os.path.basename(args.trace))
        if found is None:
            raise ValueError(f"method {method.name} keeps a different layout per layer: pass --layer, the model layer "
                             f"{args.trace} was recorded from (or keep the layerNN.npz name --record-traces gives)")
        method = method.for_layer(int(found.group(1)))
    trace = load_trace(args.trace)
    check_beta(trace.beta, args.trace)
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
    for s in progress(starts, desc=f"replay {method.name}", enabled=not args.json, total=len(starts)):
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
    emit(args, payload, f"replayed {trace.num_tokens} tokens x {h} heads with {method.name} in {seconds:.1f}s -> {args.out}")
    return 0


# ----------------------------------------------------------------------------- studies


def cmd_study_errors(args) -> int:
    # The sizes' rules, named by their flags before ErrorStudyConfig checks them again.
    if args.tokens % args.every:
        raise ValueError(f"--tokens {args.tokens} must be a multiple of --every {args.every}")
    if args.every % args.window:
        raise ValueError(f"--every {args.every} must be a multiple of --window {args.window}")
    cfg = ErrorStudyConfig(tokens=args.tokens, heads=args.heads, seeds=args.seeds, dk=args.dk, dv=args.dv,
                           every=args.every, window=args.window, kda=args.kda)
    methods = [m.strip() for m in args.methods.split(",")] if args.methods is not None else None
    plot = plot_path(args)
    result = run_error_study(cfg, methods, progress=lambda it: progress(it, desc="methods", enabled=not args.json))
    human = format_error_table(result)
    if plot:
        make_folder_for(plot)
        plot_error_study(result, plot)
        result["plot"] = plot
        human += f"\nplot: {plot}"
    emit(args, result, human)
    return 0


def cmd_study_freeze(args) -> int:
    try:
        decays = tuple(float(x) for x in args.decays.split(","))
    except ValueError:
        raise ValueError(f"--decays {args.decays!r}: give comma-separated numbers in (0, 1]") from None
    result = run_freeze_study(decays)
    emit(args, result, format_freeze_table(result))
    return 0


def cmd_study_outliers(args) -> int:
    plot = plot_path(args)
    if args.trace:
        trace = load_trace(args.trace)
        inputs, s0, source = trace.batched(), trace.s0, args.trace
    else:
        spec = SyntheticSpec(tokens=args.tokens, heads=args.heads, dk=args.dk, dv=args.dv)
        inputs = {k: np.asarray(v) for k, v in synthetic_batch(args.seed, 1, spec).items()}
        s0, source = None, f"synthetic ({args.tokens} tokens, seed {args.seed})"
    # Checked before the states are computed, against the sizes of the input actually used.
    _, _, h, dv = inputs["v"].shape
    LeapQuantConfig(rank=args.rank).check_head_size(inputs["k"].shape[-1], dv)
    if args.head is not None and args.head >= h:
        raise ValueError(f"--head {args.head}: {source} has {h} heads")
    states = final_states(inputs, s0)
    result = run_outlier_study(states, rank=args.rank, head=args.head)
    result["source"] = source
    if plot:
        make_folder_for(plot)
        plot_outliers(states[result["head"]], args.rank, plot, title=f"{source}, head {result['head']}")
        result["plot"] = plot
    pm = result["peak_over_median"]
    human = (f"head {result['head']} of {source}: peak/median  state {pm['state']:.1f}  "
             f"residual (r={args.rank}) {pm['residual']:.1f}  smoothed {pm['smoothed']:.1f}")
    emit(args, result, human + (f"\nplot: {plot}" if plot else ""))
    return 0


def cmd_memory(args) -> int:
    names = None
    if args.stepquant_calibration and not args.methods:
        raise ValueError("--stepquant-calibration measures methods of --methods: pass --methods too")
    if args.methods:
        names = "all" if args.methods.strip() == "all" else [m.strip() for m in args.methods.split(",")]
        if names != "all" and (not names or not all(names)):
            raise ValueError(f"--methods must be 'all' or a comma-separated list of methods, got {args.methods!r}")
    r = measure_memory(MemoryQuery(dk=args.dk, dv=args.dv, bits=args.bits, rank=args.rank, window=args.window,
                                   layers=args.layers, heads=args.heads, key_heads=args.key_heads))
    rows = [f"{'':<12}{'B/head':>12}{'B/element':>12}{'model MiB':>12}"]
    for k, b in r["bytes_per_head"].items():
        rows.append(f"{k:<12}{b:>12.1f}{r['bytes_per_element'][k]:>12.4f}{r['model_bytes'][k] / 2**20:>12.2f}")
    q = r["query"]
    gva = "" if q["key_heads"] in (None, q["heads"]) else f" over {q['key_heads']} key heads"
    rows.append(f"({q['layers']} layers x {q['heads']} heads{gva}, dk={q['dk']} dv={q['dv']}, {q['bits']} bits, "
                f"r={q['rank']}, p={q['window']}; checkpoint: the window-boundary state; live_gdn / live_kda: a "
                "decoding stream with its window buffer, scalar (GDN) or per-channel (KDA) decays)")
    if names is not None:
        r["methods"] = method_memory(names, dk=args.dk, dv=args.dv, heads=args.heads, key_heads=args.key_heads,
                                     calibration=args.stepquant_calibration)
        rows.append(f"\nbits per value, each method as its label fixes it, defaults otherwise:\n"
                    f"{'method':<16}{'checkpoint':>12}{'live GDN':>12}{'live KDA':>12}")
        rows += [f"{k:<16}{m['checkpoint_bits_per_value']:>12.3f}{m['live_gdn_bits_per_value']:>12.3f}"
                 f"{m['live_kda_bits_per_value']:>12.3f}" for k, m in r["methods"].items()]
    emit(args, r, "\n".join(rows))
    return 0


# ----------------------------------------------------------------------------- registration


def _add_synthetic_size_options(p, *, tokens: int, tokens_help: str, note: str = "") -> None:
    """``--tokens``, ``--heads``, ``--dk``, ``--dv``: the size of a synthetic head batch
    (``SyntheticSpec``); ``note`` ends each help line (when the options apply)."""
    p.add_argument("--tokens", type=int_at_least(1), default=tokens, help=tokens_help + note)
    p.add_argument("--heads", type=int_at_least(1), default=4, help="heads per head batch" + note)
    p.add_argument("--dk", type=int_at_least(1), default=128, help="key size" + note)
    p.add_argument("--dv", type=int_at_least(1), default=128, help="value size" + note)


def add_subcommands(sub) -> None:
    """Registers ``replay``, ``study`` (``errors``, ``freeze``, ``outliers``) and ``memory`` on an
    ``argparse`` subparsers object."""
    p = sub.add_parser("replay", help="replay a trace file with a state method")
    p.add_argument("trace", help="trace .npz (q, k, v, beta, g[, s0]); beta in [0, 2]")
    add_method_options(p)
    p.add_argument("--out", required=True, help="output .npz with o [T, H, dv] and state [H, dk, dv]")
    p.add_argument("--chunk", type=int_at_least(1), default=1024, help="tokens per compiled chunk")
    p.add_argument("--layer", type=int_at_least(0),
                   help="model layer the trace comes from (calibrated methods; default: from a layerNN.npz name)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_replay)

    study = sub.add_parser("study", help="studies: errors, freeze, outliers").add_subparsers(dest="study", required=True)
    p = study.add_parser("errors", help="relative state error vs decoded tokens (Figure 3 in miniature)")
    _add_synthetic_size_options(p, tokens=4096, tokens_help="tokens decoded (a multiple of --every)")
    p.add_argument("--seeds", type=int_at_least(1), default=2, help="independent head batches")
    p.add_argument("--every", type=int_at_least(1), default=128, help="tokens between measurements (a multiple of --window)")
    p.add_argument("--window", type=window_size, default=16, help="window p of the windowed methods")
    p.add_argument("--kda", action="store_true", help="per-channel decays (KDA) instead of scalar (GDN)")
    p.add_argument("--methods", help="comma-separated subset of the study's methods (default: all)")
    add_plot_options(p, "study_errors.png")
    p.set_defaults(func=cmd_study_errors)

    p = study.add_parser("freeze", help="fraction of bf16/fp16 values that alpha * x rounds back to")
    p.add_argument("--decays", default="0.997,0.998,0.999,0.9995,0.9999", help="comma-separated decays in (0, 1]")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_study_freeze)

    p = study.add_parser("outliers", help="peak/median of state, residual and smoothed residual (Figure 6)")
    p.add_argument("--trace", help="trace .npz; default: a synthetic long-memory head batch")
    _add_synthetic_size_options(p, tokens=2048, tokens_help="synthetic tokens", note=" (without --trace)")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="synthetic seed (without --trace)")
    p.add_argument("--rank", type=int_at_least(0), default=4, help="Compensator Tokens r, at most min(dk, dv)")
    p.add_argument("--head", type=int_at_least(0), help="head to detail (default: most outlier-heavy)")
    add_plot_options(p, "study_outliers.png")
    p.set_defaults(func=cmd_study_outliers)

    p = sub.add_parser("memory", help="bytes of checkpoints and live streams, measured on the pytrees")
    p.add_argument("--dk", type=int_at_least(1), default=128, help="key size")
    p.add_argument("--dv", type=int_at_least(1), default=128, help="value size")
    p.add_argument("--bits", type=int, default=8, choices=(8, 6, 4), help="residual bits")
    p.add_argument("--rank", type=int_at_least(0), help="Compensator Tokens r, at most min(dk, dv) (default 4 at 8 bits, 6 at 6/4)")
    p.add_argument("--window", type=window_size, default=16, help="window p")
    p.add_argument("--layers", type=int_at_least(1), default=48, help="linear-attention layers of the model")
    p.add_argument("--heads", type=int_at_least(1), default=32, help="heads per layer")
    p.add_argument("--key-heads", type=int_at_least(1), default=None,
                   help="GVA's key heads per layer, dividing --heads: live streams keep one key record per key "
                        "head (default: --heads)")
    p.add_argument("--methods", default=None,
                   help="also every state method's bits per value (checkpoint, live GDN and KDA streams): 'all' or "
                        "a comma-separated list of method names")
    p.add_argument("--stepquant-calibration", metavar="FILE",
                   help="measure stepquant-* and leapquant-alloc-* with the plans of this calibration (its layers' "
                        "mean; pass its --heads, --dk, --dv) instead of their names' uniform widths")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_memory)


__all__ = ["BETA_RANGE", "add_subcommands", "check_beta", "cmd_memory", "cmd_replay", "cmd_study_errors",
           "cmd_study_freeze", "cmd_study_outliers"]
