"""Kernel benchmark (docs/design.md §6): correctness, variant sweep, then µs per token-step on one layer.

    python -m bench.kernels [--batches 32 128 512] [--heads 32] [--window 16] [--bits 8] [--sweep]
                            [--load-only] [--extra-bits 6 4] [--correctness full|ops|none] [--check-bits 8 6 4]
                            [--check-flush-impls auto split] [--modes gdn kda] [--time-budget SECONDS]
                            [--long-decode TOKENS] [--commit HASH] [--out bench/results]

In this order:

1. Correctness of the compiled kernels on one step and one flush from the same state (ragged
   positions), against ``windowed``'s reference.
2. ``--sweep``: at the largest batch, block/warp/stage variants of the Pallas fp32 dense step,
   the LeapQuant step (``heads_per_program`` too; on Hopper the Mosaic GPU step, with the Triton
   step's defaults timed beside it when it is the fastest) and the flush (``fused``, ``split``,
   ``auto``); the timings below use the fastest of each. A variant the kernels do not
   (yet) accept is reported with its error, not fatal.
   ``--load-only`` (on with ``--sweep``): a Pallas Triton kernel that reads exactly the bytes the
   LeapQuant step reads (``step_bytes``) and does only a trivial reduction of each, at 1, 2 and
   4 warps: the bandwidth Pallas Triton reaches on the step's access pattern, the step's
   ceiling. Off the GPU it runs in interpret mode (a smoke test; its times mean nothing).
3. Timings, one layer of ``--heads`` heads, ``dk = dv = 128``, per batch size, GDN and KDA:
   FLA's fp32 ``fused_recurrent_gated_delta_rule`` / ``fused_recurrent_kda`` (CUDA events via
   ``triton.testing.do_bench``, median), the Pallas fp32 and bf16 dense steps and the LeapQuant
   step amortised over a full window including its flush (``p`` steps + 1 flush, divided by
   ``p``), the step alone and the flush alone (host clock around many back-to-back calls of a
   jitted window after warm-up, median over repeats), and a device-to-device copy (bytes read +
   written) for the bandwidth ceiling.
4. ``--correctness full``: ``make_method("leapquant", impl="pallas")`` against
   ``impl="reference"`` over 64 tokens at ragged window positions (sequences start at
   different steps, so flushes fall at different steps), both against the exact fp32
   recurrence; the Pallas dense steps over 8 tokens; FLA against the exact recurrence. (Last,
   because its compile time is the longest; nothing here depends on its outcome.)

``--long-decode TOKENS`` (after the single-op checks): ``TOKENS`` tokens of the extreme-decay
heads (``synthetic.EXTREME_DECAYS``: alpha from 0, fully decayed, to exactly 1) through
``make_method("leapquant")`` with ``impl="pallas"`` and ``"reference"``, GDN and KDA, batch 4;
every output and state must stay finite; errors per head against the exact fp32 recurrence.

``--modes gdn`` (or ``kda``) checks and times one recurrence only, and ``--time-budget SECONDS``
lists the optional parts still to come once the budget is spent (sweep and load-only variants,
extra bit widths) as skipped, so that a run that must fit a device call still writes its main
rows, targets and report.

Errors are ``||out - ref|| / ||ref||``. Bytes per step are the kernels' docstring counts
(``dense_step_bytes``, ``step_bytes``, ``flush_bytes``); FLA's fp32 kernel moves what the Pallas
fp32 step moves. Results go to ``<out>/kernels-<date>.json`` and ``.md``, with the targets
(``TARGETS``) evaluated at the largest batch against FLA timed in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with PyTorch

import jax
import jax.numpy as jnp
import numpy as np

from leapquant_jax import dispatch, windowed
from leapquant_jax.impls import OPS, Impl
from leapquant_jax.methods import make_method
from leapquant_jax.quantizers import packed_rows
from leapquant_jax.recurrence import delta_rule_token, recurrent_scan
from leapquant_jax.state import LeapQuantConfig, LeapQuantState, WindowBuffer
from pallas_kernels._compat import compiler_params, default_interpret, is_pow2, load, pl
from pallas_kernels.dense_step import dense_step, dense_step_bytes, dense_step_reference
from pallas_kernels.leapquant_flush import flush_bytes, split_fit, split_quantize, split_reconstruct
from pallas_kernels.leapquant_step import check_token, leapquant_step, step_bytes
from pallas_kernels import mosaic_dense, mosaic_flush, mosaic_step
from pallas_kernels.shared import num_parts


# ----------------------------------------------------------------------------- inputs


def random_sequence(key, bsz, t, h, dk, dv, kda):
    """Realistic decode inputs ``[B, T, H, ...]``: L2-normalised keys with a few outlier channels,
    queries carrying ``1/sqrt(dk)``, decays near 1, ``beta`` in (0, 1)."""
    ks = jax.random.split(key, 6)
    chan = jnp.ones((dk,)).at[jnp.array([3, 17, dk - 5])].set(6.0)               # outlier channels
    k = jax.random.normal(ks[0], (bsz, t, h, dk)) * chan
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    q = jax.random.normal(ks[1], (bsz, t, h, dk)) * chan
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True) / np.sqrt(dk)
    v = jax.random.normal(ks[2], (bsz, t, h, dv))
    gshape = (bsz, t, h, dk) if kda else (bsz, t, h)
    g = -jax.nn.softplus(jax.random.normal(ks[3], gshape) - 4.0)                # about -0.02
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (bsz, t, h)))
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def random_state(key, bsz, h, dk, dv):
    """A dense fp32 state with the scale of a decoded one and a few outlier value columns."""
    s = jax.random.normal(key, (bsz, h, dk, dv)) * 0.3
    return s.at[..., :3].multiply(5.0)


def token_at(seq, t):
    return delta_rule_token(**{n: x[:, t] for n, x in seq.items()})


def rel(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ----------------------------------------------------------------------------- correctness


def ragged_decode(method, state, seq, offsets):
    """Decode where sequence ``i`` starts at step ``offsets[i]`` (ragged window positions)."""
    t = seq["q"].shape[1]

    def body(s, i):
        xs = {n: jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False) for n, x in seq.items()}
        o, s = method.step(s, **xs, active=i >= offsets)
        return s, o

    state, o = jax.lax.scan(body, state, jnp.arange(t))
    return jnp.moveaxis(o, 0, 1), state


# The flushes a run can name: a flush kernel (leapquant_jax.impls) or auto, what dispatch runs on the kernels.
FLUSH_IMPLS = ("auto",) + tuple(i for i in OPS["flush"] if i != Impl.REFERENCE)


def takes_mosaic(op, *operands) -> bool:
    """Whether ``dispatch`` runs ``op`` on its Mosaic GPU kernel here (``impl="pallas"``)."""
    return dispatch.resolve(op, "pallas", *operands) is Impl.MOSAIC


def run_flush(config, state, impl="auto", *, only_full=False, **options):
    """The flush kernel ``impl`` names with its ``options``, or for ``"auto"`` (no options) what
    ``dispatch.leapquant_flush`` runs on the kernels (``impl="pallas"``)."""
    if impl == "auto":
        if options:
            raise ValueError(f"the auto flush takes no kernel options, got {sorted(options)}")
        return dispatch.leapquant_flush(config, state, only_full=only_full, impl="pallas")
    return dispatch.kernel("flush", Impl(impl))(config, state, only_full=only_full, **options)


def check_single_ops(log, bits_list=(8,), kda_modes=(False, True), flush_impls=("auto",),
                     config_options=None):
    """One step and one flush of the compiled kernels against the reference from the same state
    (ragged positions 0, 5, 11, 16 of a 16-slot window; the flush covers every sequence), one
    row per flush implementation in ``flush_impls`` (an ``impl`` name, or a dict of ``run_flush``
    options with its ``impl``); ``config_options``: further ``LeapQuantConfig`` fields."""
    rows = []
    bsz, h, dk, dv = 4, 4, 128, 128
    for kda in kda_modes:
        seq = random_sequence(jax.random.PRNGKey(11 + kda), bsz, 16, h, dk, dv, kda)
        s0 = random_state(jax.random.PRNGKey(5), bsz, h, dk, dv)
        for bits in bits_list:
            config = LeapQuantConfig(bits=bits, window=16, impl="pallas", **(config_options or {}))
            st = windowed.from_dense(config, s0, per_channel_decay=kda)
            for i in range(15):
                _, st = windowed.step_reference(config, st, token_at(seq, i))
            st = st.replace(pos=jnp.array([0, 5, 11, 15], jnp.int32))
            tok = token_at(seq, 15)
            o_r, n_r = windowed.step_reference(config, st, tok)
            step_errs = {}
            for reduce in ("dot", "lanes"):
                o_k, n_k = leapquant_step(config, jax.tree_util.tree_map(jnp.copy, st), tok, reduce=reduce)
                step_errs[reduce] = rel(o_k, o_r)
            if takes_mosaic("step", config, st):       # what auto runs on Hopper
                o_m, _ = mosaic_step.leapquant_step(config, jax.tree_util.tree_map(jnp.copy, st), tok)
                step_errs["mosaic"] = rel(o_m, o_r)
            buf_err = max(rel(a, b) for a, b in zip(jax.tree_util.tree_leaves(n_k.buffer), jax.tree_util.tree_leaves(n_r.buffer)))
            f_r = windowed.flush_reference(config, n_r)
            dense = windowed.reconstruct_reference(config, n_r)
            d_r = windowed.decode_checkpoint(config, f_r.checkpoint)
            for impl in flush_impls:
                options = dict(impl) if isinstance(impl, dict) else dict(impl=impl)
                impl = options.pop("impl", "auto")
                if impl == "mosaic" and mosaic_flush.unsupported_reason(config, n_r) is not None:
                    continue
                f_k = run_flush(config, jax.tree_util.tree_map(jnp.copy, n_r), impl, **options)
                d_k = windowed.decode_checkpoint(config, f_k.checkpoint)
                label = "" if impl == "auto" and not options else f" ({impl} flush{', ' if options else ''}" \
                    f"{', '.join(f'{k}={v}' for k, v in options.items())})"
                row = dict(check=f"int{bits} one step + one flush vs reference (same state){label}",
                           mode="KDA" if kda else "GDN",
                           o_rel_err=max(step_errs.values()), state_rel_err=rel(d_k, d_r), buffer_rel_err=buf_err,
                           **{f"o_err_{k}": v for k, v in step_errs.items()},
                           reference_flush_err=rel(d_r, dense), pallas_flush_err=rel(d_k, dense),
                           finite=bool(jnp.all(jnp.isfinite(o_k)) and jnp.all(jnp.isfinite(d_k))))
                rows.append(row)
                log(row)
    return rows


def check_correctness(log, kda_modes=(False, True), bits_list=(8, 6, 4)):
    rows = []
    bsz, h, dk, dv, t = 4, 4, 128, 128, 64
    for kda in kda_modes:
        mode = "KDA" if kda else "GDN"
        seq = random_sequence(jax.random.PRNGKey(1 + kda), bsz, t, h, dk, dv, kda)
        s0 = random_state(jax.random.PRNGKey(7), bsz, h, dk, dv)
        o_exact, s_exact = recurrent_scan(s0, **seq)
        # dense steps, 8 tokens
        for dt in ("float32", "bfloat16"):
            s_k = jnp.copy(s0).astype(dt)          # the kernel donates its state
            s_r = jnp.copy(s0).astype(dt)
            errs = []
            for i in range(8):
                tok = token_at(seq, i)
                o_k, s_k = dense_step(s_k, tok)
                o_r, s_r = dense_step_reference(s_r, tok)
                errs.append(rel(o_k, o_r))
            row = dict(check=f"pallas dense {dt} step vs reference", mode=mode, tokens=8,
                       o_rel_err=max(errs), state_rel_err=rel(s_k.astype(jnp.float32), s_r.astype(jnp.float32)),
                       finite=bool(jnp.all(jnp.isfinite(s_k.astype(jnp.float32)))))
            rows.append(row)
            log(row)
        # LeapQuant through the method, ragged starts
        offsets = jnp.array([0, 3, 9, 14], jnp.int32)
        for bits in bits_list:
            res = {}
            for impl in ("pallas", "reference"):
                m = make_method("leapquant", bits=bits, window=16, impl=impl)
                st = m.from_dense(s0, per_channel_decay=kda)
                o, st = jax.jit(lambda st, seq: ragged_decode(m, st, seq, offsets))(st, seq)
                res[impl] = (o, m.to_dense(st))
            o_ex_r, _ = jax.jit(lambda seq: ragged_decode(make_method("fp32"), make_method("fp32").from_dense(s0), seq, offsets))(seq)
            row = dict(check=f"leapquant int{bits} impl=pallas vs impl=reference (64 tokens, window 16, ragged)",
                       mode=mode, tokens=t, o_rel_err=rel(res["pallas"][0], res["reference"][0]),
                       state_rel_err=rel(res["pallas"][1], res["reference"][1]),
                       reference_o_err_vs_fp32=rel(res["reference"][0], o_ex_r),
                       pallas_o_err_vs_fp32=rel(res["pallas"][0], o_ex_r),
                       finite=bool(jnp.all(jnp.isfinite(res["pallas"][0]))))
            rows.append(row)
            log(row)
        # FLA against the exact fp32 recurrence
        fla = fla_fns()
        if fla is not None:
            import torch
            tq = {n: torch.from_numpy(np.asarray(x)).cuda() for n, x in seq.items()}
            h0 = torch.from_numpy(np.asarray(s0)).cuda()
            o_f, s_f = fla[kda](tq, h0)
            row = dict(check="FLA fp32 fused_recurrent vs reference", mode=mode, tokens=t,
                       o_rel_err=rel(o_f.cpu().numpy(), o_exact), state_rel_err=rel(s_f.cpu().numpy(), s_exact))
            rows.append(row)
            log(row)
    return rows


def check_long_decode(log, tokens, *, chunk=16384, batch=4, impls=("pallas", "reference"), kda_modes=(False, True)):
    """``studies.stability.extreme_decay_check`` for GDN and KDA with each ``impl``: long decodes of
    the extreme-decay heads (alpha from 0 to exactly 1), finiteness and per-head errors vs fp32."""
    from leapquant_jax.studies.stability import extreme_decay_check

    rows = []
    for kda in kda_modes:
        for impl in impls:
            t0 = time.perf_counter()
            r = extreme_decay_check(make_method("leapquant", impl=impl), tokens=tokens, chunk=min(chunk, tokens),
                                    batch=batch, per_channel_decay=kda)
            r.update(impl=impl, seconds=time.perf_counter() - t0)
            rows.append(r)
            log(r)
    return rows


# ----------------------------------------------------------------------------- FLA


def fla_fns():
    """``{False: gdn, True: kda}`` callables ``(tensors [B, T, H, ...], h0) -> (o, state)``, or None."""
    try:
        __import__("torch")
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        from fla.ops.kda import fused_recurrent_kda
    except Exception as err:  # reported in the results
        print(f"FLA unavailable: {err!r}", flush=True)
        return None

    def gdn(x, h0):
        return fused_recurrent_gated_delta_rule(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], scale=1.0,
                                                initial_state=h0, output_final_state=True)

    def kda(x, h0):
        return fused_recurrent_kda(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], scale=1.0,
                                   initial_state=h0, output_final_state=True)

    return {False: gdn, True: kda}


def time_fla(fn, bsz, h, dk, dv, kda):
    import torch
    from triton.testing import do_bench

    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(bsz, 1, h, dk, device="cuda", generator=gen), dim=-1)
    q = torch.nn.functional.normalize(torch.randn(bsz, 1, h, dk, device="cuda", generator=gen), dim=-1) / dk ** 0.5
    v = torch.randn(bsz, 1, h, dv, device="cuda", generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(*((bsz, 1, h, dk) if kda else (bsz, 1, h)), device="cuda", generator=gen) - 4)
    beta = torch.sigmoid(torch.randn(bsz, 1, h, device="cuda", generator=gen))
    h0 = torch.randn(bsz, h, dk, dv, device="cuda", generator=gen) * 0.3
    x = dict(q=q, k=k, v=v, g=g, beta=beta)
    ms = do_bench(lambda: fn(x, h0), warmup=100, rep=500, return_mode="median")
    x = h0 = None   # free before empty_cache (the lambda's cells hold them)
    torch.cuda.empty_cache()
    return ms * 1e3


def time_copy(nbytes=2 << 30):
    import torch
    from triton.testing import do_bench

    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=100, rep=500, return_mode="median")
    src = dst = None
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3)


# ----------------------------------------------------------------------------- JAX timing


def time_loop(step, carry, min_seconds=0.25, repeats=5):
    """Median µs per call of ``carry = step(carry)`` (host clock around ``calls`` back-to-back
    calls, after two warm-up calls)."""
    for _ in range(2):
        carry = step(carry)
    jax.block_until_ready(carry)
    t0 = time.perf_counter()
    carry = step(carry)
    jax.block_until_ready(carry)
    once = max(time.perf_counter() - t0, 1e-6)
    calls = max(3, int(min_seconds / once))
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            carry = step(carry)
        jax.block_until_ready(carry)
        per.append((time.perf_counter() - t0) / calls)
    del carry
    return statistics.median(per) * 1e6


def time_jax(fn, state, toks, steps, **kw):
    """Median µs per token-step of ``state, o = fn(state, toks)`` (``steps`` token-steps per call)."""
    return time_loop(lambda c: fn(c[0], toks), (state, None), **kw) / steps


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


def window_tokens(bsz, h, dk, dv, kda, p, seed=0):
    seq = random_sequence(jax.random.PRNGKey(seed), bsz, p, h, dk, dv, kda)
    return [token_at(seq, i) for i in range(p)]


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
    """mode: 'window' (p steps + flush of full windows), 'steps' (p steps), 'flush' (flush only),
    'flush-1/16' (flush with one sequence in 16 full, as in a batch at spread-out positions).
    ``step_opts``: the Triton step's options, or ``{"kernel": "mosaic", ...}`` for the Mosaic GPU
    step's."""
    p = config.window
    opts = dict(step_opts or {})
    step = mosaic_step.leapquant_step if opts.pop("kernel", None) == "mosaic" else leapquant_step

    def run(state, toks):
        o = jnp.zeros(())
        if mode in ("window", "steps"):
            state = state.replace(pos=jnp.zeros_like(state.pos))
            for tok in toks:
                o, state = step(config, state, tok, **opts)
        if mode in ("window", "flush", "flush-1/16"):
            if mode == "flush":
                state = state.replace(pos=jnp.full_like(state.pos, p))
            elif mode == "flush-1/16":
                state = state.replace(pos=jnp.where(jnp.arange(state.pos.shape[0]) % 16 == 0, p, 0).astype(state.pos.dtype))
            state = run_flush(config, state, only_full=True, **(flush_opts or {}))
        return state, o

    return jax.jit(run, donate_argnums=(0,))


def leapquant_bytes_per_step(config, dk, dv, kda, flush_impl="split"):
    """Bytes per head per token-step of a full window: ``p`` steps and one flush, divided by ``p``."""
    p = config.window
    total = sum(step_bytes(config, dk, dv, pos, kda) for pos in range(p))
    total += impl_flush_bytes(config, dk, dv, kda, flush_impl)
    return total / p


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


# ----------------------------------------------------------------------------- load-only kernel
#
# The LeapQuant step's ceiling on this access pattern: the step's reads and writes (exactly
# ``step_bytes``) with only a trivial reduction of each, so that no load is dead code. If this
# kernel does not reach the copy bandwidth, no arithmetic in the step can.


def _load_only_kernel(*refs, rank, window, chunk, per_channel, smoothing, rec_dtype):
    it = iter(refs)
    pos_ref, q_ref, w_ref, b_ref, v_ref, g_ref, beta_ref = (next(it) for _ in range(7))
    codes_ref, scale_ref = next(it), next(it)
    smooth_ref = next(it) if smoothing else None
    ck_ref, cu_ref = (next(it), next(it)) if rank else (None, None)
    bk_ref, bu_ref, bg_ref = next(it), next(it), next(it)
    o_ref, bk_out, bu_out, bg_out = (next(it) for _ in range(4))

    f32 = jnp.float32
    pos = pos_ref[...]
    live = jnp.arange(window) < pos                                      # [p]
    rows = codes_ref.shape[0]
    # int32 column sums of the codes, ``chunk`` packed rows at a time (bounds the registers)
    zsum = jnp.zeros(o_ref.shape, jnp.int32)
    for c in range(rows // chunk):
        zsum = zsum + jnp.sum(codes_ref[pl.ds(c * chunk, chunk), :].astype(jnp.int32), axis=0)
    col = zsum.astype(f32) * scale_ref[...]                               # [dv]
    s = jnp.sum(q_ref[...] + w_ref[...] + b_ref[...]) + jnp.sum(g_ref[...]) + beta_ref[...]
    if smoothing:
        s = s + jnp.sum(smooth_ref[...])
    if rank and is_pow2(rank):
        s = s + jnp.sum(ck_ref[...].astype(f32))
        col = col + jnp.sum(cu_ref[...].astype(f32), axis=0)
    elif rank:   # a [r, n] block needs r a power of two in Triton: one row at a time
        for c in range(rank):
            s = s + jnp.sum(ck_ref[c, :].astype(f32))
            col = col + cu_ref[c, :].astype(f32)
    # only the live records: masked loads fetch nothing for dead slots, as in the step
    s = s + jnp.sum(load(bk_ref, mask=live[:, None], other=0.0).astype(f32))
    col = col + jnp.sum(load(bu_ref, mask=live[:, None], other=0.0).astype(f32), axis=0)
    s = s + jnp.sum(load(bg_ref, mask=live[:, None] if per_channel else live, other=0.0).astype(f32))
    o = col + v_ref[...] + s
    o_ref[...] = o
    rec = jnp.dtype(rec_dtype)

    @pl.when(pos < window)
    def _append():
        bk_out[pos, :] = w_ref[...].astype(rec)
        bu_out[pos, :] = o.astype(rec)
        if per_channel:
            bg_out[pos, :] = g_ref[...].astype(rec)
        else:
            bg_out[pos] = g_ref[...].astype(rec)


@functools.partial(jax.jit, static_argnames=("config", "num_warps", "num_stages", "chunk", "interpret"))
def load_only_step(config: LeapQuantConfig, state: LeapQuantState, token, *, num_warps: int = 2, num_stages: int = 1,
                   chunk: int | None = None, interpret: bool | None = None):
    """The LeapQuant step's memory traffic with a trivial reduction: one program per (sequence, head).

    state: ``LeapQuantState`` (codes ``[B, H, rows, dv]`` int8, scales ``[B, H, dv]``, smoothing
    ``[B, H, dk]``, Compensator Tokens ``[B, H, r, dk]``/``[B, H, r, dv]`` fp16, records
    ``k [B, H, p, dk]``, ``u [B, H, p, dv]``, ``g [B, H, p]`` or ``[B, H, p, dk]``, ``pos [B]``);
    token: ``Token`` with ``[B, H, ...]`` fields. Reads what ``leapquant_step`` reads (the first
    ``pos`` records only) and returns ``(o [B, H, dv] fp32, state with pos + 1)`` where

        s = sum(q + w + b) + sum(g) + beta + sum(smooth) + sum(comp_k) + sum(live k) + sum(live g)
        o = colsum(codes) * scale + colsum(comp_u) + colsum(live u) + v + s

    and the record ``(w, o, g)`` (record dtype) is stored at slot ``pos`` when ``pos < p``: bytes
    moved per head equal ``step_bytes(config, dk, dv, pos, per_channel)``. ``chunk``: packed code
    rows per load (a power of two dividing a code part; default the whole part).
    """
    check_token(state, token)
    if state.key_heads != state.shape[1]:
        raise ValueError(f"the load-only kernel reads one key record per value head; the state keeps them for "
                         f"{state.key_heads} key heads of {state.shape[1]}")
    interpret = default_interpret() if interpret is None else interpret
    bsz, h, dk, dv = state.shape
    ckpt, buf = state.checkpoint, state.buffer
    per_channel = state.per_channel_decay
    p, r = config.window, config.effective_rank
    rows = packed_rows(dk, config.bits)
    n = dk // num_parts(config.bits)
    ch = n if chunk is None else chunk
    if not is_pow2(ch) or n % ch:
        raise ValueError(f"chunk={ch} must be a power of two dividing the {n} rows of a code part")
    f32 = jnp.float32

    def spec(*shape):
        return pl.BlockSpec((None, None) + shape, lambda i, j: (i, j) + (0,) * len(shape))

    scalar = pl.BlockSpec((None, None), lambda i, j: (i, j))
    args = [state.pos.astype(jnp.int32), token.q.astype(f32), token.w.astype(f32), token.b.astype(f32),
            token.v.astype(f32), token.g.astype(f32), token.beta.astype(f32), ckpt.residual.codes, ckpt.residual.scale]
    specs = [pl.BlockSpec((None,), lambda i, j: (i,)), spec(dk), spec(dk), spec(dk), spec(dv),
             spec(dk) if per_channel else scalar, scalar, spec(rows, dv), spec(dv)]
    if config.smoothing:
        args.append(ckpt.smooth)
        specs.append(spec(dk))
    if r:
        args += [ckpt.comp_k, ckpt.comp_u]
        specs += [spec(r, dk), spec(r, dv)]
    g_spec = spec(p, dk) if per_channel else spec(p)
    first_buf = len(args)
    args += [buf.k, buf.u, buf.g]
    specs += [spec(p, dk), spec(p, dv), g_spec]
    kernel = functools.partial(_load_only_kernel, rank=r, window=p, chunk=ch, per_channel=per_channel,
                               smoothing=config.smoothing, rec_dtype=config.record_dtype)
    o, bk, bu, bg = pl.pallas_call(
        kernel,
        grid=(bsz, h),
        in_specs=specs,
        out_specs=[spec(dv), spec(p, dk), spec(p, dv), g_spec],
        out_shape=[jax.ShapeDtypeStruct((bsz, h, dv), f32), jax.ShapeDtypeStruct(buf.k.shape, buf.k.dtype),
                   jax.ShapeDtypeStruct(buf.u.shape, buf.u.dtype), jax.ShapeDtypeStruct(buf.g.shape, buf.g.dtype)],
        input_output_aliases={first_buf: 1, first_buf + 1: 2, first_buf + 2: 3},
        compiler_params=compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"leapquant_load_only_{'kda' if per_channel else 'gdn'}_int{config.bits}",
    )(*args)
    return o, LeapQuantState(checkpoint=ckpt, buffer=WindowBuffer(k=bk, u=bu, g=bg), pos=state.pos + 1)


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


LOAD_ONLY_VARIANTS = tuple(dict(num_warps=nw, num_stages=1) for nw in (1, 2, 4)) + (
    dict(num_warps=2, num_stages=1, chunk=32), dict(num_warps=4, num_stages=1, chunk=32))


SKIPPED = "skipped: the run's --time-budget was spent"


def time_load_only(log, config, bsz, h, dk, dv, copy_bw, kda_modes=(False, True), over=lambda: False):
    """Rows of the "Load-only kernel" section: each of ``LOAD_ONLY_VARIANTS`` per mode, µs per step
    (mean over the window), bytes, GB/s and fraction of ``copy_bw`` (None off the GPU). Once
    ``over()`` (the time budget), the remaining variants are listed as skipped."""
    p = config.window
    rows = []
    nbytes = {kda: sum(step_bytes(config, dk, dv, i, kda) for i in range(p)) / p * bsz * h for kda in (False, True)}
    for kda in kda_modes:
        toks = window_tokens(bsz, h, dk, dv, kda, p)
        for opts in LOAD_ONLY_VARIANTS:
            if opts.get("chunk", 0) >= dk // num_parts(config.bits):
                continue   # the same as the whole-part default
            row = dict(kernel=f"load-only (int{config.bits} step's bytes)", mode="KDA" if kda else "GDN", batch=bsz,
                       heads=h, dk=dk, dv=dv, options=opts, bytes=nbytes[kda], interpret=default_interpret())
            if over():
                row.update(us=float("nan"), error=SKIPPED)
                rows.append(row)
                log(row)
                continue
            try:
                st = windowed.from_dense(config, random_state(jax.random.PRNGKey(3), bsz, h, dk, dv), per_channel_decay=kda)
                row["us"] = time_jax(load_only_timer(config, opts), st, toks, p)
            except Exception as err:  # reported, not fatal: the rest of the run does not depend on it
                row.update(us=float("nan"), error=f"{type(err).__name__}: {str(err)[:300]}")
            else:
                row["GBps"] = row["bytes"] / (row["us"] * 1e-6) / 1e9
                row["frac_copy_bw"] = row["bytes"] / (row["us"] * 1e-6) / copy_bw if copy_bw else None
            rows.append(row)
            log(row)
        del toks
    return rows


# ----------------------------------------------------------------------------- main


def environment(commit):
    info = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                python=platform.python_version(), jax=jax.__version__,
                devices=[str(d) for d in jax.devices()], commit=commit,
                command=" ".join([os.path.basename(sys.executable), "-m", "bench.kernels"] + sys.argv[1:]))
    try:
        import torch
        import triton
        info.update(torch=torch.__version__, triton=triton.__version__,
                    gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    except Exception as err:
        info["torch"] = f"unavailable ({err!r})"
    try:
        from importlib.metadata import version
        info["fla"] = version("fla-core")
    except Exception:
        info["fla"] = None
    return info


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return None


def results_log(out: str, prefix: str):
    """``(base, say)``: ``out/<prefix>-<UTC time>`` (the folder made) and a ``say(*x)`` that prints
    its arguments and appends them to ``base.log``, flushed at once (a run cut short keeps them)."""
    os.makedirs(out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = os.path.join(out, f"{prefix}-{stamp}")
    log = open(base + ".log", "w")

    def say(*x):
        line = " ".join(str(y) for y in x)
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    return base, say


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--sweep", action="store_true", help="also time block_v / num_warps variants at the largest batch")
    ap.add_argument("--load-only", action="store_true",
                    help="time a kernel reading exactly the step's bytes at the largest batch (on with --sweep; "
                         "off the GPU: interpret mode, a smoke test)")
    ap.add_argument("--correctness", choices=("full", "ops", "none"), default="full",
                    help="full: single ops and 64-token decodes; ops: one step + one flush; none")
    ap.add_argument("--check-bits", type=int, nargs="+", default=[8, 6, 4])
    ap.add_argument("--check-flush-impls", nargs="+", default=["auto"], choices=list(FLUSH_IMPLS),
                    help="flush implementations the single-op checks compare with the reference")
    ap.add_argument("--flush", default="{}", metavar="JSON",
                    help='the timed flush: run_flush options (default {}: impl auto; {"impl": "mosaic"}: the Mosaic '
                         'GPU flush); --sweep replaces it with the fastest of its flush variants')
    ap.add_argument("--flush-stages", action="store_true",
                    help="time the split flush's stages at the largest batch (also done by --sweep)")
    ap.add_argument("--extra-bits", type=int, nargs="*", default=[],
                    help="other bit widths to time (window, steps, flush) at the largest batch")
    ap.add_argument("--long-decode", type=int, default=0, metavar="TOKENS",
                    help="decode this many tokens of the extreme-decay heads per mode and impl (0: skip)")
    ap.add_argument("--checks-only", action="store_true", help="stop after the single-op and long-decode checks")
    ap.add_argument("--modes", nargs="+", choices=("gdn", "kda"), default=["gdn", "kda"],
                    help="which recurrences to check and time (a run that must fit a device call can take one)")
    ap.add_argument("--time-budget", type=float, default=0.0, metavar="SECONDS",
                    help="once this many seconds have passed, the optional parts (sweep and load-only variants, "
                         "extra bit widths) are listed as skipped, so that the main rows and the report still come "
                         "(0: no budget)")
    ap.add_argument("--commit", default=None, help="commit hash to record (default: git rev-parse HEAD)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    kda_modes = tuple(m == "kda" for m in dict.fromkeys(args.modes))
    started = time.monotonic()

    def over() -> bool:
        return bool(args.time_budget) and time.monotonic() - started > args.time_budget

    def log(x):
        print(json.dumps(x) if isinstance(x, dict) else x, flush=True)

    env = environment(args.commit or git_commit())
    log(env)
    on_gpu = _on_gpu()
    results = dict(environment=env, bits=args.bits, correctness=[], timings=[], sweep=[], notes=[])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"kernels-{stamp}")

    def save():
        with open(base + ".json", "w") as f:
            json.dump(results, f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(markdown(results))

    if args.correctness != "none":
        results["correctness"] = check_single_ops(log, tuple(args.check_bits), kda_modes,
                                                  flush_impls=tuple(args.check_flush_impls))
        save()
    if args.long_decode:
        results["long_decode"] = check_long_decode(log, args.long_decode,
                                                   impls=("pallas", "reference") if _on_gpu() else ("reference",),
                                                   kda_modes=kda_modes)
        save()
    if args.checks_only:
        return results
    if not on_gpu:
        if args.correctness == "full":
            results["correctness"] += check_correctness(log, kda_modes, bits_list=tuple(args.check_bits))
        if args.load_only:
            cfg = LeapQuantConfig(bits=args.bits, window=args.window, impl="pallas")
            results["load_only"] = time_load_only(log, cfg, max(args.batches), args.heads, args.dim, args.dim, None,
                                                  kda_modes, over)
            results["notes"].append("no GPU: the load-only kernel ran in interpret mode (its times mean nothing)")
        log("no GPU: timings skipped")
        save()
        return results

    fla = fla_fns()
    copy_bw = time_copy()
    results["copy_bandwidth_Bps"] = copy_bw
    log(dict(copy_bandwidth_TBps=copy_bw / 1e12))
    h, dk, dv = args.heads, args.dim, args.dim
    config = LeapQuantConfig(bits=args.bits, window=args.window, impl="pallas")
    p = config.window

    def flush_stages(kda, bsz):
        mode = "KDA" if kda else "GDN"
        try:
            st = windowed.from_dense(config, random_state(jax.random.PRNGKey(3), bsz, h, dk, dv), per_channel_decay=kda)
            stages = time_split_stages(config, st)
        except Exception as err:
            stages = dict(error=f"{type(err).__name__}: {str(err)[:300]}")
        results.setdefault("split_flush_stages", {})[mode] = stages
        log(dict(split_flush_stages=stages, mode=mode))
        save()

    if args.flush_stages and not args.sweep:
        for kda in kda_modes:
            flush_stages(kda, max(args.batches))

    # Sweep first (largest batch): the main timings use the fastest variant of each kernel.
    best = {False: {}, True: {}}
    for kda in (False, True):
        best[kda] = dict(dense=dict(block_v=min(64, dv), num_warps=4), step={}, flush=json.loads(args.flush))
    if args.load_only or args.sweep:
        results["load_only"] = time_load_only(log, config, max(args.batches), h, dk, dv, copy_bw, kda_modes, over)
        save()
    if args.sweep:
        bsz = max(args.batches)
        for kda in kda_modes:
            mode = "KDA" if kda else "GDN"
            toks = window_tokens(bsz, h, dk, dv, kda, p)

            def sweep(kernel, variants, make_state, timer, steps, toks=toks):
                timed = []
                for opts in variants:
                    if over():
                        row = dict(kernel=kernel, mode=mode, batch=bsz, options=opts, us=float("nan"), error=SKIPPED)
                        results["sweep"].append(row); log(row)
                        continue
                    try:
                        us = time_jax(timer(opts), make_state(), toks, steps)
                    except Exception as err:  # a variant that does not compile is reported, not fatal
                        row = dict(kernel=kernel, mode=mode, batch=bsz, options=opts, us=float("nan"),
                                   error=f"{type(err).__name__}: {str(err)[:300]}")
                    else:
                        row = dict(kernel=kernel, mode=mode, batch=bsz, options=opts, us=us)
                        timed.append(row)
                    results["sweep"].append(row); log(row)
                save()
                return min(timed, key=lambda r: r["us"])["options"] if timed else None

            def dense_state():
                return random_state(jax.random.PRNGKey(3), bsz, h, dk, dv)

            def lq_state():
                return windowed.from_dense(config, random_state(jax.random.PRNGKey(3), bsz, h, dk, dv), per_channel_decay=kda)

            best[kda]["dense"] = sweep("pallas fp32 dense step", dense_variants(dv), dense_state,
                                       lambda o, toks=toks: dense_timer("float32", toks, **o), p) or best[kda]["dense"]
            probe = windowed.from_dense(config, random_state(jax.random.PRNGKey(3), 8, h, dk, dv), per_channel_decay=kda)
            mosaic = takes_mosaic("step", config, probe)
            best[kda]["step"] = sweep(f"leapquant int{args.bits} step (no flush)", step_variants(config, dk, dv, mosaic),
                                      lq_state, lambda o: leapquant_window_timer(config, "steps", o), p) or {}
            best[kda]["flush"] = sweep(f"leapquant int{args.bits} flush (per flush)", flush_variants(kda, dv), lq_state,
                                       lambda o: leapquant_window_timer(config, "flush", flush_opts=o), 1) or {}
            # one sequence in 16 full: what a batch at spread-out positions pays
            sweep(f"leapquant int{args.bits} flush, 1/16 of sequences full",
                  [dict(impl="fused"), dict(impl="split"), dict(impl="auto")], lq_state,
                  lambda o: leapquant_window_timer(config, "flush-1/16", flush_opts=o), 1)
            flush_stages(kda, bsz)
    results["chosen_variants"] = {("KDA" if k else "GDN"): v for k, v in best.items()}
    log(results["chosen_variants"])

    for bsz in args.batches:
        for kda in kda_modes:
            mode = "KDA" if kda else "GDN"
            rows = []
            dense_b = dense_step_bytes(dk, dv, 4, kda) * bsz * h
            if fla is not None:
                us = time_fla(fla[kda], bsz, h, dk, dv, kda)
                rows.append(dict(impl="FLA fp32 fused_recurrent", kind="fla", us=us, bytes=dense_b))
            toks = window_tokens(bsz, h, dk, dv, kda, p)
            for dt, isz in (("float32", 4), ("bfloat16", 2)):
                fresh = lambda dt=dt: random_state(jax.random.PRNGKey(3), bsz, h, dk, dv).astype(dt)
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
            s = random_state(jax.random.PRNGKey(3), bsz, h, dk, dv)
            flush_impl = bytes_impl(best[kda]["flush"],
                                    takes_mosaic("flush", config, windowed.from_dense(config, s[:1], per_channel_decay=kda)))
            step_opts = best[kda]["step"]
            step_kernel = " (Mosaic GPU step)"
            if not args.sweep and takes_mosaic("step", config, windowed.from_dense(config, s, per_channel_decay=kda)):
                step_opts, step_kernel = dict(kernel="mosaic"), " (Mosaic GPU step, auto on Hopper)"
            mosaic_step_row = step_opts.get("kernel") == "mosaic"     # the sweep's fastest step, or auto's
            step_kernel = step_kernel if mosaic_step_row else ""
            for what in ("window", "steps", "flush") + (("steps-triton",) if mosaic_step_row else ()):
                st = windowed.from_dense(config, s, per_channel_decay=kda)
                steps = 1 if what == "flush" else p
                err = None
                try:
                    timer = (leapquant_window_timer(config, "steps", {}) if what == "steps-triton" else
                             leapquant_window_timer(config, what, step_opts, best[kda]["flush"]))
                    us = time_jax(timer, st, toks, steps)
                except Exception as e:   # a kernel being changed must not cost the FLA and dense rows
                    us, err = float("nan"), f"{type(e).__name__}: {str(e)[:300]}"
                if what == "window":
                    nb = leapquant_bytes_per_step(config, dk, dv, kda, flush_impl) * bsz * h
                    name = f"LeapQuant int{args.bits} p={p} (steps + flush, per step)" + step_kernel
                elif what == "steps":
                    nb = sum(step_bytes(config, dk, dv, i, kda) for i in range(p)) / p * bsz * h
                    name = f"LeapQuant int{args.bits} step only (mean over window)" + step_kernel
                elif what == "steps-triton":      # the Triton step beside the Mosaic GPU one
                    nb = sum(step_bytes(config, dk, dv, i, kda) for i in range(p)) / p * bsz * h
                    name = f"LeapQuant int{args.bits} Triton step (mean over window)"
                else:
                    nb = impl_flush_bytes(config, dk, dv, kda, flush_impl) * bsz * h
                    name = f"LeapQuant int{args.bits} flush (per flush)"
                rows.append(dict(impl=name, kind=f"lq-{what}", bits=args.bits, flush_impl=flush_impl, us=us, bytes=nb))
                if err:
                    rows[-1]["error"] = err
            del toks, s
            fla_us = rows[0]["us"] if fla is not None else None
            pallas_us = next(r["us"] for r in rows if r["impl"].startswith("Pallas float32"))
            for r in rows:
                r.update(batch=bsz, heads=h, dk=dk, dv=dv, mode=mode, GBps=r["bytes"] / (r["us"] * 1e-6) / 1e9)
                r["frac_copy_bw"] = r["bytes"] / (r["us"] * 1e-6) / copy_bw
                r["speedup_vs_fla_fp32"] = fla_us / r["us"] if fla_us else None
                r["speedup_vs_pallas_fp32"] = pallas_us / r["us"]
                log(r)
            results["timings"] += rows
            save()
    for bits in args.extra_bits:
        bsz = max(args.batches)
        cfg = LeapQuantConfig(bits=bits, window=args.window, impl="pallas")
        for kda in kda_modes:
            mode = "KDA" if kda else "GDN"
            toks = window_tokens(bsz, h, dk, dv, kda, p)
            s = random_state(jax.random.PRNGKey(3), bsz, h, dk, dv)
            fla_us = next((r["us"] for r in results["timings"] if r["batch"] == bsz and r["mode"] == mode
                           and r["impl"].startswith("FLA")), None)
            for what in ("window", "steps", "flush"):
                steps = 1 if what == "flush" else p
                row = dict(impl=f"LeapQuant int{bits} {what}", batch=bsz, mode=mode, bits=bits)
                if over():
                    row.update(us=float("nan"), error=SKIPPED)
                    results.setdefault("other_bits", []).append(row)
                    log(row)
                    continue
                try:
                    # the step options of the main bit width, where they fit this one's code parts
                    opts = dict(best[kda]["step"])
                    if opts.get("kernel") == "mosaic":
                        opts = {}                  # the Mosaic GPU step reads 8 bits only: the Triton step's defaults
                    if "chunk" in opts:
                        opts["chunk"] = min(opts["chunk"], dk // num_parts(bits))
                        if opts.get("reduce") == "dot" and opts["chunk"] < 32:
                            opts["reduce"] = "lanes"   # the int8 dots need 32 rows (only at dk < 128)
                    row["us"] = time_jax(leapquant_window_timer(cfg, what, opts, best[kda]["flush"]),
                                         windowed.from_dense(cfg, s, per_channel_decay=kda), toks, steps)
                except Exception as err:
                    row.update(us=float("nan"), error=f"{type(err).__name__}: {str(err)[:300]}")
                if what == "window":
                    row["speedup_vs_fla_fp32"] = fla_us / row["us"] if fla_us else None
                results.setdefault("other_bits", []).append(row)
                log(row)
            del toks, s
            save()
    if args.correctness == "full" and on_gpu:
        results["correctness"] += check_correctness(log, kda_modes, bits_list=tuple(args.check_bits))
        save()
    results["targets"] = targets(results)
    save()
    log(markdown(results))
    return results


TARGETS = (  # (what, mode, timing row kind, measure, sense, wanted) at the largest batch, FLA from the same run
    ("amortised per token-step vs FLA fp32", "GDN", "lq-window", "speedup_vs_fla_fp32", ">=", 4.0),
    ("amortised per token-step vs FLA fp32", "KDA", "lq-window", "speedup_vs_fla_fp32", ">=", 3.5),
    ("step alone: bandwidth on its bytes / copy bandwidth", "GDN", "lq-steps", "frac_copy_bw", ">=", 0.70),
    ("step alone: bandwidth on its bytes / copy bandwidth", "KDA", "lq-steps", "frac_copy_bw", ">=", 0.70),
    ("flush of full windows, µs per window", "GDN", "lq-flush", "us", "<=", 600.0),
    ("flush of full windows, µs per window", "KDA", "lq-flush", "us", "<=", 600.0),
    ("flush, KB (10^3 B) moved per head", "GDN", "lq-flush", "kb_per_head", "<=", 60.0),
    ("flush, KB (10^3 B) moved per head", "KDA", "lq-flush", "kb_per_head", "<=", 60.0),
    ("Pallas fp32 dense step vs FLA fp32", "GDN", "dense-float32", "speedup_vs_fla_fp32", ">=", 0.95),
    ("Pallas fp32 dense step vs FLA fp32", "KDA", "dense-float32", "speedup_vs_fla_fp32", ">=", 1.0),
)


def row_kind(row) -> str:
    """The kind of a timing row (``fla``, ``dense-float32``, ``dense-bfloat16``, ``lq-window``,
    ``lq-steps``, ``lq-flush``), from its name for results written before rows carried one."""
    if row.get("kind"):
        return row["kind"]
    name = row["impl"]
    for prefix, kind in (("FLA", "fla"), ("Pallas float32", "dense-float32"), ("Pallas bfloat16", "dense-bfloat16")):
        if name.startswith(prefix):
            return kind
    for part, kind in (("steps + flush", "lq-window"), ("step only", "lq-steps"), ("flush (per flush)", "lq-flush")):
        if part in name:
            return kind
    return "other"


def _measure(row, key):
    if key == "kb_per_head":
        return row["bytes"] / (row["batch"] * row["heads"]) / 1e3
    return row.get(key)


def targets(results):
    """Each of ``TARGETS`` at the largest batch: ``dict(target, mode, batch, measured, wanted, sense,
    met, missing_factor)``; ``measured``/``met`` are None where the run has no such row (FLA absent).
    ``missing_factor``: ``wanted / measured`` for a ``>=`` target, ``measured / wanted`` for ``<=``."""
    rows = results.get("timings") or []
    if not rows:
        return []
    bsz = max(r["batch"] for r in rows)
    out = []
    for what, mode, kind, key, sense, wanted in TARGETS:
        hit = next((r for r in rows if r["batch"] == bsz and r["mode"] == mode and row_kind(r) == kind), None)
        value = _measure(hit, key) if hit is not None else None
        label = what
        if hit is not None and kind.startswith("lq"):
            bits = hit.get("bits", "")
            fl = f", flush {hit['flush_impl']}" if hit.get("flush_impl") and kind != "lq-steps" else ""
            label = f"LeapQuant int{bits} {what}{fl}"
        met = missing = None
        if value is not None and value == value:   # not NaN
            met = value >= wanted if sense == ">=" else value <= wanted
            if not met:
                missing = (wanted / value if value else float("inf")) if sense == ">=" else value / wanted
        out.append(dict(target=f"{mode}: {label}", mode=mode, batch=bsz, key=key, measured=value, wanted=wanted,
                        sense=sense, met=met, missing_factor=missing))
    return out


def _fmt_target(key, x):
    if x is None:
        return "-"
    if key == "frac_copy_bw":
        return f"{100 * x:.0f}%"
    if key == "us":
        return f"{x:.0f} µs"
    if key == "kb_per_head":
        return f"{x:.1f} KB"
    return f"{x:.2f}×"


def _cell(text, n=160):
    return str(text)[:n].replace("|", "/").replace("\n", " ")


def markdown(results) -> str:
    env = results["environment"]
    out = [f"# Kernel benchmark ({env.get('gpu') or env['devices']})", "",
           f"date {env['date']}; jax {env['jax']}; torch {env.get('torch')}; triton {env.get('triton')}; "
           f"fla-core {env.get('fla')}; commit {env.get('commit')}; command `{env['command']}`", ""]
    if "copy_bandwidth_Bps" in results:
        out += [f"Device-to-device copy: {results['copy_bandwidth_Bps'] / 1e12:.2f} TB/s (read + write).", ""]
    if results["correctness"]:
        out += ["## Correctness (compiled kernels)", "", "| check | mode | o rel err | state rel err | other |", "| --- | --- | --- | --- | --- |"]
        for r in results["correctness"]:
            extra = {k: v for k, v in r.items() if k not in ("check", "mode", "o_rel_err", "state_rel_err", "tokens")}
            ex = ", ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items())
            out.append(f"| {r['check']} | {r['mode']} | {r['o_rel_err']:.2e} | {r['state_rel_err']:.2e} | {ex} |")
        out.append("")
    if results.get("long_decode"):
        from leapquant_jax.synthetic import EXTREME_DECAYS

        r0 = results["long_decode"][0]
        out += [f"## Long decodes of extreme-decay heads ({r0['tokens']} tokens, batch {r0['batch']}, "
                f"{r0['dk']}x{r0['dv']}, LeapQuant int8 against exact fp32)", "",
                "Per head (alpha): final state relative error / output relative error over all tokens; "
                "NaN marks a head with a non-finite output or state.", "",
                "| mode | impl | all finite | s | " + " | ".join(f"a={a:.8g}" for a in EXTREME_DECAYS) + " |",
                "| --- | --- | --- | --- | " + " | ".join("---" for _ in EXTREME_DECAYS) + " |"]
        for r in results["long_decode"]:
            cells = [f"{h['state_rel_error']:.1e} / {h['output_rel_error']:.1e}" if h["finite"] else "NaN"
                     for h in r["heads"]]
            out.append(f"| {r['mode']} | {r['impl']} | {'yes' if r['all_finite'] else 'no'} | {r['seconds']:.0f} | "
                       + " | ".join(cells) + " |")
        out.append("")
    if results["timings"]:
        out += ["## Timings (µs per token-step, medians)", "",
                "| batch | mode | impl | µs/step | MB moved/step | GB/s | % copy BW | × vs FLA fp32 | × vs Pallas fp32 |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in results["timings"]:
            if r.get("error"):
                out.append(f"| {r['batch']} | {r['mode']} | {r['impl']} | error: {_cell(r['error'])} | | | | | |")
                continue
            fla = f"{r['speedup_vs_fla_fp32']:.2f}" if r.get("speedup_vs_fla_fp32") else "-"
            out.append(f"| {r['batch']} | {r['mode']} | {r['impl']} | {r['us']:.1f} | {r['bytes'] / 1e6:.1f} | "
                       f"{r['GBps']:.0f} | {100 * r['frac_copy_bw']:.0f} | {fla} | {r['speedup_vs_pallas_fp32']:.2f} |")
        out.append("")
    if results.get("load_only"):
        lo = results["load_only"]
        steps = {(r["batch"], r["mode"]): r["us"] for r in results["timings"] if row_kind(r) == "lq-steps"}
        out += ["## Load-only kernel (the step's bytes)", "",
                f"A Pallas Triton kernel, one program per (sequence, head), reading exactly what the LeapQuant "
                f"step reads (codes, scales, smoothing, Compensator Tokens, the live records, the token) with a "
                f"trivial reduction of each, and writing the output and one record: `step_bytes` per head. "
                f"µs per step, mean over window positions 0..p-1, batch {lo[0]['batch']}, {lo[0]['heads']} heads, "
                f"{lo[0]['dk']}x{lo[0]['dv']}"
                + (" (interpret mode: not a timing)." if lo[0].get("interpret") else "."), "",
                "| mode | options | µs/step | MB/step | GB/s | % copy BW | step µs (same batch) | step / load-only |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in lo:
            if r.get("error"):
                out.append(f"| {r['mode']} | {r['options']} | error: {_cell(r['error'])} | | | | | |")
                continue
            st = steps.get((r["batch"], r["mode"]))
            bw = f"{100 * r['frac_copy_bw']:.0f}" if r.get("frac_copy_bw") else "-"
            out.append(f"| {r['mode']} | {r['options']} | {r['us']:.1f} | {r['bytes'] / 1e6:.1f} | {r['GBps']:.0f} | {bw} | "
                       + (f"{st:.1f} | {st / r['us']:.2f} |" if st else "- | - |"))
        out.append("")
    if results.get("split_flush_stages"):
        out += ["## Split flush stages (largest batch, µs per flush, every window full)", "",
                "| mode | stage 1: reconstruct + S S^T Q0 | stage 2: fit in XLA | stage 3: residual, quantize, write |",
                "| --- | --- | --- | --- |"]
        for mode, st in results["split_flush_stages"].items():
            if "error" in st:
                out.append(f"| {mode} | {st['error']} | | |")
            else:
                out.append(f"| {mode} | {st['reconstruct']:.0f} | {st['fit_xla']:.0f} | {st['quantize']:.0f} |")
        out.append("")
    if results.get("other_bits"):
        bsz = results["other_bits"][0]["batch"]
        out += [f"## Other bit widths (batch {bsz}, µs per token-step; flush: per flush)", "",
                "| bits | mode | what | µs | × vs FLA fp32 |", "| --- | --- | --- | --- | --- |"]
        for r in results["other_bits"]:
            sp = f"{r['speedup_vs_fla_fp32']:.2f}" if r.get("speedup_vs_fla_fp32") else "-"
            us = f"error: {_cell(r['error'])}" if r.get("error") else f"{r['us']:.1f}"
            out.append(f"| {r['bits']} | {r['mode']} | {r['impl']} | {us} | {sp} |")
        out.append("")
        # the amortised window (p steps + flush, per step) of every bit width timed, against FLA fp32
        amort = {}
        for r in results["timings"]:
            if r["batch"] == bsz and row_kind(r) == "lq-window":
                amort[(r.get("bits") or results.get("bits"), r["mode"])] = r
        for r in results["other_bits"]:
            if r["impl"].endswith(" window") and not r.get("error"):
                amort[(r["bits"], r["mode"])] = r
        if amort:
            out += [f"### Amortised per token-step vs FLA fp32 by bit width (batch {bsz}, p steps + flush)", "",
                    "| bits | GDN µs | GDN × vs FLA fp32 | KDA µs | KDA × vs FLA fp32 |", "| --- | --- | --- | --- | --- |"]
            for bits in sorted({b for b, _ in amort if b is not None}, reverse=True):
                cells = []
                for mode in ("GDN", "KDA"):
                    r = amort.get((bits, mode))
                    sp = r.get("speedup_vs_fla_fp32") if r else None
                    cells += [f"{r['us']:.1f}" if r else "-", f"{sp:.2f}" if sp else "-"]
                out.append(f"| {bits} | " + " | ".join(cells) + " |")
            out.append("")
    if results["sweep"]:
        out += [f"## Variant sweep (batch {results['sweep'][0]['batch']}; the timings above use the fastest)", "",
                "| kernel | mode | options | µs | error |", "| --- | --- | --- | --- | --- |"]
        for r in results["sweep"]:
            out.append(f"| {r['kernel']} | {r['mode']} | {r['options']} | {r['us']:.1f} | {_cell(r.get('error', ''))} |")
        out.append("")
    tg = targets(results)
    if tg:
        out += [f"## Targets (batch {tg[0]['batch']}, FLA fp32 timed in the same run)", "",
                "| target | measured | wanted | met | short by |", "| --- | --- | --- | --- | --- |"]
        for t in tg:
            met = {True: "yes", False: "no", None: "not measured"}[t["met"]]
            short = f"{t['missing_factor']:.2f}×" if t["missing_factor"] else "-"
            wanted = ("≥ " if t["sense"] == ">=" else "≤ ") + _fmt_target(t["key"], t["wanted"])
            out.append(f"| {t['target']} | {_fmt_target(t['key'], t['measured'])} | {wanted} | {met} | {short} |")
        out.append("")
    for n in results.get("notes", []):
        out.append(f"- {n}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
