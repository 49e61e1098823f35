"""The steps ``leapquant train`` on a corpus (``models.training.cli``) and on task rows
(``models.training.task_cli``) share: the output folder and the ``TrainConfig`` fields from the
command line, a model trained from scratch, what the run records about itself (the model's
description, the exact command, ``training.json``), the tensors of the shipped file (bf16, the decay
gates fp32), the checkpoint folder and the closing summary.
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Mapping, Optional

import jax
import ml_dtypes
import numpy as np

from models.checkpoint import save_hf
from models.export import to_hf_tensors
from models.registry import architecture_for_config
from models.training import loop, report
from models.training.model import init_params, parameter_count

# Training-loss steps averaged for the report's final training loss.
TRAIN_LOSS_STEPS = 50
# Leaves exported in fp32, as the released checkpoints store them: the decay gates.
FP32_TENSOR_SUFFIXES = ("A_log", "dt_bias")


def describe_model(config, config_json: dict) -> dict:
    """Words and numbers for TRAINING.md's model table."""
    types = config.layer_types
    lin = [i for i, t in enumerate(types) if t == "linear_attention"]
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if config.model_type.startswith("qwen"):
        return dict(
            description="Qwen3.5-style hybrid of Gated DeltaNet and gated full attention (3:1)",
            layout=f"{len(types)} layers; Gated DeltaNet at {lin}, gated full attention at {full}",
            linear=(f"Gated DeltaNet, {config.linear_num_key_heads} key heads and {config.linear_num_value_heads} "
                    f"value heads per layer (GVA), dk = {config.linear_key_head_dim}, dv = "
                    f"{config.linear_value_head_dim}, short convolution {config.linear_conv_kernel_dim}"),
            attention=(f"{config.num_attention_heads} query heads, {config.num_key_value_heads} KV heads, head dim "
                       f"{config.head_dim}, output gate, RoPE on {config.partial_rotary_factor:g} of each head"),
            mlp=f"dense SwiGLU, intermediate size {config.intermediate_size}",
        )
    return dict(
        description="Kimi-Linear-style hybrid of Kimi Delta Attention and multi-head latent attention (3:1)",
        layout=f"{len(types)} layers; KDA at {lin}, MLA at {full}",
        linear=(f"KDA, {config.kda_num_heads} heads per layer, dk = dv = {config.kda_head_dim}, per-channel decay, "
                f"short convolutions {config.kda_conv_kernel}"),
        attention=(f"MLA, {config.num_attention_heads} heads, kv_lora_rank {config.kv_lora_rank}, qk "
                   f"{config.qk_nope_head_dim} + {config.qk_rope_head_dim}, v {config.v_head_dim}, no RoPE "
                   f"(mla_use_nope)"),
        mlp=f"dense SwiGLU, intermediate size {config.intermediate_size}",
    )


def command_line(args) -> str:
    """The ``leapquant train`` command line that reproduces ``args`` (every flag given)."""
    parts = ["leapquant", "train", "--arch", args.arch] + (["--data", str(args.data)] if args.data is not None else [])
    parts += ["--out", str(args.out)]
    for flag in ("task", "task_vocab", "task_keys", "task_values", "task_needle_rows", "task_gap", "name", "size",
                 "state_dir", "minutes", "steps", "batch", "seq_len", "lr", "warmup", "weight_decay", "recall_fraction",
                 "recall_pairs", "recall_min_gap",
                 "recurrence", "chunk", "seed", "eval_every", "eval_windows", "final_eval_windows",
                 "spectrum_windows", "reserve_seconds"):
        value = getattr(args, flag)
        if value is not None:
            parts += ["--" + flag.replace("_", "-"), str(value)]
    for flag in ("task_fillers", "task_pairs", "task_spreads", "task_lengths"):  # lists
        if getattr(args, flag):
            parts += ["--" + flag.replace("_", "-")] + [str(x) for x in getattr(args, flag)]
    return " ".join(shlex.quote(p) for p in parts)


def export_tensors(config, params) -> dict:
    """HF tensors for the shipped file: bf16, except the decay gates (fp32)."""
    out = {}
    for name, x in to_hf_tensors(config, params).items():
        x = np.asarray(x, np.float32)
        out[name] = x if name.endswith(FP32_TENSOR_SUFFIXES) else x.astype(ml_dtypes.bfloat16)
    return out


def output_paths(args) -> tuple[Path, str, Path]:
    """``(out, name, state_dir)`` of a train command: ``--out`` (which must not exist or be an empty
    folder: ``FileExistsError`` otherwise), ``--name`` (default: ``out``'s name) and ``--state-dir``
    (default ``out/train/NAME``)."""
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} exists and is not an empty directory; not overwriting it")
    name = args.name or out.name
    state_dir = Path(args.state_dir) if args.state_dir else Path("out") / "train" / name
    return out, name, state_dir


def train_overrides(args, *, size: str) -> dict:
    """The ``TrainConfig`` fields the command line gives (``size`` where ``--size`` is not given)."""
    return {k: v for k, v in dict(
        arch=args.arch, size=args.size or size, seq_len=args.seq_len, batch=args.batch, peak_lr=args.lr,
        warmup_steps=args.warmup, recurrence=args.recurrence, chunk=args.chunk, seed=args.seed,
        eval_every=args.eval_every, eval_windows=args.eval_windows, final_eval_windows=args.final_eval_windows,
        steps=args.steps, minutes=args.minutes, reserve_seconds=args.reserve_seconds,
        weight_decay=args.weight_decay).items() if v is not None}


def train_from_scratch(args, cfg, config_json: dict, corpus, *, name: str, state_dir: Path, what: str,
                       meta_extra: dict, t_start: float):
    """Trains a freshly initialised ``config_json`` model by ``loop.train`` (``corpus``: ``None`` for
    task rows), logging to stderr unless ``--json``; ``what`` goes into the opening log line.
    Returns ``(arch, config, trainer, params, run)``."""
    arch = architecture_for_config(config_json)
    config = arch.config_from_hf(config_json)
    params = init_params(config_json, seed=cfg.seed)
    trainer = loop.Trainer(arch, config, cfg)
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if not args.json else (lambda msg: None)
    log(f"{name}: {parameter_count(params):,} parameters, {cfg.batch} x {cfg.seq_len} tokens per step, "
        f"{what}state in {state_dir}, device {jax.devices()[0].device_kind}")
    params, run = loop.train(trainer, corpus, params, state_dir=state_dir, start_time=t_start, meta_extra=meta_extra,
                             progress=not args.json and not args.no_progress, log=log)
    return arch, config, trainer, params, run


def training_record(args, *, name: str, inputs: tuple[str, dict], config, config_json: dict, words: dict,
                    tensors: Mapping, cfg, run, final: dict, spectrum: dict, t_start: float) -> dict:
    """``training.json``: name and command, ``inputs`` (``("data", ...)`` or ``("task", ...)``), the
    model table (``words`` from ``describe_model``, the counts of ``tensors``), the trajectory, the
    progress, the final numbers (the mean training loss of the last ``TRAIN_LOSS_STEPS`` steps, then
    ``final``), the decay spectrum, the environment and the full history."""
    tail = run.history["train"][-TRAIN_LOSS_STEPS:]
    tokens_seen = int(run.step * cfg.batch * cfg.seq_len)
    return {
        "name": name,
        "command": command_line(args),
        inputs[0]: inputs[1],
        "model": dict(words, model_type=config.model_type, parameters=parameter_count(tensors),
                      bytes=int(sum(x.nbytes for x in tensors.values())), vocab_size=config.vocab_size,
                      dtype_note="bf16; A_log and dt_bias in fp32, as the released checkpoints store them"),
        "train": cfg.trajectory(),
        "progress": {"steps": run.step, "total_steps": run.total_steps, "stopped_by": run.stopped_by or "steps",
                     "tokens_seen": tokens_seen, "train_seconds": run.train_seconds,
                     "tokens_per_second": tokens_seen / max(run.train_seconds, 1e-9),
                     "wall_seconds": time.time() - t_start},
        "final": {"train_loss": float(np.mean([e["loss"] for e in tail])) if tail else None,
                  "train_loss_steps": len(tail), **final},
        "spectrum": spectrum,
        "environment": {"device": f"{len(jax.devices())} x {jax.devices()[0].device_kind} ({jax.default_backend()})",
                        "jax": jax.__version__, "python": sys.version.split()[0]},
        "history": run.history,
    }


def write_checkpoint(out: Path, run_json: dict, *, state_dir: Path, config_json: dict, tensors: Mapping,
                     plots: Mapping[str, Callable], render: Callable[[dict], str], texts: Optional[Mapping[str, str]] = None,
                     copies: Optional[Mapping[str, Path]] = None, t_start: float) -> None:
    """Writes the checkpoint folder ``out`` (``models.checkpoint.save_hf``): ``config_json``,
    ``tensors``, the ``plots`` (file name -> function drawing it to a path), ``training.json``
    (``run_json``, its wall time taken then), ``TRAINING.md`` (``render(run_json)``), ``texts``
    (file name -> contents), ``copies`` (file name -> file copied), then ``SHA256SUMS``. The files
    are made in a temporary folder under ``state_dir`` first."""
    with tempfile.TemporaryDirectory(prefix=f".{run_json['name']}-report.", dir=state_dir) as tmp:
        tmp = Path(tmp)
        for file, plot in plots.items():
            plot(tmp / file)
        run_json["progress"]["wall_seconds"] = time.time() - t_start
        (tmp / "training.json").write_text(json.dumps(run_json, indent=1) + "\n")
        (tmp / "TRAINING.md").write_text(render(run_json))
        texts = dict(texts or {})
        for file, text in texts.items():
            (tmp / file).write_text(text)
        files = {n: tmp / n for n in (*plots, "training.json", "TRAINING.md", *texts)}
        files.update(copies or {})
        save_hf(out, config_json=config_json, tensors=tensors, files=files)
    report.write_sha256sums(out)


def print_summary(args, out: Path, run_json: dict, *, words: str, t_start: float) -> None:
    """The train command's last output: one JSON line with ``--json``, else ``wrote OUT: N steps,
    {words}, long-memory summary {...}, S s``."""
    p, f = run_json["progress"], run_json["final"]
    summary = {"command": "train", "out": str(out), "name": run_json["name"],
               **({"task": args.task} if args.task is not None else {}),
               "steps": p["steps"], "total_steps": p["total_steps"], "stopped_by": p["stopped_by"],
               "tokens_seen": p["tokens_seen"], "train_loss": f["train_loss"], "heldout_loss": f["heldout_loss"],
               "recall_accuracy": f["recall_accuracy"],
               **({"accuracy_by_pairs": f["accuracy_by_pairs"]} if "accuracy_by_pairs" in f else {}),
               "long_memory": run_json["spectrum"]["summary"], "seconds": round(time.time() - t_start, 1)}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"wrote {out}: {p['steps']} steps, {words}, long-memory summary {summary['long_memory']}, "
              f"{summary['seconds']} s")


__all__ = ["FP32_TENSOR_SUFFIXES", "TRAIN_LOSS_STEPS", "command_line", "describe_model", "export_tensors",
           "output_paths", "print_summary", "train_from_scratch", "train_overrides", "training_record",
           "write_checkpoint"]
