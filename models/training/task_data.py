"""Training rows for the long-memory tasks (``models.tasks``): what ``leapquant train --task`` feeds.

A ``TaskMix`` says which rows a step holds: MQAR rows with each filler of ``fillers``, each pair
count of ``pairs`` and each query spread of ``spreads`` in equal shares (the easy rows, few
pairs or queries packed right after them, give the gradient a foothold while the hard ones are
learned: a curriculum inside every batch), and ``needle_rows`` needle rows. Across steps,
``lengths`` is a curriculum over row lengths: the schedule is cut into as many equal parts, part
``i`` has rows of ``lengths[i]`` tokens and as many rows as keep the tokens per step those of
the run's ``batch x seq_len`` (one compiled program per distinct length). Without ``lengths``
every row has the run's ``seq_len``. The batch of step ``s`` is a function of ``(seed, s)`` and
the schedule length alone, so a resumed run sees the batches of an uninterrupted one; the held-out rows come from
another key stream (``HELDOUT_STREAM``) and are fixed for the run.

The loss counts the scored positions only (the queried values): pairs and filler are noise by
design and cannot be predicted.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import numpy as np

from leapquant_jax.checks import check_integer, is_integer
from models.tasks import FILLERS, TASKS, TaskSpec, TaskVocab, generate

# fold_in value of the held-out rows' key stream (the training steps use 0, 1, 2, ...)
HELDOUT_STREAM = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class TaskMix:
    """pairs: the MQAR pair counts; spreads: the query region of each, as a fraction of what
    the row leaves after pairs and gap (0: the queries packed right after the pairs, the easy
    rows; 1: spread to the end of the row); every (pairs, spread) combination takes an equal
    share of each batch, once per filler of ``fillers`` (``"noise"``, ``"pairs"``:
    ``models.tasks``). needle_rows: needle rows per batch (the first filler); gap: MQAR filler
    tokens between pairs and queries; lengths: the
    curriculum over row lengths (see the module docstring; empty: none); vocab: the split."""

    pairs: tuple[int, ...] = (16, 32, 64)
    spreads: tuple[float, ...] = (1.0,)
    needle_rows: int = 0
    gap: int = 0
    fillers: tuple[str, ...] = ("noise",)
    lengths: tuple[int, ...] = ()
    vocab: TaskVocab = TaskVocab()

    def __post_init__(self):
        if not self.pairs or any(not is_integer(n, 1) for n in self.pairs):
            raise ValueError(f"task pairs must be positive integers, got {self.pairs!r}")
        if not self.fillers or len(set(self.fillers)) != len(self.fillers) or set(self.fillers) - set(FILLERS):
            raise ValueError(f"task fillers must be distinct names of {FILLERS}, got {self.fillers!r}")
        if not self.spreads or any(not 0.0 <= float(x) <= 1.0 for x in self.spreads):
            raise ValueError(f"task spreads must be fractions in [0, 1], got {self.spreads!r}")
        check_integer("needle_rows", self.needle_rows, 0)

    def stage(self, step: int, total: Optional[int], *, seq_len: int, batch: int) -> tuple[int, int]:
        """``(row length, rows)`` of training step ``step`` of a ``total``-step schedule (``None``
        before the schedule is fixed: the first stage)."""
        if not self.lengths:
            return seq_len, batch
        i = 0 if total is None else min(len(self.lengths) - 1, step * len(self.lengths) // max(int(total), 1))
        return self.lengths[i], batch * seq_len // self.lengths[i]

    def check(self, *, seq_len: int, batch: int) -> None:
        """Raises ``ValueError`` naming what does not fit a run of ``batch`` rows of ``seq_len``."""
        for length in self.lengths or (seq_len,):
            if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1 or seq_len % length:
                raise ValueError(f"task lengths must divide seq_len {seq_len} (the tokens per step stay "
                                 f"batch x seq_len), got {length!r}")
            self.specs(length)
            self.rows(batch * seq_len // length)
        self.specs(seq_len)
        self.rows(batch)

    def specs(self, seq_len: int) -> list[tuple[TaskSpec, Optional[int]]]:
        """``[(spec, rows or None)]``: the MQAR specs (``None``: an equal share of what the needle
        rows leave) and the needle spec with its rows. Raises ``ValueError`` for a length the
        largest pair count does not fit."""
        out = []
        for filler in self.fillers:
            for n in self.pairs:
                for f in self.spreads:
                    room = seq_len - 2 * n - self.gap
                    span = None if f == 1.0 else max(2 * n, min(room, int(round(f * room))))
                    out.append((TaskSpec("mqar", length=seq_len, pairs=int(n), gap=self.gap, span=span, filler=filler,
                                         vocab=self.vocab), None))
        if self.needle_rows:
            out.append((TaskSpec("needle", length=seq_len, pairs=1, filler=self.fillers[0], vocab=self.vocab),
                        self.needle_rows))
        return out

    def rows(self, batch: int) -> list[int]:
        """Rows of each spec of ``specs`` in a batch of ``batch``."""
        left, kinds = batch - self.needle_rows, len(self.fillers) * len(self.pairs) * len(self.spreads)
        if left < kinds:
            raise ValueError(f"a batch of {batch} rows cannot hold {self.needle_rows} needle rows and one row "
                             f"for each of the {kinds} (filler, pairs, spread) combinations")
        share = [left // kinds + (i < left % kinds) for i in range(kinds)]
        return share + ([self.needle_rows] if self.needle_rows else [])

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "TaskMix":
        d = dict(d)
        d["pairs"] = tuple(d["pairs"])
        d["spreads"] = tuple(d.get("spreads", (1.0,)))
        d["fillers"] = tuple(d.get("fillers", ("noise",)))
        d["lengths"] = tuple(d.get("lengths", ()))
        d["vocab"] = TaskVocab(**d["vocab"])
        return cls(**d)


def task_batch(mix: TaskMix, *, seed: int, step: int, batch: int, seq_len: int) -> dict[str, np.ndarray]:
    """The rows of training step ``step`` (``step = HELDOUT_STREAM``: the held-out rows):
    ``ids [B, seq_len + 1]`` int32 (the row and its last target), ``mask [B, seq_len]`` float32
    (scored targets ``ids[:, 1:]``) and ``answer`` (the same mask: every scored target is an
    answer). Rows are grouped by spec, in ``mix.specs`` order."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
    ids, masks = [], []
    specs = mix.specs(seq_len)
    for i, ((spec, _), rows) in enumerate(zip(specs, mix.rows(batch))):
        b = generate(jax.random.fold_in(key, i), spec, rows)
        ids.append(b.with_next())
        masks.append(b.mask.astype(np.float32))
    mask = np.concatenate(masks)
    return {"ids": np.concatenate(ids).astype(np.int32), "mask": mask, "answer": mask}


__all__ = ["HELDOUT_STREAM", "TASKS", "TaskMix", "task_batch"]
