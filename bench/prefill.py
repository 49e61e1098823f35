"""Prefill benchmark: tokens/s of the chunkwise-parallel delta rule against FLA's chunk kernels.

    python -m bench.prefill [--tokens 4096 16384 65536] [--batches 1 8] [--heads 32] [--dim 128]
                            [--chunk 64] [--group CHUNKS]
                            [--variants kernel:default serial:default kernel:highest]
                            [--check-tokens 4096] [--serial-tokens 16384] [--breakdown T BATCH]
                            [--scan-configs 32:4 64:4 64:8 128:8 32:4:2] [--commit HASH]
                            [--out bench/results] [--tiny]

One layer of ``--heads`` heads, ``dk = dv = --dim``, GDN and KDA, fp32 inputs (L2-normalised keys
with a few outlier channels, decays near 1, ``beta`` in (0, 1), as in ``bench.kernels``), every
``(T, batch)`` in one run. Ours is ``jax.jit(chunk_delta_rule)`` in each ``--variants`` entry
``INTER:PRECISION``: ``inter`` how the state crosses chunks (``kernel``: the Pallas chunk scan,
``impl="triton"``; ``serial``: a ``lax.scan``, ``impl="reference"``; ``associative``; ``auto``: the
function's defaults), ``precision`` of its matmuls (``highest``: fp32, the function's
default; ``default``: TF32 on the GPU, the math FLA's fp32 kernels use, so the like-for-like
comparison). In this order:

1. Ours compiled for every case and variant, ``--compile-threads`` at a time, before anything is
   timed (compilation dominates the run's length otherwise).
2. FLA, in a child process (so that PyTorch and JAX never compete for GPU memory): its fp32
   ``chunk_gated_delta_rule`` / ``chunk_kda`` (``scale=1``, gates in log space, keys already
   normalised, ``output_final_state=True``, under ``torch.inference_mode``) on the correctness
   inputs, then timed per case (CUDA events via ``triton.testing.do_bench``, median after
   warm-up, its autotuning included in the warm-up). Without ``fla`` or CUDA this step reports
   "fla unavailable".
3. Correctness (``--check-tokens`` tokens, batch 1, with an initial state): ours (each variant)
   and FLA against the token-serial fp32 ``recurrent_scan``, and ours against FLA:
   ``||a - b|| / ||b||`` on the outputs and the final state.
4. Ours timed with the host clock around back-to-back calls after warm-up
   (``block_until_ready``), median over repeats, every case of the first variant first; and the
   token-serial ``recurrent_scan`` at batch 1, ``--serial-tokens`` tokens.
5. ``--breakdown T BATCH``: the parts of one case timed alone (pair scores, the triangular
   inverse, all state-independent terms; the serial part as a ``lax.scan`` and as the kernel at
   each ``--scan-configs`` value block, warp count and pipeline depth; the KDA pair-score kernel
   also at each ``--score-warps``), if time is left.

A case that does not fit in memory is skipped and marked so (never a crash), and so are the
timings left when ``--time-budget`` seconds have passed (the default run is meant to end well
inside a 10-minute limit). Results go to ``<out>/prefill-<UTC time>.json`` and ``.md`` (date, GPU,
versions, commit, command), saved after every case. ``--tiny`` runs a small configuration on the
CPU as a smoke test. FLA comes from the ``fla-core`` package (0.6.0 was used when this was written).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # FLA's child process needs the GPU too

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import environment, git_commit, time_loop
from bench.inputs import random_sequence, rel
from leapquant_jax.chunked import chunk_delta_rule
from leapquant_jax.recurrence import recurrent_scan

PRECISIONS = {"highest": jax.lax.Precision.HIGHEST, "default": jax.lax.Precision.DEFAULT}
MODES = ("GDN", "KDA")


def _oom(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}"
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "OutOfMemory" in text


def _short(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err)[:300]}"


def _peak_gb():
    """Peak device memory of this process so far (GB), where the backend reports it."""
    try:
        return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 1e9 or None
    except Exception:
        return None


def check_inputs(seed, t, h, dk, dv):
    """Host (NumPy) inputs of both modes for the correctness check, batch 1, with ``s0``."""
    out = {}
    for kda in (False, True):
        x = random_sequence(jax.random.PRNGKey(seed + kda), 1, t, h, dk, dv, kda)
        x = {n: np.asarray(a, np.float32) for n, a in x.items()}
        x["s0"] = np.asarray(jax.random.normal(jax.random.PRNGKey(seed + 7), (1, h, dk, dv)) * 0.3, np.float32)
        out[MODES[kda]] = x
    return out


# ----------------------------------------------------------------------------- FLA (child process)


def fla_worker(spec_path: str) -> None:
    """Runs in the child process: FLA on the check inputs, then per-case timings; results are
    rewritten to ``spec["out"]`` after every step."""
    with open(spec_path) as f:
        spec = json.load(f)
    res = dict(check={}, timings=[], error=None)

    def save():
        with open(spec["out"], "w") as f:
            json.dump(res, f)

    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.kda import chunk_kda
        from triton.testing import do_bench
    except Exception as err:  # reported in the results
        res["error"] = f"fla unavailable: {_short(err)}"
        save()
        return
    fns = {"GDN": chunk_gated_delta_rule, "KDA": chunk_kda}

    def call(mode, x, h0):
        with torch.inference_mode():
            return fns[mode](q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], scale=1.0,
                             initial_state=h0, output_final_state=True)

    data = np.load(spec["check_npz"])
    outs = {}
    for mode in MODES:
        x = {n: torch.from_numpy(data[f"{mode}_{n}"]).cuda() for n in ("q", "k", "v", "g", "beta")}
        h0 = torch.from_numpy(data[f"{mode}_s0"]).cuda()
        try:
            o, s = call(mode, x, h0)
            outs[f"{mode}_o"], outs[f"{mode}_s"] = o.float().cpu().numpy(), s.float().cpu().numpy()
        except Exception as err:
            res["check"][mode] = _short(err)
        del x, h0
    np.savez(spec["check_out"], **outs)
    save()

    for t, bsz in spec["cases"]:
        for mode in MODES:
            row = dict(mode=mode, tokens=t, batch=bsz, impl="FLA fp32 chunk")
            try:
                row["seconds"] = _time_fla(torch, do_bench, call, spec, mode, bsz, t)
            except Exception as err:
                row["skipped"] = "out of memory" if _oom(err) else _short(err)
            torch.cuda.empty_cache()
            res["timings"].append(row)
            print(json.dumps(row), flush=True)
            save()


def _time_fla(torch, do_bench, call, spec, mode, bsz, t):
    """Seconds per call of FLA (median of CUDA-event timings after warm-up)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = _torch_inputs(torch, gen, bsz, t, spec["heads"], spec["dim"], spec["dim"], mode == "KDA")
    ms = do_bench(lambda: call(mode, x, None), warmup=spec["warmup_ms"], rep=spec["rep_ms"], return_mode="median")
    return ms * 1e-3


def _torch_inputs(torch, gen, bsz, t, h, dk, dv, kda):
    """``random_sequence``'s distribution, drawn on the GPU by PyTorch."""
    chan = torch.ones(dk, device="cuda")
    chan[[3, 17, dk - 5]] = 6.0
    k = torch.nn.functional.normalize(torch.randn(bsz, t, h, dk, device="cuda", generator=gen) * chan, dim=-1)
    q = torch.nn.functional.normalize(torch.randn(bsz, t, h, dk, device="cuda", generator=gen) * chan, dim=-1) / dk ** 0.5
    v = torch.randn(bsz, t, h, dv, device="cuda", generator=gen)
    gshape = (bsz, t, h, dk) if kda else (bsz, t, h)
    g = -torch.nn.functional.softplus(torch.randn(*gshape, device="cuda", generator=gen) - 4.0)
    beta = torch.sigmoid(torch.randn(bsz, t, h, device="cuda", generator=gen))
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def run_fla(args, cases, check, log):
    """FLA in a child process; returns its results (``error`` set when it could not run)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(cases=cases, heads=args.heads, dim=args.dim, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                    check_npz=os.path.join(tmp, "check.npz"), check_out=os.path.join(tmp, "fla_check.npz"),
                    out=os.path.join(tmp, "fla.json"))
        np.savez(spec["check_npz"], **{f"{m}_{n}": a for m, x in check.items() for n, a in x.items()})
        with open(os.path.join(tmp, "spec.json"), "w") as f:
            json.dump(spec, f)
        res = dict(check={}, timings=[], error=None)
        try:
            proc = subprocess.run([sys.executable, "-m", "bench.prefill", "--fla-worker", os.path.join(tmp, "spec.json")],
                                  timeout=args.fla_timeout)
            if proc.returncode:
                res["error"] = f"FLA child process exited with {proc.returncode}"
        except subprocess.TimeoutExpired:
            res["error"] = f"FLA child process timed out after {args.fla_timeout} s"
        if os.path.exists(spec["out"]):
            with open(spec["out"]) as f:
                got = json.load(f)
            res.update(check=got["check"], timings=got["timings"], error=got["error"] or res["error"])
        outs = {}
        if os.path.exists(spec["check_out"]):
            with np.load(spec["check_out"]) as z:
                outs = {n: z[n] for n in z.files}
        res["outputs"] = outs
    if res["error"]:
        log(res["error"])
    return res


# ----------------------------------------------------------------------------- ours


# INTER of a variant -> chunk_delta_rule's inter and impl
INTER_CHUNK = {"auto": dict(), "serial": dict(inter="serial", impl="reference"),
               "associative": dict(inter="associative", impl="reference"), "kernel": dict(inter="serial", impl="triton")}


def parse_variant(text: str) -> tuple[str, str]:
    """``"INTER:PRECISION"`` (``serial:default``) -> ``(inter, precision)``, checked."""
    inter, _, pname = text.partition(":")
    if inter not in INTER_CHUNK or pname not in PRECISIONS:
        raise argparse.ArgumentTypeError(f"a variant is INTER:PRECISION with INTER in {tuple(INTER_CHUNK)} and PRECISION in "
                                         f"{sorted(PRECISIONS)}, got {text!r}")
    return inter, pname


def _scan_config(text: str) -> tuple[int, int, int]:
    """``"BLOCK_V:WARPS[:STAGES]"`` -> ``(block_v, num_warps, num_stages)`` (stages default 1)."""
    try:
        parts = [int(x) for x in text.split(":")]
        if len(parts) not in (2, 3):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a scan configuration is BLOCK_V:WARPS or BLOCK_V:WARPS:STAGES (integers), got {text!r}") from None
    return tuple(parts + [1] * (3 - len(parts)))


def variant_label(inter: str, pname: str) -> str:
    return f"ours chunk_delta_rule {inter} ({pname})"


def ours(chunk, group, precision, inter="serial"):
    return jax.jit(lambda x, s0: chunk_delta_rule(**x, initial_state=s0, chunk=chunk, group=group,
                                                  precision=precision, **INTER_CHUNK[inter]))


def compile_ahead(jobs: dict, threads: int, log) -> dict:
    """Compiles every ``{key: (jitted, bsz, t, h, dk, dv, kda)}`` for its input shapes, ``threads``
    at a time (XLA compiles outside the GIL); returns ``{key: compiled or the error}``. Done before
    anything is timed, so that compilation never runs beside a timing."""
    def one(job):
        fn, bsz, t, h, dk, dv, kda = job
        gshape = (bsz, t, h, dk) if kda else (bsz, t, h)
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)   # noqa: E731
        x = dict(q=f32(bsz, t, h, dk), k=f32(bsz, t, h, dk), v=f32(bsz, t, h, dv), g=f32(*gshape), beta=f32(bsz, t, h))
        t0 = time.perf_counter()
        try:
            compiled = fn.lower(x, f32(bsz, h, dk, dv)).compile()
        except Exception as err:                     # reported with the case, never fatal
            return err, time.perf_counter() - t0
        return compiled, time.perf_counter() - t0

    out = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        futures = {pool.submit(one, job): key for key, job in jobs.items()}
        for fut in concurrent.futures.as_completed(futures):
            key = futures[fut]
            out[key], seconds = fut.result()
            log(dict(compiled=list(key), seconds=round(seconds, 1),
                     error=None if not isinstance(out[key], Exception) else _short(out[key])))
    return out


def check_correctness(args, check, fla_out, log):
    rows = []
    scan = jax.jit(lambda x, s0: recurrent_scan(s0, **x))
    for mode in MODES:
        host = check[mode]
        x = {n: jnp.asarray(host[n]) for n in ("q", "k", "v", "g", "beta")}
        s0 = jnp.asarray(host["s0"])
        o_ref, s_ref = (np.asarray(a) for a in scan(x, s0))
        fla = (fla_out.get(f"{mode}_o"), fla_out.get(f"{mode}_s"))
        for inter, pname in args.variants:
            o, s = (np.asarray(a) for a in ours(args.chunk, args.group, PRECISIONS[pname], inter)(x, s0))
            name = f"ours {inter} ({pname})"
            row = dict(mode=mode, tokens=host["v"].shape[1], check=f"{name} vs recurrent_scan",
                       o_rel_err=rel(o, o_ref), state_rel_err=rel(s, s_ref), finite=bool(np.isfinite(o).all()))
            rows.append(row)
            log(row)
            if fla[0] is not None:
                row = dict(mode=mode, tokens=host["v"].shape[1], check=f"{name} vs FLA chunk",
                           o_rel_err=rel(o, fla[0]), state_rel_err=rel(s, fla[1]))
                rows.append(row)
                log(row)
        if fla[0] is not None:
            row = dict(mode=mode, tokens=host["v"].shape[1], check="FLA chunk vs recurrent_scan",
                       o_rel_err=rel(fla[0], o_ref), state_rel_err=rel(fla[1], s_ref))
            rows.append(row)
            log(row)
        del x, s0
    return rows


def time_ours(fn, bsz, t, h, dk, dv, kda, *, repeats, min_seconds):
    """Seconds per call (median), or raises."""
    x = jax.jit(random_sequence, static_argnums=(1, 2, 3, 4, 5, 6))(jax.random.PRNGKey(0), bsz, t, h, dk, dv, kda)
    s0 = jnp.zeros((bsz, h, dk, dv), jnp.float32)
    return time_loop(lambda c: fn(x, s0), None, min_seconds=min_seconds, repeats=repeats) * 1e-6


def breakdown(args, t, bsz, log) -> list[dict]:
    """Where a case's time goes: ``chunk_delta_rule``'s parts timed alone on the same number of
    chunks (``bsz * heads * t / chunk`` chunk-heads at once, TF32): the pair scores, the unit
    lower-triangular inverse, every state-independent term (scores, inverse, ``w``, ``uv``),
    for KDA also with the pair-score kernel; then ``scan_breakdown``."""
    from leapquant_jax import chunked as C
    from pallas_kernels.kda_scores import kda_pair_scores

    h, d, c = args.heads, args.dim, args.chunk
    n = bsz * h * (t // c)
    rows = []
    for mode in MODES:
        kda = mode == "KDA"
        key = jax.random.PRNGKey(1)
        x = jax.jit(random_sequence, static_argnums=(1, 2, 3, 4, 5, 6))(key, n, c, 1, d, d, kda)
        x = {name: a[:, :, 0] for name, a in x.items()}                 # [n, C, ...]: one chunk per row
        lower = jnp.tril(jax.random.normal(key, (n, c, c)) * 0.05, -1)
        prec = PRECISIONS["default"]
        parts = {
            "pair scores": (jax.jit(lambda x: C.pair_scores_kda(x["q"], x["k"], C.kda_cumulative(x["g"]), prec) if kda
                                    else C._pair_scores_gdn(x["q"], x["k"], jnp.cumsum(x["g"], -1), prec)), x),
            "unit lower inverse": (jax.jit(lambda a: C.unit_lower_inverse(a, precision=prec)), lower),
            "state-independent terms": (jax.jit(lambda x: C._chunk_terms(x["q"], x["k"], x["v"], x["g"], x["beta"], prec)), x),
        }
        if kda:
            parts["pair scores, kernel"] = (jax.jit(lambda x: kda_pair_scores(x["q"], x["k"], C.kda_cumulative(x["g"]),
                                                                               precision=prec)), x)
            for warps in args.score_warps:
                parts[f"pair scores, kernel ({warps} warps)"] = (jax.jit(lambda x, w=warps: kda_pair_scores(
                    x["q"], x["k"], C.kda_cumulative(x["g"]), precision=prec, num_warps=w)), x)
            parts["state-independent terms, kernel"] = (jax.jit(lambda x: C._chunk_terms(
                x["q"], x["k"], x["v"], x["g"], x["beta"], prec, kda_scores=C._kda_scores_kernel)), x)
        for name, (fn, arg) in parts.items():
            rows.append(_time_part(args, log, fn, arg, mode=mode, tokens=t, batch=bsz, part=name, chunk_heads=n))
        del x, lower
    rows += scan_breakdown(args, t, bsz, log)
    return rows


def _time_part(args, log, fn, arg, **row):
    try:
        row["seconds"] = time_loop(lambda _: fn(arg), None, min_seconds=args.min_seconds, repeats=3) * 1e-6
    except Exception as err:
        row["skipped"] = "out of memory" if _oom(err) else _short(err)
    log(row)
    return row


def scan_breakdown(args, t, bsz, log) -> list[dict]:
    """The serial part alone (``o`` and the final state from the chunk terms, TF32): the lax.scan
    (``chunked.scan_chunks``) and the Pallas kernel at each value block and warp count of
    ``--scan-configs``, on ``t / chunk`` chunks of ``bsz * heads`` rows, and on one row of heads
    (batch 1)."""
    from leapquant_jax.chunked import scan_chunks
    from pallas_kernels.chunk_scan import chunk_scan

    h, d, c = args.heads, args.dim, args.chunk
    n = t // c
    prec = PRECISIONS["default"]
    rows = []
    for b in sorted({bsz, 1}):
        r = b * h
        keys = jax.random.split(jax.random.PRNGKey(2), 7)
        unit = lambda k, *shape: jax.random.normal(k, shape, jnp.float32) * shape[-1] ** -0.5   # noqa: E731
        terms = (unit(keys[0], r, d, d), unit(keys[1], n, r, c, d), unit(keys[2], n, r, c, d), unit(keys[3], n, r, c, d),
                 jax.random.uniform(keys[4], (n, r, d), jnp.float32, 0.9, 1.0), unit(keys[5], n, r, c, d),
                 jnp.tril(unit(keys[6], n, r, c, c)))
        base = dict(mode="GDN/KDA", tokens=t, batch=b, chunk_heads=n * r)
        fns = {"chunk scan, lax.scan": jax.jit(lambda a: scan_chunks(*a, precision=prec))}
        for bv, warps, stages in args.scan_configs:
            fns[f"chunk scan, kernel (block_v {bv}, {warps} warps, {stages} stages)"] = jax.jit(
                lambda a, bv=bv, warps=warps, stages=stages: chunk_scan(*a, precision=prec, block_v=bv,
                                                                        num_warps=warps, num_stages=stages))
        for name, fn in fns.items():
            rows.append(_time_part(args, log, fn, terms, part=name, **base))
        del terms
    return rows


# ----------------------------------------------------------------------------- main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--group", type=int, default=None,
                    help="chunk_delta_rule's group (chunks in parallel at a time; default: its own choice)")
    ap.add_argument("--variants", nargs="+", type=parse_variant,
                    default=[parse_variant(v) for v in ("kernel:default", "serial:default", "kernel:highest")],
                    help="INTER:PRECISION of ours, each timed on every case (inter: chunk_delta_rule's, "
                         "precision: highest = fp32 matmuls, default = TF32 on the GPU, the math of FLA's fp32 kernels)")
    ap.add_argument("--compile-threads", type=int, default=8, help="compilations of ours at a time, before any timing")
    ap.add_argument("--check-tokens", type=int, default=4096)
    ap.add_argument("--serial-tokens", type=int, default=16384, help="token-serial recurrent_scan at batch 1 (0: skip)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-seconds", type=float, default=0.25, help="host-clock time per repeat (JAX)")
    ap.add_argument("--warmup-ms", type=int, default=200, help="FLA warm-up (do_bench)")
    ap.add_argument("--rep-ms", type=int, default=1000, help="FLA timed time (do_bench)")
    ap.add_argument("--fla-timeout", type=int, default=270, help="seconds for the FLA child process")
    ap.add_argument("--time-budget", type=int, default=500,
                    help="seconds after which the remaining timings are skipped (and marked so)")
    ap.add_argument("--breakdown", type=int, nargs=2, metavar=("T", "BATCH"), default=[16384, 8],
                    help="time chunk_delta_rule's parts alone on this case (T 0: skip)")
    ap.add_argument("--scan-configs", type=_scan_config, nargs="+",
                    default=[(32, 4, 1), (64, 4, 1), (64, 8, 1), (128, 8, 1)], metavar="BLOCK_V:WARPS[:STAGES]",
                    help="the chunk-scan kernel's configurations timed in the breakdown (stages: Triton's "
                         "software pipelining of the loop's loads; 1 by default)")
    ap.add_argument("--score-warps", type=int, nargs="*", default=[],
                    help="also time the KDA pair-score kernel at these warp counts in the breakdown")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="small CPU smoke test")
    ap.add_argument("--commit", default=None, help="commit hash to record (default: git rev-parse HEAD)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--fla-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fla_worker:
        return fla_worker(args.fla_worker)
    if args.tiny:
        args.tokens, args.batches, args.heads, args.dim = [100, 256], [1, 2], 2, 32
        args.chunk, args.check_tokens, args.serial_tokens, args.breakdown = 16, 130, 256, [64, 2]
        args.repeats, args.min_seconds, args.compile_threads = 2, 0.05, 2
        args.scan_configs, args.score_warps = [(16, 4, 1), (32, 4, 2)], [4]

    def log(x):
        print(json.dumps(x) if isinstance(x, dict) else x, flush=True)

    start = time.perf_counter()
    env = environment(args.commit or git_commit())
    env["command"] = " ".join([os.path.basename(sys.executable), "-m", "bench.prefill"] + sys.argv[1:])
    log(env)
    cases = sorted(((t, b) for t in args.tokens for b in args.batches), key=lambda c: (c[0] * c[1], c[0]))
    results = dict(environment=env, config=dict(heads=args.heads, dk=args.dim, dv=args.dim, chunk=args.chunk,
                                                group=args.group, cases=cases,
                                                variants=[f"{i}:{p}" for i, p in args.variants]),
                   correctness=[], timings=[], notes=[])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"prefill-{stamp}")

    def save():  # after every case, so that a run cut short still leaves its tables
        for r in results["timings"]:
            if "seconds" in r:
                r["tokens_per_s"] = r["batch"] * r["tokens"] / r["seconds"]
        results["ratios"] = ratios(results["timings"])
        with open(base + ".json", "w") as f:
            json.dump(results, f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(markdown(results))

    h, dk, dv = args.heads, args.dim, args.dim
    jobs = {(mode, t, bsz, variant_label(inter, pname)): (ours(args.chunk, args.group, PRECISIONS[pname], inter),
                                                          bsz, t, h, dk, dv, mode == "KDA")
            for inter, pname in args.variants for t, bsz in cases for mode in MODES}
    if args.serial_tokens:
        scan = jax.jit(lambda x, s0: recurrent_scan(s0, **x))
        for mode in MODES:
            jobs[(mode, args.serial_tokens, 1, "token-serial recurrent_scan")] = (scan, 1, args.serial_tokens, h, dk, dv,
                                                                                 mode == "KDA")
    t0 = time.perf_counter()
    compiled = compile_ahead(jobs, args.compile_threads, log)
    results["notes"].append(f"compiling ours ({len(jobs)} programs, {args.compile_threads} at a time): "
                            f"{time.perf_counter() - t0:.0f} s")

    check = check_inputs(0, args.check_tokens, args.heads, args.dim, args.dim)
    fla = dict(check={}, timings=[], outputs={}, error="not run (--no-fla)")
    if not args.no_fla:
        t0 = time.perf_counter()
        fla = run_fla(args, cases, check, log)
        results["notes"].append(f"FLA child process: {time.perf_counter() - t0:.0f} s")
    if fla["error"]:
        results["notes"].append(fla["error"])
    for mode, err in fla["check"].items():
        results["notes"].append(f"FLA {mode} on the check inputs failed: {err}")
    results["timings"] += fla["timings"]
    results["correctness"] = check_correctness(args, check, fla["outputs"], log)
    save()

    # Every case of the first variant before the next, so that a run cut short keeps the headline.
    for key, fn in sorted(compiled.items(), key=lambda kv: (list(jobs).index(kv[0]),)):
        mode, t, bsz, impl = key
        row = dict(mode=mode, tokens=t, batch=bsz, impl=impl)
        if isinstance(fn, Exception):
            row["skipped"] = "out of memory" if _oom(fn) else _short(fn)
        elif time.perf_counter() - start > args.time_budget:
            row["skipped"] = f"time budget ({args.time_budget} s) spent"
        else:
            try:
                repeats = args.repeats if impl.startswith("ours") else max(2, args.repeats // 2)
                row["seconds"] = time_ours(fn, bsz, t, h, dk, dv, mode == "KDA", repeats=repeats,
                                           min_seconds=args.min_seconds)
            except Exception as err:  # a case that does not fit is reported, not fatal
                row["skipped"] = "out of memory" if _oom(err) else _short(err)
        row["peak_gb_so_far"] = _peak_gb()
        results["timings"].append(row)
        log(row)
        save()
    if args.breakdown[0] and time.perf_counter() - start < args.time_budget:
        results["breakdown"] = breakdown(args, *args.breakdown, log)
    save()
    log(markdown(results))
    return results


def ratios(timings):
    """Per case and mode: our tokens/s over FLA's, per precision."""
    fla = {(r["mode"], r["tokens"], r["batch"]): r for r in timings if r["impl"].startswith("FLA") and "seconds" in r}
    out = []
    for r in timings:
        key = (r["mode"], r["tokens"], r["batch"])
        if r["impl"].startswith("ours") and "seconds" in r and key in fla:
            out.append(dict(mode=r["mode"], tokens=r["tokens"], batch=r["batch"], impl=r["impl"],
                            ratio_vs_fla=fla[key]["seconds"] / r["seconds"]))
    return out


def markdown(results) -> str:
    env, cfg = results["environment"], results["config"]
    out = [f"# Prefill benchmark ({env.get('gpu') or env['devices']})", "",
           f"date {env['date']}; jax {env['jax']}; torch {env.get('torch')}; triton {env.get('triton')}; "
           f"fla-core {env.get('fla')}; commit {env.get('commit')}; command `{env['command']}`", "",
           f"One layer, {cfg['heads']} heads, dk = {cfg['dk']}, dv = {cfg['dv']}, fp32 inputs; ours: chunk "
           f"{cfg['chunk']}, group {cfg['group'] or 'auto'}. Tokens/s = batch x T / time of one "
           "whole-sequence call (median). FLA's fp32 kernels multiply in TF32 (Triton's default for "
           "fp32 `tl.dot`), as ours does at precision `default`.", ""]
    if results["correctness"]:
        out += ["## Correctness (batch 1, with an initial state)", "",
                "| mode | T | check | o rel err | state rel err |", "| --- | --- | --- | --- | --- |"]
        for r in results["correctness"]:
            out.append(f"| {r['mode']} | {r['tokens']} | {r['check']} | {r['o_rel_err']:.2e} | {r['state_rel_err']:.2e} |")
        out.append("")
    rows = results["timings"]
    if rows:
        out += ["## Throughput", "", "| mode | T | batch | impl | ms | tokens/s | x FLA |", "| --- | --- | --- | --- | --- | --- | --- |"]
        ratio = {(r["mode"], r["tokens"], r["batch"], r["impl"]): r["ratio_vs_fla"] for r in results.get("ratios", [])}
        for r in sorted(rows, key=lambda r: (r["mode"], r["tokens"], r["batch"], r["impl"])):
            if "seconds" not in r:
                out.append(f"| {r['mode']} | {r['tokens']} | {r['batch']} | {r['impl']} | skipped: {r.get('skipped')} | | |")
                continue
            x = ratio.get((r["mode"], r["tokens"], r["batch"], r["impl"]))
            tps = r["batch"] * r["tokens"] / r["seconds"]
            out.append(f"| {r['mode']} | {r['tokens']} | {r['batch']} | {r['impl']} | {r['seconds'] * 1e3:.2f} | "
                       f"{tps:,.0f} | {'-' if x is None else f'{x:.2f}'} |")
        out.append("")
        for impl in sorted({r["impl"] for r in results.get("ratios", [])}):
            xs = sorted(r["ratio_vs_fla"] for r in results["ratios"] if r["impl"] == impl)
            met = sum(x >= 0.5 for x in xs)
            out.append(f"- {impl}: {xs[0]:.2f} to {xs[-1]:.2f} x FLA's tokens/s (median {xs[len(xs) // 2]:.2f}) "
                       f"over {len(xs)} cases; the target of 0.5x is met in {met}.")
        out.append("")
    if results.get("breakdown"):
        out += ["## Where the time goes (parts timed alone, TF32)", "",
                "| mode | T | batch | chunk-heads | part | ms |", "| --- | --- | --- | --- | --- | --- |"]
        for r in results["breakdown"]:
            ms = f"{r['seconds'] * 1e3:.2f}" if "seconds" in r else f"skipped: {r.get('skipped')}"
            out.append(f"| {r['mode']} | {r['tokens']} | {r['batch']} | {r['chunk_heads']} | {r['part']} | {ms} |")
        out.append("")
    for n in results.get("notes", []):
        out.append(f"- {n}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
