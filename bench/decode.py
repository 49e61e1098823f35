"""End-to-end decode benchmark: ms per step of a whole model with each state format, at serving scale.

    python -m bench.decode [--models qwen3.5-9b kimi-linear-48b-a3b] [--layers N] [--batches 32 256]
                           [--contexts 4096 32768] [--states fp32 bf16 lq8 lq6 lq4] [--compute fast]
                           [--layout scan|unrolled] [--steps 16] [--repeats 3] [--budget-gb 64]
                           [--mesh DATA MODEL]
                           [--commit HASH] [--out bench/results]

Models are random bf16 weights in the shape of a released checkpoint (``MODELS``; ``tiny``,
``tiny-tp`` and ``tiny-kimi`` run anywhere in seconds), built on the device from the converter's
own params tree. ``--layout``:
the layers one by one (default) or under one ``lax.scan`` (``config.scan_layers``); scanned, the
caches go through the scan as stacked inputs and outputs and XLA copies them every step
(docs/end-to-end.md has the measured cost). For each model, context, batch and state format: a cache
of ``context + steps`` positions with every sequence at position ``context`` (the attention KV
cache is allocated to that length and attended over in full; its contents are zeros, which the
time does not depend on), then ``steps`` teacher-forced decode steps of random tokens in one
compiled ``lax.scan`` (16 steps: one LeapQuant window, its flush included), timed on the host
clock after a warm-up call, median over ``repeats`` calls.

Reported per row: ms per step, tokens per second, the speed-up over the fp32 state in the same
run, the recurrent state per stream (a live stream and the window-boundary checkpoint, measured
on the state pytrees), the KV cache per stream, and the bytes a step must move: weights read
(MoE: the experts a batch is expected to touch), the recurrent state (per-step formats: read and
written; LeapQuant: its checkpoint and on average half its window buffer read, one record
written, plus a flush per window, that is checkpoint and buffer read and checkpoint written,
divided by the window), the KV cache read. ``roofline`` is the time those bytes take at the copy
bandwidth measured in the same run (a device-to-device copy, bytes read + written); ``x roof`` is
the step's time over it (on a mesh: the bytes over every device's bandwidth, the copy measured on
one). Concurrency: how many streams fit ``--budget-gb`` of state memory
(recurrent state only, and recurrent state plus KV cache at the context), counted on the
measured per-stream bytes.

``--mesh DATA MODEL`` places the weights and caches on a ``DATA x MODEL`` device mesh
(``models.sharding``): sequences over ``data``, heads, channels and experts over ``model``; the
recurrence runs per shard (``shard_method``). Each row then lists the collectives of the compiled
step (``collective_bytes``: count and bytes of each kind, every instruction counted once).

Results: ``<out>/decode-<date>.json`` and ``.md`` with the command and the commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from leapquant_jax.methods import make_method
from leapquant_jax.quantizers import tree_bytes
from leapquant_jax.state import LeapQuantState
from models.base import check_runtime, layer_caches, layer_plan, stack_layers
from models.checkpoint import architecture_for_config
from models.flax_modules import param_shapes
from models.layers import COMPUTE_MODES, FAST

# Released configurations (text decoder), as their config.json files give them.
QWEN35_9B = dict(
    model_type="qwen3_5_text", vocab_size=248320, hidden_size=4096, num_hidden_layers=32,
    full_attention_interval=4, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    rms_norm_eps=1e-6, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, intermediate_size=12288, tie_word_embeddings=False)
KIMI_LINEAR_48B = dict(
    model_type="kimi_linear", vocab_size=163840, hidden_size=2304, num_hidden_layers=27,
    num_attention_heads=32, num_key_value_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True, intermediate_size=9216, moe_intermediate_size=1024,
    num_experts=256, num_experts_per_token=8, num_shared_experts=1, first_k_dense_replace=1,
    routed_scaling_factor=2.446, moe_renormalize=True, use_grouped_topk=False, rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    linear_attn_config={"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
                        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                        "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)]})
# The same architecture as qwen3.5-9b at test scale.
TINY = dict(
    QWEN35_9B, vocab_size=64, hidden_size=32, num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=1,
    head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    intermediate_size=48)
MODELS = {
    "qwen3.5-9b": QWEN35_9B,
    "qwen3.5-4b": dict(QWEN35_9B, hidden_size=2560, intermediate_size=9216, tie_word_embeddings=True),
    "kimi-linear-48b-a3b": KIMI_LINEAR_48B,
    "tiny": TINY,
    # qwen3.5-9b's and kimi-linear-48b-a3b's architectures at test scale, every count a mesh splits
    # (heads, KV heads, experts) divisible by 8
    "tiny-tp": dict(TINY, hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                    linear_num_key_heads=8, linear_num_value_heads=16, intermediate_size=64),
    "tiny-kimi": dict(
        KIMI_LINEAR_48B, vocab_size=64, hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_token=2,
        linear_attn_config={"num_heads": 8, "head_dim": 16, "short_conv_kernel_size": 4, "full_attn_layers": [4],
                            "kda_layers": [1, 2, 3]}),
}

STATES = {"fp32": ("fp32", {}), "bf16": ("bf16", {}), "lq8": ("leapquant", dict(bits=8)),
          "lq6": ("leapquant", dict(bits=6)), "lq4": ("leapquant", dict(bits=4)), "fp32-w": ("fp32-w", {})}
# Standard deviation of the random weights: small enough that activations stay finite at depth.
WEIGHT_STD = 0.02


def model_config(name: str, layers: int | None, compute: str, scan_layers: bool = True):
    """``(arch, config, config_json)`` for a ``MODELS`` entry, cut to its first ``layers`` layers."""
    cj = json.loads(json.dumps(MODELS[name]))
    if layers is not None:
        if not 1 <= layers <= cj["num_hidden_layers"]:
            raise ValueError(f"--layers must be in [1, {cj['num_hidden_layers']}] for {name}, got {layers}")
        cj["num_hidden_layers"] = layers
        lac = cj.get("linear_attn_config")
        if lac:
            lac["full_attn_layers"] = [i for i in lac["full_attn_layers"] if i <= layers]
            lac["kda_layers"] = [i for i in lac["kda_layers"] if i <= layers]
    arch = architecture_for_config(cj)
    config = dataclasses.replace(arch.config_from_hf(cj), compute=compute, scan_layers=scan_layers)
    check_runtime(config)
    return arch, config, cj


def placed_shapes(arch, config, mesh=None):
    """The bf16 weights of ``config`` as ``jax.ShapeDtypeStruct`` leaves, in the tree
    ``random_params`` makes (layers stacked under ``config.scan_layers``); on ``mesh`` in the
    architecture's tensor-parallel layout, each leaf with its ``models.sharding`` placement
    (what ``jit(...).lower`` needs to compile a program for the placed weights)."""
    shapes = param_shapes(arch, config, dtype=jnp.bfloat16)
    if config.scan_layers:
        stacked = jax.eval_shape(lambda t: stack_layers(t, layer_plan(config)), shapes["layers"])
        shapes = dict({k: v for k, v in shapes.items() if k != "layers"}, **stacked)
    if mesh is None:
        return shapes
    from jax.sharding import NamedSharding

    from models.sharding import param_specs, tensor_parallel_layout

    shapes = tensor_parallel_layout(shapes, mesh, arch=arch, config=config)
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    specs = jax.tree_util.tree_leaves(param_specs(shapes, mesh))
    placed = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)) for x, s in zip(leaves, specs)]
    return jax.tree_util.tree_unflatten(treedef, placed)


def random_params(arch, config, seed: int = 0, mesh=None):
    """Random bf16 weights (normal, ``WEIGHT_STD``) in the config's layout, made on the device leaf
    by leaf (never the whole model on the host); on ``mesh`` in the architecture's tensor-parallel
    layout and placed by ``models.sharding`` (``placed_shapes``)."""
    leaves, treedef = jax.tree_util.tree_flatten(placed_shapes(arch, config, mesh))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    makers = {}  # one compiled maker per distinct leaf shape
    out = []
    for key, leaf in zip(keys, leaves):
        sharding = leaf.sharding if mesh is not None else None
        sig = (leaf.shape, leaf.dtype, sharding)
        if sig not in makers:
            makers[sig] = jax.jit(lambda k, s=leaf: (jax.random.normal(k, s.shape, jnp.float32) * WEIGHT_STD
                                                     ).astype(s.dtype), out_shardings=sharding)
        out.append(makers[sig](key))
    return jax.tree_util.tree_unflatten(treedef, out)


def stream_bytes(arch, config, method, context: int) -> dict:
    """Per-stream bytes of one sequence's cache at ``context`` positions, from the pytrees."""
    cache = jax.eval_shape(lambda: arch.init_cache(config, batch=1, max_len=context, method=method))
    states, ckpt, kv = [], [], []
    for layer in layer_caches(cache, config):
        if "state" in layer:
            states.append(layer["state"])
            ckpt.append(layer["state"].checkpoint if isinstance(layer["state"], LeapQuantState) else layer["state"])
        else:
            kv.append(layer)
    return {"state": tree_bytes(states), "checkpoint": tree_bytes(ckpt), "kv": tree_bytes(kv),
            "window": getattr(getattr(method, "config", None), "window", 1)}


def weight_bytes_read(params, config, batch: int) -> float:
    """Bytes of weights a decode step of ``batch`` tokens reads: every leaf but the embedding (a
    lookup of ``batch`` rows), routed experts weighted by the share a batch is expected to touch
    (``1 - (1 - k/E)^batch`` with uniform routing)."""
    total = 0.0
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        keys = [str(getattr(k, "key", k)) for k in path]
        nbytes = x.size * x.dtype.itemsize
        if keys[0] == "embed":
            nbytes = batch * x.shape[-1] * x.dtype.itemsize
        elif "moe" in keys and keys[-1] in ("w1", "w2", "w3"):
            e, k = config.num_experts, config.num_experts_per_tok
            nbytes *= 1.0 - (1.0 - k / e) ** batch
        total += nbytes
    return total


def step_bytes(weights: float, per_stream: dict, batch: int, state: str) -> float:
    """Bytes one decode step must move (module docstring; ``fp32-w`` as LeapQuant, its checkpoint
    fp32)."""
    s, c, p = per_stream["state"], per_stream["checkpoint"], per_stream["window"]
    if p > 1:  # a windowed state (LeapQuant, fp32-w)
        buffer = s - c
        state_bytes = c + buffer / 2 + (c + buffer + c) / p
    else:
        state_bytes = 2 * s
    return weights + batch * (state_bytes + per_stream["kv"])


def copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 5) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + written), median over ``repeats``."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    copy(x).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def make_steps(arch, config, method, mesh=None):
    """A compiled function ``(params, cache, ids [S, B]) -> (cache, next ids [S, B])``: ``S``
    teacher-forced decode steps in one ``lax.scan``; the cache is donated."""
    from models.sharding import constrain_cache

    @functools.partial(jax.jit, donate_argnums=(1,))
    def run(params, cache, ids):
        def body(cache, tok):
            logits, cache, _ = arch.forward(params, config, tok[:, None], cache, method=method, mode="decode")
            return constrain_cache(cache, mesh), jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)

        cache, out = jax.lax.scan(body, cache, ids)
        # the next call takes this cache back: its layout must be the one the program was built for
        return constrain_cache(cache, mesh), out

    return run


def time_decode(arch, config, params, method, *, batch: int, context: int, steps: int, repeats: int,
                mesh=None, seed: int = 0) -> dict:
    """Median seconds per decode step and the compile time (module docstring)."""
    from models.sharding import constrain_cache

    init = jax.jit(lambda: constrain_cache(arch.init_cache(config, batch=batch, max_len=context + steps,
                                                           method=method), mesh))
    cache = init()
    def place(x, *spec):
        if mesh is None:
            return x
        from jax.sharding import NamedSharding, PartitionSpec

        return jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec)))

    # a fresh array each call: the cache, ``pos`` included, is donated
    start = lambda: place(jnp.full((batch,), context, jnp.int32), "data")  # noqa: E731
    ids = place(jax.random.randint(jax.random.PRNGKey(seed), (steps, batch), 0, config.vocab_size, jnp.int32),
                None, "data")
    cache = dict(cache, pos=start())
    t0 = time.perf_counter()
    run = make_steps(arch, config, method, mesh).lower(params, cache, ids).compile()
    compile_s = time.perf_counter() - t0
    collectives = collective_bytes(run.as_text()) if mesh is not None else {}
    cache, out = run(params, dict(cache, pos=start()), ids)
    out.block_until_ready()
    times = []
    for _ in range(repeats):
        cache = dict(cache, pos=start())
        t0 = time.perf_counter()
        cache, out = run(params, cache, ids)
        out.block_until_ready()
        times.append((time.perf_counter() - t0) / steps)
    finite = bool(np.all((np.asarray(out) >= 0) & (np.asarray(out) < config.vocab_size)))
    del cache
    return {"step_s": statistics.median(times), "all_step_s": times, "compile_s": compile_s, "tokens_ok": finite,
            "collectives": collectives}


def build_method(state: str, mesh=None):
    """The state method of a ``STATES`` label; on ``mesh``, run per shard (``models.sharding.shard_method``)."""
    from models.sharding import shard_method

    name, options = STATES[state]
    return shard_method(make_method(name, **options), mesh)


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(r"= (\(?[^=]*?\)?) (" + "|".join(COLLECTIVES) + r")(-start)?\(")
_SHAPE = re.compile(r"(pred|[a-z]+\d+)\[([\d,]*)\]")


def collective_bytes(hlo_text: str) -> dict:
    """Bytes of each kind of collective in a compiled program's HLO, every instruction counted once
    (the decode step's body holds one per layer and use): ``{kind: {"count", "bytes"}}``. A
    collective's bytes are its result's (for an asynchronous all-gather, the gathered array)."""
    out = {}
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        shapes = _SHAPE.findall(m.group(1))
        if not shapes:
            continue
        dtype, dims = shapes[-1] if m.group(2) == "all-gather" else shapes[0]
        size = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        bits = 1 if dtype == "pred" else int(re.sub(r"\D", "", dtype) or 32)
        entry = out.setdefault(m.group(2), {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += size * max(bits // 8, 1)
    return out


def memory_table(args) -> list:
    """Per-stream bytes and concurrency at ``args.budget_gb`` for every model, context and state."""
    budget = args.budget_gb * 1e9
    memory = []
    for name in args.models:
        arch, config, _ = model_config(name, args.layers, args.compute)
        for context in args.contexts:
            fp32 = stream_bytes(arch, config, build_method("fp32"), context)
            for state in args.states:
                b = stream_bytes(arch, config, build_method(state), context)
                memory.append(dict(model=name, context=context, state=state, state_bytes=b["state"],
                                   checkpoint_bytes=b["checkpoint"], kv_bytes=b["kv"],
                                   state_vs_fp32=b["state"] / fp32["state"],
                                   streams_state_only=int(budget // b["state"]),
                                   streams_with_kv=int(budget // (b["state"] + b["kv"])),
                                   concurrency_vs_fp32_state_only=(budget // b["state"]) / (budget // fp32["state"]),
                                   concurrency_vs_fp32_with_kv=(budget // (b["state"] + b["kv"]))
                                   / (budget // (fp32["state"] + fp32["kv"]))))
    return memory


def run(args, result: dict, save) -> dict:
    """Fills ``result["rows"]`` (module docstring), calling ``save(result)`` after every row, so a
    run cut short keeps what it measured."""
    mesh = None
    if args.mesh:
        from models.sharding import make_mesh

        mesh = make_mesh(*args.mesh)  # checked in parse_args
    result["memory"] = memory_table(args)
    bandwidth = copy_bandwidth(args.copy_bytes)
    result.update(copy_bandwidth_GBps=bandwidth / 1e9, rows=[])
    save(result)
    rows = result["rows"]
    for name in args.models:
        arch, config, cj = model_config(name, args.layers, args.compute, args.layout == "scan")
        params = random_params(arch, config, mesh=mesh)
        print(f"# {name}: {config.num_layers} layers, {tree_bytes(params) / 1e9:.2f} GB of weights", flush=True)
        for context in args.contexts:
            per_stream = {s: stream_bytes(arch, config, build_method(s), context) for s in args.states}
            for batch in args.batches:
                fp32_s = None
                for state in args.states:
                    method = build_method(state, mesh)
                    row = dict(model=name, layers=config.num_layers, context=context, batch=batch, state=state,
                               method=repr(method), state_bytes=per_stream[state]["state"],
                               checkpoint_bytes=per_stream[state]["checkpoint"], kv_bytes=per_stream[state]["kv"])
                    try:
                        t = time_decode(arch, config, params, method, batch=batch, context=context, steps=args.steps,
                                        repeats=args.repeats, mesh=mesh)
                    except Exception as err:  # out of memory at a large batch: recorded, the run goes on
                        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
                        print(f"{name} ctx {context} batch {batch} {state}: {row['error']}", flush=True)
                        rows.append(row)
                        save(result)
                        continue
                    need = step_bytes(weight_bytes_read(params, config, batch), per_stream[state], batch, state)
                    # on a mesh every device moves its share at its own bandwidth
                    total_bw = bandwidth * (1 if mesh is None else mesh.size)
                    row.update(t, ms_per_step=1e3 * t["step_s"], tokens_per_s=batch / t["step_s"], step_bytes=need,
                               roofline_ms=1e3 * need / total_bw, x_roof=t["step_s"] * total_bw / need)
                    if state == "fp32":
                        fp32_s = t["step_s"]
                    if fp32_s is not None:
                        row["speedup_vs_fp32"] = fp32_s / t["step_s"]
                    rows.append(row)
                    save(result)
                    print(f"{name} ctx {context} batch {batch} {state}: {row['ms_per_step']:.2f} ms/step, "
                          f"{row['x_roof']:.2f}x roof, compile {t['compile_s']:.0f} s"
                          + (f", {row['speedup_vs_fp32']:.2f}x fp32" if "speedup_vs_fp32" in row else ""), flush=True)
        del params
    return result


def _collectives(c: dict | None) -> str:
    if not c:
        return ""
    return ", ".join(f"{k} {v['count']} ({v['bytes'] / 1e6:.1f} MB)" for k, v in sorted(c.items()))


def markdown(result: dict) -> str:
    """The report: the command, the device, the timing table and the memory table."""
    lines = [f"# Decode benchmark ({result['date']})", "", f"Command: `{result['command']}`  ",
             f"Commit: `{result['commit']}`  ", f"Device: {result['device']}; JAX {result['jax']}  ",
             f"Mesh (data x model): {result['mesh'] or 'none (one device)'}  ",
             f"Compute: {result['compute']}; layers: {result.get('layout', 'scan')}; copy bandwidth {result['copy_bandwidth_GBps']:.0f} GB/s (read + written)",
             "", "| model | layers | context | batch | state | ms/step | tokens/s | vs fp32 | roofline ms | x roof |"
             " compile s | collectives per step |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['layers']} | {r['context']} | {r['batch']} | {r['state']} | "
                         f"{r['error'][:80]} | | | | | | |")
            continue
        vs = f"{r['speedup_vs_fp32']:.2f}x" if "speedup_vs_fp32" in r else ""
        lines.append(f"| {r['model']} | {r['layers']} | {r['context']} | {r['batch']} | {r['state']} | "
                     f"{r['ms_per_step']:.2f} | {r['tokens_per_s']:,.0f} | {vs} | {r['roofline_ms']:.2f} | "
                     f"{r['x_roof']:.2f} | {r['compile_s']:.0f} | {_collectives(r.get('collectives'))} |")
    lines += ["", f"Memory per stream and concurrency at a budget of {result['budget_gb']} GB:", "",
              "| model | context | state | recurrent state | checkpoint | vs fp32 | KV cache | streams (state) |"
              " vs fp32 | streams (state + KV) | vs fp32 |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in result["memory"]:
        lines.append(f"| {m['model']} | {m['context']} | {m['state']} | {m['state_bytes'] / 1e6:.2f} MB | "
                     f"{m['checkpoint_bytes'] / 1e6:.2f} MB | {m['state_vs_fp32']:.3f} | {m['kv_bytes'] / 1e6:.1f} MB | "
                     f"{m['streams_state_only']:,} | {m['concurrency_vs_fp32_state_only']:.2f}x | "
                     f"{m['streams_with_kv']:,} | {m['concurrency_vs_fp32_with_kv']:.2f}x |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen3.5-9b"], choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    ap.add_argument("--batches", nargs="+", type=int, default=[32, 256])
    ap.add_argument("--contexts", nargs="+", type=int, default=[4096])
    ap.add_argument("--states", nargs="+", default=list(STATES), choices=list(STATES))
    ap.add_argument("--compute", default=FAST, choices=COMPUTE_MODES)
    ap.add_argument("--layout", default="unrolled", choices=("scan", "unrolled"),
                    help="layers under one lax.scan (config.scan_layers) or one by one")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-gb", type=float, default=64.0)
    ap.add_argument("--copy-bytes", type=int, default=2 << 30, help="bytes of the bandwidth probe's array")
    ap.add_argument("--mesh", nargs=2, type=int, metavar=("DATA", "MODEL"), default=None,
                    help="a DATA x MODEL device mesh: sequences over DATA, heads, channels and experts over MODEL")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    for flag, values in (("--batches", args.batches), ("--contexts", args.contexts)):
        if min(values) < 1:
            ap.error(f"{flag} must be positive, got {values}")
    if args.steps < 1 or args.repeats < 1:
        ap.error("--steps and --repeats must be >= 1")
    if "fp32" in args.states and args.states[0] != "fp32":
        ap.error("give fp32 first in --states: the other states are compared with it")
    if args.mesh:
        try:
            check_mesh_args(args.mesh, args.models, args.layers, args.batches)
        except ValueError as err:
            ap.error(str(err))
    return args


def check_mesh_args(mesh, models, layers, batches, *, devices: bool = True) -> None:
    """Raises ``ValueError`` (one line naming ``--mesh`` and what does not fit) unless the
    ``DATA MODEL`` mesh splits every model's heads and experts (``models.sharding.check_mesh``)
    and every batch, and (``devices``) fits the visible devices."""
    from models.sharding import check_mesh, make_mesh

    data, model = mesh
    try:
        for name in models:
            _, config, _ = model_config(name, layers, FAST)
            for batch in batches or [None]:
                check_mesh(config, data, model, batch=batch)
        if devices:
            make_mesh(data, model)
    except ValueError as err:
        raise ValueError(f"--mesh {data} {model}: {err}") from None


def main(argv=None) -> int:
    args = parse_args(argv)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip() or "unknown"
    date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    result = dict(date=date, command="python -m bench.decode " + " ".join(sys.argv[1:] if argv is None else argv),
                  commit=commit, device=f"{jax.devices()[0].device_kind} x{len(jax.devices())}",
                  jax=jax.__version__, python=platform.python_version(), compute=args.compute,
                  budget_gb=args.budget_gb, mesh=args.mesh, layout=args.layout, copy_bandwidth_GBps=0.0, rows=[], memory=[])
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"decode-{date}")

    def save(res):
        with open(path + ".json", "w") as f:
            json.dump(res, f, indent=1)
        with open(path + ".md", "w") as f:
            f.write(markdown(res))

    run(args, result, save)
    print(f"wrote {path}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
