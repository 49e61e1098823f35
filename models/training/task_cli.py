"""``leapquant train --task mqar``: train a model on generated long-memory task rows, export it.

The run is ``leapquant train``'s (the same loop, resumable state, budget and export), with the
rows made by ``models.training.task_data`` instead of read from a corpus. The checkpoint folder
holds ``config.json``, ``model.safetensors`` (bf16; the decay gates fp32), ``task.json`` (the
vocabulary split, the training rows and length: what ``leapquant task`` reads), ``TRAINING.md``
and ``training.json`` (the command, the accuracy curve, the decay spectrum measured on held-out
task rows), the plots and ``SHA256SUMS``. No tokenizer: the ids are the task's own.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

from models.tasks import TaskVocab, generate
from models.training import data as D
from models.training import loop, report
from models.training.model import hf_config
from models.training.run_record import (describe_model, export_tensors, output_paths, print_summary,
                                        train_from_scratch, train_overrides, training_record, write_checkpoint)
from models.training.task_data import HELDOUT_STREAM, TaskMix

TASK_FILE = "task.json"
TASK_FORMAT = "leapquant-task"
TASK_VERSION = 1


def task_mix_from_args(args):
    """The ``TaskMix`` of parsed ``--task-*`` flags (``None`` keeps each default)."""
    vocab = TaskVocab(**{k: v for k, v in dict(size=args.task_vocab, keys=args.task_keys,
                                                values=args.task_values).items() if v is not None})
    opts = {k: v for k, v in dict(pairs=tuple(args.task_pairs) if args.task_pairs else None,
                                   spreads=tuple(args.task_spreads) if args.task_spreads else None,
                                   lengths=tuple(args.task_lengths) if args.task_lengths else None,
                                   needle_rows=args.task_needle_rows, gap=args.task_gap,
                                   fillers=tuple(args.task_fillers) if args.task_fillers else None).items()
            if v is not None}
    return TaskMix(vocab=vocab, **opts)


def task_file(mix, seq_len: int, task: str) -> dict:
    """``task.json``: what a checkpoint was trained on (``leapquant task`` reads the vocabulary
    split, the training length and the pair counts from it)."""
    return {"format": TASK_FORMAT, "version": TASK_VERSION, "task": task, "seq_len": seq_len,
            "mix": mix.to_json(), "reserved_ids": [0]}


def read_task_file(folder):
    """``(mix, seq_len)`` of a checkpoint's ``task.json``, or ``None`` when it has none. Raises
    ``ValueError`` naming the file when it is not one."""
    path = Path(folder) / TASK_FILE
    if not path.exists():
        return None
    try:
        d = json.loads(path.read_text())
        if d.get("format") != TASK_FORMAT or d.get("version") != TASK_VERSION:
            raise ValueError(f"not a {TASK_FORMAT} v{TASK_VERSION} file")
        return TaskMix.from_json(d["mix"]), int(d["seq_len"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a readable task file ({err})") from None


def per_pairs_accuracy(trainer, params, cfg, *, rows: int) -> dict[str, float]:
    """Accuracy on ``rows`` held-out rows (whole batches) of each kind of row of the mix alone:
    ``{"<filler> <pairs> pairs[ spread <s>]": accuracy, ..., "needle": accuracy}``."""
    out = {}
    n = -(-rows // cfg.batch) * cfg.batch
    key = jax.random.fold_in(jax.random.PRNGKey(cfg.seed), HELDOUT_STREAM - 1)
    for i, (spec, _) in enumerate(cfg.task.specs(cfg.seq_len)):
        b = generate(jax.random.fold_in(key, i), spec, n)
        mask = b.mask.astype(np.float32)
        label = (f"{spec.filler} filler, {spec.pairs} pairs, queries " +
                 ("to the end" if spec.span is None else f"within {spec.span} tokens") if spec.task == "mqar"
                 else f"needle, {spec.filler} filler")
        out[label] = loop.task_metrics(trainer, params, {"ids": b.with_next(), "mask": mask, "answer": mask})[1]
    return out


def _pure_linear(config) -> dict:
    """TRAINING.md's words for a stack with no softmax attention (``{}`` for a hybrid)."""
    types = config.layer_types
    if "full_attention" in types:
        return {}
    kind = "Gated DeltaNet (Qwen3.5 layers)" if config.model_type.startswith("qwen") else "Kimi Delta Attention"
    return {"description": f"stack of {len(types)} {kind} layers", "layout": f"{len(types)} linear-attention layers",
            "attention": "none"}


def run_train_task(args, t_start: float) -> int:
    """The ``leapquant train --task`` handler (``models.training.cli.run_train`` calls it)."""
    out, name, state_dir = output_paths(args)
    if args.data is not None:
        raise ValueError("--task trains on generated rows: leave out --data")
    given = [f for f, v in (("--recall-fraction", args.recall_fraction), ("--recall-pairs", args.recall_pairs),
                            ("--recall-min-gap", args.recall_min_gap)) if v is not None]
    if given:
        raise ValueError(f"--task trains on task rows alone: leave out {', '.join(given)}")
    mix = task_mix_from_args(args)
    cfg = loop.TrainConfig(recall=D.RecallSpec(fraction=0.0), task=mix, **train_overrides(args, size="recall"))
    config_json = hf_config(cfg.arch, vocab_size=mix.vocab.size, eos_token_id=0, size=cfg.size)
    meta_extra = {"name": name, "config_json": config_json, "task": args.task}
    arch, config, trainer, params, run = train_from_scratch(args, cfg, config_json, None, name=name,
                                                            state_dir=state_dir,
                                                            what=f"task {args.task} {mix.to_json()}, ",
                                                            meta_extra=meta_extra, t_start=t_start)

    # final evaluation and spectrum on held-out rows
    final_cfg = dataclasses.replace(cfg, eval_windows=cfg.final_eval_windows)
    held = loop.heldout_task_rows(final_cfg)
    heldout, accuracy = loop.task_metrics(trainer, params, held)
    by_pairs = per_pairs_accuracy(trainer, params, cfg, rows=cfg.final_eval_windows)
    spectrum = report.decay_spectrum(arch, config, params, held["ids"][: args.spectrum_windows or 16],
                                     batch=cfg.batch, recurrence=trainer.recurrence)
    params_np = jax.tree.map(np.asarray, jax.device_get(params))
    tensors = export_tensors(config, params_np)
    final = {"heldout_loss": heldout, "heldout_rows": int(len(held["ids"])), "recall_accuracy": accuracy,
             "accuracy_by_pairs": by_pairs}
    run_json = training_record(args, name=name, inputs=("task", task_file(mix, cfg.seq_len, args.task)),
                               config=config, config_json=config_json,
                               words=dict(describe_model(config, config_json), **_pure_linear(config)),
                               tensors=tensors, cfg=cfg, run=run, final=final, spectrum=spectrum, t_start=t_start)
    write_checkpoint(
        out, run_json, state_dir=state_dir, config_json=config_json, tensors=tensors,
        plots={"loss_curve.png": lambda path: report.plot_loss_curve(
                   run.history, path, title=f"{name}: loss on the queried values"),
               "accuracy_curve.png": lambda path: report.plot_accuracy_curve(
                   run.history, path, title=f"{name}: held-out recall accuracy"),
               "decay_spectrum.png": lambda path: report.plot_spectrum(
                   spectrum, path, title=f"{name}: decay spectrum (held-out task rows)")},
        render=report.render_task_training_md,
        texts={TASK_FILE: json.dumps(run_json["task"], indent=1) + "\n"},
        t_start=t_start)
    print_summary(args, out, run_json, words=f"held-out recall accuracy {accuracy:.4f} {by_pairs}", t_start=t_start)
    return 0


__all__ = ["TASK_FILE", "read_task_file", "run_train_task", "task_file", "task_mix_from_args"]
