"""Prefill, the compiled decode loop, and teacher-forced scoring through the decode path.

Prompts of different lengths share a batch **right-padded**: row ``b`` holds its prompt at
positions ``0 .. len_b - 1``, prefill computes its state over exactly those tokens, and from
then on each row decodes at its own position (``cache["pos"]``), so RoPE positions, KV-cache
slots and the recurrent state never see padding.

``generate`` is one ``jit``-compiled function: prefill, then a ``lax.while_loop`` over the new
tokens (no Python per token) that stops when every row has produced a stop token or the token
budget is spent. Finished rows are passed ``active=False`` and keep their cache.
``score`` runs every token through the decode step (``lax.scan``), optionally after a
prefill of a first segment, and returns the logits of every position.

The state format is a parameter (``method``, from ``leapquant_jax.make_method``), not part
of the model.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import leapquant_jax
from leapquant_jax.quantizers import tree_bytes
from leapquant_jax.traces import Trace, save_trace
from models.fingerprint import check_state_method
from models.layers import Sampling, sample_next
from models.sharding import (check_mesh, constrain_cache, place, replicated, shard_batch, shard_method, shard_params,
                             to_host)

Array = jax.Array
# Prompt lengths are rounded up to a multiple of this, so prompts of nearby lengths share one
# compiled program.
PROMPT_BUCKET = 16


def make_state_method(name: str, **options):
    """A state method by its docs/design.md §5 name (``fp32``, ``bf16``, ..., ``leapquant``);
    ``None``-valued options keep the method's defaults."""
    return leapquant_jax.make_method(name, **{k: v for k, v in options.items() if v is not None})


def check_token_ids(ids, vocab_size: int, *, name: str = "ids") -> np.ndarray:
    """Checks token ids against ``[0, vocab_size)`` and returns them as an int32 array.

    ids: a sequence of Python/NumPy integers, or an integer array of any shape. Raises
    ``ValueError`` naming ``name`` and the first offending entry (a float, a bool, an id
    outside the vocabulary, however large).
    """
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"{name} must hold integer token ids, got the string {ids!r}")
    if hasattr(ids, "dtype"):
        arr = np.asarray(ids)
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
        bad = np.argwhere((arr < 0) | (arr >= vocab_size))
        if bad.size:
            where = tuple(int(i) for i in bad[0])
            index = f"[{', '.join(map(str, where))}]" if where else ""
            raise ValueError(f"{name}{index} = {arr[where]} is outside the vocabulary [0, {vocab_size})")
        return arr.astype(np.int32)
    values = list(ids)
    for i, t in enumerate(values):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"{name}[{i}] = {t!r} is not an integer token id")
        if not 0 <= int(t) < vocab_size:
            raise ValueError(f"{name}[{i}] = {int(t)} is outside the vocabulary [0, {vocab_size})")
    return np.asarray([int(t) for t in values], np.int32)


def pad_prompts(prompts: Sequence[Sequence[int]], *, bucket: int = PROMPT_BUCKET) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads prompts into ``ids [B, T]`` int32 (``T`` a multiple of ``bucket``) and
    ``lengths [B]`` int32. Every prompt needs at least one token."""
    if not prompts:
        raise ValueError("no prompts given")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min() < 1:
        raise ValueError("every prompt needs at least one token")
    t = int(-(-lengths.max() // bucket) * bucket)
    ids = np.zeros((len(prompts), t), np.int32)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = np.asarray(p, np.int32)
    return ids, lengths


def _is_stop(tokens: Array, stop_ids: Array) -> Array:
    return jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1)


def _write_step(buffers: dict, step_traces: dict, i: Array) -> dict:
    # step traces are [B, 1, ...]; buffers [B, N, ...]
    return jax.tree.map(
        lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), i, axis=1), buffers, step_traces
    )


@functools.partial(
    jax.jit, static_argnames=("arch", "config", "method", "sampling", "max_new_tokens", "record", "mesh")
)
def _generate(arch, params, config, ids, lengths, stop_ids, key, *, method, sampling, max_new_tokens, record, mesh):
    bsz, t = ids.shape
    cache = constrain_cache(arch.init_cache(config, batch=bsz, max_len=t + max_new_tokens, method=method), mesh)
    logits, cache, prefill_traces = arch.forward(params, config, ids, cache, method=method, mode="prefill",
                                                 lengths=lengths, record=record)
    cache = constrain_cache(cache, mesh)
    last_logits = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    key, sub = jax.random.split(key)
    first = sample_next(last_logits, sub, sampling)
    tokens = jnp.zeros((bsz, max_new_tokens), jnp.int32).at[:, 0].set(first)
    done = _is_stop(first, stop_ids)
    count = jnp.ones((bsz,), jnp.int32)
    buffers = jax.tree.map(
        lambda x: jnp.zeros((bsz, max(max_new_tokens - 1, 1)) + x.shape[2:], jnp.float32), prefill_traces
    )

    def cond(carry):
        i, _, done, *_ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, tokens, done, count, last, cache, key, buffers = carry
        active = ~done
        logits, cache, step_traces = arch.forward(params, config, last[:, None], cache, method=method,
                                                  mode="decode", active=active, record=record)
        cache = constrain_cache(cache, mesh)
        key, sub = jax.random.split(key)
        nxt = jnp.where(active, sample_next(logits[:, 0], sub, sampling), 0)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, nxt[:, None], i, axis=1)
        count = count + active.astype(jnp.int32)
        done = done | _is_stop(nxt, stop_ids)
        buffers = _write_step(buffers, step_traces, i - 1) if record else buffers
        return i + 1, tokens, done, count, jnp.where(active, nxt, last), cache, key, buffers

    carry = (jnp.int32(1), tokens, done, count, first, cache, key, buffers)
    _, tokens, _, count, _, _, _, buffers = jax.lax.while_loop(cond, body, carry)
    return tokens, count, prefill_traces, buffers


@dataclasses.dataclass(frozen=True)
class Generation:
    """Result of ``generate``: ``tokens[b]`` the new ids of row ``b`` (including a final stop
    token), and when recorded ``traces[layer][b]``, that layer's recurrence inputs for every
    token that went through it (the prompt, then each fed-back generated token)."""

    tokens: list
    prompt_lengths: list
    traces: Optional[dict] = None


def _generate_inputs(config, prompts, stop_ids, seed):
    # What ``generate`` hands the compiled program, checked: (prompts, ids, lengths, stop, key).
    prompts = [check_token_ids(p, config.vocab_size, name=f"prompts[{b}]") for b, p in enumerate(prompts)]
    stop_ids = check_token_ids(stop_ids, config.vocab_size, name="stop_ids")
    ids, lengths = pad_prompts(prompts)
    stop = jnp.asarray(stop_ids.tolist() or [-1], jnp.int32)
    return prompts, jnp.asarray(ids), jnp.asarray(lengths), stop, jax.random.PRNGKey(seed)


def generate(arch, params, config, prompts: Sequence[Sequence[int]], *, method, max_new_tokens: int,
             sampling: Sampling = Sampling(), stop_ids: Sequence[int] = (), seed: int = 0,
             record: bool = False, mesh=None) -> Generation:
    """Generates up to ``max_new_tokens`` tokens for each prompt (a batch of any lengths).
    ``mesh`` (``models.sharding.make_mesh``): decode across its devices, the prompts split over
    its data axis and heads over its model axis."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(sampling, Sampling) or not math.isfinite(sampling.temperature):
        raise ValueError(f"sampling must be a Sampling with a finite temperature, got {sampling!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not -2**63 <= seed < 2**63:
        raise ValueError(f"seed must be an integer in [-2**63, 2**63), got {seed!r}")
    if isinstance(prompts, (str, bytes)) or not len(prompts):
        raise ValueError(f"prompts must be a non-empty list of token-id lists, got {prompts!r}")
    prompts, ids, lengths, stop, key = _generate_inputs(config, prompts, stop_ids, seed)
    check_state_method(method, arch, config, params)
    if mesh is not None:
        check_mesh(config, mesh.shape["data"], mesh.shape["model"])
        method = shard_method(method, mesh)
        params = shard_params(params, mesh, arch=arch, config=config)
        ids, lengths = shard_batch(ids, mesh, name="prompts"), shard_batch(lengths, mesh, name="prompts")
        stop, key = place(stop, replicated(mesh)), place(key, replicated(mesh))
    tokens, count, pre, dec = _generate(
        arch, params, config, ids, lengths, stop, key,
        method=method, sampling=sampling, max_new_tokens=max_new_tokens, record=record, mesh=mesh,
    )
    tokens, count, pre, dec, lengths = to_host((tokens, count, pre, dec, lengths))
    out = [tokens[b, : count[b]].tolist() for b in range(len(prompts))]
    traces = None
    if record:
        traces = {}
        for layer in pre:
            rows = []
            for b in range(len(prompts)):
                n_fed = count[b] - 1  # the last generated token is never fed back
                rows.append({name: np.concatenate([np.asarray(pre[layer][name][b, : lengths[b]]),
                                                   np.asarray(dec[layer][name][b, :n_fed])])
                             for name in pre[layer]})
            traces[layer] = rows
    return Generation(tokens=out, prompt_lengths=lengths.tolist(), traces=traces)


def generation_program_bytes(arch, params, config, prompts: Sequence[Sequence[int]], *, method,
                             max_new_tokens: int, sampling: Sampling = Sampling(), stop_ids: Sequence[int] = (),
                             seed: int = 0, record: bool = False) -> int:
    """Bytes the compiled program of ``generate`` (same arguments, one device) allocates beyond
    its arguments: XLA's own count of its temporaries (the cache, attention over all of it) and
    its outputs. Compiling allocates none of them, and ``generate`` then reuses the program."""
    _, ids, lengths, stop, key = _generate_inputs(config, prompts, stop_ids, seed)
    compiled = _generate.lower(arch, params, config, ids, lengths, stop, key, method=method, sampling=sampling,
                               max_new_tokens=max_new_tokens, record=record, mesh=None).compile()
    stats = compiled.memory_analysis()
    return int(stats.temp_size_in_bytes + stats.output_size_in_bytes)


@dataclasses.dataclass(frozen=True)
class GenerationMemory:
    """Bytes a generation holds beyond the weights, at least: ``fixed + per_token * max_new_tokens``.
    ``fixed``: the caches' positions of the prompt and the recurrent states, (recorded) the prompt's
    traces; ``per_token``: per new token, the caches' positions, the token and (recorded) its traces."""

    fixed: int
    per_token: int

    def bytes(self, max_new_tokens: int) -> int:
        return self.fixed + self.per_token * int(max_new_tokens)


def generation_memory(arch, params, config, *, batch: int, prompt_len: int, method, record: bool = False
                      ) -> GenerationMemory:
    """What ``generate`` (or a one-slot ``models.serving`` pool) of ``batch`` prompts of at most
    ``prompt_len`` tokens holds, measured on shapes (``jax.eval_shape``: nothing is allocated): the
    cache of ``prompt_len`` rounded up to ``PROMPT_BUCKET`` plus the new tokens' positions, the
    new tokens ``[B, N]`` int32 and, with ``record``, every token's traces."""
    t = -(-int(prompt_len) // PROMPT_BUCKET) * PROMPT_BUCKET

    def cache(max_len):
        return jax.eval_shape(lambda: arch.init_cache(config, batch=batch, max_len=max_len, method=method))

    per_position = tree_bytes(cache(t + 2)) - tree_bytes(cache(t + 1))
    fixed = tree_bytes(cache(t))
    per_token = per_position + 4 * batch
    if record:
        ids = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
        _, _, traces = jax.eval_shape(
            lambda p, c, i: arch.forward(p, config, i, c, method=method, mode="decode", record=True),
            params, cache(t + 1), ids)
        per_trace = tree_bytes(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), traces))
        fixed += per_trace * (t - 1)   # the prompt's traces, then one per fed-back token
        per_token += per_trace
    return GenerationMemory(fixed=fixed, per_token=per_token)


def available_memory(device=None) -> tuple[int, str]:
    """``(bytes, what they are)`` that a computation on ``device`` (default: JAX's first) can
    still allocate: ``bytes_limit - bytes_in_use`` of JAX's ``memory_stats`` where the device
    reports them (GPUs), else the host's physical memory (the CPU backend allocates there)."""
    device = jax.devices()[0] if device is None else device
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        return free, f"free on {device.device_kind} (JAX's memory_stats)"
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "of the host's physical memory"


@functools.partial(jax.jit, static_argnames=("arch", "config", "method", "prefill_len", "record", "mesh"))
def _score(arch, params, config, ids, *, method, prefill_len, record, mesh):
    bsz, t = ids.shape
    cache = constrain_cache(arch.init_cache(config, batch=bsz, max_len=t, method=method), mesh)
    head_logits, head_traces = [], []
    if prefill_len:
        logits, cache, traces = arch.forward(params, config, ids[:, :prefill_len], cache, method=method,
                                             mode="prefill", record=record)
        cache = constrain_cache(cache, mesh)
        head_logits.append(logits)
        head_traces.append(traces)

    def body(cache, tok):
        logits, cache, traces = arch.forward(params, config, tok[:, None], cache, method=method, mode="decode",
                                             record=record)
        return constrain_cache(cache, mesh), (logits[:, 0], jax.tree.map(lambda x: x[:, 0], traces))

    _, (logits, traces) = jax.lax.scan(body, cache, jnp.moveaxis(ids[:, prefill_len:], 1, 0))
    logits = jnp.concatenate(head_logits + [jnp.moveaxis(logits, 0, 1)], axis=1)
    traces = jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), traces)
    if head_traces:
        traces = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), head_traces[0], traces)
    return logits, traces


def score(arch, params, config, ids, *, method, prefill_len: int = 0, record: bool = False, mesh=None):
    """Teacher-forced logits ``[B, T, vocab]`` float32 through the decode path:
    ``logits[b, t]`` predicts ``ids[b, t + 1]`` from ``ids[b, :t + 1]`` (like a transformers
    forward). The first ``prefill_len`` tokens go through prefill, the rest one decode step
    each. Returns ``(logits, traces)``; traces ``{layer: {name: [B, T, ...]}}`` when recorded.
    ``mesh`` as in ``generate``."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"ids must be an integer array [B, T], got {ids.dtype} {ids.shape}")
    if ids.size == 0:
        raise ValueError(f"ids must hold at least one token in each of at least one row, got shape {ids.shape}")
    ids = check_token_ids(ids, config.vocab_size, name="ids")
    if isinstance(prefill_len, bool) or not isinstance(prefill_len, (int, np.integer)) or not 0 <= prefill_len < ids.shape[1]:
        raise ValueError(f"prefill_len must be an integer in [0, T) = [0, {ids.shape[1]}), got {prefill_len!r}")
    check_state_method(method, arch, config, params)
    ids = jnp.asarray(ids, jnp.int32)
    if mesh is not None:
        check_mesh(config, mesh.shape["data"], mesh.shape["model"])
        method = shard_method(method, mesh)
        params, ids = shard_params(params, mesh, arch=arch, config=config), shard_batch(ids, mesh)
    logits, traces = _score(arch, params, config, ids, method=method, prefill_len=prefill_len, record=record,
                            mesh=mesh)
    return to_host((logits, traces))


def write_traces(out_dir, traces: dict) -> list[Path]:
    """Writes ``traces[layer]`` (a list of per-row dicts, or a dict of ``[B, T, ...]`` arrays)
    as docs/design.md §5 trace files: ``layer{NN}.npz``, or ``layer{NN}_b{b}.npz`` for batches."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for layer, rows in sorted(traces.items()):
        if isinstance(rows, dict):
            rows = [{n: x[b] for n, x in rows.items()} for b in range(next(iter(rows.values())).shape[0])]
        for b, row in enumerate(rows):
            path = out_dir / (f"layer{layer:02d}.npz" if len(rows) == 1 else f"layer{layer:02d}_b{b}.npz")
            save_trace(path, Trace(**{n: np.asarray(row[n], np.float32) for n in ("q", "k", "v", "beta", "g")}))
            written.append(path)
    return written


def to_device(params) -> Any:
    """Moves a numpy params pytree onto the default device (dtypes kept)."""
    return jax.tree.map(jnp.asarray, params)


__all__ = [
    "Generation",
    "GenerationMemory",
    "available_memory",
    "generation_memory",
    "generation_program_bytes",
    "PROMPT_BUCKET",
    "check_token_ids",
    "generate",
    "make_state_method",
    "pad_prompts",
    "score",
    "to_device",
    "write_traces",
]
