"""The optimizer, the jitted train step, resumable checkpoints and the time-budgeted loop.

Precision: fp32 parameters, gradients and optimizer moments throughout (the models compute in
fp32 anyway, at full matmul precision); the export rounds to bf16 once, at the end.

Optimizer: AdamW as ``optax.chain(clip_by_global_norm, scale_by_adam, add_decayed_weights)``
with the learning rate applied in the step, so the schedule (linear warm-up, then cosine decay
to ``final_lr_fraction`` of the peak) can be a function of the step and of a total step count
fixed once the time budget is known. Weight decay applies to matrices only.

Budget: ``steps`` fixes the schedule length; ``minutes`` bounds the whole command's wall
clock: after a few timed steps the schedule length is set to what fits before
``deadline = start + minutes - reserve_seconds`` (the reserve pays for the final evaluation,
spectrum and export), and the loop also stops at the deadline if the estimate was optimistic.
Once fixed, the schedule length is stored with the checkpoints; a resumed run keeps it (a new
budget can only stop it earlier), so its learning rates are those of an uninterrupted run.

Checkpoints (``state_dir``): ``ckpt-<step>/state.safetensors`` (every leaf of params and
optimizer state, named by its pytree path) and ``meta.json`` (step, schedule length,
history, the run's settings), written into a temporary directory and renamed; then ``LATEST``
is replaced atomically and older checkpoints are deleted. An interrupted save leaves the
previous checkpoint and ``LATEST`` intact. Batches depend only on ``(seed, step)``, so a
resumed run continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import safetensors.numpy
from tqdm.auto import tqdm

from models.checkpoint import read_safetensors
from models.training import data as D
from models.training.task_data import HELDOUT_STREAM, TaskMix, task_batch
from models.training.model import (TrainingRecurrence, forward_logits, masked_loss, trainable_mask,
                                   weight_decay_mask)

Array = jax.Array
LATEST = "LATEST"
STATE_FILE = "state.safetensors"
META_FILE = "meta.json"
# Steps timed (after the compiling first one) before the schedule length is fixed from the budget.
PROBE_STEPS = 8
STATE_FORMAT = "leapquant-train-state"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a run's trajectory; the budget fields (``BUDGET_FIELDS``) alone
    may change on resume. With ``task`` the run trains on generated long-memory task rows alone
    (``TaskMix``, no corpus), and the held-out evaluation is the loss and accuracy on
    ``eval_windows`` rounded up to whole batches of held-out task rows."""

    arch: str = "gdn"  # models.training.model.hf_config's arch and size
    size: str = "ship"
    seq_len: int = 2048  # tokens per row
    batch: int = 16  # rows per step
    peak_lr: float = 2e-3  # the schedule (learning_rate): warm-up to peak_lr, cosine to final_lr_fraction x it
    warmup_steps: int = 100
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.1  # AdamW (decoupled decay, on the weight_decay_mask leaves)
    clip_norm: float = 1.0  # global gradient norm clipped to this
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    seed: int = 0  # parameters and batches
    eval_every: int = 100  # steps between periodic held-out losses
    eval_windows: int = 32  # fixed held-out windows of the periodic evaluation
    final_eval_windows: int = 128  # and of the final one
    recurrence: str = "chunked"  # TrainingRecurrence(recurrence, chunk)
    chunk: int = 64
    recall: D.RecallSpec = D.RecallSpec()  # the synthetic recall mix
    task: Optional[TaskMix] = None
    # budget
    steps: Optional[int] = None
    minutes: Optional[float] = None
    reserve_seconds: float = 120.0
    save_every_minutes: float = 2.0

    BUDGET_FIELDS = ("steps", "minutes", "reserve_seconds", "save_every_minutes")

    def __post_init__(self):
        TrainingRecurrence(self.recurrence, self.chunk)  # validates both
        for name in ("seq_len", "batch", "eval_every", "eval_windows", "final_eval_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.warmup_steps < 0 or self.peak_lr <= 0 or not 0 <= self.final_lr_fraction <= 1:
            raise ValueError("need warmup_steps >= 0, peak_lr > 0 and final_lr_fraction in [0, 1]")
        if self.task is not None:
            if self.recall.fraction:
                raise ValueError("a task run trains on task rows alone: use recall fraction 0")
            self.task.check(seq_len=self.seq_len, batch=self.batch)
        if self.recall.fraction and self.seq_len + 1 < self.recall.row_tokens(self.recall.min_gap):
            raise ValueError(f"seq_len {self.seq_len} is too short for recall rows ({self.recall.pairs} pairs, gap >= "
                             f"{self.recall.min_gap}); use recall fraction 0 or a longer seq_len")
        if self.steps is None and self.minutes is None:
            raise ValueError("give a budget: steps, minutes, or both")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be positive, got {self.steps}")
        if self.minutes is not None:
            if self.minutes <= 0:
                raise ValueError(f"minutes must be positive, got {self.minutes}")
            if self.warmup_steps <= PROBE_STEPS + 1:
                raise ValueError(f"a time budget fixes the schedule after {PROBE_STEPS + 1} steps, inside the warm-up: "
                                 f"warmup_steps must exceed {PROBE_STEPS + 1}, got {self.warmup_steps}")

    def trajectory(self) -> dict:
        """The settings a resumed run must share (JSON-ready)."""
        d = dataclasses.asdict(self)
        for name in self.BUDGET_FIELDS:
            d.pop(name)
        return d


def learning_rate(step: Array, total: Array, cfg: TrainConfig) -> Array:
    """Linear warm-up to ``peak_lr`` over ``warmup_steps``, then cosine decay to
    ``final_lr_fraction * peak_lr`` at step ``total``. ``step`` is 0-based (the update it scales)."""
    step = jnp.asarray(step, jnp.float32)
    warm = cfg.peak_lr * jnp.minimum(1.0, (step + 1.0) / max(cfg.warmup_steps, 1))
    span = jnp.maximum(jnp.asarray(total, jnp.float32) - cfg.warmup_steps, 1.0)
    frac = jnp.clip((step - cfg.warmup_steps) / span, 0.0, 1.0)
    cosine = cfg.peak_lr * (cfg.final_lr_fraction + (1 - cfg.final_lr_fraction) * 0.5 * (1 + jnp.cos(jnp.pi * frac)))
    return jnp.where(step < cfg.warmup_steps, warm, cosine)


def make_optimizer(cfg: TrainConfig, params):
    """AdamW without its learning-rate factor (the step applies the schedule)."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
        optax.add_decayed_weights(cfg.weight_decay, mask=weight_decay_mask(params)),
    )


def _loss(params, ids: Array, mask: Array, *, arch, config, cfg: TrainConfig) -> Array:
    """Masked next-token loss of ``ids [B, T + 1]`` (targets ``ids[:, 1:]``, mask ``[B, T]``)."""
    params = jax.tree.map(lambda x, t: x if t else jax.lax.stop_gradient(x), params, trainable_mask(params))
    logits = forward_logits(arch, config, params, ids[:, :-1], TrainingRecurrence(cfg.recurrence, cfg.chunk))
    return masked_loss(logits, ids[:, 1:], mask)[0]


# Module-level programs with (arch, config, cfg) static: every run with equal settings shares one
# compilation (all three are frozen, hashable dataclasses).
@functools.partial(jax.jit, static_argnames=("arch", "config", "cfg"), donate_argnums=(0, 1))
def train_step(params, opt_state, ids: Array, mask: Array, step: Array, total: Array, *, arch, config,
               cfg: TrainConfig):
    """One AdamW update: ``(params, opt_state, metrics {"loss", "grad_norm", "lr"})``.

    ids ``[B, T + 1]`` int32, mask ``[B, T]``; step (0-based) and total (schedule length) are
    int32 scalars, traced, so a schedule fixed mid-run needs no recompilation.
    """
    loss, grads = jax.value_and_grad(_loss)(params, ids, mask, arch=arch, config=config, cfg=cfg)
    updates, opt_state = make_optimizer(cfg, params).update(grads, opt_state, params)
    lr = learning_rate(step, total, cfg)
    params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
    grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    return params, opt_state, {"loss": loss, "grad_norm": grad_norm, "lr": lr}


@functools.partial(jax.jit, static_argnames=("arch", "config", "cfg"))
def eval_batch(params, ids: Array, mask: Array, answer: Array, *, arch, config, cfg: TrainConfig):
    """``(loss_sum, count, hits, answers)``: summed next-token loss over ``mask [B, T]`` and
    argmax hits over the ``answer [B, T]`` positions of ``ids [B, T + 1]``."""
    logits = forward_logits(arch, config, params, ids[:, :-1], TrainingRecurrence(cfg.recurrence, cfg.chunk))
    _, per_token = masked_loss(logits, ids[:, 1:], mask)
    hit = (jnp.argmax(logits, axis=-1) == ids[:, 1:]).astype(jnp.float32)
    return jnp.sum(per_token * mask), jnp.sum(mask), jnp.sum(hit * answer), jnp.sum(answer)


@dataclasses.dataclass(frozen=True)
class Trainer:
    """One run's architecture, model config and settings, with the programs bound to them."""

    arch: Any
    config: Any
    cfg: TrainConfig

    @property
    def recurrence(self) -> TrainingRecurrence:
        return TrainingRecurrence(self.cfg.recurrence, self.cfg.chunk)

    def init_optimizer(self, params):
        return make_optimizer(self.cfg, params).init(params)

    def step(self, params, opt_state, ids, mask, step, total):
        """``train_step`` with this run's static arguments (donates params and opt_state)."""
        return train_step(params, opt_state, ids, mask, step, total, arch=self.arch, config=self.config, cfg=self.cfg)

    def evaluate(self, params, ids, mask, answer):
        """``eval_batch`` with this run's static arguments."""
        return eval_batch(params, ids, mask, answer, arch=self.arch, config=self.config, cfg=self.cfg)


def heldout_loss(trainer: Trainer, params, windows: np.ndarray) -> float:
    """Mean next-token loss over held-out ``windows [N, T + 1]`` (run ``cfg.batch`` rows at a
    time, the last batch padded with masked-out rows so one program serves every call)."""
    b = trainer.cfg.batch
    total = count = 0.0
    for i in range(0, len(windows), b):
        ids = windows[i:i + b]
        mask = np.ones((b, ids.shape[1] - 1), np.float32)
        if len(ids) < b:
            mask[len(ids):] = 0.0
            ids = np.concatenate([ids, np.repeat(ids[-1:], b - len(ids), axis=0)])
        s, n, _, _ = trainer.evaluate(params, ids, mask, np.zeros_like(mask))
        total, count = total + float(s), count + float(n)
    return total / count


def recall_accuracy(trainer: Trainer, params, corpus: D.Corpus) -> Optional[float]:
    """Share of queried values predicted exactly (argmax) on one batch of recall rows whose gaps
    come from the held-out stream; ``None`` when the run mixes in no recall rows."""
    cfg = trainer.cfg
    if cfg.recall.fraction == 0:
        return None
    spec = dataclasses.replace(cfg.recall, fraction=1.0)
    batch = D.sample_batch(corpus.heldout, seed=cfg.seed + 1, step=0, batch=cfg.batch, seq_len=cfg.seq_len,
                           recall=spec, vocab_size=corpus.vocab_size, recall_id=corpus.special(D.RECALL),
                           query_id=corpus.special(D.QUERY))
    _, _, hit, n = trainer.evaluate(params, batch["ids"], batch["answer"], batch["answer"])
    return float(hit) / float(n)


def heldout_task_rows(cfg: TrainConfig) -> dict[str, np.ndarray]:
    """A task run's fixed held-out rows: ``eval_windows`` rounded up to whole batches."""
    n = -(-cfg.eval_windows // cfg.batch) * cfg.batch
    return task_batch(cfg.task, seed=cfg.seed, step=HELDOUT_STREAM, batch=n, seq_len=cfg.seq_len)


def task_metrics(trainer: Trainer, params, rows: dict[str, np.ndarray]) -> tuple[float, float]:
    """``(loss, accuracy)`` over the scored positions of task ``rows`` (``task_batch``'s dict,
    a whole number of ``cfg.batch`` rows): mean next-token loss and argmax accuracy there."""
    b = trainer.cfg.batch
    loss = count = hits = 0.0
    for i in range(0, len(rows["ids"]), b):
        s, n, h, _ = trainer.evaluate(params, rows["ids"][i:i + b], rows["mask"][i:i + b], rows["answer"][i:i + b])
        loss, count, hits = loss + float(s), count + float(n), hits + float(h)
    return loss / count, hits / count


# ----------------------------------------------------------------------------- checkpoints


def _named_leaves(tree) -> list[tuple[str, Any]]:
    return [(jax.tree_util.keystr(path), x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def save_state(state_dir, *, params, opt_state, meta: dict) -> Path:
    """Writes ``ckpt-<step>`` atomically, points ``LATEST`` at it, deletes older checkpoints."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    name = f"ckpt-{int(meta['step']):08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=state_dir))
    try:
        tensors = {}
        for prefix, tree in (("params", params), ("opt_state", opt_state)):
            for key, x in _named_leaves(tree):
                tensors[prefix + key] = np.asarray(x).copy(order="C")  # keeps 0-d leaves 0-d (step counts)
        safetensors.numpy.save_file(tensors, str(tmp / STATE_FILE))
        (tmp / META_FILE).write_text(json.dumps(dict(meta, format=STATE_FORMAT), indent=1))
        final, k = state_dir / name, 0
        while final.exists():  # a second save at the same step: never replace what LATEST may name
            k += 1
            final = state_dir / f"{name}.{k}"
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer = state_dir / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, state_dir / LATEST)
    for old in list(state_dir.glob("ckpt-*")) + list(state_dir.glob(".ckpt-*")):  # older ones, dead writers' debris
        if old.name != final.name:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_state(state_dir) -> Optional[Path]:
    """The checkpoint ``LATEST`` names, or ``None`` when there is none."""
    pointer = Path(state_dir) / LATEST
    if not pointer.exists():
        return None
    path = Path(state_dir) / pointer.read_text().strip()
    if not (path / META_FILE).exists():
        raise FileNotFoundError(f"{pointer} names {path.name}, which is not a complete checkpoint")
    return path


def load_state(path, *, params_template, opt_template) -> tuple[Any, Any, dict]:
    """Reads a checkpoint into the structure of the templates (same pytree paths, shapes and
    dtypes; every difference is named)."""
    path = Path(path)
    meta = json.loads((path / META_FILE).read_text())
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"{path / META_FILE} is not a {STATE_FORMAT} checkpoint")
    stored = read_safetensors([path / STATE_FILE])
    out, problems = [], []
    for prefix, tree in (("params", params_template), ("opt_state", opt_template)):
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        loaded = []
        for (key, x) in _named_leaves(tree):
            name = prefix + key
            if name not in stored:
                problems.append(f"missing {name}")
                continue
            y = stored.pop(name)
            if y.shape != np.shape(x) or y.dtype != np.asarray(x).dtype:
                problems.append(f"{name}: expected {np.shape(x)} {np.asarray(x).dtype}, found {y.shape} {y.dtype}")
            loaded.append(y)
        out.append((treedef, loaded))
    problems += [f"unexpected {name}" for name in stored]
    if problems:
        raise ValueError(f"checkpoint {path} does not fit this run:\n  " + "\n  ".join(problems))
    params, opt_state = (jax.tree_util.tree_unflatten(td, leaves) for td, leaves in out)
    return params, opt_state, meta


# ----------------------------------------------------------------------------- the loop


@dataclasses.dataclass
class RunState:
    """What the loop carries and checkpoints besides params and optimizer state."""

    step: int = 0
    total_steps: Optional[int] = None
    train_seconds: float = 0.0
    history: dict = dataclasses.field(default_factory=lambda: {"train": [], "eval": []})
    stopped_by: str = ""
    schedule_fixed: bool = False  # once fixed, a resumed run keeps the schedule length

    def meta(self, cfg: TrainConfig, extra: dict) -> dict:
        return dict(extra, step=self.step, total_steps=self.total_steps, schedule_fixed=self.schedule_fixed,
                    train_seconds=self.train_seconds, history=self.history, trajectory=cfg.trajectory())


def train(trainer: Trainer, corpus: Optional[D.Corpus], params, *, state_dir, start_time: float, meta_extra: dict,
          progress: bool = True, log: Callable[[str], None] = print,
          stop_at_step: Optional[int] = None) -> tuple[Any, RunState]:
    """Runs (or resumes from ``state_dir``) the loop until the schedule ends or the deadline.

    params: the initial params (numpy or jax); ignored when a checkpoint is resumed.
    start_time: ``time.time()`` when the command started (the budget counts from there).
    meta_extra: JSON-ready facts stored with every checkpoint (the corpus hash, the model config);
    resuming requires them to be equal.
    stop_at_step: end this call at that step although the schedule goes on (a staged run,
    resumed later). corpus: ``None`` for a task run (``cfg.task``), whose rows are generated. Returns the final params and the ``RunState``; the last checkpoint is saved.
    """
    cfg = trainer.cfg
    params = jax.tree.map(jnp.asarray, params)
    opt_state = trainer.init_optimizer(params)
    # with a time budget the schedule length is fixed after the probe steps, else by ``steps``
    run = RunState(total_steps=cfg.steps, schedule_fixed=cfg.minutes is None)
    resumed = latest_state(state_dir)
    if resumed is not None:
        params, opt_state, meta = load_state(resumed, params_template=params, opt_template=opt_state)
        want = json.loads(json.dumps(cfg.trajectory()))
        if meta["trajectory"] != want:
            diff = sorted(k for k in set(want) | set(meta["trajectory"]) if meta["trajectory"].get(k) != want.get(k))
            raise ValueError(f"{resumed} was written by a run with different settings: {', '.join(diff)}")
        extra = json.loads(json.dumps(meta_extra))
        diff = sorted(k for k in extra if meta.get(k) != extra[k])
        if diff:  # e.g. another corpus or model config
            raise ValueError(f"{resumed} was written by a run with a different {', '.join(diff)}")
        params, opt_state = jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, opt_state)
        run = RunState(step=meta["step"], total_steps=meta["total_steps"], train_seconds=meta["train_seconds"],
                       history=meta["history"], schedule_fixed=meta["schedule_fixed"])
        if not run.schedule_fixed:  # interrupted before its probe: this run's budget decides
            run.total_steps, run.schedule_fixed = cfg.steps, cfg.minutes is None
        log(f"resumed {resumed} at step {run.step} (schedule length {run.total_steps})")
    deadline = math.inf if cfg.minutes is None else start_time + 60.0 * cfg.minutes - cfg.reserve_seconds
    if cfg.task is not None:
        held = heldout_task_rows(cfg)
    else:
        windows = D.eval_windows(corpus.heldout, seq_len=cfg.seq_len, max_windows=cfg.eval_windows)
        batch_args = dict(batch=cfg.batch, seq_len=cfg.seq_len, recall=cfg.recall if cfg.recall.fraction else None,
                          vocab_size=corpus.vocab_size, recall_id=corpus.special(D.RECALL),
                          query_id=corpus.special(D.QUERY))

    pending: list = []  # (step, device metrics) not yet fetched: fetching every step would stall the device

    def evaluate_now():
        if cfg.task is not None:
            loss, acc = task_metrics(trainer, params, held)
            entry = {"step": run.step, "heldout_loss": loss, "recall_accuracy": acc}
            run.history["eval"].append(entry)
            return entry
        entry = {"step": run.step, "heldout_loss": heldout_loss(trainer, params, windows)}
        acc = recall_accuracy(trainer, params, corpus)
        if acc is not None:
            entry["recall_accuracy"] = acc
        run.history["eval"].append(entry)
        return entry

    def flush():
        for s, m in jax.device_get(pending):
            if not math.isfinite(float(m["loss"])):
                raise FloatingPointError(f"training loss became {float(m['loss'])} at step {s + 1}")
            run.history["train"].append({"step": s + 1, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                                         "lr": float(m["lr"])})
        pending.clear()

    def save():
        flush()
        run.train_seconds = base_seconds + time.time() - t_begin  # compilation and evaluation included
        save_state(state_dir, params=params, opt_state=opt_state, meta=run.meta(cfg, meta_extra))

    t_begin, base_seconds = time.time(), run.train_seconds
    if not run.history["eval"]:
        evaluate_now()
    last_save = t_loop = time.time()
    bar = tqdm(total=run.total_steps, initial=run.step, disable=not progress, file=sys.stderr, mininterval=10.0,
               desc=f"train {cfg.arch}", unit="step")
    budget_total = np.int32(2**30)  # a placeholder schedule length inside the warm-up (see PROBE_STEPS)
    first = run.step
    while True:
        if run.total_steps is not None and run.step >= run.total_steps:
            run.stopped_by = "steps"
            break
        if time.time() >= deadline:
            run.stopped_by = "time"
            break
        if stop_at_step is not None and run.step >= stop_at_step:
            run.stopped_by = "stop_at_step"
            break
        if cfg.task is not None:
            length, rows = cfg.task.stage(run.step, run.total_steps, seq_len=cfg.seq_len, batch=cfg.batch)
            batch = task_batch(cfg.task, seed=cfg.seed, step=run.step, batch=rows, seq_len=length)
        else:
            batch = D.sample_batch(corpus.train, seed=cfg.seed, step=run.step, **batch_args)
        total = np.int32(run.total_steps) if run.total_steps is not None else budget_total
        params, opt_state, metrics = trainer.step(params, opt_state, batch["ids"], batch["mask"], np.int32(run.step), total)
        pending.append((run.step, metrics))
        run.step += 1
        bar.update(1)
        if run.step - first == 1:
            jax.block_until_ready(metrics["loss"])  # the compiling step is not timed
            t_loop = time.time()
        elif run.step - first == 1 + PROBE_STEPS and not run.schedule_fixed:
            jax.block_until_ready(metrics["loss"])
            per_step = (time.time() - t_loop) / PROBE_STEPS
            # periodic evaluation: forward-only batches (held-out windows, one recall batch), each
            # about a third of a step; counted as half a step to stay on the safe side
            eval_batches = math.ceil(cfg.eval_windows / cfg.batch) + (1 if cfg.recall.fraction or cfg.task else 0)
            per_step *= 1.0 + eval_batches / (2.0 * cfg.eval_every)
            fits = run.step + int(0.95 * max(0.0, deadline - time.time()) / per_step)  # 5% margin for jitter
            run.total_steps = max(fits if run.total_steps is None else min(fits, run.total_steps), run.step)
            run.schedule_fixed = True
            bar.total = run.total_steps
            log(f"{per_step:.3f} s/step measured; schedule length {run.total_steps} steps")
        if len(pending) >= 10:
            flush()
            last = run.history["train"][-1]
            bar.set_postfix(loss=f"{last['loss']:.3f}", lr=f"{last['lr']:.2e}")
        if run.step % cfg.eval_every == 0:
            entry = evaluate_now()
            log(f"step {run.step}: held-out loss {entry['heldout_loss']:.4f}"
                + (f", recall accuracy {entry['recall_accuracy']:.3f}" if "recall_accuracy" in entry else ""))
        if time.time() - last_save >= 60.0 * cfg.save_every_minutes:
            save()
            last_save = time.time()
    flush()
    jax.block_until_ready(params)
    bar.close()
    if not run.history["eval"] or run.history["eval"][-1]["step"] != run.step:
        evaluate_now()
    save()
    return params, run


__all__ = [
    "PROBE_STEPS",
    "RunState",
    "TrainConfig",
    "Trainer",
    "eval_batch",
    "heldout_loss",
    "heldout_task_rows",
    "latest_state",
    "learning_rate",
    "load_state",
    "make_optimizer",
    "recall_accuracy",
    "save_state",
    "task_metrics",
    "train",
    "train_step",
]
