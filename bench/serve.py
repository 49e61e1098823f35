"""Serving benchmark: generation throughput of a whole model with each state format, static batches,
a fixed memory budget and continuous batching.

    python -m bench.serve [--models qwen3.5-4b qwen3.5-9b] [--batches 32 128 256 512]
                          [--states fp32 bf16 fp32-w lq8 lq6 lq4] [--prompt 128] [--generate 1024]
                          [--steps N] [--fit [plain|prefix|both]] [--budget GB] [--prefix-every 1024]
                          [--pool] [--pool-states fp32 fp32-w lq8] [--pool-slots 256] [--pool-requests 512]
                          [--mesh DATA MODEL [--coordinator HOST:PORT --num-processes N --process-id I]]
                          [--json] [--out bench/results]

Models are ``bench.decode``'s (random bf16 weights in a released checkpoint's shape, our decoder,
``--compute fast``, the layers unrolled; ``tiny`` runs anywhere in seconds). All states run in one
process, one model at a time.

Static batches (``--batches``): each of ``batch`` requests has ``--prompt`` random tokens, prefilled
through the chunked form in groups of ``--prefill-rows`` sequences (the last group overlaps the one
before it when the batch does not divide: those rows are prefilled twice, into the same values),
then ``--generate`` greedy decode steps, each one new token per sequence fed back (the first fed
token is the prefill's), in compiled ``lax.scan`` chunks of ``--chunk`` steps. The cache holds
``prompt + generate`` positions and the attention reads all of them every step, so a step's time
does not depend on its position: ``--steps`` runs and times the first ``N`` decode steps only
(default all), for shorter runs of the same configuration. Per row: prefill seconds on their own,
generation tokens/s (over every step run, the first chunk included) and ms per step (median chunk),
compile seconds, and ``bench.decode``'s bytes roofline of one step (weights read, the state read
and written or a window's share, the KV cache read) at the copy bandwidth measured in the same run.

Fixed budget (``--fit plain``, ``prefix`` or ``both``, the default): the memory left for
sequences, ``--budget`` GB (default: the device's memory less the weights and ``--headroom`` GB for
activations and XLA's buffers), over each state's bytes per sequence (recurrent state + KV cache at
``prompt + generate`` tokens, measured on the cache pytrees) gives the largest batch, measured as a
row. With prefix caching (``prefix``), each sequence also keeps one state checkpoint per
``--prefix-every`` cached tokens (LeapQuant and fp32-w: the window checkpoint; per-step states: the
whole state), held on the device during the run.

Continuous batching (``--pool``): ``--pool-requests`` requests from a seeded generator, prompts of
``--pool-prompt`` and generations of ``--pool-generate`` tokens (uniform, inclusive), through
``models.serving.DecodePool`` (``serve_requests``: slots refilled as requests finish, prompts
prefilled one by one in one bucket), at ``--pool-slots`` slots and, with ``--fit``, at each state's
largest slot count under the budget (per slot: state + KV at the longest prompt and generation).
Reported: generated tokens/s over the wall time, and per-request latency (queued at the start) and
time to first token, p50 and p99.

Over several devices (``--mesh DATA MODEL``, static batches only): the weights in
``bench.decode``'s tensor-parallel layout and the caches placed by ``models.sharding``, the
recurrence per shard; the roofline counts every device's bandwidth. With ``--coordinator``, one
process per host joins a global mesh (``models.distributed``); process 0 prints and writes.

``--json`` prints the result as one JSON object; ``--out DIR`` writes ``serve-<date>.json`` and
``.md`` there.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.decode import (MODELS, STATES, build_method, check_mesh_args, copy_bandwidth, model_config, random_params,
                          step_bytes, stream_bytes, weight_bytes_read)
from leapquant_jax.quantizers import tree_bytes
from models.base import put_rows
from models.distributed import add_mesh_options, check_distributed_args, is_primary, start
from models.sharding import constrain_cache, make_mesh, place, to_host
from models.layers import COMPUTE_MODES, FAST
from models.prefix_state import empty_cache

# The issue's serving setup (STEPQuant's appendix F.5): 128 prompt and 1,024 generated tokens.
PROMPT, GENERATE = 128, 1024
POOL_PROMPT, POOL_GENERATE = (64, 512), (256, 2048)
# Activations and XLA's buffers beside the weights and the sequences (the step's logits are
# [batch, vocab] fp32: 2 GB at batch 2,048 of a 248K vocabulary; a prefill group's are
# [rows, prompt, vocab]).
HEADROOM_GB = 10.0


# ----------------------------------------------------------------------------- memory


def sequence_bytes(per_stream: dict, prefix_every: int | None, context: int) -> int:
    """Bytes one sequence holds: its recurrent state and KV cache (``bench.decode.stream_bytes``), and
    with ``prefix_every`` one checkpoint per ``prefix_every`` of its ``context`` tokens."""
    extra = 0 if not prefix_every else (context // prefix_every) * per_stream["checkpoint"]
    return per_stream["state"] + per_stream["kv"] + extra


def device_budget(weights: int, headroom_gb: float) -> float | None:
    """Bytes left for sequences on the first device: its memory less ``weights`` and the headroom;
    ``None`` when the device reports no memory size."""
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return None if limit is None else float(limit) - weights - headroom_gb * 1e9


# ----------------------------------------------------------------------------- programs


@functools.lru_cache(maxsize=None)
def prefill_program(arch, config, method, rows: int, max_len: int, mesh=None):
    """``(params, cache, ids [rows, T], start []) -> (cache, first tokens [rows])``: prefills ``rows``
    sequences through the chunked form and writes them into rows ``start ..`` of the cache
    (donated); the first token is the argmax after each prompt. On ``mesh`` the cache keeps
    ``models.sharding.cache_specs``'s layout."""

    @functools.partial(jax.jit, donate_argnums=(1,))
    def run(params, cache, ids, start):
        sub = arch.init_cache(config, batch=rows, max_len=max_len, method=method)
        logits, sub, _ = arch.forward(params, config, ids, sub, method=method, mode="prefill")
        first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        return constrain_cache(put_rows(cache, start + jnp.arange(rows), sub), mesh), first

    return run


@functools.lru_cache(maxsize=None)
def generate_program(arch, config, method, steps: int, mesh=None):
    """``(params, cache, tokens [B]) -> (cache, tokens [B], finite [])``: ``steps`` greedy decode
    steps in one ``lax.scan`` (cache donated); ``finite`` says every step's logits were finite. On
    ``mesh`` the cache keeps ``models.sharding.cache_specs``'s layout after every step."""

    @functools.partial(jax.jit, donate_argnums=(1,))
    def run(params, cache, tokens):
        def body(carry, _):
            cache, tok, ok = carry
            logits, cache, _ = arch.forward(params, config, tok[:, None], cache, method=method, mode="decode")
            nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
            return (constrain_cache(cache, mesh), nxt, ok & jnp.all(jnp.isfinite(logits))), None

        (cache, tokens, ok), _ = jax.lax.scan(body, (cache, tokens, jnp.bool_(True)), None, length=steps)
        return cache, tokens, ok

    return run


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return out, time.perf_counter() - t0


def measure_batch(arch, config, params, method, *, batch: int, prompt: int, generate: int, chunk: int,
                  prefill_rows: int, steps: int | None = None, hold_bytes: int = 0, seed: int = 0,
                  mesh=None) -> dict:
    """One static batch (module docstring): prefill and generation times, compile seconds, and
    whether every logit was finite. ``steps`` of the ``generate`` decode steps run (default all);
    ``hold_bytes`` are held on the device throughout (prefix states); on ``mesh`` (``params``
    placed there, ``method`` per shard) the batch is split over its data axis."""
    steps = generate if steps is None else steps
    max_len = prompt + generate
    rows = min(prefill_rows, batch)
    held = jnp.zeros((hold_bytes // 4,), jnp.float32) if hold_bytes else None
    host_ids = np.asarray(jax.random.randint(jax.random.PRNGKey(seed), (batch, prompt), 0, config.vocab_size,
                                             jnp.int32))
    if mesh is None:
        ids, cache = jnp.asarray(host_ids), empty_cache(arch, config, method=method, batch=batch, max_len=max_len)
        put = jnp.asarray
    else:
        from jax.sharding import NamedSharding, PartitionSpec

        put = lambda x, *spec: place(x, NamedSharding(mesh, PartitionSpec(*spec)))  # noqa: E731
        ids = put(host_ids, "data")
        cache = jax.jit(lambda: constrain_cache(arch.init_cache(config, batch=batch, max_len=max_len, method=method),
                                                mesh))()
    t0 = time.perf_counter()
    prefill = prefill_program(arch, config, method, rows, max_len, mesh).lower(
        params, cache, put(host_ids[:rows]), put(np.int32(0))).compile()
    gen = generate_program(arch, config, method, chunk, mesh).lower(params, cache, ids[:, 0]).compile()
    compile_s = time.perf_counter() - t0
    starts = sorted({min(s, batch - rows) for s in range(0, batch, rows)})
    firsts, prefill_s = [], 0.0
    for s in starts:
        (cache, first), dt = _timed(prefill, params, cache, put(host_ids[s:s + rows]), put(np.int32(s)))
        firsts.append((s, to_host(first)))
        prefill_s += dt
    first_tokens = np.zeros((batch,), np.int32)
    for s, first in firsts:
        first_tokens[s:s + rows] = first
    tokens = put(first_tokens) if mesh is None else put(first_tokens, "data")
    chunks, finite = [], True
    for _ in range(steps // chunk):
        (cache, tokens, ok), dt = _timed(gen, params, cache, tokens)
        chunks.append(dt)
        finite = finite and bool(to_host(ok))
    tokens = to_host(tokens)
    tokens_ok = bool(np.all((tokens >= 0) & (tokens < config.vocab_size)))
    del cache, held
    gen_s = sum(chunks)
    return {"prefill_s": prefill_s, "prefill_groups": len(starts), "generate_s": gen_s, "steps": steps,
            "tokens_per_s": batch * steps / gen_s, "ms_per_step": 1e3 * statistics.median(chunks) / chunk,
            "compile_s": compile_s, "finite": finite and tokens_ok}


# ----------------------------------------------------------------------------- continuous batching


def pool_requests(n: int, prompt: tuple, generate: tuple, vocab: int, seed: int) -> tuple[list, list]:
    """``n`` requests: prompts of uniform length in ``prompt`` (inclusive) of uniform random ids, and
    generation budgets uniform in ``generate``."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(prompt[0], prompt[1] + 1, n)
    budgets = rng.integers(generate[0], generate[1] + 1, n)
    return [rng.integers(0, vocab, int(t)).tolist() for t in lengths], [int(b) for b in budgets]


def percentile(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, np.float64), q))


def measure_pool(arch, config, params, method, *, slots: int, prompts: list, budgets: list, prompt_max: int,
                 generate_max: int) -> dict:
    """Continuous batching of the requests through a ``DecodePool`` of ``slots`` slots (module
    docstring). A warm-up request compiles the pool's programs first."""
    from models.serving import DecodePool, PoolConfig, serve_requests

    pool = DecodePool(arch, params, config, method=method,
                      pool=PoolConfig(slots=slots, max_len=prompt_max + generate_max, bucket=prompt_max))
    t0 = time.perf_counter()
    serve_requests(pool, prompts[:1], max_new_tokens=2)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    served = serve_requests(pool, prompts, max_new_tokens=budgets)
    wall = time.perf_counter() - t0
    errors = [r.error for r in served if r.error is not None]
    done = [r for r in served if r.error is None]
    generated = sum(len(r.tokens) for r in served)
    out = {"slots": slots, "requests": len(prompts), "generated_tokens": generated, "wall_s": wall,
           "tokens_per_s": generated / wall, "compile_s": compile_s, "errors": errors[:5], "failed": len(errors)}
    if done:
        latency = [r.end_s for r in done]
        ttft = [r.first_token_s for r in done]
        out.update(latency_p50_s=percentile(latency, 50), latency_p99_s=percentile(latency, 99),
                   ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99))
    del pool
    return out


# ----------------------------------------------------------------------------- the run


def run(args, result: dict, save) -> dict:
    """Fills ``result`` (module docstring), calling ``save(result)`` after every row."""
    mesh = None
    if args.mesh:
        try:
            mesh = make_mesh(*args.mesh)
        except ValueError as err:
            raise SystemExit(f"bench.serve: error: --mesh {args.mesh[0]} {args.mesh[1]}: {err}") from None
    bandwidth = copy_bandwidth(args.copy_bytes)
    result.update(copy_bandwidth_GBps=bandwidth / 1e9)
    total_bw = bandwidth * (1 if mesh is None else mesh.size)  # on a mesh every device moves its share
    context = args.prompt + args.generate
    for name in args.models:
        arch, config, _ = model_config(name, args.layers, args.compute, scan_layers=False)
        params = random_params(arch, config, mesh=mesh)
        weights = tree_bytes(params)
        budget = args.budget * 1e9 if args.budget is not None else device_budget(weights, args.headroom)
        if (args.fit or args.pool) and budget is None:
            raise SystemExit("bench.serve: error: --budget: the device reports no memory size; give --budget GB")
        result["models"][name] = {"layers": config.num_layers, "weight_bytes": weights, "budget_bytes": budget}
        print(f"# {name}: {config.num_layers} layers, {weights / 1e9:.2f} GB of weights"
              + (f", {budget / 1e9:.1f} GB for sequences" if budget is not None else ""), flush=True)
        states = list(dict.fromkeys(args.states + (args.pool_states if args.pool else [])))
        methods = {s: build_method(s, mesh) for s in states}
        per_stream = {s: stream_bytes(arch, config, build_method(s), context) for s in states}

        def row(kind, state, batch, hold=0, **extra):
            r = dict(model=name, kind=kind, state=state, batch=batch, method=repr(methods[state]),
                     state_bytes=per_stream[state]["state"], checkpoint_bytes=per_stream[state]["checkpoint"],
                     kv_bytes=per_stream[state]["kv"], **extra)
            try:
                r.update(measure_batch(arch, config, params, methods[state], batch=batch, prompt=args.prompt,
                                       generate=args.generate, chunk=args.chunk, prefill_rows=args.prefill_rows,
                                       steps=args.steps, hold_bytes=hold, mesh=mesh))
                need = step_bytes(weight_bytes_read(params, config, batch), per_stream[state], batch, state)
                r.update(step_bytes=need, roofline_ms=1e3 * need / total_bw,
                         x_roof=r["ms_per_step"] * 1e-3 * total_bw / need)
                print(f"{name} {kind} batch {batch} {state}: {r['tokens_per_s']:,.0f} tokens/s, "
                      f"{r['ms_per_step']:.2f} ms/step ({r['x_roof']:.2f}x roof), prefill {r['prefill_s']:.2f} s, "
                      f"compile {r['compile_s']:.0f} s" + ("" if r["finite"] else ", NON-FINITE"), flush=True)
            except Exception as err:  # out of memory at a large batch: recorded, the run goes on
                r["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                print(f"{name} {kind} batch {batch} {state}: {r['error']}", flush=True)
            result["rows"].append(r)
            save(result)
            return r

        for batch in args.batches:
            for state in args.states:
                row("batch", state, batch)
        if args.fit:
            for prefix in {"plain": [None], "prefix": [args.prefix_every], "both": [None, args.prefix_every]}[args.fit]:
                for state in args.states:
                    per_seq = sequence_bytes(per_stream[state], prefix, context)
                    largest = int(budget // per_seq)
                    kind = "budget" if prefix is None else "budget+prefix"
                    hold = 0 if prefix is None else largest * (per_seq - per_stream[state]["state"]
                                                               - per_stream[state]["kv"])
                    if largest < 1:
                        result["rows"].append(dict(model=name, kind=kind, state=state, batch=0, sequence_bytes=per_seq,
                                                   error="not one sequence fits the budget"))
                        continue
                    row(kind, state, largest, hold=hold, sequence_bytes=per_seq, prefix_every=prefix)
        if args.pool:
            prompts, budgets = pool_requests(args.pool_requests, tuple(args.pool_prompt), tuple(args.pool_generate),
                                             config.vocab_size, args.seed)
            pool_len = args.pool_prompt[1] + args.pool_generate[1]
            for state in args.pool_states:
                pool_stream = stream_bytes(arch, config, methods[state], pool_len)
                counts = [("same", args.pool_slots)]
                if args.fit:
                    counts.append(("budget", int(budget // (pool_stream["state"] + pool_stream["kv"]))))
                for kind, slots in counts:
                    r = dict(model=name, state=state, kind=kind, slots=slots,
                             slot_bytes=pool_stream["state"] + pool_stream["kv"])
                    try:
                        if slots < 1:
                            raise ValueError("not one slot fits the budget")
                        r.update(measure_pool(arch, config, params, methods[state], slots=slots, prompts=prompts,
                                              budgets=budgets, prompt_max=args.pool_prompt[1],
                                              generate_max=args.pool_generate[1]))
                        print(f"{name} pool {kind} {slots} slots {state}: {r['tokens_per_s']:,.0f} tokens/s, latency "
                              f"p50 {r.get('latency_p50_s', float('nan')):.2f} s p99 "
                              f"{r.get('latency_p99_s', float('nan')):.2f} s", flush=True)
                    except Exception as err:
                        r["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                        print(f"{name} pool {kind} {slots} slots {state}: {r['error']}", flush=True)
                    result["pool"].append(r)
                    save(result)
        del params
    _ratios(result)
    save(result)
    return result


def _ratios(result: dict) -> None:
    """Each row's tokens/s over fp32's of the same model and kind (same batch for static batches)."""
    def key(r):
        return (r["model"], r["kind"], r.get("batch") if r["kind"] == "batch" else None)

    base = {key(r): r["tokens_per_s"] for r in result["rows"] if r["state"] == "fp32" and "tokens_per_s" in r}
    for r in result["rows"]:
        if "tokens_per_s" in r and key(r) in base:
            r["vs_fp32"] = r["tokens_per_s"] / base[key(r)]
    pool_base = {(r["model"], r["kind"]): r["tokens_per_s"] for r in result["pool"]
                 if r["state"] == "fp32" and "tokens_per_s" in r}
    for r in result["pool"]:
        if "tokens_per_s" in r and (r["model"], r["kind"]) in pool_base:
            r["vs_fp32"] = r["tokens_per_s"] / pool_base[(r["model"], r["kind"])]


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def markdown(result: dict) -> str:
    """The report: the command, the device, the static-batch and budget rows, the pool rows."""
    vs = lambda r: f"{r['vs_fp32']:.2f}x" if "vs_fp32" in r else ""  # noqa: E731
    lines = [f"# Serving benchmark ({result['date']})", "", f"Command: `{result['command']}`  ",
             f"Commit: `{result['commit']}`  ", f"Device: {result['device']}; JAX {result['jax']}  ",
             f"Compute: {result['compute']}; prompt {result['prompt']}, generate {result['generate']} "
             f"({result['steps']} steps timed); copy bandwidth "
             f"{result['copy_bandwidth_GBps']:.0f} GB/s (read + written)  "]
    if result.get("mesh"):
        lines.append(f"Mesh (data x model): {result['mesh']}, {result.get('processes', 1)} process(es)  ")
    for name, m in result["models"].items():
        budget = "" if m["budget_bytes"] is None else f", {_size(m['budget_bytes'])} for sequences (the budget)"
        lines.append(f"{name}: {m['layers']} layers, {_size(m['weight_bytes'])} of weights{budget}  ")
    lines += ["", "| model | kind | state | batch | tokens/s | vs fp32 | ms/step | roofline ms | x roof | prefill s | "
              "compile s | per sequence |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        per_seq = r.get("sequence_bytes", r.get("state_bytes", 0) + r.get("kv_bytes", 0))
        if "error" in r:
            lines.append(f"| {r['model']} | {r['kind']} | {r['state']} | {r['batch']} | {r['error'][:80]} | | | | | | | "
                         f"{_size(per_seq)} |")
            continue
        lines.append(f"| {r['model']} | {r['kind']} | {r['state']} | {r['batch']} | {r['tokens_per_s']:,.0f} | {vs(r)} | "
                     f"{r['ms_per_step']:.2f} | {r['roofline_ms']:.2f} | {r['x_roof']:.2f} | {r['prefill_s']:.2f} | "
                     f"{r['compile_s']:.0f} | {_size(per_seq)}" + ("" if r["finite"] else " NON-FINITE") + " |")
    if result["pool"]:
        lines += ["", "Continuous batching (`models.serving.DecodePool`):", "",
                  "| model | slots | state | tokens/s | vs fp32 | latency p50 s | p99 s | first token p50 s | p99 s | "
                  "requests | failed |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in result["pool"]:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['kind']} {r['slots']} | {r['state']} | {r['error'][:80]} | | | | | "
                             "| | |")
                continue
            lat = [r.get(k) for k in ("latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s")]
            lat = " | ".join("" if x is None else f"{x:.2f}" for x in lat)
            lines.append(f"| {r['model']} | {r['kind']} {r['slots']} | {r['state']} | {r['tokens_per_s']:,.0f} | "
                         f"{vs(r)} | {lat} | {r['requests']} | {r['failed']} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- arguments


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen3.5-4b", "qwen3.5-9b"], choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    ap.add_argument("--batches", nargs="*", type=int, default=[32, 128, 256, 512])
    ap.add_argument("--states", nargs="+", default=["fp32", "bf16", "fp32-w", "lq8", "lq6", "lq4"],
                    choices=list(STATES))
    ap.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens per request")
    ap.add_argument("--generate", type=int, default=GENERATE, help="decode steps per request")
    ap.add_argument("--chunk", type=int, default=64, help="decode steps per compiled call (divides --steps)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps run and timed (default: --generate)")
    ap.add_argument("--prefill-rows", type=int, default=32, help="sequences per prefill call")
    ap.add_argument("--compute", default=FAST, choices=COMPUTE_MODES)
    ap.add_argument("--fit", nargs="?", const="both", default=None, choices=("plain", "prefix", "both"),
                    help="measure each state at its largest batch under the budget, without or with prefix "
                         "states (default both)")
    ap.add_argument("--budget", type=float, default=None,
                    help="GB for sequences (default: the device's memory less the weights and --headroom)")
    ap.add_argument("--headroom", type=float, default=HEADROOM_GB, help="GB kept for activations (default budget)")
    ap.add_argument("--prefix-every", type=int, default=1024, help="cached tokens per prefix checkpoint (--fit)")
    ap.add_argument("--pool", action="store_true", help="continuous batching through models.serving.DecodePool")
    ap.add_argument("--pool-states", nargs="+", default=["fp32", "fp32-w", "lq8"], choices=list(STATES))
    ap.add_argument("--pool-slots", type=int, default=256)
    ap.add_argument("--pool-requests", type=int, default=512)
    ap.add_argument("--pool-prompt", nargs=2, type=int, default=list(POOL_PROMPT), metavar=("MIN", "MAX"))
    ap.add_argument("--pool-generate", nargs=2, type=int, default=list(POOL_GENERATE), metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0, help="seed of the pool's requests")
    ap.add_argument("--copy-bytes", type=int, default=2 << 30, help="bytes of the bandwidth probe's array")
    ap.add_argument("--commit", default=None)
    add_mesh_options(ap)
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ap.add_argument("--out", default=None, help="folder for serve-<date>.json and .md (default: none written)")
    args = ap.parse_args(argv)
    positive = [("--prompt", [args.prompt]), ("--generate", [args.generate]), ("--chunk", [args.chunk]),
                ("--prefill-rows", [args.prefill_rows]), ("--prefix-every", [args.prefix_every]),
                ("--pool-slots", [args.pool_slots]), ("--pool-requests", [args.pool_requests]),
                ("--pool-prompt", args.pool_prompt), ("--pool-generate", args.pool_generate),
                ("--copy-bytes", [args.copy_bytes])] + ([("--batches", args.batches)] if args.batches else [])
    if args.layers is not None:
        positive.append(("--layers", [args.layers]))
    for flag, values in positive:
        if min(values) < 1:
            ap.error(f"{flag} must be positive, got {' '.join(map(str, values))}")
    if args.steps is None:
        args.steps = args.generate
    if not 1 <= args.steps <= args.generate:
        ap.error(f"--steps must be in [1, --generate = {args.generate}], got {args.steps}")
    if args.steps % args.chunk:
        ap.error(f"--chunk ({args.chunk}) must divide --steps ({args.steps}, default --generate)")
    for flag, (lo, hi) in (("--pool-prompt", args.pool_prompt), ("--pool-generate", args.pool_generate)):
        if lo > hi:
            ap.error(f"{flag} MIN must not exceed MAX, got {lo} {hi}")
    if args.budget is not None and not args.budget > 0:
        ap.error(f"--budget must be a positive number of GB, got {args.budget}")
    if args.headroom < 0:
        ap.error(f"--headroom must be >= 0, got {args.headroom}")
    for flag, states in (("--states", args.states), ("--pool-states", args.pool_states)):
        if len(set(states)) != len(states):
            ap.error(f"{flag} names a state more than once: {' '.join(states)}")
    if not args.batches and not args.fit and not args.pool:
        ap.error("nothing to measure: give --batches, --fit or --pool")
    try:
        check_distributed_args(args)
        if args.mesh:
            if args.pool or args.fit:
                raise ValueError("--mesh runs static batches (--batches) only: drop --pool and --fit")
            # the devices are counted after the processes join (main)
            check_mesh_args(args.mesh, args.models, args.layers, args.batches, devices=args.coordinator is None)
    except ValueError as err:
        ap.error(str(err))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        start(args, prog="python -m bench.serve")
    except ValueError as err:
        print(f"python -m bench.serve: error: {err}", file=sys.stderr)
        return 2
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                           cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    result = dict(date=date, command="python -m bench.serve " + " ".join(sys.argv[1:] if argv is None else argv),
                  commit=commit, device=f"{jax.devices()[0].device_kind} x{len(jax.devices())}", jax=jax.__version__,
                  python=platform.python_version(), compute=args.compute, prompt=args.prompt, generate=args.generate,
                  steps=args.steps, copy_bandwidth_GBps=0.0, models={}, rows=[], pool=[], mesh=args.mesh,
                  processes=jax.process_count())
    path = None
    if args.out and is_primary():
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"serve-{date}")

    def save(res):
        if path is None:
            return
        with open(path + ".json", "w") as f:
            json.dump(res, f, indent=1)
        with open(path + ".md", "w") as f:
            f.write(markdown(res))

    out = sys.stdout
    if args.json:  # progress lines go to stderr, the JSON object alone to stdout
        sys.stdout = sys.stderr
    if not is_primary():  # every process runs the same program; process 0 reports it
        sys.stdout = open(os.devnull, "w")
    try:
        run(args, result, save)
    finally:
        if sys.stdout not in (out, sys.stderr):
            sys.stdout.close()
        sys.stdout = out
    if not is_primary():
        return 0
    if args.json:
        print(json.dumps(result))
    else:
        print(markdown(result))
    if path:
        print(f"wrote {path}.json and .md", file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
