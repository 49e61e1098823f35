"""``leapquant demo``: fp32 against the LeapQuant state on the shipped GDN checkpoint.

The checkpoint's held-out text is read, without any download, from the running interpreter's
standard library: ``DATA_FILES.txt`` lists every file of the training corpus as ``split sha256
relative/path``; the held-out files whose bytes still have the listed sha256 are tokenized as
the corpus was (each file's tokens, then ``<|endoftext|>``, in list order). ``--data`` takes any
text or ``.npy`` file instead.

One row of ``--context`` tokens is decoded teacher-forced, one decode step per token from an
empty state, once per state format (``models.evaluate.evaluate``: perplexity, KL and top-1
agreement to fp32, greedy match, per-layer relative state error). Next to it the command shows
what each format costs: the bytes of the whole model's recurrent state per decoding stream,
measured on the state pytrees of the model's own cache (``jax.eval_shape``, nothing allocated).
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from pathlib import Path
from typing import Optional

import jax
import numpy as np
from matplotlib.figure import Figure

from leapquant_jax.cli_support import (add_plot_options, add_states_option, int_at_least, make_folder_for, plot_path,
                                       progress, state_options)
from leapquant_jax.method_names import methods_for_labels
from leapquant_jax.methods import make_method
from leapquant_jax.quantizers import tree_bytes
from leapquant_jax.studies.errors import method_styles
from leapquant_jax.studies.memory import boundary_state
from models.base import layer_caches
from models.decode import check_token_ids
from models.evaluate import EvalConfig, evaluate, format_table, load_data, segment_rows, warn_if_training_data
from models.loading import DATA_FILES, check_checkpoint, load_checkpoint, load_tokenizer, read_file_list
from models.training.data import EOS, default_source, file_sha256, tokenize_texts

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "stdlib-gdn"
# fp32, two per-step formats bracketing LeapQuant's bytes (bf16 above, int8 below), LeapQuant at 8
# and 4 bits. Compilation dominates on a CPU (tens of seconds per format), so the list sets the run time.
DEFAULT_STATES = "fp32,bf16,int8,leapquant,leapquant-b4"
DEFAULT_CONTEXT = 2048


@dataclasses.dataclass(frozen=True)
class HeldOutText:
    """Token ids ``[N]`` and where they came from.

    source: one line for people; files: the relative paths used (empty for ``--data``);
    listed: held-out files in the list (0 for ``--data``); python: version of the standard
    library read (``None`` when it is not the running interpreter's, or for ``--data``).
    """

    ids: np.ndarray
    source: str
    files: tuple = ()
    listed: int = 0
    python: Optional[str] = None

    def to_json(self) -> dict:
        """Everything but the ids."""
        return {"source": self.source, "tokens": int(self.ids.size), "files": list(self.files),
                "listed_files": self.listed, "python": self.python}


def stdlib_heldout(checkpoint, tokenizer, *, min_tokens: int, stdlib=None) -> HeldOutText:
    """The held-out split of ``checkpoint``'s ``DATA_FILES.txt``, read from ``stdlib`` (default:
    the running interpreter's standard library), keeping the files whose sha256 matches the list,
    tokenized with ``tokenizer`` (a ``tokenizers.Tokenizer``) as the training corpus was.

    Returns a ``HeldOutText`` with ids ``[N]`` uint16. Raises ``ValueError`` naming the
    directory, its Python, the files matched and ``--data`` when fewer than ``min_tokens``
    tokens match, and when the checkpoint has no file list or no tokenizer.
    """
    checkpoint = Path(checkpoint)
    files_list = checkpoint / DATA_FILES
    if not files_list.is_file():
        raise ValueError(f"{checkpoint} has no {DATA_FILES} (the list of its training corpus); "
                         "pass --data FILE (held-out text or .npy ids)")
    if tokenizer is None:
        raise ValueError(f"{checkpoint} has no tokenizer.json to encode its held-out text; pass --data FILE.npy (ids)")
    if tokenizer.token_to_id(EOS) is None:
        raise ValueError(f"the tokenizer of {checkpoint} has no {EOS} token, which separates the corpus files")
    root = Path(stdlib) if stdlib is not None else default_source()
    python = platform.python_version() if root.resolve() == default_source().resolve() else None
    where = f"the standard library of Python {python} ({root})" if python else f"the standard library at {root}"
    listed = [(digest, rel) for split, digest, rel in read_file_list(files_list) if split == "heldout"]
    used, texts = [], []
    for digest, rel in listed:
        path = root / rel
        # A different patch version changes a few files: those are left out, never mixed in.
        if not path.is_file() or file_sha256(path) != digest:
            continue
        try:
            texts.append(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as err:
            raise ValueError(f"{path} matches its listed sha256 but is not UTF-8 ({err.reason})") from None
        used.append(rel)
    ids = tokenize_texts(tokenizer, texts) if texts else np.zeros((0,), np.uint16)
    if ids.size < min_tokens:
        corpus = _corpus_python(checkpoint)
        raise ValueError(
            f"the held-out files of {files_list} give {ids.size} tokens from {where}, fewer than the "
            f"{min_tokens} needed: {len(used)} of {len(listed)} files have the listed sha256"
            + (f" (the corpus is Python {corpus}'s)" if corpus else "")
            + "; pass --data FILE (text or .npy ids) or a shorter --context")
    source = (f"held-out split of {files_list.name}: {len(used)} of {len(listed)} files from {where}, "
              f"{ids.size:,} tokens")
    return HeldOutText(ids=ids, source=source, files=tuple(used), listed=len(listed), python=python)


def _corpus_python(checkpoint: Path) -> Optional[str]:
    # training.json (written by `leapquant train`) records the corpus's Python; absent elsewhere.
    try:
        return json.loads((checkpoint / "training.json").read_text())["data"]["python_version"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stream_memory(arch, config, methods: dict) -> dict:
    """Bytes of the whole model's recurrent state per decoding stream, for each method of
    ``methods`` (``{label: method}``), measured on the linear-attention layers' ``state`` pytrees
    of ``arch.init_cache`` for one stream (``jax.eval_shape``: nothing is allocated).

    Returns ``{"layers", "elements" (dense elements, the sum of H x dk x dv over layers),
    "methods": {label: {"bytes" (a live stream, window buffer included), "checkpoint_bytes"
    (window-boundary checkpoint; the state itself for per-step methods), "bytes_per_element",
    "vs_fp32" (bytes over fp32's bytes)}}}``.
    """
    def states(method):
        cache = jax.eval_shape(lambda: arch.init_cache(config, batch=1, max_len=1, method=method))
        found = [layer["state"] for layer in layer_caches(cache, config) if isinstance(layer, dict) and "state" in layer]
        if not found:
            raise ValueError(f"the {config.model_type} cache holds no recurrent state")
        return found

    fp32 = make_method("fp32")
    dense = [jax.eval_shape(fp32.to_dense, s) for s in states(fp32)]   # [1, H, dk, dv] per layer
    elements = int(sum(np.prod(d.shape) for d in dense))
    fp32_bytes = tree_bytes(states(fp32))
    out = {}
    for label, method in methods.items():
        found = states(method)
        live = tree_bytes(found)
        ckpt = tree_bytes([boundary_state(s) for s in found])
        out[label] = {"bytes": live, "checkpoint_bytes": ckpt, "bytes_per_element": live / elements,
                      "vs_fp32": live / fp32_bytes}
    return {"layers": len(dense), "elements": elements, "methods": out}


def format_memory(memory: dict) -> str:
    """The printed table of ``stream_memory``."""
    lines = [f"recurrent state per decoding stream ({memory['layers']} linear-attention layers, "
             f"{memory['elements']:,} state elements), measured on the state pytrees:",
             f"{'method':<16}{'bytes':>12}{'B/element':>11}{'vs fp32':>9}{'checkpoint':>13}"]
    for label, m in memory["methods"].items():
        lines.append(f"{label:<16}{m['bytes']:>12,}{m['bytes_per_element']:>11.3f}{m['vs_fp32']:>8.3f}x"
                     f"{m['checkpoint_bytes']:>13,}")
    lines.append("bytes: a live stream (windowed methods: with their window buffer of high-precision records); "
                 "checkpoint: the window-boundary state alone")
    return "\n".join(lines)


def layer_line(errors: dict) -> tuple[list, list]:
    """``(x, y)`` of one method's per-layer errors (``{model layer: error}``), ``x`` the model
    layer indices, with a NaN (no line) where an attention layer lies between two linear ones."""
    xs, ys = [], []
    for layer, err in sorted((int(k), v) for k, v in errors.items()):
        if xs and layer != xs[-1] + 1:
            xs.append(np.nan)
            ys.append(np.nan)
        xs.append(layer)
        ys.append(err)
    return xs, ys


def plot_demo(result: dict, memory: dict, path, *, title: str) -> None:
    """Writes the demo's PNG: (left) each method's final relative state error per
    linear-attention layer against its model layer index, log scale, the attention layers
    between them shaded and not crossed by the lines; (right) KL to fp32 against bytes per
    stream, each point labelled with its perplexity change. fp32 is the reference (zero error),
    marked by a line."""
    labels = [m for m in result["methods"] if m != "fp32"]
    styles = method_styles(labels)
    fp32 = result["methods"]["fp32"]
    kib = 1024.0
    fig = Figure(figsize=(13, 5.4))
    ax, bx = fig.subplots(1, 2)
    layers = sorted(int(k) for k in fp32["state_rel_error"])
    for label in labels:
        r, mem = result["methods"][label], memory["methods"][label]
        st = styles[label]
        colour = st["color"]
        ax.plot(*layer_line(r["state_rel_error"]), label=f"{label}  ({mem['bytes'] / kib:,.0f} KiB per stream)", **st)
        kl = r["kl_to_fp32"]
        bx.plot(mem["bytes"] / kib, kl, st["marker"], color=colour, markersize=9)
        delta = r["perplexity"] - fp32["perplexity"]
        bx.annotate(f"{label}\nppl {delta:+.4f}", (mem["bytes"] / kib, kl), textcoords="offset points",
                    xytext=(8, 0), ha="left", va="center", fontsize=8, color=colour)
    for gap in sorted(set(range(layers[0], layers[-1] + 1)) - set(layers)):
        ax.axvspan(gap - 0.5, gap + 0.5, color="0.92", linewidth=0)
    ax.set_xticks(layers)
    ax.set_yscale("log", nonpositive="mask")
    ax.set_xlabel("model layer (linear-attention layers; shaded: attention layers)")
    ax.set_ylabel(r"final relative state error  $\|S - S_{fp32}\|_F\, /\, \|S_{fp32}\|_F$")
    ax.set_title("state error per layer (each layer replays fp32's own inputs)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, title="method (state of the whole model per stream)", title_fontsize=8)
    fp32_kib = memory["methods"]["fp32"]["bytes"] / kib
    bx.axvline(fp32_kib, color="0.5", linestyle=(0, (1, 3)), linewidth=1.2)
    bx.annotate(f"fp32 reference\n(KL 0, ppl {fp32['perplexity']:.3f})", (fp32_kib, 0.5),
                xycoords=("data", "axes fraction"), textcoords="offset points", xytext=(-4, 0), ha="right",
                fontsize=8, color="0.35")
    bx.set_yscale("log", nonpositive="mask")
    bx.margins(y=0.15)  # room for the labels of the highest and lowest points
    bx.set_xlim(0, fp32_kib * 1.1)
    bx.set_xlabel("recurrent state per decoding stream (KiB, live stream)")
    bx.set_ylabel("mean KL(fp32 || method) per next token (nats)")
    bx.set_title("next-token damage against state size (ppl: perplexity minus fp32's)", fontsize=10)
    bx.grid(True, which="both", alpha=0.3)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_demo(args) -> int:
    """The ``leapquant demo`` handler."""
    t0 = time.time()
    cfg = EvalConfig(context=args.context)
    options = state_options(args)
    methods = methods_for_labels(args.states.split(","), options)
    plot = plot_path(args)
    check_checkpoint(args.checkpoint)
    tokenizer = load_tokenizer(args.checkpoint)
    if args.data is not None:
        ids = load_data(args.data, tokenizer)
        data = HeldOutText(ids=ids, source=f"--data {args.data}, {ids.shape[-1]:,} tokens"
                           + (f" per row ({ids.shape[0]} rows)" if ids.ndim == 2 else ""))
    else:
        data = stdlib_heldout(args.checkpoint, tokenizer, min_tokens=cfg.context)
    rows = segment_rows(data.ids, cfg, source=f"--data {args.data}" if args.data is not None else "the held-out text")
    arch, config, params, _ = load_checkpoint(args.checkpoint)
    rows = check_token_ids(rows, config.vocab_size, name="--data ids" if args.data is not None else "held-out ids")
    if args.data is not None:
        warn_if_training_data(args.checkpoint, args.data)
    memory = stream_memory(arch, config, methods)
    result = evaluate(arch, params, config, rows, methods, cfg,
                      progress=lambda it, desc: progress(it, desc=desc, enabled=True, total=len(methods)))
    name = Path(args.checkpoint).resolve().name
    if plot:
        make_folder_for(plot)
        text = Path(args.data).name if args.data is not None else f"held-out text ({len(data.files)} stdlib files)"
        plot_demo(result, memory, plot, title=f"{name}: {cfg.context:,} tokens of {text}, one decode step each "
                                              "from an empty state; state formats against fp32")
    seconds = time.time() - t0
    if args.json:
        result.update(checkpoint=str(args.checkpoint), data=data.to_json(), memory=memory, plot=plot,
                      state_options={k: v for k, v in options.items() if v is not None}, seconds=round(seconds, 3))
        print(json.dumps(result))
        return 0
    print("\n".join([
        f"checkpoint  {args.checkpoint} ({config.model_type})",
        f"data        {data.source}",
        f"context     the first {cfg.context:,} tokens, one decode step each from an empty state; "
        "fp32 is the reference",
        "",
        format_table(result),
        "",
        format_memory(memory),
        "",
        (f"plot: {plot}\n" if plot else "") + f"ran in {seconds:.0f} s",
    ]))
    return 0


def add_subcommand(subparsers) -> None:
    """Registers ``demo`` on an argparse subparsers object."""
    p = subparsers.add_parser("demo", help="fp32 against LeapQuant and per-step state formats on the shipped "
                                           "GDN checkpoint's held-out text: table, memory per stream, plot")
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                   help="converted checkpoint or HF directory (default: the shipped models/checkpoints/stdlib-gdn)")
    p.add_argument("--data", type=Path,
                   help="UTF-8 text (tokenized with the checkpoint's tokenizer.json) or .npy ids [N] / [rows, N] "
                        f"(default: the held-out files of the checkpoint's {DATA_FILES} from this Python's "
                        "standard library)")
    p.add_argument("--context", type=int_at_least(2), default=DEFAULT_CONTEXT, help="tokens decoded")
    add_states_option(p, DEFAULT_STATES)
    add_plot_options(p, "demo.png")
    p.set_defaults(func=run_demo)


__all__ = ["DEFAULT_CHECKPOINT", "DEFAULT_STATES", "HeldOutText", "add_subcommand", "format_memory", "layer_line",
           "plot_demo", "run_demo", "stdlib_heldout", "stream_memory"]
