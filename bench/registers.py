"""Registers and spills of the Pallas Triton kernels, on a machine without a GPU.

    python -m bench.registers [--what step flush dense chunk scores] [--bits 8 6 4] [--modes gdn kda]
                              [--step-opts JSON] [--flush-opts JSON] [--arch 90] [--out DIR]

Why: a kernel whose live tiles exceed the register file spills to local memory and slows down
many times over, and the figure that says so (``ptxas -v``: registers per thread, spill stores
and loads) does not need a GPU. Each kernel is lowered as on a GPU (``jax.export`` for
``cuda``), its Triton IR is taken from the ``pallas_call`` and compiled for ``sm_<arch>`` with the
``triton`` package's compiler and its bundled ``ptxas``. The sizes are the benchmark's (32
heads, 128 x 128, window 16); registers do not depend on the batch, so the batch is small.

Needs ``triton`` (``pip install triton``; 3.6 was used), which JAX's CPU wheels do not bring.
Its compiler and the one inside ``jaxlib`` on a GPU differ in version, and the IR goes in as
lowered (the GPU's pipeline first runs Triton's TTIR clean-up passes on it), so figures can
differ a little from the device's (``bench.ncu_kernels`` measures those): on the old stream
flush (8-bit GDN, 4 warps) 1,704 bytes of spill stores here against 1,820 with the clean-up
passes run first. What holds is the ordering and whether a kernel spills.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from unittest import mock

import jax
import jax.numpy as jnp

WHAT = ("step", "flush", "dense", "chunk", "scores")


@dataclasses.dataclass(frozen=True)
class KernelIR:
    """One ``pallas_call`` lowered for the GPU: its name, Triton IR as MLIR bytecode, warps, stages."""
    name: str
    bytecode: bytes
    num_warps: int
    num_stages: int


def capture(fn, *args) -> list[KernelIR]:
    """The Triton kernels of ``fn(*args)`` (a jit-able function; arrays or ShapeDtypeStructs),
    lowered for CUDA without a GPU."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    found = []
    original = registration.mlir.custom_call

    def spy(*a, **kw):
        config = kw.get("backend_config")
        if isinstance(config, dict) and "ir" in config:
            found.append(KernelIR(config["name"].value, config["ir"].value_bytes,
                                  int(config["num_warps"].value), int(config["num_stages"].value)))
        return original(*a, **kw)

    registration.mlir.custom_call = spy
    try:
        disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
        jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled)(*args)
    finally:
        registration.mlir.custom_call = original
    return found


def _text(bytecode: bytes) -> str:
    """Triton IR bytecode -> MLIR text (the ``triton`` package's compiler reads text)."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton.lowering import _new_ir_context

    with _new_ir_context():
        return ir.Module.parse(bytecode).operation.get_asm(enable_debug_info=False)


def _ptxas() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no ptxas in the triton package at {path}")
    return path


def ptxas_report(kernel: KernelIR, arch: int = 90) -> dict:
    """``{"registers", "spill_stores", "spill_loads", "stack", "shared", "async_copies", "compile_s"}``
    of one kernel compiled for ``sm_<arch>``: registers per thread; spills, stack frame and shared
    memory in bytes; ``cp.async`` instructions in its PTX (loads that Triton's pipeliner issues
    ahead, with ``num_stages > 1``); seconds to compile it here (Triton, then ``ptxas``), which a
    GPU's compile of the same kernel follows, and which grows fast with the kernel's size."""
    import triton
    from triton.backends.compiler import GPUTarget

    started = time.monotonic()
    # compile_s: a compile, not a hit in Triton's cache
    with mock.patch.dict(os.environ, {"TRITON_ALWAYS_COMPILE": "1"}), tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ttir")
        with open(src, "w") as f:
            f.write(_text(kernel.bytecode))
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=kernel.num_warps, num_stages=kernel.num_stages))
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        shared = int(getattr(compiled.metadata, "shared", 0))
        async_copies = compiled.asm["ptx"].count("cp.async")
        suffix = "a" if arch >= 90 else ""
        run = subprocess.run([_ptxas(), "-v", f"--gpu-name=sm_{arch}{suffix}", ptx, "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    seconds = round(time.monotonic() - started, 1)
    if run.returncode:
        raise RuntimeError(f"ptxas failed on {kernel.name}: {run.stderr[-500:]}")
    info = run.stderr

    def number(pattern):
        m = re.search(pattern, info)
        return int(m.group(1)) if m else 0

    return dict(registers=number(r"Used (\d+) registers"), spill_stores=number(r"(\d+) bytes spill stores"),
                spill_loads=number(r"(\d+) bytes spill loads"), stack=number(r"(\d+) bytes stack frame"),
                shared=shared, async_copies=async_copies, compile_s=seconds)


def kernel_calls(what, bits, kda, opts, *, batch=2, heads=32, dim=128, window=16):
    """``[(label, fn, args)]``: the jit-able calls that launch the kernels of ``what`` at these sizes."""
    from bench.inputs import random_sequence, random_state, token_at
    from leapquant_jax import windowed
    from leapquant_jax.state import LeapQuantConfig
    from pallas_kernels.dense_step import dense_step
    from pallas_kernels.leapquant_flush import flush_fused, flush_split
    from pallas_kernels.mosaic_flush import leapquant_flush as flush_mosaic
    from pallas_kernels.leapquant_step import leapquant_step

    if isinstance(opts.get("precision"), str):           # JSON names a precision: "DEFAULT" or "HIGHEST"
        opts = dict(opts, precision=jax.lax.Precision[opts["precision"]])
    config = LeapQuantConfig(bits=bits, window=window, impl="pallas")
    tok = token_at(random_sequence(jax.random.PRNGKey(0), batch, 1, heads, dim, dim, kda), 0)
    dense0 = random_state(jax.random.PRNGKey(1), batch, heads, dim, dim)
    state = windowed.from_dense(config, dense0, per_channel_decay=kda)
    if what == "step":
        return [("step", functools.partial(leapquant_step, config, interpret=False, **opts), (state, tok))]
    if what == "flush":
        # impl "auto" (the default): both kernels a flush of full windows may take, split and fused
        opts = dict(opts)
        impl = opts.pop("impl", "auto")
        flushes = {"auto": (flush_split, flush_fused), "split": (flush_split,), "fused": (flush_fused,),
                   "mosaic": (flush_mosaic,)}[impl]

        def flush(state):
            return tuple(f(config, state, only_full=True, interpret=False, **opts) for f in flushes)

        return [("flush", flush, (state,))]
    if what == "dense":
        return [("dense", functools.partial(dense_step, interpret=False, **opts), (dense0, tok))]
    from leapquant_jax.chunked import kda_cumulative
    c, n = 64, 4
    key = jax.random.PRNGKey(2)
    if what == "chunk":
        from pallas_kernels.chunk_scan import chunk_scan
        shapes = dict(s0=(heads, dim, dim), w=(n, heads, c, dim), uv=(n, heads, c, dim), k_end=(n, heads, c, dim),
                      decay=(n, heads, dim), q_start=(n, heads, c, dim), p=(n, heads, c, c))
        args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes.values()]
        return [("chunk", functools.partial(chunk_scan, interpret=False, **opts), tuple(args))]
    if what == "scores":
        from pallas_kernels.kda_scores import kda_pair_scores
        q = jax.random.normal(key, (heads, c, dim))
        g = kda_cumulative(-jnp.abs(jax.random.normal(key, (heads, c, dim))))
        return [("scores", functools.partial(kda_pair_scores, interpret=False, **opts), (q, q, g))]
    raise ValueError(f"unknown kernel group {what!r}; choose from {WHAT}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", nargs="+", choices=WHAT, default=["step", "flush"])
    ap.add_argument("--bits", nargs="+", type=int, default=[8])
    ap.add_argument("--modes", nargs="+", choices=("gdn", "kda"), default=["gdn", "kda"])
    for k in WHAT:
        ap.add_argument(f"--{k}-opts", default="{}", help=f"JSON keyword options of the {k} kernels")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    ap.add_argument("--out", default=None, help="also write the rows as JSON lines to DIR/registers.jsonl")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("triton") is None:
        ap.error("needs the triton package (pip install triton)")

    rows = []
    print("| kernel | options | warps | registers | spill stores (B) | spill loads (B) | stack (B) | shared (B) "
          "| cp.async | compile (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for what in args.what:
        opts = json.loads(getattr(args, f"{what}_opts"))
        bits_list = args.bits if what in ("step", "flush") else [None]
        modes = args.modes if what in ("step", "flush", "dense") else ["-"]
        for bits in bits_list:
            for mode in modes:
                for label, fn, fargs in kernel_calls(what, bits or 8, mode == "kda", opts):
                    for k in capture(fn, *fargs):
                        r = dict(kernel=k.name, options=opts, bits=bits, mode=mode, num_warps=k.num_warps, **ptxas_report(k, args.arch))
                        rows.append(r)
                        print(f"| {k.name} | {json.dumps(opts) if opts else '-'} | {k.num_warps} | {r['registers']} | "
                              f"{r['spill_stores']} | {r['spill_loads']} | {r['stack']} | {r['shared']} | "
                              f"{r['async_copies']} | {r['compile_s']} |",
                              flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "registers.jsonl"), "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    sys.exit(main())
