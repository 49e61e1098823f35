"""``leapquant train-data`` and ``leapquant train``: prepare the corpus, train, export, report.

``train`` does the whole job in one command: trains (resuming from ``--state-dir`` when a
checkpoint is there), evaluates on held-out text, measures the decay spectrum, plots, exports
the model as a Hugging Face directory (``config.json``, bf16 ``model.safetensors``, tokenizer
files) together with ``TRAINING.md``, ``training.json``, the plots, the data file list, a
held-out snippet for cross-checks, and ``SHA256SUMS``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np

from models.loading import DATA_FILES
from models.training import data as D
from models.training import loop, report
from models.training.model import hf_config
from models.training.run_record import (describe_model, export_tensors, output_paths, print_summary,
                                        train_from_scratch, train_overrides, training_record, write_checkpoint)
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
    out, name, state_dir = output_paths(args)
    recall = D.RecallSpec(**{k: v for k, v in dict(fraction=args.recall_fraction, pairs=args.recall_pairs,
                                                   min_gap=args.recall_min_gap).items() if v is not None})
    cfg = loop.TrainConfig(recall=recall, **train_overrides(args, size="ship"))
    corpus = D.load_corpus(args.data)
    config_json = hf_config(cfg.arch, vocab_size=corpus.vocab_size, eos_token_id=corpus.special(D.EOS), size=cfg.size)
    meta_extra = {"name": name, "config_json": config_json, "data_contents_sha256": corpus.manifest["contents_sha256"]}
    arch, config, trainer, params, run = train_from_scratch(args, cfg, config_json, corpus, name=name,
                                                            state_dir=state_dir, what="", meta_extra=meta_extra,
                                                            t_start=t_start)

    # final evaluation and spectrum on held-out windows
    final_windows = D.eval_windows(corpus.heldout, seq_len=cfg.seq_len, max_windows=cfg.final_eval_windows)
    heldout = loop.heldout_loss(trainer, params, final_windows)
    recall_acc = loop.recall_accuracy(trainer, params, corpus)
    spectrum = report.decay_spectrum(arch, config, params, final_windows[: args.spectrum_windows or 16],
                                     batch=cfg.batch, recurrence=trainer.recurrence)
    params_np = jax.tree.map(np.asarray, jax.device_get(params))
    tensors = export_tensors(config, params_np)
    d = corpus.manifest
    heldout_tokens = int(final_windows.shape[0] * cfg.seq_len)
    data = {k: d[k] for k in ("source", "python_version", "selection", "held_out_rule", "files", "file_list_sha256",
                              "contents_sha256", "excluded", "splits", "vocab_size", "tokenizer_sha256")}
    final = {"heldout_loss": heldout, "heldout_tokens": heldout_tokens,
             "heldout_bits_per_byte": heldout * d["splits"]["heldout"]["tokens"] / d["splits"]["heldout"]["bytes"]
             / np.log(2.0), "recall_accuracy": recall_acc}
    run_json = training_record(args, name=name, inputs=("data", data), config=config, config_json=config_json,
                               words=describe_model(config, config_json), tensors=tensors, cfg=cfg, run=run,
                               final=final, spectrum=spectrum, t_start=t_start)
    snippet = corpus.heldout[:SNIPPET_TOKENS].astype(int).tolist()
    write_checkpoint(
        out, run_json, state_dir=state_dir, config_json=config_json, tensors=tensors,
        plots={"loss_curve.png": lambda path: report.plot_loss_curve(run.history, path, title=f"{name}: loss"),
               "decay_spectrum.png": lambda path: report.plot_spectrum(
                   spectrum, path, title=f"{name}: decay spectrum (held-out text)")},
        render=report.render_training_md,
        texts={"heldout_snippet.json": json.dumps({"source": "first tokens of the held-out stream",
                                                   "ids": snippet}) + "\n"},
        copies={DATA_FILES: corpus.path / D.FILES_LIST, D.TOKENIZER: corpus.path / D.TOKENIZER,
                D.TOKENIZER_CONFIG: corpus.path / D.TOKENIZER_CONFIG},
        t_start=t_start)
    print_summary(args, out, run_json, words=f"held-out loss {heldout:.4f}", t_start=t_start)
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
