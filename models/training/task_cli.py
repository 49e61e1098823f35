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
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from models.checkpoint import save_hf
from models.registry import architecture_for_config
from models.tasks import TaskVocab, generate
from models.training import data as D
from models.training import loop, report
from models.training.model import hf_config, init_params, parameter_count
from models.training.run_record import TRAIN_LOSS_STEPS, command_line, describe_model, export_tensors
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
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} exists and is not an empty directory; not overwriting it")
    if args.data is not None:
        raise ValueError("--task trains on generated rows: leave out --data")
    given = [f for f, v in (("--recall-fraction", args.recall_fraction), ("--recall-pairs", args.recall_pairs),
                            ("--recall-min-gap", args.recall_min_gap)) if v is not None]
    if given:
        raise ValueError(f"--task trains on task rows alone: leave out {', '.join(given)}")
    name = args.name or out.name
    state_dir = Path(args.state_dir) if args.state_dir else Path("out") / "train" / name
    mix = task_mix_from_args(args)
    overrides = {k: v for k, v in dict(
        arch=args.arch, size=args.size or "recall", seq_len=args.seq_len, batch=args.batch, peak_lr=args.lr,
        warmup_steps=args.warmup, recurrence=args.recurrence, chunk=args.chunk, seed=args.seed,
        eval_every=args.eval_every, eval_windows=args.eval_windows, final_eval_windows=args.final_eval_windows,
        steps=args.steps, minutes=args.minutes, reserve_seconds=args.reserve_seconds,
        weight_decay=args.weight_decay).items() if v is not None}
    cfg = loop.TrainConfig(recall=D.RecallSpec(fraction=0.0), task=mix, **overrides)
    config_json = hf_config(cfg.arch, vocab_size=mix.vocab.size, eos_token_id=0, size=cfg.size)
    arch = architecture_for_config(config_json)
    config = arch.config_from_hf(config_json)
    params = init_params(config_json, seed=cfg.seed)
    trainer = loop.Trainer(arch, config, cfg)
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if not args.json else (lambda msg: None)
    log(f"{name}: {parameter_count(params):,} parameters, {cfg.batch} x {cfg.seq_len} tokens per step, task "
        f"{args.task} {mix.to_json()}, state in {state_dir}, device {jax.devices()[0].device_kind}")
    meta_extra = {"name": name, "config_json": config_json, "task": args.task}
    params, run = loop.train(trainer, None, params, state_dir=state_dir, start_time=t_start, meta_extra=meta_extra,
                             progress=not args.json and not args.no_progress, log=log)

    # final evaluation and spectrum on held-out rows
    final_cfg = dataclasses.replace(cfg, eval_windows=cfg.final_eval_windows)
    held = loop.heldout_task_rows(final_cfg)
    heldout, accuracy = loop.task_metrics(trainer, params, held)
    by_pairs = per_pairs_accuracy(trainer, params, cfg, rows=cfg.final_eval_windows)
    spectrum = report.decay_spectrum(arch, config, params, held["ids"][: args.spectrum_windows or 16],
                                     batch=cfg.batch, recurrence=trainer.recurrence)
    params_np = jax.tree.map(np.asarray, jax.device_get(params))
    tensors = export_tensors(config, params_np)
    tail = run.history["train"][-TRAIN_LOSS_STEPS:]
    tokens_seen = int(run.step * cfg.batch * cfg.seq_len)
    run_json = {
        "name": name,
        "command": command_line(args),
        "task": task_file(mix, cfg.seq_len, args.task),
        "model": dict(describe_model(config, config_json), **_pure_linear(config), model_type=config.model_type,
                      parameters=parameter_count(tensors),
                      bytes=int(sum(x.nbytes for x in tensors.values())), vocab_size=config.vocab_size,
                      dtype_note="bf16; A_log and dt_bias in fp32, as the released checkpoints store them"),
        "train": cfg.trajectory(),
        "progress": {"steps": run.step, "total_steps": run.total_steps, "stopped_by": run.stopped_by or "steps",
                     "tokens_seen": tokens_seen, "train_seconds": run.train_seconds,
                     "tokens_per_second": tokens_seen / max(run.train_seconds, 1e-9),
                     "wall_seconds": time.time() - t_start},
        "final": {"train_loss": float(np.mean([e["loss"] for e in tail])) if tail else None,
                  "train_loss_steps": len(tail), "heldout_loss": heldout, "heldout_rows": int(len(held["ids"])),
                  "recall_accuracy": accuracy, "accuracy_by_pairs": by_pairs},
        "spectrum": spectrum,
        "environment": {"device": f"{len(jax.devices())} x {jax.devices()[0].device_kind} ({jax.default_backend()})",
                        "jax": jax.__version__, "python": sys.version.split()[0]},
        "history": run.history,
    }
    with tempfile.TemporaryDirectory(prefix=f".{name}-report.", dir=state_dir) as tmp:
        tmp = Path(tmp)
        report.plot_loss_curve(run.history, tmp / "loss_curve.png", title=f"{name}: loss on the queried values")
        report.plot_accuracy_curve(run.history, tmp / "accuracy_curve.png", title=f"{name}: held-out recall accuracy")
        report.plot_spectrum(spectrum, tmp / "decay_spectrum.png", title=f"{name}: decay spectrum (held-out task rows)")
        run_json["progress"]["wall_seconds"] = time.time() - t_start
        (tmp / "training.json").write_text(json.dumps(run_json, indent=1) + "\n")
        (tmp / "TRAINING.md").write_text(report.render_task_training_md(run_json))
        (tmp / TASK_FILE).write_text(json.dumps(run_json["task"], indent=1) + "\n")
        files = {n: tmp / n for n in ("loss_curve.png", "accuracy_curve.png", "decay_spectrum.png", "training.json",
                                      "TRAINING.md", TASK_FILE)}
        save_hf(out, config_json=config_json, tensors=tensors, files=files)
    report.write_sha256sums(out)
    summary = {"command": "train", "out": str(out), "name": name, "task": args.task, "steps": run.step,
               "total_steps": run.total_steps, "stopped_by": run_json["progress"]["stopped_by"],
               "tokens_seen": tokens_seen, "train_loss": run_json["final"]["train_loss"], "heldout_loss": heldout,
               "recall_accuracy": accuracy, "accuracy_by_pairs": by_pairs, "long_memory": spectrum["summary"],
               "seconds": round(time.time() - t_start, 1)}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {out}: {run.step} steps, held-out recall accuracy {accuracy:.4f} {by_pairs}, "
              f"long-memory summary {spectrum['summary']}, {summary['seconds']} s")
    return 0


__all__ = ["TASK_FILE", "read_task_file", "run_train_task", "task_file", "task_mix_from_args"]
