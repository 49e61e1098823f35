"""Long-memory tasks, generated in JAX: multi-query associative recall (MQAR) and a needle.

Every row is made on the fly from a PRNG key (``jax.random``), vectorised over the batch, with
no data file. A row is ``ids [T]`` with ``targets [T]`` (``targets[t]`` is the token after
``ids[t]``) and ``mask [T]`` (the positions that are scored). The vocabulary (``TaskVocab``) is
split into disjoint ranges: id 0 is reserved (the checkpoint's end/pad token, never drawn),
then keys, values, and filler tokens:

* ``mqar`` (Zoology's MQAR with random non-query tokens): ``N`` distinct keys, each followed
  by its value (``2N`` tokens); then ``gap`` filler tokens; then the query region of ``span``
  tokens (default: the rest of the row), where every key is asked once, in random order, at
  random non-overlapping even offsets (the key, then its value), the rest filler; filler after
  it to the end of the row. Scored: the position of each query key (its target is the value).
  ``gap = 0`` spreads the queries over the whole rest of the row (distances from a few tokens
  to ``T``); the largest gap, ``T - 4N``, packs them at the end (distances near ``T``); a
  ``span`` of ``2N`` packs them right after the pairs (the easy rows of a curriculum).
* ``needle``: filler everywhere, one key-value pair at relative depth ``depth`` (drawn per row
  when ``None``), and the key again as the last token; scored: that last position.

Filler (``filler``): ``"noise"``, uniform tokens from the filler range, which the model can learn
to keep out of its state; or ``"pairs"``, distractor key-value pairs on the even grid of the row,
their keys drawn from the key ids that the row never queries and their values at random. A
distractor looks like a pair or a query, so the model must write every one of them into its
state while it keeps the queried pairs: every token changes the state, which is where a state
re-rounded after every token drifts (the per-step formats), and where a window's exact records
do not. With ``"pairs"`` the gap must be even and the keys must leave at least one distractor.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from leapquant_jax.checks import check_integer, check_positive

Array = jax.Array
TASKS = ("mqar", "needle")
FILLERS = ("noise", "pairs")
# id 0 is the checkpoint's eos/pad token; task tokens start after it
FIRST_ID = 1


@dataclasses.dataclass(frozen=True)
class TaskVocab:
    """The vocabulary split: ``size`` ids, id 0 reserved, then ``keys`` key ids, ``values``
    value ids and the rest filler. The defaults (2,048 ids: 512 keys, 512 values, 1,023 filler)
    give 64 pairs an 8-fold choice of keys and a 512-way answer."""

    size: int = 2048
    keys: int = 512
    values: int = 512

    def __post_init__(self):
        for name in ("size", "keys", "values"):
            check_positive(f"vocabulary {name}", getattr(self, name))
        if self.fillers < 1:
            raise ValueError(f"a vocabulary of {self.size} ids is too small for the split: 1 reserved + "
                             f"{self.keys} keys + {self.values} values leaves no filler id")

    @property
    def key_start(self) -> int:
        return FIRST_ID

    @property
    def value_start(self) -> int:
        return FIRST_ID + self.keys

    @property
    def filler_start(self) -> int:
        return FIRST_ID + self.keys + self.values

    @property
    def fillers(self) -> int:
        """Filler ids: what the split leaves."""
        return self.size - self.filler_start

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One task's rows: task (``mqar`` or ``needle``), length ``T``, pairs ``N`` (mqar; the
    needle has one), gap (mqar: filler tokens between the pair list and the query region),
    span (mqar: the query region's width, at least ``2N``; ``None`` = to the end of the row),
    depth (needle: relative position of the pair in ``[0, 1]``, ``None`` = drawn per row),
    filler (``FILLERS``, see the module docstring) and the vocabulary split. Impossible
    settings are refused by name."""

    task: str = "mqar"
    length: int = 2048
    pairs: int = 64
    gap: int = 0
    span: Optional[int] = None
    depth: Optional[float] = None
    filler: str = "noise"
    vocab: TaskVocab = TaskVocab()

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; known: {', '.join(TASKS)}")
        if self.filler not in FILLERS:
            raise ValueError(f"unknown filler {self.filler!r}; known: {', '.join(FILLERS)}")
        for name, low in (("length", 1), ("pairs", 1), ("gap", 0)):
            check_integer(name, getattr(self, name), low)
        if self.filler == "pairs":
            if self.pairs >= self.vocab.keys:
                raise ValueError(f"distractor pairs need key ids that the row never queries: {self.pairs} pair(s) "
                                 f"leave none of the vocabulary's {self.vocab.keys} key ids")
            if self.gap % 2:
                raise ValueError(f"with distractor pairs the gap must be even (pairs sit on the even grid), got {self.gap}")
        if self.task == "mqar":
            if self.pairs > self.vocab.keys:
                raise ValueError(f"{self.pairs} pairs need as many distinct keys, but the vocabulary has "
                                 f"{self.vocab.keys} key ids")
            if self.span is not None and (isinstance(self.span, bool) or not isinstance(self.span, (int, np.integer))
                                          or self.span < 2 * self.pairs):
                raise ValueError(f"span must be an integer >= 2 x pairs = {2 * self.pairs} (or None), got {self.span!r}")
            if self.length < self.min_length:
                raise ValueError(f"length {self.length} is smaller than the {self.min_length} tokens that "
                                 f"{self.pairs} pairs need (2 x {self.pairs} for the pairs + gap {self.gap} + "
                                 + (f"span {self.span} for the queries)" if self.span is not None else
                                    f"2 x {self.pairs} for the queries)"))
        else:
            if self.span is not None:
                raise ValueError("span is an mqar setting; the needle is queried at the end")
            if self.pairs != 1:
                raise ValueError(f"the needle task has one pair, got pairs={self.pairs}")
            if self.length < self.min_length:
                raise ValueError(f"length {self.length} is smaller than the {self.min_length} tokens a needle needs")
            if self.depth is not None and not 0.0 <= float(self.depth) <= 1.0:
                raise ValueError(f"needle depth must be in [0, 1], got {self.depth!r}")

    @property
    def min_length(self) -> int:
        """Fewest tokens a row needs: ``2N + gap + span`` (``span`` at least ``2N``; mqar), 3
        (needle: pair and query)."""
        if self.task != "mqar":
            return 3
        return 2 * self.pairs + self.gap + (2 * self.pairs if self.span is None else self.span)

    @property
    def scored_per_row(self) -> int:
        """Scored positions per row: ``N`` (mqar) or 1 (needle)."""
        return self.pairs if self.task == "mqar" else 1

    def with_length(self, length: int) -> "TaskSpec":
        return dataclasses.replace(self, length=length)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "TaskSpec":
        d = dict(d)
        d["vocab"] = TaskVocab(**d.get("vocab", {}))
        return cls(**d)


# One compiled generator serves every row length up to a power of two, every pair count, gap,
# span, filler and depth of a vocabulary, and every batch up to a power of two: these settings are
# data (``_row_settings``) and the rows are made at the padded sizes, then cut. jax.random's
# threefry draws element ``i`` of a 1-D draw from counter ``i`` (``jax_threefry_partitionable``,
# on by default), so a padded draw begins with the unpadded one, and a shuffle of ``n`` items
# padded with items that sort last begins with the shuffle of the ``n``: the rows are those of a
# generator compiled for each exact size. Short rows and small batches share the smallest
# program: a row costs far less to make than a program to compile.
MIN_LENGTH_BUCKET = 32
MIN_BATCH_BUCKET = 32


def _bucket(n: int, least: int) -> int:
    """The power of two at least ``n`` and ``least``."""
    return max(least, 1 << (int(n) - 1).bit_length())


def _shuffle_rounds(n: int) -> int:
    """Sorting rounds of ``jax.random.permutation`` for ``n`` items."""
    return int(np.ceil(3 * np.log(max(1, n)) / np.log(np.iinfo(np.uint32).max)))


def _padded_permutation(key: Array, n: Array, rounds: Array, capacity: int) -> Array:
    """``jax.random.permutation(key, n)`` for a traced ``n`` (``rounds = _shuffle_rounds(n)``),
    followed by ``n, ..., capacity - 1``: each round sorts by the same random keys, the
    positions from ``n`` on last."""
    x = jnp.arange(capacity)
    pad = (x >= n).astype(jnp.int32)                    # by position: the pads stay at the end
    for r in range(_shuffle_rounds(capacity)):
        key, subkey = jax.random.split(key)
        bits = jax.random.bits(subkey, (capacity,), jnp.uint32)
        _, _, shuffled = jax.lax.sort((pad, bits, x), num_keys=2, is_stable=True)
        x = jnp.where(r < rounds, shuffled, x)
    return x


def _keys_and_filler(key: Array, p: dict, n, *, vocab: TaskVocab, length: int):
    """Distinct key ids in random order, the first ``n`` the row's own, and a filler row
    ``[length]`` (see the module docstring), valid up to ``p["length"]``."""
    v, t = vocab, length
    k_perm, k_noise, k_dkeys, k_dvalues = jax.random.split(key, 4)
    perm = jax.random.permutation(k_perm, v.keys)
    ids = v.filler_start + jax.random.randint(k_noise, (t,), 0, v.fillers)
    slots = t // 2
    dkeys = v.key_start + perm[n + jax.random.randint(k_dkeys, (slots,), 0, v.keys - n)]   # never the row's keys
    dvalues = v.value_start + jax.random.randint(k_dvalues, (slots,), 0, v.values)
    grid = jnp.arange(t) < 2 * (p["length"] // 2)
    ids = jnp.where(p["pairs_filler"] & grid, jnp.stack([dkeys, dvalues], axis=1).reshape(-1), ids)
    return v.key_start + perm, ids


def _mqar_row(key: Array, p: dict, *, vocab: TaskVocab, length: int):
    v, t, n = vocab, length, p["pairs"]
    cap = min(v.keys, t // 4)                           # pairs a row of `length` tokens can hold
    lane = jnp.arange(cap)
    k_keys, k_values, k_slots, k_order = jax.random.split(key, 4)
    keys, ids = _keys_and_filler(k_keys, p, n, vocab=v, length=t)
    keys = keys[:cap]
    values = v.value_start + jax.random.randint(k_values, (cap,), 0, v.values)
    pairs = jnp.pad(jnp.stack([keys, values], axis=1).reshape(-1), (0, t - 2 * cap))
    ids = jnp.where(jnp.arange(t) < 2 * n, pairs, ids)
    drawn = _padded_permutation(k_slots, p["slots"], p["slot_rounds"], t // 2)[:cap]   # query slots
    pos = p["start"] + 2 * jnp.sort(jnp.where(lane < n, drawn, t))                     # [cap] query key positions
    pos = jnp.where(lane < n, pos, t)                   # a lane past the pairs writes nothing
    order = _padded_permutation(k_order, n, p["order_rounds"], cap)                     # which pair each slot asks
    ids = ids.at[pos].set(keys[order], mode="drop").at[pos + 1].set(values[order], mode="drop")
    ids = jnp.where(jnp.arange(t) < p["length"], ids, 0)
    targets = jnp.concatenate([ids[1:], jnp.zeros((1,), ids.dtype)])
    mask = jnp.zeros((t,), bool).at[pos].set(True, mode="drop")
    return ids, targets, mask


def _needle_row(key: Array, p: dict, *, vocab: TaskVocab, length: int):
    v, t, end = vocab, length, p["length"]
    k_key, k_value, k_depth = jax.random.split(key, 3)
    needle, ids = _keys_and_filler(k_key, p, 1, vocab=v, length=t)
    needle = needle[0]
    value = v.value_start + jax.random.randint(k_value, (), 0, v.values)
    depth = jnp.where(p["random_depth"], jax.random.uniform(k_depth), p["depth"])
    # distractor pairs: on the even grid, the pair in a slot, the query at the last slot's key;
    # noise: the query is the last token, the pair at pos, pos + 1 <= end - 2
    grid_query = 2 * ((end - 1) // 2)
    query = jnp.where(p["pairs_filler"], grid_query, end - 1)
    pos = jnp.where(p["pairs_filler"], 2 * jnp.round(depth * (grid_query // 2 - 1)).astype(jnp.int32),
                    jnp.round(depth * (end - 3)).astype(jnp.int32))
    ids = ids.at[pos].set(needle).at[pos + 1].set(value).at[query].set(needle)
    targets = jnp.concatenate([ids[1:], value[None]])
    targets = jnp.where(jnp.arange(t) == end - 1, value, targets).at[query].set(value)
    mask = jnp.zeros((t,), bool).at[query].set(True)
    return ids, targets, mask


def _row_settings(spec: TaskSpec) -> dict:
    """What the compiled generator takes as data: length, pairs, the query region (start, slots
    and the rounds of its shuffle), the filler and the needle's depth."""
    n, t = spec.pairs, spec.length
    start = 2 * n + spec.gap
    slots = ((t - start) if spec.span is None else spec.span) // 2
    return {"length": np.int32(t), "pairs": np.int32(n), "start": np.int32(start), "slots": np.int32(slots),
            "slot_rounds": np.int32(_shuffle_rounds(slots)), "order_rounds": np.int32(_shuffle_rounds(n)),
            "pairs_filler": np.bool_(spec.filler == "pairs"), "random_depth": np.bool_(spec.depth is None),
            "depth": np.float32(0.0 if spec.depth is None else spec.depth)}


@functools.partial(jax.jit, static_argnames=("task", "vocab", "length", "batch"))
def _generate(key: Array, settings: dict, *, task: str, vocab: TaskVocab, length: int, batch: int):
    row = _mqar_row if task == "mqar" else _needle_row
    ids, targets, mask = jax.vmap(lambda k: row(k, settings, vocab=vocab, length=length))(jax.random.split(key, batch))
    return ids.astype(jnp.int32), targets.astype(jnp.int32), mask


@dataclasses.dataclass(frozen=True)
class TaskBatch:
    """``ids [B, T]`` int32, ``targets [B, T]`` int32 (the token after each position),
    ``mask [B, T]`` bool (scored positions)."""

    ids: np.ndarray
    targets: np.ndarray
    mask: np.ndarray

    def with_next(self) -> np.ndarray:
        """``[B, T + 1]``: the ids followed by the last position's target (the training loop's rows)."""
        return np.concatenate([self.ids, self.targets[:, -1:]], axis=1)


def generate(key, spec: TaskSpec, batch: int) -> TaskBatch:
    """``batch`` rows of ``spec`` from the PRNG ``key`` (an int seed is taken as
    ``jax.random.PRNGKey(seed)``): the same key gives the same rows."""
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
    if isinstance(key, (int, np.integer)):
        key = jax.random.PRNGKey(int(key))
    b, t = int(batch), spec.length
    out = _generate(key, _row_settings(spec), task=spec.task, vocab=spec.vocab, length=_bucket(t, MIN_LENGTH_BUCKET),
                    batch=_bucket(b, MIN_BATCH_BUCKET))
    ids, targets, mask = (np.ascontiguousarray(np.asarray(x)[:b, :t]) for x in jax.device_get(out))
    return TaskBatch(ids=ids, targets=targets, mask=mask)


__all__ = ["FILLERS", "FIRST_ID", "TASKS", "TaskBatch", "TaskSpec", "TaskVocab", "generate"]
