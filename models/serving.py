"""Continuous batching: a pool of live decode states that sequences enter and leave.

``DecodePool`` holds one cache of ``slots`` sequences and ``max_len`` positions. ``insert``
prefills one prompt (batch 1, right-padded to a bucket like ``models.decode.pad_prompts``) and
writes its cache row into a free slot (``models.base.put_rows``, so either cache layout works);
``step`` runs one decode step of the whole pool, the free slots passed ``active=False``;
``evict`` frees a slot. Sequences sit at their own positions (the cache's ``pos``, a LeapQuant
stream's own ``pos``), so a slot never waits for the others.

Each compiled program has fixed shapes: the step is compiled once for the pool's size however
slots fill and empty, the prefill once per prompt bucket, the row write once. They are shared by
pools of the same model, state method, sampling and size.

Each slot samples with its own key, split exactly as ``models.decode.generate`` splits a batch of
one, so what a sequence samples does not depend on what else shares the pool: greedy tokens are
those of ``generate`` on its prompt alone, and sampled ones too wherever the two programs' logits
(which may differ in their last bits) pick the same token. Tokens teacher-forced through decode
steps (``feed``, a restored state's pending ids) do not use up the key: the token after the last
of them is drawn with the key that would have drawn the first token after the prompt.

Faults stay with their slot. A request with ids outside the vocabulary, or a prompt and budget
longer than a slot, is refused (``ValueError`` naming it) before anything changes. A prefill whose
logits are not finite is refused too (``PoolFault``), and a slot whose logits turn non-finite in a
step is ended: its rows reset, a ``SlotFault`` added to ``faults``; the other slots go on.

``serve`` drives a queue of requests through a pool (``serve_requests`` does it request by request,
reporting each one's refusal or fault and its times); ``save``/``restore`` move one sequence's
state out of and into a slot, ``boundary_state`` takes the state of a sequence of any length at
its last window boundary (``models.prefix_state``), and ``generate_one`` runs one sequence,
optionally from or into a prefix state.

The pool runs on one device (no ``mesh``), and keeps its per-slot bookkeeping on the host: each
step sends the slots' tokens and keys and reads back the new tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from leapquant_jax.checks import check_integer
from models.base import put_rows, take_rows
from models.fingerprint import check_state_method
from models.decode import PROMPT_BUCKET, check_token_ids
from models.layers import Sampling, sample_next
from models.prefix_state import (PrefixState, check_prefix, empty_cache, restore_cache, take_prefix,
                                 window_boundary)

Array = jax.Array


class PoolFault(ValueError):
    """A sequence the pool cannot continue: its logits are not finite (after its prompt, or in a
    step of its slot, which then ends)."""


@dataclasses.dataclass(frozen=True)
class SlotFault:
    """A slot ended by a fault: ``slot``, the ``tokens`` it had consumed, ``reason``."""

    slot: int
    tokens: int
    reason: str

    def __str__(self) -> str:
        return f"slot {self.slot} ended after {self.tokens} tokens: {self.reason}"


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """The shape of a pool: ``slots`` sequences of at most ``max_len`` tokens each (prompt and
    generated tokens fed back), how they sample, and the prompt bucket of the prefill."""

    slots: int
    max_len: int
    sampling: Sampling = Sampling()
    bucket: int = PROMPT_BUCKET

    def __post_init__(self):
        check_integer("slots", self.slots)
        check_integer("max_len", self.max_len)
        check_integer("bucket", self.bucket)
        if not isinstance(self.sampling, Sampling):
            raise ValueError(f"sampling must be a models.layers.Sampling, got {self.sampling!r}")


# ----------------------------------------------------------------------------- compiled programs


def _sample_rows(logits: Array, keys: Array, sampling: Sampling) -> tuple[Array, Array]:
    """Per-row sampling: ``logits [S, V]``, raw keys ``[S, ...]`` -> ``(tokens [S], keys [S, ...])``,
    each row as ``generate`` samples a batch of one (split, then draw with the second key)."""
    def one(row, key):
        key, sub = jax.random.split(key)
        return sample_next(row[None], sub, sampling)[0], key

    return jax.vmap(one)(logits, keys)


@functools.partial(jax.jit, static_argnames=("arch", "config", "method", "sampling"))
def _prefill(arch, params, config, blank, ids, lengths, keys, *, method, sampling):
    # ``blank``, an empty batch-1 cache, is an argument: making it here would compile a
    # LeapQuant stream's checkpoint encoding (of zeros) into every prefill program.
    logits, cache, _ = arch.forward(params, config, ids, blank, method=method, mode="prefill", lengths=lengths)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    first, keys = _sample_rows(last, keys, sampling)
    return cache, last, first, keys, jnp.all(jnp.isfinite(last), axis=-1)


@functools.partial(jax.jit, static_argnames=("arch", "config", "method", "sampling"), donate_argnames=("cache",))
def _step(arch, params, config, cache, logits, tokens, active, keys, *, method, sampling):
    new_logits, cache, _ = arch.forward(params, config, tokens[:, None], cache, method=method, mode="decode",
                                        active=active)
    nxt, new_keys = _sample_rows(new_logits[:, 0], keys, sampling)
    finite = jnp.all(jnp.isfinite(new_logits[:, 0]), axis=-1) | ~active
    nxt = jnp.where(active & finite, nxt, 0)
    keys = jnp.where(active.reshape((-1,) + (1,) * (keys.ndim - 1)), new_keys, keys)
    logits = jnp.where(active[:, None], new_logits[:, 0], logits)
    return nxt, cache, logits, keys, finite


@functools.partial(jax.jit, donate_argnames=("cache", "logits"))
def _write(cache, logits, rows, sub_cache, sub_logits):
    return put_rows(cache, rows, sub_cache), logits.at[rows].set(sub_logits)


# ----------------------------------------------------------------------------- the pool


class DecodePool:
    """Live decode states of up to ``pool.slots`` sequences (module docstring).

    Host-side per slot: whether it is in use, its pending token (sampled, not yet fed), its
    position and consumed ids, its sampling key and the key that drew the pending token (a token
    fed in its place is drawn again with it). On the device: the cache (batch ``slots``) and
    ``logits [slots, vocab]``, each slot's last next-token logits. ``faults``: the slots ended
    because their logits turned non-finite, in order.
    """

    def __init__(self, arch, params, config, *, method, pool: PoolConfig):
        if not isinstance(pool, PoolConfig):
            raise ValueError(f"pool must be a PoolConfig, got {pool!r}")
        check_state_method(method, arch, config, params)
        self.arch, self.params, self.config, self.method, self.pool = arch, params, config, method, pool
        s = pool.slots
        self.cache = empty_cache(arch, config, method=method, batch=s, max_len=pool.max_len)
        self._blank = take_rows(self.cache, jnp.zeros((1,), jnp.int32))
        self.logits = jnp.zeros((s, config.vocab_size), jnp.float32)
        key = np.asarray(jax.random.PRNGKey(0))
        self._keys = np.zeros((s,) + key.shape, key.dtype)
        self._drew = np.zeros((s,) + key.shape, key.dtype)
        self._active = np.zeros(s, bool)
        self._pending = np.zeros(s, np.int32)
        self._pos = np.zeros(s, np.int64)
        self._ids: list[list[int]] = [[] for _ in range(s)]
        self._faults: list[SlotFault] = []

    # -- inspection

    @property
    def slots(self) -> int:
        """Sequences the pool holds at once (the cache's batch)."""
        return self.pool.slots

    @property
    def max_len(self) -> int:
        """Positions per sequence (the attention caches' length)."""
        return self.pool.max_len

    @property
    def active(self) -> np.ndarray:
        """``[slots]`` bool: the slots in use."""
        return self._active.copy()

    @property
    def pending(self) -> np.ndarray:
        """``[slots]`` int32: each slot's last sampled token, the next one it feeds (0 when free)."""
        return np.where(self._active, self._pending, 0).astype(np.int32)

    @property
    def positions(self) -> np.ndarray:
        """``[slots]``: tokens each slot has consumed."""
        return self._pos.copy()

    @property
    def faults(self) -> tuple:
        """The ``SlotFault`` of every slot a step ended, oldest first."""
        return tuple(self._faults)

    def free_slots(self) -> list[int]:
        """The slots not in use, lowest first."""
        return [int(i) for i in np.flatnonzero(~self._active)]

    def ids(self, slot: int) -> list[int]:
        """The tokens slot ``slot`` has consumed (its prompt, then the tokens fed back)."""
        return list(self._ids[self._check_slot(slot, in_use=True)])

    # -- checks

    def _check_slot(self, slot, *, in_use: bool) -> int:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.slots:
            raise ValueError(f"slot must be an integer in [0, {self.slots}), got {slot!r}")
        if bool(self._active[slot]) != in_use:
            raise ValueError(f"slot {slot} is {'free' if in_use else 'in use; evict it first'}")
        return int(slot)

    def check_fits(self, length: int, budget: int, *, name: str = "the prompt") -> None:
        """Raises ``ValueError`` unless ``length`` consumed tokens and ``budget`` new ones fit in
        ``max_len`` (the last new token is never fed back: ``length + budget - 1 <= max_len``)."""
        budget = check_integer("budget", budget)
        if length + budget - 1 > self.max_len:
            raise ValueError(f"{name} ({length} tokens) and {budget} new tokens need {length + budget - 1} "
                             f"positions, more than the pool's max_len = {self.max_len}")

    def _free_slot(self, slot: Optional[int]) -> int:
        if slot is not None:
            return self._check_slot(slot, in_use=False)
        free = self.free_slots()
        if not free:
            raise ValueError(f"no free slot: all {self.slots} slots are in use")
        return free[0]

    # -- entering and leaving

    def _occupy(self, slot: int, sub_cache, sub_logits, first, keys, drew, ids) -> int:
        self.cache, self.logits = _write(self.cache, self.logits, jnp.asarray([slot], jnp.int32), sub_cache,
                                         sub_logits)
        self._keys[slot] = np.asarray(keys)[0]
        self._drew[slot] = np.asarray(drew)[0]
        self._pending[slot] = int(np.asarray(first)[0])
        self._pos[slot] = len(ids)
        self._ids[slot] = list(map(int, ids))
        self._active[slot] = True
        return slot

    def insert(self, prompt: Sequence[int], *, budget: int, seed: int = 0, slot: Optional[int] = None) -> int:
        """Prefills ``prompt`` (token ids ``[n]``, ``n >= 1``) into ``slot`` (default: the lowest
        free one) and samples its first token (``pending``) with ``PRNGKey(seed)``; returns the
        slot. ``budget``: new tokens it may generate (checked against ``max_len``)."""
        prompt = check_token_ids(prompt, self.config.vocab_size, name="prompt").reshape(-1)
        if prompt.shape[0] < 1:
            raise ValueError("the prompt needs at least one token")
        self.check_fits(prompt.shape[0], budget)
        slot = self._free_slot(slot)
        drew = np.asarray(jax.random.PRNGKey(seed))[None]
        cache, last, first, keys, finite = self._prefill_one(prompt, drew)
        if not bool(np.asarray(finite)[0]):
            raise PoolFault(f"the logits after the prompt ({prompt.shape[0]} tokens) are not finite; "
                            f"the prompt was not admitted")
        return self._occupy(slot, cache, last, first, keys, drew, prompt)

    def _prefill_one(self, prompt: np.ndarray, keys: np.ndarray, *, length: Optional[int] = None):
        """Prefill of the first ``length`` (default all, ``>= 1``) tokens of ``prompt [n]`` from an
        empty row, in the program of the prompt's bucket (the tokens past ``length`` are padding):
        ``(cache of batch 1, last logits [1, vocab], first token [1], keys [1, ...], finite [1])``,
        ``finite`` whether those logits are all finite."""
        n, bucket = prompt.shape[0], self.pool.bucket
        t = min(-(-n // bucket) * bucket, self.max_len)
        ids = np.zeros((1, t), np.int32)
        ids[0, :n] = prompt
        lengths = np.array([n if length is None else length], np.int32)
        return _prefill(self.arch, self.params, self.config, self._blank, ids, lengths, keys, method=self.method,
                        sampling=self.pool.sampling)

    def restore(self, prefix: PrefixState, *, budget: int, seed: int = 0, slot: Optional[int] = None) -> int:
        """Writes a prefix state into ``slot`` (default: the lowest free one), feeds its pending ids
        through decode steps of that slot (``feed``; the other slots wait) and samples its next
        token with ``PRNGKey(seed)``: after the last pending id, or from the prefix's logits when
        it has none. Returns the slot. The prefix is checked first
        (``models.prefix_state.check_prefix``): a refused one changes nothing."""
        check_prefix(prefix, self.arch, self.params, self.config, method=self.method)
        m = prefix.pending.shape[0]
        self.check_fits(prefix.length + m, budget, name="the prefix and its pending ids" if m else "the prefix")
        slot = self._free_slot(slot)
        cache = restore_cache(self.arch, self.params, self.config, prefix, method=self.method, max_len=self.max_len)
        drew = np.asarray(jax.random.PRNGKey(seed))[None]
        if not m:
            if not np.all(np.isfinite(prefix.logits)):
                raise PoolFault("the prefix state's logits are not finite; it was not restored")
            logits = jnp.asarray(prefix.logits)[None]
            first, keys = _sample_rows(logits, jnp.asarray(drew), self.pool.sampling)
            return self._occupy(slot, cache, logits, first, keys, drew, prefix.ids)
        # No token is drawn before the pending ids are fed: the one after them is drawn with
        # PRNGKey(seed), as generate draws the first token after a prompt.
        logits = jnp.zeros((1, self.config.vocab_size), jnp.float32)
        self._occupy(slot, cache, logits, np.zeros(1, np.int32), drew, drew, prefix.ids)
        self.feed(slot, prefix.pending)
        return slot

    def boundary_state(self, ids: Sequence[int] = (), *, prefix: Optional[PrefixState] = None) -> PrefixState:
        """The prefix state of a sequence of any length at its last window boundary ``B``, with
        the tokens after ``B`` as its pending ids: what ``restore`` continues from. ``save``, by
        contrast, takes a slot whose sequence ends at ``B``.

        The sequence is ``ids [m]`` alone, or ``prefix`` (its ids, then its pending ids) followed
        by ``ids``. ``B`` is the sequence's length rounded down to a multiple of the method's
        window from where the prefix's state ends (``models.prefix_state.window_boundary``; the
        whole sequence for a per-step method). The state at ``B`` is a prefill of ``ids[:B]``
        (in the program ``insert`` runs for ``ids``; the empty state for ``B = 0``) or, after a
        ``prefix`` whose state ends before ``B``, its restore with the tokens up to ``B`` fed
        through decode steps, in a free slot that is freed again. A prefix that already ends at
        ``B`` comes back with the tokens appended to its pending ids.
        """
        ids = check_token_ids(ids, self.config.vocab_size, name="ids").reshape(-1)
        if prefix is None:
            if ids.shape[0] < 1:
                raise ValueError("boundary_state needs ids or a prefix state")
            self.check_fits(ids.shape[0], 1, name="the sequence")
            b = window_boundary(ids.shape[0], self.method)
            if b:
                # The prompt's own bucket, whatever b: one prefill program per bucket, as insert.
                cache, last, _, _, _ = self._prefill_one(ids, np.asarray(jax.random.PRNGKey(0))[None], length=b)
                logits = last[0]
            else:
                cache, logits = self._blank, None
            return take_prefix(self.arch, self.params, self.config, cache, 0, method=self.method, ids=ids[:b],
                               logits=logits, pending=ids[b:])
        check_prefix(prefix, self.arch, self.params, self.config, method=self.method)
        rest = np.concatenate([prefix.pending, ids]).astype(np.int32)
        n = prefix.length
        self.check_fits(n + rest.shape[0], 1, name="the sequence")
        b = n + window_boundary(rest.shape[0], self.method)
        if b == n:
            return dataclasses.replace(prefix, pending=rest)
        slot = self.restore(dataclasses.replace(prefix, pending=rest[:b - n]), budget=1)
        state = self.save(slot)
        self.evict(slot)
        return dataclasses.replace(state, pending=rest[b - n:])

    def save(self, slot: int) -> PrefixState:
        """The prefix state of slot ``slot`` (``models.prefix_state.take_prefix``): its consumed
        ids, its cache row and its next-token logits, no pending ids. A LeapQuant stream must be
        at a window boundary (``PrefixStateError`` otherwise; ``boundary_state`` takes a sequence
        of any length)."""
        slot = self._check_slot(slot, in_use=True)
        return take_prefix(self.arch, self.params, self.config, self.cache, slot, method=self.method,
                           ids=self._ids[slot], logits=self.logits[slot])

    def evict(self, slot: int) -> None:
        """Frees ``slot``. Its rows keep their values: the next ``insert``/``restore`` writes every
        leaf of the row (a whole batch-1 cache of ``max_len`` positions)."""
        slot = self._check_slot(slot, in_use=True)
        self._active[slot] = False
        self._ids[slot] = []

    # -- decoding

    def _run(self, tokens: np.ndarray, active: np.ndarray) -> np.ndarray:
        full = np.flatnonzero(active & (self._pos >= self.max_len))
        if full.size:
            raise ValueError(f"slot {int(full[0])} has consumed all max_len = {self.max_len} positions")
        nxt, self.cache, self.logits, keys, finite = _step(self.arch, self.params, self.config, self.cache,
                                                           self.logits, tokens.astype(np.int32), active, self._keys,
                                                           method=self.method, sampling=self.pool.sampling)
        nxt = np.asarray(nxt)
        self._drew[active] = self._keys[active]
        self._keys = np.array(keys)
        for s in np.flatnonzero(active):
            self._ids[s].append(int(tokens[s]))
        self._pos[active] += 1
        self._pending[active] = nxt[active]
        for s in np.flatnonzero(~np.asarray(finite)):
            self._end(int(s), "its next-token logits are not finite")
        return nxt

    def _end(self, slot: int, reason: str) -> None:
        """Ends ``slot`` for a fault: recorded in ``faults``, its rows reset to the empty cache (so
        no non-finite value stays in the pool), the slot freed."""
        self._faults.append(SlotFault(slot=slot, tokens=int(self._pos[slot]), reason=reason))
        self.cache, self.logits = _write(self.cache, self.logits, jnp.asarray([slot], jnp.int32), self._blank,
                                         jnp.zeros((1, self.config.vocab_size), jnp.float32))
        self._active[slot] = False
        self._ids[slot] = []

    def step(self) -> np.ndarray:
        """One decode step of every slot in use: each feeds its pending token and samples the
        next. Returns the new tokens ``[slots]`` int32 (0 for free slots). A slot whose logits
        turn non-finite is ended (``faults``; its token 0) and the others go on."""
        if not self._active.any():
            raise ValueError("no slot is in use: nothing to step")
        return self._run(self._pending, self._active.copy())

    def feed(self, slot: int, ids: Sequence[int]) -> int:
        """Teacher-forces ``ids [m]`` through decode steps of ``slot`` alone (its pending token is
        dropped; the other slots wait) and returns the token sampled after the last one, drawn
        with the key that drew the dropped token (the tokens fed use up no key). Raises
        ``PoolFault`` when the slot's logits turn non-finite (the slot is then ended)."""
        slot = self._check_slot(slot, in_use=True)
        ids = check_token_ids(ids, self.config.vocab_size, name="ids").reshape(-1)
        if self._pos[slot] + ids.shape[0] > self.max_len:
            raise ValueError(f"slot {slot} holds {int(self._pos[slot])} tokens; {ids.shape[0]} more exceed "
                             f"max_len = {self.max_len}")
        only = np.arange(self.slots) == slot
        key = self._drew[slot].copy()
        for t in ids:
            tokens = self._pending.copy()
            tokens[slot] = t
            self._keys[slot] = key
            self._run(tokens, only)
            if not self._active[slot]:
                raise PoolFault(str(self._faults[-1]))
        return int(self._pending[slot])


# ----------------------------------------------------------------------------- drivers


def _budgets(max_new_tokens, n: int) -> list[int]:
    if isinstance(max_new_tokens, (int, np.integer)) and not isinstance(max_new_tokens, bool):
        return [check_integer("max_new_tokens", max_new_tokens)] * n
    budgets = list(max_new_tokens)
    if len(budgets) != n:
        raise ValueError(f"max_new_tokens gives {len(budgets)} budgets for {n} requests")
    return [check_integer(f"max_new_tokens[{i}]", b) for i, b in enumerate(budgets)]


def decode_slot(pool: DecodePool, slot: int, *, max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
    """Steps the pool until slot ``slot`` has generated ``max_new_tokens`` tokens (its pending
    token first) or a stop token (kept); returns them and evicts the slot. Raises ``PoolFault``
    when the slot's logits turn non-finite (the pool has then ended it)."""
    budget = check_integer("max_new_tokens", max_new_tokens)
    stop = set(check_token_ids(stop_ids, pool.config.vocab_size, name="stop_ids").tolist())
    pool.check_fits(len(pool.ids(slot)), budget, name=f"slot {slot}")
    tokens = [int(pool.pending[slot])]
    while len(tokens) < budget and tokens[-1] not in stop:
        nxt = pool.step()
        if not pool.active[slot]:
            raise PoolFault(str(pool.faults[-1]))
        tokens.append(int(nxt[slot]))
    pool.evict(slot)
    return tokens


@dataclasses.dataclass(frozen=True)
class Served:
    """One request's outcome in ``serve_requests``.

    tokens: its new tokens (up to a fault, the tokens sampled before it); error: ``None`` when it
    finished (a stop token or its budget), else why it was refused or ended; start_s,
    first_token_s, end_s: host-clock seconds from the start of the run at which it entered a slot,
    had its first token (sampled after its prompt) and left (``None`` where it never did).
    All requests are queued at 0, so ``end_s`` is its latency.
    """

    tokens: tuple
    error: Optional[str] = None
    start_s: Optional[float] = None
    first_token_s: Optional[float] = None
    end_s: Optional[float] = None


def serve_requests(pool: DecodePool, requests: Sequence[Sequence[int]], *, max_new_tokens,
                   stop_ids: Sequence[int] = (), seed: int = 0, clock=time.perf_counter) -> list[Served]:
    """Continuous batching of ``requests`` (prompts, token ids ``[n_i]``) through an empty pool,
    request by request: one that cannot be served is reported and the others go on.

    Requests enter free slots in order as slots free up; every step advances all slots in use;
    a sequence leaves at a stop token (kept) or after ``max_new_tokens`` tokens (an int, or one
    per request). Request ``i`` samples with ``PRNGKey(seed + i)``. A request with ids outside the
    vocabulary, an empty prompt, a prompt and budget longer than a slot, or logits that are not
    finite after its prompt is refused; a slot whose logits turn non-finite is ended. Either way
    its ``Served.error`` says why, by name. Returns one ``Served`` per request, in request order;
    its times are read from ``clock`` (seconds), after the host has the tokens of each step.
    """
    if isinstance(requests, (str, bytes)) or not len(requests):
        raise ValueError(f"requests must be a non-empty list of token-id lists, got {requests!r}")
    if pool.active.any():
        raise ValueError(f"serve needs an empty pool; slots {np.flatnonzero(pool.active).tolist()} are in use")
    budgets = _budgets(max_new_tokens, len(requests))
    stop = set(check_token_ids(stop_ids, pool.config.vocab_size, name="stop_ids").tolist())
    t0 = clock()
    out: list = [None] * len(requests)
    prompts: dict[int, np.ndarray] = {}
    for i, p in enumerate(requests):
        try:
            prompt = check_token_ids(p, pool.config.vocab_size, name=f"requests[{i}]").reshape(-1)
            if prompt.shape[0] < 1:
                raise ValueError(f"requests[{i}] needs at least one token")
            pool.check_fits(prompt.shape[0], budgets[i], name=f"requests[{i}]")
            prompts[i] = prompt
        except ValueError as err:
            out[i] = Served(tokens=(), error=str(err))
        except TypeError:
            out[i] = Served(tokens=(), error=f"requests[{i}] must be a sequence of token ids, got {p!r}")
    queue = collections.deque(prompts)
    live: dict[int, int] = {}  # slot -> request
    tokens: dict[int, list[int]] = {}  # slot -> its new tokens so far
    times: dict[int, tuple] = {}  # slot -> (start_s, first_token_s)

    def finish(slot: int, error: Optional[str] = None) -> None:
        i = live.pop(slot)
        out[i] = Served(tokens=tuple(tokens.pop(slot)), error=error, start_s=times[slot][0],
                        first_token_s=times[slot][1], end_s=clock() - t0)
        if error is None:
            pool.evict(slot)

    while queue or live:
        while queue and pool.free_slots():
            i = queue.popleft()
            start = clock() - t0
            try:
                slot = pool.insert(prompts[i], budget=budgets[i], seed=seed + i)
            except PoolFault as err:
                out[i] = Served(tokens=(), error=f"requests[{i}]: {err}", start_s=start, end_s=clock() - t0)
                continue
            live[slot], tokens[slot], times[slot] = i, [int(pool.pending[slot])], (start, clock() - t0)
            if tokens[slot][-1] in stop or budgets[i] == 1:
                finish(slot)
        if not live:
            continue
        known = len(pool.faults)
        nxt = pool.step()
        ended = {f.slot: f for f in pool.faults[known:]}
        for slot in list(live):
            if slot in ended:
                finish(slot, error=f"requests[{live[slot]}]: {ended[slot]}")
                continue
            tokens[slot].append(int(nxt[slot]))
            if tokens[slot][-1] in stop or len(tokens[slot]) == budgets[live[slot]]:
                finish(slot)
    return out


def serve(pool: DecodePool, requests: Sequence[Sequence[int]], *, max_new_tokens, stop_ids: Sequence[int] = (),
          seed: int = 0) -> list[list[int]]:
    """Continuous batching of ``requests`` (prompts, token ids ``[n_i]``) through an empty pool
    (``serve_requests``), all or nothing: every request is checked before any runs (``ValueError``
    naming the first that cannot be served), and a request a fault ended raises ``PoolFault``
    once the others are done. Returns each request's new tokens, in request order: with greedy
    sampling what ``models.decode.generate`` gives it alone.
    """
    if isinstance(requests, (str, bytes)) or not len(requests):
        raise ValueError(f"requests must be a non-empty list of token-id lists, got {requests!r}")
    budgets = _budgets(max_new_tokens, len(requests))
    for i, (p, b) in enumerate(zip(requests, budgets)):
        p = check_token_ids(p, pool.config.vocab_size, name=f"requests[{i}]").reshape(-1)
        if p.shape[0] < 1:
            raise ValueError(f"requests[{i}] needs at least one token")
        pool.check_fits(p.shape[0], b, name=f"requests[{i}]")
    served = serve_requests(pool, requests, max_new_tokens=budgets, stop_ids=stop_ids, seed=seed)
    errors = [r.error for r in served if r.error is not None]
    if errors:
        raise PoolFault("; ".join(errors))
    return [list(r.tokens) for r in served]


def generate_one(arch, params, config, *, method, prompt: Sequence[int] = (), prefix: Optional[PrefixState] = None,
                 max_new_tokens: int, stop_ids: Sequence[int] = (), sampling: Sampling = Sampling(), seed: int = 0,
                 keep_state: bool = False) -> tuple[list[int], Optional[PrefixState]]:
    """One sequence through a one-slot pool: ``prompt [n]``, or ``prefix`` (restored, its pending
    ids fed) and then ``prompt`` (possibly empty) fed through decode steps; then up to
    ``max_new_tokens`` new tokens (stop tokens kept). Returns ``(tokens, state)``: ``state`` is
    ``None``, or with ``keep_state`` the state of the whole sequence before any new token
    (``DecodePool.boundary_state``: at its last window boundary, the tokens after it pending).

    With ``keep_state`` the run continues from that state as a restore of it would: restored,
    its pending ids fed through decode steps, then sampled from. So a ``keep_state`` run and a
    run from the state it returns (``prefix=state``, no ``prompt``; in memory or through
    ``save_prefix``/``load_prefix``) are the same computation: bit-identical logits and tokens
    (same backend, ``seed`` and sampling).

    Without ``keep_state`` a ``prompt`` alone is prefilled whole, as ``models.decode.generate``
    prefills it. For a per-step method ``keep_state`` changes nothing (the boundary is the
    prompt's end: the same prefill, bit-identical logits). For a windowed method (``leapquant``,
    ``int8-w``, ...) off a window boundary, ``keep_state`` prefills the prompt up to its last
    boundary and runs the rest through decode steps: the same maths, rounded differently, so the
    logits agree with the whole-prompt prefill's to round-off only, and greedy tokens agree but
    at near-ties. (On the tiny test models, relative logit differences: with ``compute="exact"``
    about 1e-5 after the prompt, up to 2e-3 once a later flush rounds a residual code of the two
    states apart; with ``compute="fast"`` none for GDN, and about 5e-3 (up to 7e-3 later) for KDA,
    whose MLA attention prefills with expanded keys and decodes in the absorbed form, which bf16
    operands round apart.)

    The pool holds the whole sequence rounded up to the prompt bucket plus the new tokens: what
    ``generate`` allocates for it as one prompt, so it decodes with the same attention extent
    whichever way it came in.
    """
    budget = check_integer("max_new_tokens", max_new_tokens)
    extra = check_token_ids(prompt, config.vocab_size, name="prompt").reshape(-1)
    if prefix is None and extra.shape[0] < 1:
        raise ValueError("generate_one needs a prompt or a prefix state")
    total = extra.shape[0]
    if prefix is not None:
        check_prefix(prefix, arch, params, config, method=method)  # before anything compiles
        total += prefix.length + prefix.pending.shape[0]
    max_len = -(-total // PROMPT_BUCKET) * PROMPT_BUCKET + budget
    pool = DecodePool(arch, params, config, method=method,
                      pool=PoolConfig(slots=1, max_len=max_len, sampling=sampling))
    state = None
    if keep_state:
        state = prefix = pool.boundary_state(extra, prefix=prefix)
        extra = extra[:0]
    if prefix is None:
        slot = pool.insert(extra, budget=budget, seed=seed)
    else:
        slot = pool.restore(prefix, budget=budget, seed=seed)
        if extra.shape[0]:
            pool.feed(slot, extra)
    return decode_slot(pool, slot, max_new_tokens=budget, stop_ids=stop_ids), state


__all__ = ["DecodePool", "PoolConfig", "PoolFault", "Served", "SlotFault", "decode_slot", "generate_one", "serve",
           "serve_requests"]
