"""``leapquant train-data`` and ``leapquant train``: prepare the corpus, train, export, report.

``train`` does the whole job in one command: trains (resuming from ``--state-dir`` when a
checkpoint is there), evaluates on held-out text, measures the decay spectrum, plots, exports
the model as a Hugging Face directory (``config.json``, bf16 ``model.safetensors``, tokenizer
files) together with ``TRAINING.md``, ``training.json``, the plots, the data file list, a
held-out snippet for cross-checks, and ``SHA256SUMS``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from models.checkpoint import save_hf
from models.loading import DATA_FILES
from models.registry import architecture_for_config
from models.training import data as D
from models.training import loop, report
from models.training.model import hf_config, init_params, parameter_count
from models.training.run_record import TRAIN_LOSS_STEPS, command_line, describe_model, export_tensors
from models.training.task_cli import run_train_task

# The held-out snippet shipped with a checkpoint (its first tokens of held-out text), on which
# tests compare our logits with transformers'.
SNIPPET_TOKENS = 256


def run_train_data(args) -> int:
    source = args.source or D.default_source()
    t0 = time.time()
    manifest = D.prepare_data(source, args.out, spec=D.DataSpec(vocab_size=args.vocab_size,
                                                                held_out_fraction=args.held_out_fraction),
                              python_version=args.python_version)
    summary = {"command": "train-data", "out": str(args.out), "source": manifest["source"],
               "python_version": manifest["python_version"], "files": manifest["files"],
               "excluded": len(manifest["excluded"]), "file_list_sha256": manifest["file_list_sha256"],
               "contents_sha256": manifest["contents_sha256"], "vocab_size": manifest["vocab_size"],
               "train_tokens": manifest["splits"]["train"]["tokens"],
               "heldout_tokens": manifest["splits"]["heldout"]["tokens"], "seconds": round(time.time() - t0, 1)}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {args.out}: {summary['files']} files of Python {summary['python_version']} "
              f"({summary['train_tokens']:,} train / {summary['heldout_tokens']:,} held-out tokens, "
              f"vocab {summary['vocab_size']}); file list sha256 {summary['file_list_sha256']}")
    return 0


def run_train(args) -> int:
    t_start = time.time()
    if args.task is not None:
        return run_train_task(args, t_start)
    if args.data is None:
        raise ValueError("train needs --data (a `leapquant train-data` directory) or --task")
    task_flags = ("task_pairs", "task_spreads", "task_vocab", "task_keys", "task_values", "task_needle_rows", "task_gap",
                  "task_fillers", "task_lengths")
    given = [f"--{k.replace('_', '-')}" for k in task_flags if getattr(args, k) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} apply to --task runs")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} exists and is not an empty directory; not overwriting it")
    name = args.name or out.name
    state_dir = Path(args.state_dir) if args.state_dir else Path("out") / "train" / name
    recall = D.RecallSpec(**{k: v for k, v in dict(fraction=args.recall_fraction, pairs=args.recall_pairs,
                                                   min_gap=args.recall_min_gap).items() if v is not None})
    overrides = {k: v for k, v in dict(
        arch=args.arch, size=args.size or "ship", seq_len=args.seq_len, batch=args.batch, peak_lr=args.lr,
        warmup_steps=args.warmup, recurrence=args.recurrence, chunk=args.chunk, seed=args.seed,
        eval_every=args.eval_every, eval_windows=args.eval_windows, final_eval_windows=args.final_eval_windows,
        steps=args.steps, minutes=args.minutes, reserve_seconds=args.reserve_seconds,
        weight_decay=args.weight_decay).items() if v is not None}
    cfg = loop.TrainConfig(recall=recall, **overrides)
    corpus = D.load_corpus(args.data)
    config_json = hf_config(cfg.arch, vocab_size=corpus.vocab_size, eos_token_id=corpus.special(D.EOS), size=cfg.size)
    arch = architecture_for_config(config_json)
    config = arch.config_from_hf(config_json)
    params = init_params(config_json, seed=cfg.seed)
    trainer = loop.Trainer(arch, config, cfg)
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if not args.json else (lambda msg: None)
    log(f"{name}: {parameter_count(params):,} parameters, {cfg.batch} x {cfg.seq_len} tokens per step, "
        f"state in {state_dir}, device {jax.devices()[0].device_kind}")
    meta_extra = {"name": name, "config_json": config_json, "data_contents_sha256": corpus.manifest["contents_sha256"]}
    params, run = loop.train(trainer, corpus, params, state_dir=state_dir, start_time=t_start, meta_extra=meta_extra,
                             progress=not args.json and not args.no_progress, log=log)

    # final evaluation and spectrum on held-out windows
    final_windows = D.eval_windows(corpus.heldout, seq_len=cfg.seq_len, max_windows=cfg.final_eval_windows)
    heldout = loop.heldout_loss(trainer, params, final_windows)
    recall_acc = loop.recall_accuracy(trainer, params, corpus)
    spectrum = report.decay_spectrum(arch, config, params, final_windows[: args.spectrum_windows or 16],
                                     batch=cfg.batch, recurrence=trainer.recurrence)
    params_np = jax.tree.map(np.asarray, jax.device_get(params))
    tensors = export_tensors(config, params_np)
    tail = run.history["train"][-TRAIN_LOSS_STEPS:]
    d = corpus.manifest
    heldout_tokens = int(final_windows.shape[0] * cfg.seq_len)
    tokens_seen = int(run.step * cfg.batch * cfg.seq_len)
    run_json = {
        "name": name,
        "command": command_line(args),
        "data": {k: d[k] for k in ("source", "python_version", "selection", "held_out_rule", "files", "file_list_sha256",
                                   "contents_sha256", "excluded", "splits", "vocab_size", "tokenizer_sha256")},
        "model": dict(describe_model(config, config_json), model_type=config.model_type, parameters=parameter_count(tensors),
                      bytes=int(sum(x.nbytes for x in tensors.values())), vocab_size=config.vocab_size,
                      dtype_note="bf16; A_log and dt_bias in fp32, as the released checkpoints store them"),
        "train": cfg.trajectory(),
        "progress": {"steps": run.step, "total_steps": run.total_steps, "stopped_by": run.stopped_by or "steps",
                     "tokens_seen": tokens_seen, "train_seconds": run.train_seconds,
                     "tokens_per_second": tokens_seen / max(run.train_seconds, 1e-9),
                     "wall_seconds": time.time() - t_start},
        "final": {"train_loss": float(np.mean([e["loss"] for e in tail])) if tail else None,
                  "train_loss_steps": len(tail), "heldout_loss": heldout, "heldout_tokens": heldout_tokens,
                  "heldout_bits_per_byte": heldout * d["splits"]["heldout"]["tokens"] / d["splits"]["heldout"]["bytes"]
                  / np.log(2.0), "recall_accuracy": recall_acc},
        "spectrum": spectrum,
        "environment": {"device": f"{len(jax.devices())} x {jax.devices()[0].device_kind} ({jax.default_backend()})",
                        "jax": jax.__version__, "python": sys.version.split()[0]},
        "history": run.history,
    }
    with tempfile.TemporaryDirectory(prefix=f".{name}-report.", dir=state_dir) as tmp:
        tmp = Path(tmp)
        report.plot_loss_curve(run.history, tmp / "loss_curve.png", title=f"{name}: loss")
        report.plot_spectrum(spectrum, tmp / "decay_spectrum.png", title=f"{name}: decay spectrum (held-out text)")
        run_json["progress"]["wall_seconds"] = time.time() - t_start
        (tmp / "training.json").write_text(json.dumps(run_json, indent=1) + "\n")
        (tmp / "TRAINING.md").write_text(report.render_training_md(run_json))
        snippet = corpus.heldout[:SNIPPET_TOKENS].astype(int).tolist()
        (tmp / "heldout_snippet.json").write_text(json.dumps({"source": "first tokens of the held-out stream",
                                                              "ids": snippet}) + "\n")
        files = {n: tmp / n for n in ("loss_curve.png", "decay_spectrum.png", "training.json", "TRAINING.md",
                                      "heldout_snippet.json")}
        files.update({DATA_FILES: corpus.path / D.FILES_LIST, D.TOKENIZER: corpus.path / D.TOKENIZER,
                      D.TOKENIZER_CONFIG: corpus.path / D.TOKENIZER_CONFIG})
        save_hf(out, config_json=config_json, tensors=tensors, files=files)
    report.write_sha256sums(out)
    summary = {"command": "train", "out": str(out), "name": name, "steps": run.step, "total_steps": run.total_steps,
               "stopped_by": run_json["progress"]["stopped_by"], "tokens_seen": tokens_seen,
               "train_loss": run_json["final"]["train_loss"], "heldout_loss": heldout, "recall_accuracy": recall_acc,
               "long_memory": spectrum["summary"], "seconds": round(time.time() - t_start, 1)}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {out}: {run.step} steps, held-out loss {heldout:.4f}, "
              f"long-memory summary {spectrum['summary']}, {summary['seconds']} s")
    return 0


def add_subcommand(subparsers) -> None:
    """Registers ``train-data`` and ``train`` on an argparse subparsers object."""
    p = subparsers.add_parser("train-data", help="prepare the training corpus (stdlib sources, BPE tokenizer, tokens)")
    p.add_argument("--out", type=Path, default=Path("out/data"), help="output directory (default out/data)")
    p.add_argument("--source", type=Path, help="standard-library directory (default: this interpreter's)")
    p.add_argument("--python-version", help="version label for --source (default: this interpreter's, for its own stdlib)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--held-out-fraction", type=float, default=0.02)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_train_data)

    p = subparsers.add_parser("train", help="train a small GDN or KDA model, export it with TRAINING.md")
    p.add_argument("--arch", required=True, choices=("gdn", "kda"))
    p.add_argument("--data", type=Path, help="directory written by `leapquant train-data` (or give --task)")
    p.add_argument("--out", required=True, type=Path, help="checkpoint directory to create (HF format)")
    p.add_argument("--name", help="model name (default: the --out directory's name)")
    p.add_argument("--size", choices=("ship", "tiny", "recall", "recall-tiny"),
                   help="model size (default ship, recall with --task; the tiny ones for smoke runs)")
    p.add_argument("--state-dir", type=Path, help="resumable training state (default out/train/NAME)")
    p.add_argument("--minutes", type=float, help="wall-clock budget of the whole command")
    p.add_argument("--steps", type=int, help="schedule length in steps")
    p.add_argument("--batch", type=int, help="rows per step (default 16)")
    p.add_argument("--seq-len", type=int, help="tokens per row (default 2048)")
    p.add_argument("--lr", type=float, help="peak learning rate (default 2e-3)")
    p.add_argument("--weight-decay", type=float, help="AdamW weight decay on matrices (default 0.1)")
    p.add_argument("--warmup", type=int, help="warm-up steps (default 100)")
    p.add_argument("--recall-fraction", type=float, help="share of rows carrying the recall task (default 0.25; 0 = none)")
    p.add_argument("--recall-pairs", type=int, help="key-value pairs per recall row (default 32)")
    p.add_argument("--recall-min-gap", type=int, help="fewest text tokens between pairs and queries (default 1024)")
    p.add_argument("--task", choices=("mqar",), help="train on generated long-memory task rows instead of --data "
                   "(models.training.task_data; the checkpoint gets a task.json for `leapquant task`)")
    p.add_argument("--task-pairs", type=int, nargs="+", help="MQAR pair counts, equal shares of each batch (default 16 32 64)")
    p.add_argument("--task-spreads", type=float, nargs="+",
                   help="query regions as fractions of the row after the pairs, equal shares (default 1: to the end)")
    p.add_argument("--task-lengths", type=int, nargs="+",
                   help="curriculum over row lengths: equal parts of the schedule, each dividing --seq-len, tokens per "
                        "step kept (default: every row --seq-len long)")
    p.add_argument("--task-needle-rows", type=int, help="needle rows per batch (default 0)")
    p.add_argument("--task-gap", type=int, help="MQAR filler tokens between pairs and queries (default 0)")
    p.add_argument("--task-fillers", choices=("noise", "pairs"), nargs="+",
                   help="fillers, equal shares: noise tokens, or distractor pairs on keys never queried (default noise)")
    p.add_argument("--task-vocab", type=int, help="task vocabulary size (default 2048)")
    p.add_argument("--task-keys", type=int, help="key ids of the task vocabulary (default 512)")
    p.add_argument("--task-values", type=int, help="value ids of the task vocabulary (default 512)")
    p.add_argument("--recurrence", choices=("chunked", "recurrent"), help="linear-attention form (default chunked)")
    p.add_argument("--chunk", type=int, help="chunk length of the chunked form (default 64)")
    p.add_argument("--seed", type=int)
    p.add_argument("--eval-every", type=int, help="steps between held-out evaluations (default 100)")
    p.add_argument("--eval-windows", type=int, help="held-out windows per periodic evaluation (default 32)")
    p.add_argument("--final-eval-windows", type=int, help="held-out windows of the final evaluation (default 128)")
    p.add_argument("--spectrum-windows", type=int, help="held-out windows for the decay spectrum (default 16)")
    p.add_argument("--reserve-seconds", type=float, help="part of --minutes kept for evaluation and export (default 120)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run_train)


__all__ = ["SNIPPET_TOKENS", "add_subcommand", "run_train", "run_train_data"]
