"""The ``leapquant`` command line: replay, studies and memory; the models add convert, generate, score, eval, recall,
train-data, train and demo.

Every command that reports numbers takes ``--json`` and then prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from typing import Optional, Sequence


def _progress(iterable, *, desc: str, enabled: bool, total: Optional[int] = None):
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, disable=not enabled, file=sys.stderr, leave=False)


class UsageError(ValueError):
    """Bad command-line input found by the parser (an unknown option, a value out of range)."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (``None``, a flag's
    ``False``) or the help text already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text.lower():
            return text
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """The CLI's parser: help shows defaults, and a usage error is raised as ``UsageError``
    (``main`` prints it as one line and returns 2) instead of printing the usage and exiting.
    Sub-command parsers inherit both."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UsageError(f"{message} (see '{self.prog} --help')")


def int_at_least(low: int):
    """An ``argparse`` type: an integer ``>= low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def float_in(low: float, high: float = math.inf, *, low_open: bool = False):
    """An ``argparse`` type: a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        above = value > low if low_open else value >= low
        if not (math.isfinite(value) and above and value <= high):
            if math.isfinite(high):
                span = f"in {'(' if low_open else '['}{low}, {high}]"
            else:
                span = f"{'>' if low_open else '>='} {low}"
            raise argparse.ArgumentTypeError(f"must be a finite number {span}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def add_method_options(parser: argparse.ArgumentParser, *, flag: Optional[str] = "--method",
                       default: Optional[str] = None) -> None:
    """The state-method option and the LeapQuant options, for every command that picks a state
    method (``replay --method``, ``generate``/``score --state``). The method is stored as
    ``args.method`` whatever ``flag`` is; ``default=None`` makes it required. ``flag=None`` adds
    the LeapQuant options alone (``eval`` takes a list of methods)."""
    from .methods import METHOD_NAMES

    if flag is not None:
        parser.add_argument(flag, dest="method", metavar="METHOD", choices=METHOD_NAMES, required=default is None,
                            default=default, help="state method: %(choices)s")
    parser.add_argument("--bits", type=int, choices=(8, 6, 4), help="residual bits (leapquant; default 8)")
    parser.add_argument("--window", type=int_at_least(1), help="records per window p (windowed methods; default 16)")
    parser.add_argument("--rank", type=int_at_least(0),
                        help="Compensator Tokens r, at most min(dk, dv) (leapquant; default 4 at 8 bits, 6 at 6/4)")
    parser.add_argument("--no-compensators", dest="compensators", action="store_false", default=None,
                        help="no Compensator Tokens (leapquant)")
    parser.add_argument("--no-smoothing", dest="smoothing", action="store_false", default=None,
                        help="no residual smoothing (leapquant)")
    parser.add_argument("--impl", choices=("auto", "reference", "pallas"),
                        help="kernels of the windowed methods (default auto: Pallas on a GPU, the reference elsewhere)")
    parser.add_argument("--damp-calibration", dest="calibration", metavar="FILE",
                        help="method damp's calibration file (made by `leapquant calibrate-damp`)")


def method_from_args(args: argparse.Namespace):
    """Builds the state method of parsed ``add_method_options`` flags."""
    from .methods import make_method

    if args.method == "damp" and args.calibration is None:
        raise ValueError("method damp needs its calibration file: --damp-calibration FILE "
                         "(made by `leapquant calibrate-damp`)")
    return make_method(
        args.method, bits=args.bits, window=args.window, rank=args.rank,
        compensators=args.compensators, smoothing=args.smoothing, impl=args.impl, calibration=args.calibration,
    )


def method_label(args: argparse.Namespace) -> dict:
    """The method options given on the command line (for ``--json`` reports)."""
    return {k: getattr(args, k) for k in ("method", "bits", "window", "rank", "compensators", "smoothing", "impl",
                                          "calibration")
            if getattr(args, k) is not None}


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

    method = method_from_args(args)
    if args.layer is not None:
        method = method.for_layer(args.layer)
    elif getattr(method, "calibration", None) is not None:
        found = re.fullmatch(r"layer(\d+)(_b\d+)?\.npz", os.path.basename(args.trace))
        if found is None:
            raise ValueError(f"method damp keeps different channels per layer: pass --layer, the model layer "
                             f"{args.trace} was recorded from (or keep the layerNN.npz name --record-traces gives)")
        method = method.for_layer(int(found.group(1)))
    trace = load_trace(args.trace)
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


def _plot_path(args) -> Optional[str]:
    """Where a study writes its plot: ``--plot`` inside ``--out-dir`` (created if missing; an
    absolute ``--plot`` is used as is), or ``None`` for ``--plot ''``."""
    if not args.plot:
        return None
    from matplotlib.backend_bases import FigureCanvasBase

    ext = os.path.splitext(args.plot)[1].lstrip(".").lower()
    supported = FigureCanvasBase.get_supported_filetypes()
    if ext not in supported:
        raise ValueError(f"--plot {args.plot!r}: the file name must end in one of .{', .'.join(sorted(supported))}")
    path = os.path.join(args.out_dir, args.plot)
    # Checked before the study runs (a bad folder should not cost a run), created only when writing.
    existing = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        raise ValueError(f"--out-dir {args.out_dir!r}: {existing!r} is not a writable folder")
    return path


def _make_folder_for(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out-dir: cannot create the folder {folder!r} ({err.strerror})") from None


def cmd_study_errors(args) -> int:
    from .studies.errors import ErrorStudyConfig, format_error_table, plot_error_study, run_error_study

    cfg = ErrorStudyConfig(tokens=args.tokens, heads=args.heads, seeds=args.seeds, dk=args.dk, dv=args.dv,
                           every=args.every, window=args.window, kda=args.kda)
    methods = [m.strip() for m in args.methods.split(",")] if args.methods is not None else None
    plot = _plot_path(args)
    result = run_error_study(cfg, methods, progress=lambda it: _progress(it, desc="methods", enabled=not args.json))
    human = format_error_table(result)
    if plot:
        _make_folder_for(plot)
        plot_error_study(result, plot)
        result["plot"] = plot
        human += f"\nplot: {plot}"
    _emit(args, result, human)
    return 0


def cmd_study_freeze(args) -> int:
    from .studies.freeze import format_freeze_table, run_freeze_study

    try:
        decays = tuple(float(x) for x in args.decays.split(","))
    except ValueError:
        raise ValueError(f"--decays {args.decays!r}: give comma-separated numbers in (0, 1]") from None
    result = run_freeze_study(decays)
    _emit(args, result, format_freeze_table(result))
    return 0


def cmd_study_outliers(args) -> int:
    import numpy as np

    from .studies.outliers import final_states, plot_outliers, run_outlier_study

    plot = _plot_path(args)
    if args.trace:
        from .traces import load_trace

        trace = load_trace(args.trace)
        inputs, s0, source = trace.batched(), trace.s0, args.trace
    else:
        from .synthetic import SyntheticSpec, synthetic_batch

        spec = SyntheticSpec(tokens=args.tokens, heads=args.heads, dk=args.dk, dv=args.dv)
        inputs = {k: np.asarray(v) for k, v in synthetic_batch(args.seed, 1, spec).items()}
        s0, source = None, f"synthetic ({args.tokens} tokens, seed {args.seed})"
    # Checked before the states are computed, against the sizes of the input actually used.
    from .state import LeapQuantConfig

    _, _, h, dv = inputs["v"].shape
    LeapQuantConfig(rank=args.rank).check_head_size(inputs["k"].shape[-1], dv)
    if args.head is not None and args.head >= h:
        raise ValueError(f"--head {args.head}: {source} has {h} heads")
    states = final_states(inputs, s0)
    result = run_outlier_study(states, rank=args.rank, head=args.head)
    result["source"] = source
    if plot:
        _make_folder_for(plot)
        plot_outliers(states[result["head"]], args.rank, plot, title=f"{source}, head {result['head']}")
        result["plot"] = plot
    pm = result["peak_over_median"]
    human = (f"head {result['head']} of {source}: peak/median  state {pm['state']:.1f}  "
             f"residual (r={args.rank}) {pm['residual']:.1f}  smoothed {pm['smoothed']:.1f}")
    _emit(args, result, human + (f"\nplot: {plot}" if plot else ""))
    return 0


def cmd_memory(args) -> int:
    from .studies.memory import MemoryQuery, measure_memory, method_memory

    r = measure_memory(MemoryQuery(dk=args.dk, dv=args.dv, bits=args.bits, rank=args.rank, window=args.window,
                                   layers=args.layers, heads=args.heads, key_heads=args.key_heads))
    rows = [f"{'':<12}{'B/head':>12}{'B/element':>12}{'model MiB':>12}"]
    for k, b in r["bytes_per_head"].items():
        rows.append(f"{k:<12}{b:>12.1f}{r['bytes_per_element'][k]:>12.4f}{r['model_bytes'][k] / 2**20:>12.2f}")
    q = r["query"]
    gva = "" if q["key_heads"] in (None, q["heads"]) else f" over {q['key_heads']} key heads"
    rows.append(f"({q['layers']} layers x {q['heads']} heads{gva}, dk={q['dk']} dv={q['dv']}, {q['bits']} bits, "
                f"r={q['rank']}, p={q['window']})")
    if args.methods:
        names = "all" if args.methods.strip() == "all" else [m.strip() for m in args.methods.split(",")]
        if names != "all" and (not names or not all(names)):
            raise ValueError(f"--methods must be 'all' or a comma-separated list of methods, got {args.methods!r}")
        r["methods"] = method_memory(names, dk=args.dk, dv=args.dv, heads=args.heads)
        rows.append(f"\n{'method':<16}{'bits/value':>12}{'B/head':>12}   (live GDN stream, each method's defaults)")
        rows += [f"{k:<16}{m['bits_per_value']:>12.3f}{m['bytes_per_head']:>12.1f}" for k, m in r["methods"].items()]
    _emit(args, r, "\n".join(rows))
    return 0


# ----------------------------------------------------------------------------- parser


def _add_plot_options(p: argparse.ArgumentParser, plot: str) -> None:
    """``--out-dir``, ``--plot`` (default ``plot``) and ``--json`` of the studies that draw."""
    p.add_argument("--out-dir", default="out", help="folder for the plot, created if missing (default: %(default)s)")
    p.add_argument("--plot", default=plot, help="plot file name inside --out-dir, '' to skip (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def build_parser() -> argparse.ArgumentParser:
    """The ``leapquant`` argument parser."""
    parser = ArgumentParser(prog="leapquant", description=__doc__.splitlines()[0].replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("replay", help="replay a trace file with a state method")
    p.add_argument("trace", help="trace .npz (q, k, v, beta, g[, s0])")
    add_method_options(p)
    p.add_argument("--out", required=True, help="output .npz with o [T, H, dv] and state [H, dk, dv]")
    p.add_argument("--chunk", type=int_at_least(1), default=1024, help="tokens per compiled chunk")
    p.add_argument("--layer", type=int_at_least(0),
                   help="model layer the trace comes from (method damp; default: from a layerNN.npz name)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_replay)

    study = sub.add_parser("study", help="studies: errors, freeze, outliers").add_subparsers(dest="study", required=True)
    p = study.add_parser("errors", help="relative state error vs decoded tokens (Figure 3 in miniature)")
    p.add_argument("--tokens", type=int_at_least(1), default=4096, help="tokens decoded (a multiple of --every)")
    p.add_argument("--heads", type=int_at_least(1), default=4, help="heads per seed")
    p.add_argument("--seeds", type=int_at_least(1), default=2, help="independent head batches")
    p.add_argument("--dk", type=int_at_least(1), default=128, help="key size")
    p.add_argument("--dv", type=int_at_least(1), default=128, help="value size")
    p.add_argument("--every", type=int_at_least(1), default=128, help="tokens between measurements (a multiple of --window)")
    p.add_argument("--window", type=int_at_least(1), default=16, help="window p of the windowed methods")
    p.add_argument("--kda", action="store_true", help="per-channel decays (KDA) instead of scalar (GDN)")
    p.add_argument("--methods", help="comma-separated subset of the study's methods (default: all)")
    _add_plot_options(p, "study_errors.png")
    p.set_defaults(func=cmd_study_errors)

    p = study.add_parser("freeze", help="fraction of bf16/fp16 values that alpha * x rounds back to")
    p.add_argument("--decays", default="0.997,0.998,0.999,0.9995,0.9999", help="comma-separated decays in (0, 1]")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_study_freeze)

    p = study.add_parser("outliers", help="peak/median of state, residual and smoothed residual (Figure 6)")
    p.add_argument("--trace", help="trace .npz; default: a synthetic long-memory head batch")
    p.add_argument("--tokens", type=int_at_least(1), default=2048, help="synthetic tokens (without --trace)")
    p.add_argument("--heads", type=int_at_least(1), default=4, help="synthetic heads (without --trace)")
    p.add_argument("--dk", type=int_at_least(1), default=128, help="synthetic key size (without --trace)")
    p.add_argument("--dv", type=int_at_least(1), default=128, help="synthetic value size (without --trace)")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="synthetic seed (without --trace)")
    p.add_argument("--rank", type=int_at_least(0), default=4, help="Compensator Tokens r, at most min(dk, dv)")
    p.add_argument("--head", type=int_at_least(0), help="head to detail (default: most outlier-heavy)")
    _add_plot_options(p, "study_outliers.png")
    p.set_defaults(func=cmd_study_outliers)

    p = sub.add_parser("memory", help="bytes of checkpoints and live streams, measured on the pytrees")
    p.add_argument("--dk", type=int_at_least(1), default=128, help="key size")
    p.add_argument("--dv", type=int_at_least(1), default=128, help="value size")
    p.add_argument("--bits", type=int, default=8, choices=(8, 6, 4), help="residual bits")
    p.add_argument("--rank", type=int_at_least(0), help="Compensator Tokens r, at most min(dk, dv) (default 4 at 8 bits, 6 at 6/4)")
    p.add_argument("--window", type=int_at_least(1), default=16, help="window p")
    p.add_argument("--layers", type=int_at_least(1), default=48, help="linear-attention layers of the model")
    p.add_argument("--heads", type=int_at_least(1), default=32, help="heads per layer")
    p.add_argument("--key-heads", type=int_at_least(1), default=None,
                   help="GVA's key heads per layer, dividing --heads: live streams keep one key record per key "
                        "head (default: --heads)")
    p.add_argument("--methods", default=None,
                   help="also every state method's bits per value: 'all' or a comma-separated list of method names")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
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


# Exceptions that mean bad input: the API refuses out-of-range arguments and tensors with a
# ValueError naming them, and files that cannot be read raise OSError. Anything else (a
# TypeError, a KeyError, an error inside JAX) is a bug and keeps its traceback.
BAD_INPUT = (ValueError, OSError, FloatingPointError)


def one_line(err: BaseException) -> str:
    """An error message on one line: a multi-line report (a checkpoint naming every offending
    tensor) is joined with ``; ``."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    head, rest = lines[0], lines[1:]
    if not rest:
        return head
    return head + (" " if head.endswith(":") else "; ") + "; ".join(rest)


def run_parser(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> int:
    """Parses ``argv`` and runs the chosen command. Bad input (``BAD_INPUT``) gives one line
    ``leapquant: error: ...`` on stderr and exit code 2; ``--help`` exits 0 as usual."""
    try:
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except BAD_INPUT as err:
        print(f"leapquant: error: {one_line(err)}", file=sys.stderr)
        return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``leapquant`` console command."""
    return run_parser(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
