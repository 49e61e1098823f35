"""``leapquant task``: long-memory task accuracy against length, per recurrent-state format.

    leapquant task CKPT --task mqar|needle [--pairs N] --lengths L1 L2 ... [--samples S] [--seed S]
                   [--gap G] [--depth D] [--filler noise|pairs] [--states fp32,int8,leapquant,...]
                   [--bits --window --rank --impl] [--damp-calibration FILE]
                   [--stepquant-calibration FILE] [--json] [--plot FILE]

At each length the rows come from ``models.tasks.generate`` with the key ``fold_in(seed,
length)``: every state method sees the same rows. Every token of a row goes through the state
method's decode step (teacher-forced, no prefill), as in ``leapquant eval``, all rows at once:
a jitted ``lax.scan`` over ``chunk`` tokens (``SCAN_CHUNK`` at most) carries the cache from one
call to the next, so one program per method serves every length (rows are padded to whole
chunks; what follows a row's end is never scored), and only the argmax of each position is
kept. Accuracy is the fraction of scored positions (the queried values) whose argmax is the
right value. A row whose logits turned non-finite counts as wrong, and the report names where.

The vocabulary split, the default pair count and filler and the training length come from the
checkpoint's ``task.json`` (``leapquant train --task``), else from ``TaskVocab``'s defaults; a
checkpoint whose vocabulary cannot hold the split is refused. Calibrated here, on the same
``CALIBRATION_ROWS`` rows of the task's training distribution (the checkpoint's training rows at
its training length, or this task at its first length when the checkpoint has no ``task.json``):
``damp`` without ``--damp-calibration`` (``models.calibrate.calibrate_model``), and the
``stepquant-*`` / ``leapquant-alloc-*`` named without ``--stepquant-calibration`` (their plans
alone, ``models.calibrate_stepquant.calibrate_lifetime``). A calibration file given is checked
against the model's fingerprint as soon as the model loads.

``--json`` prints ``{"task", "results": {method: {"<length>": accuracy}}, ...}``; ``--plot``
writes accuracy against length, one line per method.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from leapquant_jax.checks import check_integer, is_integer
from leapquant_jax.cli_support import add_states_option, int_at_least, state_options
from leapquant_jax.damp import DEFAULT_CHANNELS, DEFAULT_TAU
from leapquant_jax.method_names import METHOD_LABELS, methods_for_labels
from leapquant_jax.methods import LIFETIME_METHODS
from leapquant_jax.studies.errors import method_styles
from models.calibrate import calibrate_model
from models.calibrate_stepquant import calibrate_lifetime
from models.fingerprint import check_state_method, linear_state_layout
from models.loading import check_checkpoint, load_checkpoint
from models.tasks import FILLERS, TASKS, TaskSpec, TaskVocab, generate
from models.training.task_cli import read_task_file
from models.training.task_data import HELDOUT_STREAM, task_batch

# The rows of the calibrations made here (DAMP's protocol and calibrate-stepquant's default take 32
# segments of 256 tokens; 16 rows of a long training length hold more tokens).
CALIBRATION_ROWS = 16
DAMP_SAMPLES_PER_ROW = 64       # DAMP's most state samples per row
LIFETIME_SAMPLES_PER_ROW = 16   # x 16 rows: 4x the 64 states it keeps (evenly spaced), not one every 8 tokens
DEFAULT_PAIRS = 64
# tokens per compiled scan call: long enough that the per-call overhead vanishes, short enough
# that a row of 1K tokens wastes little padding
SCAN_CHUNK = 512
DEFAULT_TASK_STATES = "fp32,bf16,fp16,int8,fp8,bf16-w,int8-w,leapquant,leapquant-b6,leapquant-b4"


@dataclasses.dataclass(frozen=True)
class TaskEvalConfig:
    """spec: the task at its first length (its length is replaced by each of ``lengths``);
    lengths: row lengths, each at least ``spec.min_length``; samples: rows per length; seed:
    the rows' PRNG seed."""

    spec: TaskSpec
    lengths: tuple[int, ...]
    samples: int = 64
    seed: int = 0

    def __post_init__(self):
        if not self.lengths:
            raise ValueError("--lengths: give at least one length")
        for name, value, low in (("samples", self.samples, 1), ("seed", self.seed, 0)):
            check_integer(f"--{name}", value, low)
        for length in self.lengths:
            if not is_integer(length, 1):
                raise ValueError(f"--lengths must be positive integers, got {length!r}")
            if length < self.spec.min_length:
                what = (f"{self.spec.pairs} pairs need" if self.spec.task == "mqar" else "a needle needs")
                raise ValueError(f"--lengths {length} is smaller than the {self.spec.min_length} tokens that {what}")
        if len(set(self.lengths)) != len(self.lengths):
            raise ValueError(f"--lengths repeats a length: {list(self.lengths)}")

    def rows(self, length: int):
        """The rows at ``length`` (a ``models.tasks.TaskBatch``), the same for every method."""
        key = jax.random.fold_in(jax.random.PRNGKey(self.seed), length)
        return generate(key, self.spec.with_length(length), self.samples)


def checkpoint_task(folder) -> tuple[Optional[object], Optional[int]]:
    """``(mix, training length)`` of a checkpoint's ``task.json`` or ``(None, None)``."""
    found = read_task_file(folder)
    return (None, None) if found is None else found


def task_spec(task: str, *, pairs: Optional[int], gap: int, depth: Optional[float], mix, length: int,
              filler: Optional[str] = None) -> TaskSpec:
    """The spec of ``task`` on a checkpoint trained on ``mix`` (``None``: the default split);
    ``filler`` ``None`` takes the mix's (else ``"noise"``)."""
    if task not in TASKS:
        raise ValueError(f"--task: unknown task {task!r}; known: {', '.join(TASKS)}")
    vocab = mix.vocab if mix is not None else TaskVocab()
    if filler is None:
        filler = mix.fillers[0] if mix is not None else "noise"
    if task == "needle":
        if pairs not in (None, 1):
            raise ValueError(f"--pairs {pairs}: the needle task has one pair")
        if gap:
            raise ValueError("--gap is an mqar setting; the needle sits at --depth")
        return TaskSpec("needle", length=length, pairs=1, depth=depth, filler=filler, vocab=vocab)
    if depth is not None:
        raise ValueError("--depth is a needle setting")
    if pairs is None:
        pairs = max(mix.pairs) if mix is not None else DEFAULT_PAIRS
    return TaskSpec("mqar", length=length, pairs=pairs, gap=gap, filler=filler, vocab=vocab)


def check_vocabulary(spec: TaskSpec, vocab_size: int, checkpoint) -> None:
    """Refuses a checkpoint whose vocabulary cannot hold the task's ids."""
    if vocab_size < spec.vocab.size:
        raise ValueError(f"checkpoint {checkpoint} has a vocabulary of {vocab_size} ids, which cannot hold the task's "
                         f"{spec.vocab.size} ({spec.vocab.keys} keys, {spec.vocab.values} values, "
                         f"{spec.vocab.fillers} filler, id 0 reserved)")


@functools.partial(jax.jit, static_argnames=("arch", "config", "method"))
def _chunk_predictions(arch, params, config, cache, finite, ids, *, method):
    # ids [B, C]: one decode step per token from `cache` -> (cache, finite [B] bool, argmax [B, C] int32)
    def body(carry, tok):
        cache, finite = carry
        logits, cache, _ = arch.forward(params, config, tok[:, None], cache, method=method, mode="decode")
        logits = logits[:, 0]
        finite = finite & jnp.all(jnp.isfinite(logits), axis=-1)
        return (cache, finite), jnp.argmax(logits, axis=-1).astype(jnp.int32)

    (cache, finite), preds = jax.lax.scan(body, (cache, finite), jnp.moveaxis(ids, 1, 0))
    return cache, finite, jnp.moveaxis(preds, 0, 1)


def predictions(arch, params, config, method, ids: np.ndarray, *, chunk: int = SCAN_CHUNK):
    """Teacher-forced argmax ``[B, T]`` int32 and ``finite [B]`` (no non-finite logit in the
    row) of ``ids [B, T]`` through ``method``'s decode step, ``chunk`` tokens per compiled call."""
    bsz, t = ids.shape
    padded = -(-t // chunk) * chunk
    ids = np.pad(ids, ((0, 0), (0, padded - t)))  # id 0 after the row's end: never scored
    # the zero state is built outside jit (XLA would constant-fold its quantization at compile time)
    cache = arch.init_cache(config, batch=bsz, max_len=padded, method=method)
    finite = jnp.ones((bsz,), bool)
    out = []
    for s in range(0, padded, chunk):
        cache, finite, preds = _chunk_predictions(arch, params, config, cache, finite, jnp.asarray(ids[:, s:s + chunk]),
                                                  method=method)
        out.append(preds)
    preds, finite = jax.device_get((jnp.concatenate(out, axis=1), finite))
    return np.asarray(preds)[:, :t], np.asarray(finite)


def task_accuracy(arch, params, config, method, rows, *, chunk: int = SCAN_CHUNK) -> tuple[float, int]:
    """``(accuracy, rows with non-finite logits)`` of ``method`` on ``rows`` (a ``TaskBatch``)."""
    preds, finite = predictions(arch, params, config, method, rows.ids, chunk=chunk)
    hit = (preds == rows.targets) & rows.mask & finite[:, None]
    return float(hit.sum() / rows.mask.sum()), int(np.sum(~finite))


def calibration_task_rows(mix, train_length: Optional[int], spec: TaskSpec, *, seed: int) -> np.ndarray:
    """``[R, T]`` int32 token ids of the task's training distribution for the calibrations made
    here (see the module docstring): ``CALIBRATION_ROWS`` rows (at least one per kind of row of
    ``mix``), on a key stream apart from the training and held-out rows."""
    if mix is not None:
        kinds = len(mix.specs(train_length)) + mix.needle_rows
        return task_batch(mix, seed=seed, step=HELDOUT_STREAM - 3, batch=max(CALIBRATION_ROWS, kinds),
                          seq_len=train_length)["ids"][:, :-1]
    return generate(jax.random.fold_in(jax.random.PRNGKey(seed), 2**31 - 4), spec, CALIBRATION_ROWS).ids


def damp_calibration(arch, params, config, rows: np.ndarray):
    """DAMP calibrated on ``rows [R, T]`` (``calibration_task_rows``): DAMP's 16 of 128 key
    channels in proportion to ``dk``, its default horizon."""
    dk = linear_state_layout(arch, config)[2]
    every = max(8, rows.shape[1] // DAMP_SAMPLES_PER_ROW)
    k_hi = max(1, round(DEFAULT_CHANNELS * dk / 128))  # DAMP's 16 of 128 key channels, in proportion
    cal, _ = calibrate_model(arch, params, config, rows, k_hi=k_hi, tau=DEFAULT_TAU, every=every)
    return cal


def lifetime_calibration(arch, params, config, rows: np.ndarray, names):
    """The lifetime plans of method names ``names`` (``stepquant-*``, ``leapquant-alloc-*``)
    calibrated on ``rows [R, T]`` (``calibration_task_rows``): ``LIFETIME_SAMPLES_PER_ROW`` states
    per row, ``lifetime.DEFAULT_SAMPLES`` of them kept, the default horizon."""
    every = max(1, rows.shape[1] // LIFETIME_SAMPLES_PER_ROW)
    cal, _ = calibrate_lifetime(arch, params, config, rows, every=every, names=names)
    return cal


def run_task_eval(arch, params, config, methods: dict, cfg: TaskEvalConfig, *,
                  progress: Callable[[str], None] = lambda msg: None) -> dict:
    """Accuracy of every method of ``methods`` (``{label: method}``) at every length of ``cfg``.

    Returns ``{"task", "results": {label: {"<length>": accuracy}}, "nonfinite_rows": {label:
    {"<length>": rows}} (only where some), "seconds": {label: {"<length>": s}}, "scored_per_row"}``.
    """
    for method in methods.values():
        check_state_method(method, arch, config, params)
    results, nonfinite, seconds = {}, {}, {}
    chunk = min(SCAN_CHUNK, max(cfg.lengths))
    for length in cfg.lengths:
        rows = cfg.rows(length)
        for label, method in methods.items():
            t0 = time.time()
            acc, bad = task_accuracy(arch, params, config, method, rows, chunk=chunk)
            results.setdefault(label, {})[str(length)] = acc
            seconds.setdefault(label, {})[str(length)] = round(time.time() - t0, 3)
            if bad:
                nonfinite.setdefault(label, {})[str(length)] = bad
            progress(f"{label} at {length}: accuracy {acc:.4f} ({time.time() - t0:.1f} s)")
    out = {"task": cfg.spec.task, "results": results, "scored_per_row": cfg.spec.scored_per_row, "seconds": seconds}
    if nonfinite:
        out["nonfinite_rows"] = nonfinite
    return out


def format_task_table(result: dict) -> str:
    """Accuracy per method (rows) and length (columns)."""
    lengths = result["lengths"]
    head = f"{'method':<16}" + "".join(f"{length:>10}" for length in lengths)
    lines = [head]
    for label, row in result["results"].items():
        lines.append(f"{label:<16}" + "".join(f"{row[str(length)]:>10.4f}" for length in lengths))
    spec = result["spec"]
    what = (f"{spec['pairs']} pairs, gap {spec['gap']}" if result["task"] == "mqar" else
            f"depth {'random' if spec['depth'] is None else spec['depth']}") + f", {spec['filler']} filler"
    lines.append(f"({result['task']}: {what}; {result['samples']} rows x {result['scored_per_row']} scored "
                 f"per length, seed {result['seed']}; accuracy of the argmax on the queried values)")
    for label, where in result.get("nonfinite_rows", {}).items():
        lines.append(f"{label}: non-finite logits (counted wrong) in " +
                     ", ".join(f"{n} rows at {length}" for length, n in where.items()))
    return "\n".join(lines)


def plot_task(result: dict, path) -> None:
    """Accuracy against length, one line per method (the styles of ``study errors``) -> ``path``;
    a (method, length) missing from ``result["results"]`` is left out of its line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(result["results"])
    styles = method_styles([x for x in labels if x != "fp32"])
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    lengths = result["lengths"]
    for label in labels:
        acc = [result["results"][label].get(str(n), np.nan) for n in lengths]   # a length not run: a gap
        style = (dict(color="0.2", linestyle="-", marker="o", linewidth=2.6, alpha=0.5) if label == "fp32"
                 else styles[label])
        ax.plot(lengths, acc, label=label, markersize=5, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths)
    ax.set_xticklabels([f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("row length (tokens, every one a decode step)")
    ax.set_ylabel("recall accuracy")
    train = result.get("train_length")
    if train:
        ax.axvline(train, color="0.6", linestyle=":", linewidth=1)
        ax.annotate("training length", (train, 0.02), textcoords="offset points", xytext=(4, 0), fontsize=7,
                    color="0.4")
    spec = result["spec"]
    what = (f"{spec['pairs']} pairs" if result["task"] == "mqar" else "needle") + f", {spec['filler']} filler"
    ax.set_title(f"{Path(result['checkpoint']).name}: {result['task']} ({what}), {result['samples']} rows per length",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------- command line


def _check_plot_path(plot) -> None:
    # Checked before anything runs: a bad path costs nothing, and nothing is written on an error.
    if plot is None:
        return
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(plot)
    ext = path.suffix.lstrip(".").lower()
    if ext not in FigureCanvasBase.get_supported_filetypes():
        raise ValueError(f"--plot {plot}: the file name must end in an image type (.png, .pdf, .svg, ...)")
    if path.is_dir():
        raise IsADirectoryError(f"--plot {plot} is a folder; give a file name")
    if not path.resolve().parent.is_dir():
        raise FileNotFoundError(f"--plot {plot}: the folder {path.resolve().parent} does not exist")


def run_task(args) -> int:
    """The ``leapquant task`` handler."""
    check_checkpoint(args.checkpoint)
    _check_plot_path(args.plot)
    mix, train_length = checkpoint_task(args.checkpoint)
    # the spec at a placeholder length that always fits: each of --lengths is checked by name next
    spec = task_spec(args.task, pairs=args.pairs, gap=args.gap, depth=args.depth, mix=mix, length=1 << 30,
                     filler=args.filler)
    cfg = TaskEvalConfig(spec=spec, lengths=tuple(args.lengths), samples=args.samples, seed=args.seed)
    options = state_options(args)
    labels = [x.strip() for x in args.states.split(",")]
    auto_damp = "damp" in labels and options.get("calibration") is None
    lifetime = [x for x in labels if x in METHOD_LABELS and METHOD_LABELS[x][0] in LIFETIME_METHODS]
    auto_lifetime = bool(lifetime) and options.get("stepquant_calibration") is None
    here = (["damp"] if auto_damp else []) + (lifetime if auto_lifetime else [])
    # every other name checked before the model loads, a calibration file given as soon as it has
    given = methods_for_labels([x for x in labels if x not in here] or ["fp32"], options)
    arch, config, params, _ = load_checkpoint(args.checkpoint)
    check_vocabulary(spec, config.vocab_size, args.checkpoint)
    for method in given.values():
        check_state_method(method, arch, config, params)
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.progress else (lambda msg: None)
    t0 = time.time()
    rows = calibration_task_rows(mix, train_length, spec.with_length(cfg.lengths[0]), seed=args.seed) if here else None
    if auto_damp:
        options["calibration"] = damp_calibration(arch, params, config, rows)
        log(f"damp calibrated on {len(rows)} rows of {rows.shape[1]} tokens ({time.time() - t0:.1f} s)")
    if auto_lifetime:
        t1 = time.time()
        options["stepquant_calibration"] = lifetime_calibration(arch, params, config, rows,
                                                                [METHOD_LABELS[x][0] for x in lifetime])
        log(f"{', '.join(lifetime)} calibrated on {len(rows)} rows of {rows.shape[1]} tokens "
            f"({time.time() - t1:.1f} s)")
    methods = methods_for_labels(labels, options)
    result = run_task_eval(arch, params, config, methods, cfg, progress=log)
    result.update(checkpoint=str(args.checkpoint), lengths=list(cfg.lengths), samples=cfg.samples, seed=cfg.seed,
                  spec={k: v for k, v in spec.to_json().items() if k not in ("length", "vocab")},
                  vocab=spec.vocab.to_json(), train_length=train_length, damp_calibrated_here=auto_damp,
                  stepquant_calibrated_here=auto_lifetime,
                  calibration_rows=None if rows is None else list(rows.shape),
                  state_options={k: v for k, v in state_options(args).items() if v is not None},
                  total_seconds=round(time.time() - t0, 3))
    if args.plot:
        plot_task(result, args.plot)
        result["plot"] = str(args.plot)
    print(json.dumps(result) if args.json else format_task_table(result) +
          (f"\nplot: {args.plot}" if args.plot else ""))
    return 0


def add_subcommand(subparsers) -> None:
    """Registers ``task`` on an argparse subparsers object."""
    p = subparsers.add_parser("task", help="long-memory task accuracy against length, per state format (decode path)")
    p.add_argument("checkpoint", type=Path, help="checkpoint directory (a `leapquant train --task` one holds task.json)")
    p.add_argument("--task", required=True, choices=TASKS, help="multi-query associative recall or one needle")
    p.add_argument("--pairs", type=int_at_least(1),
                   help=f"key-value pairs per row (mqar; default: the checkpoint's largest training count, else "
                        f"{DEFAULT_PAIRS})")
    p.add_argument("--lengths", type=int_at_least(1), nargs="+", required=True, help="row lengths in tokens")
    p.add_argument("--samples", type=int_at_least(1), default=64, help="rows per length")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="the rows' PRNG seed")
    p.add_argument("--gap", type=int_at_least(0), default=0,
                   help="mqar: filler tokens between the pairs and the queries (0: queries spread over the row)")
    p.add_argument("--depth", type=float, help="needle: relative depth of the pair in [0, 1] (default: random per row)")
    p.add_argument("--filler", choices=FILLERS,
                   help="noise tokens, or distractor pairs on keys never queried (default: the checkpoint's first "
                        "training filler, else noise)")
    add_states_option(p, DEFAULT_TASK_STATES)
    p.add_argument("--plot", type=Path, metavar="FILE", help="write accuracy against length (PNG, PDF, SVG)")
    p.add_argument("--progress", action="store_true", help="print each (method, length) as it finishes, on stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run_task)


__all__ = ["CALIBRATION_ROWS", "DEFAULT_TASK_STATES", "SCAN_CHUNK", "TaskEvalConfig", "add_subcommand",
           "calibration_task_rows", "check_vocabulary", "damp_calibration", "format_task_table", "lifetime_calibration",
           "plot_task", "predictions", "run_task", "run_task_eval", "task_accuracy", "task_spec"]
