"""The kernel benchmark's timed parts: jitted loops over one window, the sweep's variants, the
load-only kernel, and the phases ``bench.kernels`` runs (sweep, timings per batch, other bit
widths). Every phase appends its rows to ``Run.results`` and saves the report after each group,
so a run cut short keeps what it measured.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Callable

import jax
import jax.numpy as jnp

from bench.fla import time_fla
from bench.harness import on_gpu, time_jax, time_loop
from bench.inputs import random_state, window_tokens
from bench.kernel_checks import run_flush, takes_mosaic
from leapquant_jax import dispatch, windowed
from leapquant_jax.impls import Impl
from leapquant_jax.state import LeapQuantConfig
from pallas_kernels import mosaic_dense, mosaic_flush, mosaic_step
from pallas_kernels.dense_step import dense_step, dense_step_bytes
from pallas_kernels.leapquant_flush import flush_bytes, split_fit, split_quantize, split_reconstruct
from pallas_kernels.leapquant_step import leapquant_step, step_bytes
from pallas_kernels.load_only import load_only_step
from pallas_kernels.shared import num_parts

SKIPPED = "skipped: the run's --time-budget was spent"


# ----------------------------------------------------------------------------- timed loops


def time_split_stages(config, state):
    """µs of each stage of the split flush on ``state`` with every window full (stage 3 in place)."""
    full = state.replace(pos=jnp.full_like(state.pos, config.window))
    s1 = jax.jit(lambda s: split_reconstruct(config, s, only_full=True))
    s2 = jax.jit(lambda d, y: split_fit(config, d, y))
    s3 = jax.jit(lambda s, d, k, u: split_quantize(config, s.replace(pos=full.pos), d, k, u, only_full=True),
                 donate_argnums=(0,))
    dense, y = s1(full)
    k, u = s2(dense, y)
    out = dict(reconstruct=time_loop(lambda c: s1(full), None), fit_xla=time_loop(lambda c: s2(dense, y), None),
               quantize=time_loop(lambda c: s3(c, dense, k, u), jax.tree_util.tree_map(jnp.copy, full)))
    dense = y = k = u = None
    return out


def step_timer(step, **opts):
    """Jitted ``(state, toks) -> (state, o)``: ``o, state = step(state, tok, **opts)`` per token,
    the state donated."""
    def run(state, toks):
        o = None
        for tok in toks:
            o, state = step(state, tok, **opts)
        return state, o

    return jax.jit(run, donate_argnums=(0,))


def dense_timer(dtype, tokens, **opts):
    """Jitted ``(state [B, H, dk, dv], toks) -> (state, o [B, H, dv])``: one dense step per token;
    ``opts`` go to ``dense_step`` as they are (``block_v``, ``num_warps``, and ``num_stages`` where
    ``dense_accepts`` says it takes it)."""
    return step_timer(dense_step, **opts)


def dense_accepts(option: str) -> bool:
    """Whether ``dense_step`` takes keyword ``option`` (the sweep only passes options it takes)."""
    try:
        return option in inspect.signature(dense_step).parameters
    except (TypeError, ValueError):
        return False


def leapquant_window_timer(config, mode, step_opts=None, flush_opts=None):
    """mode: 'window' (p steps + flush of full windows), 'window-checked' (p steps, each followed
    by the flush of full windows, as ``WindowedMethod.step_token`` runs them), 'steps' (p steps),
    'flush' (flush only), 'flush-1/16' (flush with one sequence in 16 full, as in a batch at
    spread-out positions).
    ``step_opts``: the Triton step's options, or ``{"kernel": "mosaic", ...}`` for the Mosaic GPU
    step's."""
    p = config.window
    opts = dict(step_opts or {})
    step = mosaic_step.leapquant_step if opts.pop("kernel", None) == "mosaic" else leapquant_step

    def run(state, toks):
        o = jnp.zeros(())
        if mode in ("window", "window-checked", "steps"):
            state = state.replace(pos=jnp.zeros_like(state.pos))
            for tok in toks:
                o, state = step(config, state, tok, **opts)
                if mode == "window-checked":
                    state = run_flush(config, state, only_full=True, **(flush_opts or {}))
        if mode in ("window", "flush", "flush-1/16"):
            if mode == "flush":
                state = state.replace(pos=jnp.full_like(state.pos, p))
            elif mode == "flush-1/16":
                state = state.replace(pos=jnp.where(jnp.arange(state.pos.shape[0]) % 16 == 0, p, 0).astype(state.pos.dtype))
            state = run_flush(config, state, only_full=True, **(flush_opts or {}))
        return state, o

    return jax.jit(run, donate_argnums=(0,))


def load_only_timer(config, opts):
    """Jitted ``(state, toks) -> (state, o)``: ``p`` load-only steps at positions ``0..p-1``, as the
    step's ``leapquant_window_timer(config, "steps")``."""
    def run(state, toks):
        o = jnp.zeros(())
        state = state.replace(pos=jnp.zeros_like(state.pos))
        for tok in toks:
            o, state = load_only_step(config, state, tok, **opts)
        return state, o

    return jax.jit(run, donate_argnums=(0,))


# ----------------------------------------------------------------------------- bytes


def leapquant_bytes_per_step(config, dk, dv, kda, flush_impl="split"):
    """Bytes per head per token-step of a full window: ``p`` steps and one flush, divided by ``p``."""
    p = config.window
    total = sum(step_bytes(config, dk, dv, pos, kda) for pos in range(p))
    total += impl_flush_bytes(config, dk, dv, kda, flush_impl)
    return total / p


def mean_step_bytes(config, dk, dv, kda):
    """Bytes per head of a step, averaged over the window's positions ``0..p-1``."""
    return sum(step_bytes(config, dk, dv, i, kda) for i in range(config.window)) / config.window


def impl_flush_bytes(config, dk, dv, kda, impl):
    """Bytes per flushed head of a flush implementation (``leapquant_flush.flush_bytes``, or the
    Mosaic GPU flush's ``mosaic_flush_bytes`` for ``impl="mosaic"``)."""
    if impl == "mosaic":
        return mosaic_flush.mosaic_flush_bytes(config, dk, dv, kda)
    return flush_bytes(config, dk, dv, kda, impl)


def bytes_impl(flush_opts, mosaic: bool = False) -> str:
    """The ``flush_bytes`` impl of flush options: every window is full in the timings, where
    ``auto`` runs the split flush, or the Mosaic GPU one where ``mosaic``
    (``takes_mosaic("flush", ...)``); any other impl counts as itself."""
    impl = (flush_opts or {}).get("impl", "auto")
    return ("mosaic" if mosaic else "split") if impl == "auto" else impl


# ----------------------------------------------------------------------------- sweep variants


def _unique(variants):
    out = []
    for v in variants:
        if v not in out:
            out.append(v)
    return out


def dense_variants(dv):
    """Sweep options of the Pallas fp32 dense step (``block_v`` clamped to ``dv``); ``num_stages``
    1 and 2 only where ``dense_step`` takes it."""
    pairs = ((64, 4), (64, 2), (32, 4), (32, 2), (128, 4), (128, 8))
    base = [dict(block_v=min(bv, dv), num_warps=nw) for bv, nw in pairs]
    if dense_accepts("num_stages"):
        base = [dict(v, num_stages=ns) for v in base for ns in (1, 2)]
    return _unique(base)


def step_variants(config, dk, dv, mosaic=False):
    """Sweep options of the LeapQuant step: whole-part int8 dots at several warps and value blocks,
    the lanes reduction, and two heads per program (``heads_per_program=2``, 2 and 4 warps); with
    ``mosaic``, the Mosaic GPU step too (``kernel="mosaic"``: ``pallas_kernels.mosaic_step``, what
    ``auto`` takes on Hopper)."""
    n = dk // num_parts(config.bits)
    out = [dict(reduce="dot", chunk=n, block_v=min(bv, dv), num_warps=nw) for bv, nw in ((128, 4), (128, 2), (128, 1), (64, 1))]
    out.append(dict(reduce="lanes", chunk=16, block_v=min(128, dv), num_warps=4))
    out += [dict(reduce="dot", chunk=n, block_v=dv, num_warps=nw, heads_per_program=2) for nw in (2, 4)]
    if mosaic:
        out.append(dict(kernel="mosaic"))
    return _unique(out)


def flush_variants(kda, dv):
    """Sweep options of the flush of full windows: fused, split (two stage-1 blocks) and auto."""
    out = [dict(impl="fused", num_warps=4 if kda else 8), dict(impl="split", block_v=min(32, dv)),
           dict(impl="split", block_v=min(64, dv)), dict(impl="auto")]
    return _unique(out)


LOAD_ONLY_VARIANTS = tuple(dict(num_warps=nw, num_stages=1) for nw in (1, 2, 4)) + (
    dict(num_warps=2, num_stages=1, chunk=32), dict(num_warps=4, num_stages=1, chunk=32))


def _error(err) -> str:
    return f"{type(err).__name__}: {str(err)[:300]}"


def time_load_only(log, config, bsz, h, dk, dv, copy_bw, kda_modes=(False, True), over=lambda: False):
    """Rows of the "Load-only kernel" section: each of ``LOAD_ONLY_VARIANTS`` per mode, µs per step
    (mean over the window), bytes, GB/s and fraction of ``copy_bw`` (None off the GPU). Once
    ``over()`` (the time budget), the remaining variants are listed as skipped."""
    p = config.window
    rows = []
    nbytes = {kda: mean_step_bytes(config, dk, dv, kda) * bsz * h for kda in (False, True)}
    for kda in kda_modes:
        toks = window_tokens(bsz, h, dk, dv, kda, p)
        for opts in LOAD_ONLY_VARIANTS:
            if opts.get("chunk", 0) >= dk // num_parts(config.bits):
                continue   # the same as the whole-part default
            row = dict(kernel=f"load-only (int{config.bits} step's bytes)", mode="KDA" if kda else "GDN", batch=bsz,
                       heads=h, dk=dk, dv=dv, options=opts, bytes=nbytes[kda], interpret=not on_gpu())
            if over():
                row.update(us=float("nan"), error=SKIPPED)
                rows.append(row)
                log(row)
                continue
            try:
                st = windowed.from_dense(config, random_state(jax.random.PRNGKey(3), bsz, h, dk, dv), per_channel_decay=kda)
                row["us"] = time_jax(load_only_timer(config, opts), st, toks, p)
            except Exception as err:  # reported, not fatal: the rest of the run does not depend on it
                row.update(us=float("nan"), error=_error(err))
            else:
                row["GBps"] = row["bytes"] / (row["us"] * 1e-6) / 1e9
                row["frac_copy_bw"] = row["bytes"] / (row["us"] * 1e-6) / copy_bw if copy_bw else None
            rows.append(row)
            log(row)
        del toks
    return rows


# ----------------------------------------------------------------------------- the run's phases


@dataclasses.dataclass
class Run:
    """One benchmark run: its results (the report's JSON), where rows go (``log``, ``save``), the
    time budget (``over()``), the LeapQuant config timed and the layer's shape."""

    results: dict
    log: Callable
    save: Callable
    over: Callable
    config: LeapQuantConfig
    heads: int
    dim: int

    def state(self, bsz, kda=None):
        """The benchmark's dense state ``[B, H, dim, dim]``, or a LeapQuant state from it (``kda``)."""
        s = random_state(jax.random.PRNGKey(3), bsz, self.heads, self.dim, self.dim)
        return s if kda is None else windowed.from_dense(self.config, s, per_channel_decay=kda)


def default_variants(run: Run, flush_json: str) -> dict:
    """``{kda: {"dense", "step", "flush"}}``: the options the timings use without a sweep."""
    return {kda: dict(dense=dict(block_v=min(64, run.dim), num_warps=4), step={}, flush=json.loads(flush_json))
            for kda in (False, True)}


def flush_stages(run: Run, kda, bsz):
    """Times the split flush's stages (``time_split_stages``) into ``results["split_flush_stages"]``."""
    mode = "KDA" if kda else "GDN"
    try:
        stages = time_split_stages(run.config, run.state(bsz, kda))
    except Exception as err:
        stages = dict(error=_error(err))
    run.results.setdefault("split_flush_stages", {})[mode] = stages
    run.log(dict(split_flush_stages=stages, mode=mode))
    run.save()


def sweep(run: Run, best: dict, bsz, kda_modes):
    """At batch ``bsz``: every variant of the fp32 dense step, the step and the flush (and the flush
    with one sequence in 16 full), into ``results["sweep"]``; ``best[kda]`` takes the fastest of
    each. A variant that does not compile is reported with its error, not fatal."""
    config, h, d, p = run.config, run.heads, run.dim, run.config.window
    bits = config.bits
    for kda in kda_modes:
        mode = "KDA" if kda else "GDN"
        toks = window_tokens(bsz, h, d, d, kda, p)

        def one(kernel, variants, make_state, timer, steps):
            timed = []
            for opts in variants:
                if run.over():
                    row = dict(kernel=kernel, mode=mode, batch=bsz, options=opts, us=float("nan"), error=SKIPPED)
                    run.results["sweep"].append(row)
                    run.log(row)
                    continue
                try:
                    us = time_jax(timer(opts), make_state(), toks, steps)
                except Exception as err:  # a variant that does not compile is reported, not fatal
                    row = dict(kernel=kernel, mode=mode, batch=bsz, options=opts, us=float("nan"), error=_error(err))
                else:
                    row = dict(kernel=kernel, mode=mode, batch=bsz, options=opts, us=us)
                    timed.append(row)
                run.results["sweep"].append(row)
                run.log(row)
            run.save()
            return min(timed, key=lambda r: r["us"])["options"] if timed else None

        def dense_state():
            return run.state(bsz)

        def lq_state():
            return run.state(bsz, kda)

        best[kda]["dense"] = one("pallas fp32 dense step", dense_variants(d), dense_state,
                                 lambda o: dense_timer("float32", toks, **o), p) or best[kda]["dense"]
        probe = windowed.from_dense(config, random_state(jax.random.PRNGKey(3), 8, h, d, d), per_channel_decay=kda)
        mosaic = takes_mosaic("step", config, probe)
        best[kda]["step"] = one(f"leapquant int{bits} step (no flush)", step_variants(config, d, d, mosaic),
                                lq_state, lambda o: leapquant_window_timer(config, "steps", o), p) or {}
        best[kda]["flush"] = one(f"leapquant int{bits} flush (per flush)", flush_variants(kda, d), lq_state,
                                 lambda o: leapquant_window_timer(config, "flush", flush_opts=o), 1) or {}
        # one sequence in 16 full: what a batch at spread-out positions pays
        one(f"leapquant int{bits} flush, 1/16 of sequences full",
            [dict(impl="fused"), dict(impl="split"), dict(impl="auto")], lq_state,
            lambda o: leapquant_window_timer(config, "flush-1/16", flush_opts=o), 1)
        flush_stages(run, kda, bsz)


def time_batch(run: Run, best: dict, bsz, kda, *, fla, copy_bw, swept: bool, dense: bool = True):
    """The timing rows of one batch size and mode: FLA fp32, the Pallas fp32 and bf16 dense steps
    (the Mosaic GPU one and the Triton one where ``auto`` takes the former; left out without
    ``dense``), and the LeapQuant window, steps and flush (with the Triton step beside the Mosaic
    GPU one), with bytes, GB/s, fraction of ``copy_bw`` and ratios to FLA and to the Pallas fp32
    dense step."""
    config, h, d, p = run.config, run.heads, run.dim, run.config.window
    dk = dv = d
    bits = config.bits
    mode = "KDA" if kda else "GDN"
    rows = []
    dense_b = dense_step_bytes(dk, dv, 4, kda) * bsz * h
    if fla is not None:
        rows.append(dict(impl="FLA fp32 fused_recurrent", kind="fla", us=time_fla(fla[kda], bsz, h, dk, dv, kda),
                         bytes=dense_b))
    toks = window_tokens(bsz, h, dk, dv, kda, p)
    for dt, isz in (("float32", 4), ("bfloat16", 2)) if dense else ():
        fresh = lambda dt=dt: run.state(bsz).astype(dt)  # noqa: E731
        nb = dense_step_bytes(dk, dv, isz, kda) * bsz * h
        s = fresh()
        mosaic = takes_mosaic("dense_step", s, toks[0])
        us = time_jax(dense_timer(dt, toks, **best[kda]["dense"]), s, toks, p)
        triton = dict(impl=f"Pallas {dt} dense step", kind=f"dense-{dt}", us=us, bytes=nb)
        if mosaic:
            # what the dense methods run on Hopper (dispatch.dense_step); the Triton row beside it
            us = time_jax(step_timer(mosaic_dense.dense_step), fresh(), toks, p)
            rows.append(dict(impl=f"Pallas {dt} dense step (Mosaic GPU, auto on Hopper)", kind=f"dense-{dt}",
                             us=us, bytes=nb))
            triton.update(impl=f"Pallas {dt} dense step (Triton)", kind=f"dense-triton-{dt}")
        rows.append(triton)
    s = run.state(bsz)
    flush_impl = bytes_impl(best[kda]["flush"],
                            takes_mosaic("flush", config, windowed.from_dense(config, s[:1], per_channel_decay=kda)))
    step_opts = best[kda]["step"]
    step_kernel = " (Mosaic GPU step)"
    if not swept and takes_mosaic("step", config, windowed.from_dense(config, s, per_channel_decay=kda)):
        step_opts, step_kernel = dict(kernel="mosaic"), " (Mosaic GPU step, auto on Hopper)"
    mosaic_step_row = step_opts.get("kernel") == "mosaic"     # the sweep's fastest step, or auto's
    step_kernel = step_kernel if mosaic_step_row else ""
    # the method's window (a flush of full windows after every step) where the flush skips by itself
    flush_kind = best[kda]["flush"].get("impl", "auto")
    skips = flush_kind == "auto" or Impl(flush_kind) in dispatch.SELF_SKIPPING
    checked = ("window-checked",) if skips else ()
    for what in ("window",) + checked + ("steps", "flush") + (("steps-triton",) if mosaic_step_row else ()):
        st = windowed.from_dense(config, s, per_channel_decay=kda)
        steps = 1 if what == "flush" else p
        err = None
        try:
            timer = (leapquant_window_timer(config, "steps", {}) if what == "steps-triton" else
                     leapquant_window_timer(config, what, step_opts, best[kda]["flush"]))
            us = time_jax(timer, st, toks, steps)
        except Exception as e:   # a kernel being changed must not cost the FLA and dense rows
            us, err = float("nan"), _error(e)
        if what == "window":
            nb = leapquant_bytes_per_step(config, dk, dv, kda, flush_impl) * bsz * h
            name = f"LeapQuant int{bits} p={p} (steps + flush, per step)" + step_kernel
        elif what == "window-checked":
            nb = leapquant_bytes_per_step(config, dk, dv, kda, flush_impl) * bsz * h
            name = f"LeapQuant int{bits} p={p} as the method runs it (a flush check after each step, per step)"
        elif what == "steps":
            nb = mean_step_bytes(config, dk, dv, kda) * bsz * h
            name = f"LeapQuant int{bits} step only (mean over window)" + step_kernel
        elif what == "steps-triton":      # the Triton step beside the Mosaic GPU one
            nb = mean_step_bytes(config, dk, dv, kda) * bsz * h
            name = f"LeapQuant int{bits} Triton step (mean over window)"
        else:
            nb = impl_flush_bytes(config, dk, dv, kda, flush_impl) * bsz * h
            name = f"LeapQuant int{bits} flush (per flush)"
        rows.append(dict(impl=name, kind=f"lq-{what}", bits=bits, flush_impl=flush_impl, us=us, bytes=nb))
        if err:
            rows[-1]["error"] = err
    del toks, s
    fla_us = rows[0]["us"] if fla is not None else None
    pallas_us = next((r["us"] for r in rows if r["impl"].startswith("Pallas float32")), None)
    for r in rows:
        r.update(batch=bsz, heads=h, dk=dk, dv=dv, mode=mode, GBps=r["bytes"] / (r["us"] * 1e-6) / 1e9)
        r["frac_copy_bw"] = r["bytes"] / (r["us"] * 1e-6) / copy_bw
        r["speedup_vs_fla_fp32"] = fla_us / r["us"] if fla_us else None
        r["speedup_vs_pallas_fp32"] = pallas_us / r["us"] if pallas_us else None
        run.log(r)
    run.results["timings"] += rows
    run.save()


def time_other_bits(run: Run, best: dict, bits, bsz, kda_modes, swept: bool = False):
    """The window, steps and flush at another bit width (batch ``bsz``) into
    ``results["other_bits"]``: with the step options of the main width where they fit (``swept``),
    else on the step ``auto`` runs (the Mosaic GPU step where it takes the state, as ``time_batch``);
    each row names its step kernel."""
    h, d, p = run.heads, run.dim, run.config.window
    cfg = LeapQuantConfig(bits=bits, window=p, impl="pallas")
    for kda in kda_modes:
        mode = "KDA" if kda else "GDN"
        toks = window_tokens(bsz, h, d, d, kda, p)
        s = run.state(bsz)
        fla_us = next((r["us"] for r in run.results["timings"] if r["batch"] == bsz and r["mode"] == mode
                       and r["impl"].startswith("FLA")), None)
        for what in ("window", "steps", "flush"):
            steps = 1 if what == "flush" else p
            row = dict(impl=f"LeapQuant int{bits} {what}", batch=bsz, mode=mode, bits=bits)
            if run.over():
                row.update(us=float("nan"), error=SKIPPED)
                run.results.setdefault("other_bits", []).append(row)
                run.log(row)
                continue
            try:
                # the step options of the main bit width, where they fit this one's code parts
                opts = dict(best[kda]["step"])
                state = windowed.from_dense(cfg, s, per_channel_decay=kda)
                mosaic = takes_mosaic("step", cfg, state)
                if not swept and mosaic:
                    opts = dict(kernel="mosaic")     # what auto runs on Hopper
                if opts.get("kernel") == "mosaic" and not mosaic:
                    opts = {}                  # the Mosaic GPU step does not take it: the Triton step's defaults
                if what != "flush":
                    row["step_kernel"] = "mosaic" if opts.get("kernel") == "mosaic" else "triton"
                if "chunk" in opts:
                    opts["chunk"] = min(opts["chunk"], d // num_parts(bits))
                    if opts.get("reduce") == "dot" and opts["chunk"] < 32:
                        opts["reduce"] = "lanes"   # the int8 dots need 32 rows (only at dk < 128)
                row["us"] = time_jax(leapquant_window_timer(cfg, what, opts, best[kda]["flush"]), state, toks, steps)
            except Exception as err:
                row.update(us=float("nan"), error=_error(err))
            if what == "window":
                row["speedup_vs_fla_fp32"] = fla_us / row["us"] if fla_us else None
            run.results.setdefault("other_bits", []).append(row)
            run.log(row)
        del toks, s
        run.save()
