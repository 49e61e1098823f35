"""Prefix states: one sequence's decode state at a window boundary, in host memory or in a file.

A ``PrefixState`` is what a sequence needs to continue decoding after the tokens it has consumed
(its *prefix*): every leaf of its cache row, with two reductions.

* A LeapQuant stream (``leapquant_jax.state.LeapQuantState``) keeps only its ``checkpoint``, the
  window-boundary state: a prefix is taken only at a window boundary, where the window buffer is
  empty and the stream's ``pos`` is 0, so the restore rebuilds both (all zeros, laid out as the
  model's cache lays them out). Per-step states (``fp32``, ``bf16``, ``int8``, ...) are kept whole.
* Attention caches (KV, or MLA's latents) keep their first ``n`` positions, ``n`` the prefix
  length; the restore pads them with zeros, which attention masks.

With them: the prefix ``ids [n]``, the ``logits [vocab]`` that follow them, and ``pending [m]``,
tokens after the prefix that are not in its state. A sequence of any length ``L`` is kept
(``models.serving.DecodePool.boundary_state``, what ``generate --save-state`` writes) as its
state at its last window boundary ``B`` (``window_boundary``) and the ``L - B < p`` tokens after
it as pending ids, which a restore feeds through decode steps. A per-step method's window is one
token. A sequence shorter than one window keeps the empty state (``n = 0``, ``logits [0]``).

Leaves are named per layer (``layers.3.state.checkpoint.residual.codes``) whatever the cache layout
(``config.scan_layers``), so a prefix taken in one layout restores in the other. The model's
``compute`` is recorded: it sets the attention caches' dtype and every matmul's rounding, so a
prefix restores only under the ``compute`` it was made with.

A file is a safetensors file: the arrays, and string metadata with a format version, the model's
fingerprint (``models.fingerprint``), the state method's ``repr``, the ``compute``, every array's
layout (name, dtype, shape) and a sha256 digest of all of it. ``load_prefix`` refuses a damaged
file and ``check_prefix`` one made for another model, method or ``compute`` (naming the fields
that differ), with ``PrefixStateError``, before anything is restored. dtypes safetensors cannot
store (``bfloat16``, the ``float8`` formats) travel as unsigned integers of the same width.
``checkpoint_every`` takes prefix states every ``N`` tokens of a long sequence (prefix caching).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from leapquant_jax.state import LeapQuantState
from models.base import finish_cache, layer_caches, take_rows
from models.decode import check_token_ids
from models.fingerprint import model_fingerprint

Array = jax.Array

FORMAT = "leapquant-prefix-state"
# Version 2 added the pending ids and the compute.
VERSION = "2"
# Metadata keys of a file, all covered by its digest (besides the digest itself).
META_KEYS = ("format", "version", "model_type", "fingerprint", "method", "compute", "layout")
# Arrays of a file besides the cache leaves (``CACHE_PREFIX`` + leaf name).
TOKEN_ARRAYS = ("ids", "pending", "logits")
CACHE_PREFIX = "cache."
# dtypes safetensors stores as they are; any other travels as an unsigned integer of its width.
NATIVE_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                           "float16", "float32", "float64"})
# Checkpoint spacing when none is given: 16 tokens, rounded up to a multiple of the method's window.
DEFAULT_EVERY = 16


class PrefixStateError(ValueError):
    """A prefix state that cannot be taken, read or restored: off a window boundary, a damaged
    file, or a file made for another model, state method or compute."""


def _no_ids() -> np.ndarray:
    return np.zeros((0,), np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class PrefixState:
    """One sequence's state after its prefix, and the tokens that follow it (module docstring).

    ids ``[n]`` int32, the prefix, the tokens the state has consumed (``n >= 0``);
    logits ``[vocab]`` float32, the next-token logits after them (``[0]`` when ``n = 0``);
    leaves: name -> array ``[1, ...]`` (batch of one; attention caches ``[1, n, ...]``);
    fingerprint, method, model_type, compute: the model, state method and ``config.compute``
    it belongs to; pending ``[m]`` int32, tokens after the prefix that are not in the state,
    fed through decode steps on restore (empty for a state taken where the sequence ends).
    ``n + m >= 1``.
    """

    ids: np.ndarray
    logits: np.ndarray
    leaves: Mapping[str, np.ndarray]
    fingerprint: str
    method: str
    model_type: str
    compute: str
    pending: np.ndarray = dataclasses.field(default_factory=_no_ids)

    @property
    def length(self) -> int:
        """Tokens the state has consumed (the prefix length ``n``), the pending ids not counted."""
        return int(self.ids.shape[0])

    @property
    def all_ids(self) -> np.ndarray:
        """``[n + m]`` int32: the prefix, then the pending ids; every token a sequence restored
        from this state has consumed once its pending ids are fed."""
        return np.concatenate([self.ids, self.pending]).astype(np.int32)

    @property
    def state_bytes(self) -> int:
        """Bytes of the cache leaves (recurrent states, convolution tails, attention rows)."""
        return sum(int(x.nbytes) for x in self.leaves.values())

    @property
    def nbytes(self) -> int:
        """Bytes held in all: the cache leaves, the ids, the pending ids and the logits."""
        return self.state_bytes + int(self.ids.nbytes) + int(self.pending.nbytes) + int(self.logits.nbytes)


def window_boundary(length: int, method) -> int:
    """The last window boundary at or before ``length`` tokens of a stream started at a boundary:
    ``length`` rounded down to a multiple of ``method.window`` (``length`` itself for a per-step
    method, whose window is one token)."""
    p = int(getattr(method, "window", 1))
    return int(length) // p * p


# ----------------------------------------------------------------------------- leaf names


def _key_name(key) -> str:
    for attr in ("key", "idx", "name"):  # DictKey / FlattenedIndexKey, SequenceKey, GetAttrKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _named(tree) -> dict[str, Any]:
    """Every leaf of ``tree`` by its dotted path name, in flattening order."""
    return {".".join(_key_name(k) for k in path): x for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _is_stream(x) -> bool:
    return isinstance(x, LeapQuantState)


def _saved_named(tree) -> dict[str, Any]:
    """The leaves a prefix keeps: all of them, but of a LeapQuant stream only its checkpoint
    (named as in the full tree: ``...state.checkpoint.*``)."""
    kept = jax.tree.map(lambda x: {"checkpoint": x.checkpoint} if _is_stream(x) else x, tree, is_leaf=_is_stream)
    return _named(kept)


def _per_layer(cache: Mapping[str, Any], config) -> dict:
    """``{"pos", "layers": per-layer caches}``, whatever the cache layout."""
    return {"pos": cache["pos"], "layers": tuple(layer_caches(cache, config))}


@functools.partial(jax.jit, static_argnames=("arch", "config", "method", "batch", "max_len"))
def empty_cache(arch, config, *, method, batch: int, max_len: int):
    """``arch.init_cache`` compiled: an eager init of a LeapQuant stream would run its checkpoint
    encoding op by op. Returns the empty cache of ``batch`` sequences of ``max_len`` positions."""
    return arch.init_cache(config, batch=batch, max_len=max_len, method=method)


@functools.lru_cache(maxsize=64)
def _layout(arch, config, method) -> tuple[dict, dict]:
    """``(shapes, length_axes)`` of a batch-1 prefix's kept leaves: name -> ``ShapeDtypeStruct``
    (at ``max_len`` 1), and name -> the axis that grows with ``max_len`` (attention caches).
    Cached (tracing a LeapQuant ``init_cache`` takes a tenth of a second): callers only read it."""
    def kept(max_len):
        return jax.eval_shape(
            lambda: _saved_named(_per_layer(arch.init_cache(config, batch=1, max_len=max_len, method=method),
                                            config)))

    one, two = kept(1), kept(2)
    axes = {}
    for name, x in one.items():
        diff = [a for a, (p, q) in enumerate(zip(x.shape, two[name].shape)) if p != q]
        if diff:
            axes[name] = diff[0]
    return one, axes


# ----------------------------------------------------------------------------- take / check / restore


def take_prefix(arch, params, config, cache, row: int, *, method, ids, logits, pending=()) -> PrefixState:
    """The prefix state of sequence ``row`` of ``cache`` (any batch, any layout), in host memory.

    ids: the ``n`` tokens the row has consumed (``n == cache["pos"][row]``, 0 for an empty row);
    logits ``[vocab]``: its next-token logits (``None`` when ``n = 0``: none follow no token);
    pending ``[m]``: tokens that follow, kept with the state for a restore to feed
    (``n + m >= 1``). Raises ``PrefixStateError`` when a LeapQuant stream of the row is off its
    window boundary (records held in the open window).
    """
    batch = cache["pos"].shape[0]
    if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or not 0 <= row < batch:
        raise ValueError(f"row must be an integer in [0, {batch}), got {row!r}")
    sub = jax.tree.map(np.asarray, _per_layer(take_rows(cache, jnp.asarray([row], jnp.int32)), config))
    n = int(sub["pos"][0])
    ids = check_token_ids(ids, config.vocab_size, name="ids").reshape(-1)
    if ids.shape[0] != n:
        raise ValueError(f"ids hold {ids.shape[0]} tokens but row {row} of the cache has consumed {n}")
    pending = check_token_ids(pending, config.vocab_size, name="pending").reshape(-1)
    if n + pending.shape[0] < 1:
        raise ValueError("a prefix state holds at least one token: the row has consumed none and no pending ids "
                         "were given")
    if n == 0:
        if logits is not None and np.size(logits):
            raise ValueError("an empty row (no token consumed) has no next-token logits; pass logits=None")
        logits = np.zeros((0,), np.float32)
    elif logits is None or np.size(logits) != config.vocab_size:
        raise ValueError(f"logits must be the row's next-token logits [{config.vocab_size}], got "
                         f"{None if logits is None else np.shape(logits)}")
    for path, x in jax.tree_util.tree_flatten_with_path(sub, is_leaf=_is_stream)[0]:
        if _is_stream(x) and int(x.pos[0]):
            where = ".".join(_key_name(k) for k in path)
            raise PrefixStateError(
                f"the state is not at a window boundary: {where} holds {int(x.pos[0])} records of its "
                f"{method.window}-record window after {n} tokens; a LeapQuant state is saved only at a window "
                f"boundary (a multiple of {method.window} tokens, where the window buffer is empty)")
    _, axes = _layout(arch, config, method)
    leaves = {}
    for name, x in _saved_named(sub).items():
        x = np.asarray(x)
        leaves[name] = np.take(x, np.arange(n), axis=axes[name]) if name in axes else x
    logits = np.asarray(logits, np.float32).reshape(-1)
    return PrefixState(ids=ids, logits=logits, leaves=leaves, fingerprint=model_fingerprint(config, params),
                       method=repr(method), model_type=str(config.model_type), compute=str(config.compute),
                       pending=pending)


def _repr_fields(text: str) -> Optional[dict]:
    # 'A(x=1, y=B(z=2))' -> {'': 'A', 'x': '1', 'y': 'B', 'y.z': '2'}; None when not such a repr.
    def walk(node, prefix):
        if isinstance(node, ast.Call):
            out = {prefix: ast.unparse(node.func)}
            for kw in node.keywords:
                out.update(walk(kw.value, f"{prefix}.{kw.arg}" if prefix else kw.arg))
            return out
        return {prefix: ast.unparse(node)}

    try:
        return walk(ast.parse(text, mode="eval").body, "")
    except SyntaxError:
        return None


def method_difference(saved: str, current: str, *, most: int = 6) -> str:
    """Where two state methods' reprs differ, on one short line: the fields that differ
    (``config.bits 4 in the file, 8 here``; at most ``most``, then how many more), or for methods
    of two kinds each kind with its top-level fields."""
    a, b = _repr_fields(saved), _repr_fields(current)
    if a is None or b is None:
        return f"{saved[:80]} in the file, {current[:80]} here"
    if a[""] != b[""]:
        def kind(f):  # the type and its top-level fields that are plain values
            nested = {k.split(".")[0] for k in f if "." in k}
            plain = [f"{k}={v}" for k, v in f.items() if k and "." not in k and k not in nested]
            return f[""] + "(" + ", ".join(plain) + ")"
        return f"{kind(a)} in the file, {kind(b)} here"
    names = [k for k in list(a) + [k for k in b if k not in a] if a.get(k) != b.get(k)]
    parts = [f"{k} {a.get(k, '(none)')} in the file, {b.get(k, '(none)')} here" for k in names[:most]]
    return "; ".join(parts) + (f"; and {len(names) - most} more" if len(names) > most else "")


def check_prefix(prefix: PrefixState, arch, params, config, *, method) -> None:
    """Raises ``PrefixStateError`` unless ``prefix`` belongs to this model (fingerprint), state
    method (``repr``) and ``config.compute``, its ids and pending ids are token ids of this
    vocabulary, and every leaf has the name, dtype and shape this model's cache needs."""
    if prefix.model_type != str(config.model_type):
        raise PrefixStateError(f"the prefix state is for a {prefix.model_type} model, not {config.model_type}")
    fingerprint = model_fingerprint(config, params)
    if prefix.fingerprint != fingerprint:
        raise PrefixStateError(f"the prefix state was saved from another model (fingerprint "
                               f"{prefix.fingerprint[:12]}..., this model's is {fingerprint[:12]}...)")
    if prefix.method != repr(method):
        raise PrefixStateError(f"the prefix state was saved with another state method: "
                               f"{method_difference(prefix.method, repr(method))}")
    if prefix.compute != config.compute:
        # Caught before the leaves: under the other compute the attention caches have another
        # dtype, and a restored state would continue with matmuls rounded unlike its own.
        raise PrefixStateError(f"the prefix state was made with compute={prefix.compute!r} and this model runs "
                               f"with compute={config.compute!r}; restore it under compute={prefix.compute!r}")
    n = prefix.length
    for name, ids in (("ids", prefix.ids), ("pending ids", prefix.pending)):
        if ids.dtype != np.int32 or ids.ndim != 1:
            raise PrefixStateError(f"the prefix {name} must be int32 [n], got {ids.dtype} {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= config.vocab_size):
            raise PrefixStateError(f"the prefix {name} fall outside the vocabulary [0, {config.vocab_size})")
    if n + prefix.pending.shape[0] < 1:
        raise PrefixStateError("the prefix state holds no token (no ids, no pending ids)")
    vocab = config.vocab_size if n else 0  # no logits follow an empty prefix
    if prefix.logits.dtype != np.float32 or prefix.logits.shape != (vocab,):
        raise PrefixStateError(f"the prefix logits must be float32 [{vocab}] after {n} ids, got "
                               f"{prefix.logits.dtype} {prefix.logits.shape}")
    shapes, axes = _layout(arch, config, method)
    problems = [f"missing leaf {name}" for name in shapes if name not in prefix.leaves]
    problems += [f"unexpected leaf {name}" for name in prefix.leaves if name not in shapes]
    for name, want in shapes.items():
        got = prefix.leaves.get(name)
        if got is None:
            continue
        shape = list(want.shape)
        if name in axes:
            shape[axes[name]] = n
        if got.dtype != np.dtype(want.dtype) or tuple(got.shape) != tuple(shape):
            problems.append(f"leaf {name} is {got.dtype} {tuple(got.shape)}, expected {np.dtype(want.dtype)} "
                            f"{tuple(shape)}")
    if not problems and int(prefix.leaves["pos"][0]) != n:
        problems.append(f"leaf pos says {int(prefix.leaves['pos'][0])} tokens but the prefix holds {n} ids")
    if problems:
        raise PrefixStateError("the prefix state does not fit this model's cache: " + "; ".join(problems))


def restore_cache(arch, params, config, prefix: PrefixState, *, method, max_len: int):
    """A batch-1 cache of ``max_len`` positions (in ``config``'s layout) holding ``prefix``'s
    state, after its ``ids``: attention caches zero-padded past the prefix, LeapQuant streams
    with an empty window. Its pending ids are the caller's to feed (``decode_tokens``;
    ``models.serving.DecodePool.restore`` does), so ``max_len`` must hold them too.
    ``check_prefix`` runs first: nothing is built for a prefix of another model or method."""
    check_prefix(prefix, arch, params, config, method=method)
    m = prefix.pending.shape[0]
    if prefix.length + m > max_len:
        raise ValueError(f"the prefix holds {prefix.length} tokens and {m} pending ids, more than "
                         f"max_len = {max_len}")
    empty = jax.eval_shape(lambda: _per_layer(arch.init_cache(config, batch=1, max_len=max_len, method=method),
                                              config))
    _, axes = _layout(arch, config, method)
    paths, treedef = jax.tree_util.tree_flatten_with_path(empty)
    leaves = []
    for path, want in paths:
        name = ".".join(_key_name(k) for k in path)
        # Leaves not kept are a LeapQuant stream's window buffer and record count: an empty
        # window (``empty_buffer``) and 0 records, both all zeros.
        x = np.zeros(want.shape, want.dtype)
        if name in prefix.leaves:
            got = prefix.leaves[name]
            if name in axes:
                index = [slice(None)] * x.ndim
                index[axes[name]] = slice(0, prefix.length)
                x[tuple(index)] = got
            else:
                x = got
        leaves.append(jnp.asarray(x))
    tree = jax.tree_util.tree_unflatten(treedef, leaves)
    return dict(finish_cache(config, tree["layers"], batch=1), pos=tree["pos"])


# ----------------------------------------------------------------------------- files


def _digest(meta: Mapping[str, str], stored: Mapping[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for key in META_KEYS:
        h.update(f"{key}={meta[key]}\n".encode())
    for name in sorted(stored):
        x = np.ascontiguousarray(stored[name])
        h.update(f"{name} {x.dtype} {x.shape}\n".encode())
        h.update(x.tobytes())
    return h.hexdigest()


def _stored(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    if x.dtype.name in NATIVE_DTYPES:
        return x
    return x.view(np.dtype(f"uint{8 * x.dtype.itemsize}"))


def save_prefix(path, prefix: PrefixState, *, overwrite: bool = False) -> Path:
    """Writes ``prefix`` to the safetensors file ``path`` (module docstring) through a temporary
    file in the same folder renamed into place, so no half-written file is ever left. Refuses an
    existing ``path`` (``FileExistsError``) unless ``overwrite``."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; give a file name for the prefix state")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; not overwriting it")
    arrays = {"ids": prefix.ids, "pending": prefix.pending, "logits": prefix.logits}
    arrays.update({CACHE_PREFIX + name: x for name, x in prefix.leaves.items()})
    layout = [[name, np.asarray(x).dtype.name, list(np.shape(x))] for name, x in arrays.items()]
    stored = {name: _stored(np.asarray(x)) for name, x in arrays.items()}
    meta = {"format": FORMAT, "version": VERSION, "model_type": prefix.model_type, "fingerprint": prefix.fingerprint,
            "method": prefix.method, "compute": prefix.compute, "layout": json.dumps(layout)}
    meta["sha256"] = _digest(meta, stored)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(stored, tmp, metadata=meta)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_prefix(path) -> PrefixState:
    """Reads a ``save_prefix`` file. Raises ``PrefixStateError`` for a file that is not one, of
    another format version, or damaged (truncated, its metadata or arrays changed: the digest);
    ``FileNotFoundError`` when there is none. Whether it fits a model is ``check_prefix``'s job."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such prefix-state file")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = dict(f.metadata() or {})
            stored = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:  # safetensors raises its own SafetensorsError (not an OSError) for bad bytes
        raise PrefixStateError(f"{path} is not a readable prefix-state file ({err})") from None
    if meta.get("format") != FORMAT:
        raise PrefixStateError(f"{path} is not a {FORMAT} file (format {meta.get('format')!r})")
    if meta.get("version") != VERSION:
        raise PrefixStateError(f"{path} is a {FORMAT} file of version {meta.get('version')!r}; "
                               f"this reader takes version {VERSION}")
    missing = [k for k in META_KEYS + ("sha256",) if k not in meta]
    if missing:
        raise PrefixStateError(f"{path}: metadata lacks {', '.join(missing)}")
    if _digest(meta, stored) != meta["sha256"]:
        raise PrefixStateError(f"{path} is damaged: its contents do not match their sha256 digest")
    try:
        layout = {name: (dtype, tuple(shape)) for name, dtype, shape in json.loads(meta["layout"])}
    except (ValueError, TypeError) as err:
        raise PrefixStateError(f"{path}: unreadable layout metadata ({err})") from None
    if set(layout) != set(stored) or not set(TOKEN_ARRAYS) <= set(layout):
        raise PrefixStateError(f"{path}: the arrays ({sorted(stored)}) do not match the layout ({sorted(layout)})")
    arrays = {}
    for name, (dtype, shape) in layout.items():
        x = stored[name]
        try:
            want = np.dtype(jnp.dtype(dtype))
        except TypeError as err:
            raise PrefixStateError(f"{path}: array {name} has an unknown dtype {dtype!r} ({err})") from None
        if x.dtype.itemsize != want.itemsize or x.shape != shape:
            raise PrefixStateError(f"{path}: array {name} is stored as {x.dtype} {x.shape}, its layout says "
                                   f"{dtype} {shape}")
        arrays[name] = x.view(want)
    return PrefixState(ids=arrays["ids"], logits=arrays["logits"],
                       leaves={n[len(CACHE_PREFIX):]: x for n, x in arrays.items() if n.startswith(CACHE_PREFIX)},
                       fingerprint=meta["fingerprint"], method=meta["method"], model_type=meta["model_type"],
                       compute=meta["compute"], pending=arrays["pending"])


# ----------------------------------------------------------------------------- prefix caching


@functools.partial(jax.jit, static_argnames=("arch", "config", "method"))
def _decode_tokens(arch, params, config, cache, ids, *, method):
    def body(cache, tok):
        logits, cache, _ = arch.forward(params, config, tok[:, None], cache, method=method, mode="decode")
        return cache, logits[:, 0]

    cache, logits = jax.lax.scan(body, cache, jnp.moveaxis(ids, 1, 0))
    return jnp.moveaxis(logits, 0, 1), cache


def decode_tokens(arch, params, config, cache, ids, *, method) -> tuple[Array, Any]:
    """Teacher-forces ``ids [B, T]`` int32 through the decode step from ``cache`` (one compiled
    ``lax.scan``). Returns ``(logits [B, T, vocab] float32, cache)``; ``logits[b, t]`` follows
    ``ids[b, t]``."""
    return _decode_tokens(arch, params, config, cache, jnp.asarray(ids, jnp.int32), method=method)


@dataclasses.dataclass(frozen=True, eq=False)
class PrefixCheckpoints:
    """``checkpoint_every``'s result: ``states[i]``, the prefix state after ``positions[i]`` tokens."""

    states: tuple
    positions: tuple

    @property
    def nbytes(self) -> tuple:
        """Bytes each checkpoint holds (``PrefixState.nbytes``)."""
        return tuple(s.nbytes for s in self.states)

    @property
    def total_bytes(self) -> int:
        """Bytes all checkpoints hold together."""
        return sum(self.nbytes)


def checkpoint_every(arch, params, config, ids, *, method, every: Optional[int] = None) -> PrefixCheckpoints:
    """Teacher-forces one sequence ``ids [T]`` through the decode step and keeps its prefix state
    every ``every`` tokens (a multiple of the method's window ``p``; default 16 rounded up to one),
    in host memory: after ``every``, ``2 * every``, ... tokens (a trailing part shorter than
    ``every`` gets none)."""
    ids = check_token_ids(ids, config.vocab_size, name="ids").reshape(-1)
    p = int(getattr(method, "window", 1))
    if every is None:
        every = -(-DEFAULT_EVERY // p) * p
    if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1 or every % p:
        raise ValueError(f"every must be a positive multiple of the method's window p = {p}, got {every!r}")
    if ids.shape[0] < every:
        raise ValueError(f"ids hold {ids.shape[0]} tokens, fewer than every = {every}: no checkpoint")
    cache = empty_cache(arch, config, method=method, batch=1, max_len=int(ids.shape[0]))
    states, positions = [], []
    for end in range(every, ids.shape[0] + 1, every):
        logits, cache = decode_tokens(arch, params, config, cache, ids[None, end - every:end], method=method)
        states.append(take_prefix(arch, params, config, cache, 0, method=method, ids=ids[:end],
                                  logits=logits[0, -1]))
        positions.append(end)
    return PrefixCheckpoints(states=tuple(states), positions=tuple(positions))


__all__ = [
    "FORMAT",
    "PrefixCheckpoints",
    "PrefixState",
    "PrefixStateError",
    "VERSION",
    "check_prefix",
    "checkpoint_every",
    "decode_tokens",
    "empty_cache",
    "load_prefix",
    "restore_cache",
    "save_prefix",
    "take_prefix",
    "window_boundary",
]
