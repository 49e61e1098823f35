"""The compiled kernels against the pure-JAX reference: the checks ``bench.kernels`` runs and
``tests/test_gpu_checks.py`` (``pytest -m gpu``) asserts, one implementation for both.

Each check returns rows (dicts of relative errors ``||out - ref|| / ||ref||``); the ``*_failures``
functions hold the pass criteria, each bound relative to the reference's own error where the
format rounds (the kernels round as the reference does, so they should add almost nothing):

* ``check_single_ops``: one step and one flush from the same state at ragged window positions.
* ``dense_step_rows``: the Pallas fp32 and bf16 dense steps over 8 tokens.
* ``ragged_method_row``: 64 tokens at ragged window positions through
  ``make_method("leapquant", impl="pallas")`` against ``impl="reference"``, both against fp32.
* ``check_fp32w``: ``fp32-w`` (an fp32 checkpoint, lossless) on the kernels: one step and one
  flush against the reference, and 64 tokens at ragged window positions against
  ``impl="reference"`` and the fp32 state (``fp32w_failures``: to reassociation, 1e-5).
* ``fla_row``: FLA's fp32 kernel against the exact recurrence (needs torch and fla-core).
* ``check_long_decode``: long decodes of the extreme-decay heads, finiteness and per-head errors.
* ``check_decoded_state``: the flush judged by the decoded-state criterion of the NVlabs/kda
  flush requests (``decoded_state_row``) on structured, second-window and random heads.

On the CPU the Pallas kernels run in interpret mode, so every check also runs there (slowly).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.inputs import (
    FLUSH_HEAD_KINDS, copy_tree, next_window, random_flush_state, random_sequence, random_state, rel,
    structured_flush_state, token_at,
)
from leapquant_jax import dispatch, windowed
from leapquant_jax.impls import OPS, Impl
from leapquant_jax.methods import make_method
from leapquant_jax.recurrence import recurrent_scan
from leapquant_jax.state import LeapQuantConfig
from leapquant_jax.studies.stability import extreme_decay_check
from pallas_kernels import mosaic_flush, mosaic_step
from pallas_kernels.dense_step import dense_step, dense_step_reference
from pallas_kernels.leapquant_step import leapquant_step

# Shapes of the checks: small enough to compile in seconds, heads of the models' 128 x 128.
CHECK_BATCH, CHECK_HEADS, CHECK_DIM, CHECK_TOKENS = 4, 4, 128, 64
RAGGED_OFFSETS = (0, 3, 9, 14)     # the step at which each sequence starts: flushes at different steps


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


def ragged_decode(method, state, seq, offsets):
    """Decode where sequence ``i`` starts at step ``offsets[i]`` (ragged window positions)."""
    t = seq["q"].shape[1]

    def body(s, i):
        xs = {n: jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False) for n, x in seq.items()}
        o, s = method.step(s, **xs, active=i >= offsets)
        return s, o

    state, o = jax.lax.scan(body, state, jnp.arange(t))
    return jnp.moveaxis(o, 0, 1), state


def check_single_ops(log, bits_list=(8,), kda_modes=(False, True), flush_impls=("auto",),
                     config_options=None):
    """One step and one flush of the compiled kernels against the reference from the same state
    (ragged positions 0, 5, 11, 15 of a 16-slot window; the flush covers every sequence), one
    row per flush implementation in ``flush_impls`` (an ``impl`` name, or a dict of ``run_flush``
    options with its ``impl``); ``config_options``: further ``LeapQuantConfig`` fields. The step
    runs with both int8 reductions (``dot``, ``lanes``) and, where ``auto`` takes it, the Mosaic
    GPU step; ``o_rel_err`` is the largest of their output errors."""
    rows = []
    bsz, h, dk, dv = CHECK_BATCH, CHECK_HEADS, CHECK_DIM, CHECK_DIM
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
                o_k, n_k = leapquant_step(config, copy_tree(st), tok, reduce=reduce)
                step_errs[reduce] = rel(o_k, o_r)
            if takes_mosaic("step", config, st):       # what auto runs on Hopper
                o_m, _ = mosaic_step.leapquant_step(config, copy_tree(st), tok)
                step_errs["mosaic"] = rel(o_m, o_r)
            buf_err = max(rel(a, b) for a, b in zip(jax.tree_util.tree_leaves(n_k.buffer),
                                                    jax.tree_util.tree_leaves(n_r.buffer)))
            f_r = windowed.flush_reference(config, n_r)
            dense = windowed.reconstruct_reference(config, n_r)
            d_r = windowed.decode_checkpoint(config, f_r.checkpoint)
            for impl in flush_impls:
                options = dict(impl) if isinstance(impl, dict) else dict(impl=impl)
                impl = options.pop("impl", "auto")
                if impl == "mosaic" and mosaic_flush.unsupported_reason(config, n_r) is not None:
                    continue
                tf32 = tf32_fit(config, n_r, impl, options)
                f_k = run_flush(config, copy_tree(n_r), impl, **options)
                d_k = windowed.decode_checkpoint(config, f_k.checkpoint)
                label = "" if impl == "auto" and not options else f" ({impl} flush{', ' if options else ''}" \
                    f"{', '.join(f'{k}={v}' for k, v in options.items())})"
                row = dict(check=f"int{bits} one step + one flush vs reference (same state){label}",
                           mode="KDA" if kda else "GDN",
                           o_rel_err=max(step_errs.values()), state_rel_err=rel(d_k, d_r), buffer_rel_err=buf_err,
                           **{f"o_err_{k}": v for k, v in step_errs.items()},
                           reference_flush_err=rel(d_r, dense), pallas_flush_err=rel(d_k, dense), tf32_fit=tf32,
                           finite=bool(jnp.all(jnp.isfinite(o_k)) and jnp.all(jnp.isfinite(d_k))))
                rows.append(row)
                log(row)
    return rows


def tf32_fit(config, state, impl, options) -> bool:
    """Whether the flush ``run_flush`` runs for ``impl`` and ``options`` fits its Compensator Tokens
    with TF32 products (the Mosaic GPU flush's ``fit="wgmma"``)."""
    if impl == "auto":
        impl = "mosaic" if takes_mosaic("flush", config, state) else None
    if impl != "mosaic":
        return False
    return (options.get("fit") or mosaic_flush.default_fit(config, options.get("recon"))) == "wgmma"


def single_op_failures(row) -> list[str]:
    """What a ``check_single_ops`` row misses: finite; every step output within 1e-5 of the
    reference's (fp32 sums in another order); the records within 1e-3 (fp16 rounding of fp32
    values equal to ~1e-7); the flushed state as close to the exact one as the reference's (1%)
    and, for an fp32 fit, within a tenth of that error of the reference's flushed state (codes may
    differ by one step where a value sits on a rounding boundary). A TF32 fit (``tf32_fit``) moves
    the basis, so its codes may move further: as the NVlabs/kda requests allow for reduced
    precision, ``check_decoded_state`` judges it instead."""
    out = []
    if not row["finite"]:
        out.append("non-finite output or state")
    if not row["o_rel_err"] < 1e-5:
        out.append(f"step output {row['o_rel_err']:.2e} >= 1e-5")
    if not row["buffer_rel_err"] < 1e-3:
        out.append(f"records {row['buffer_rel_err']:.2e} >= 1e-3")
    if not row["pallas_flush_err"] <= 1.01 * row["reference_flush_err"] + 1e-6:
        out.append(f"flushed state error {row['pallas_flush_err']:.4e} > 1.01 x the reference's "
                   f"{row['reference_flush_err']:.4e}")
    if not row.get("tf32_fit") and not row["state_rel_err"] <= 0.1 * row["reference_flush_err"]:
        out.append(f"flushed state {row['state_rel_err']:.2e} from the reference's, over a tenth of its error "
                   f"{row['reference_flush_err']:.2e}")
    return out


def correctness_inputs(kda, *, tokens=CHECK_TOKENS):
    """``(seq, s0)``: the inputs of ``dense_step_rows``, ``ragged_method_row`` and ``fla_row``."""
    bsz, h, dk, dv = CHECK_BATCH, CHECK_HEADS, CHECK_DIM, CHECK_DIM
    seq = random_sequence(jax.random.PRNGKey(1 + kda), bsz, tokens, h, dk, dv, kda)
    return seq, random_state(jax.random.PRNGKey(7), bsz, h, dk, dv)


def dense_step_rows(seq, s0, mode, tokens=8):
    """The Pallas fp32 and bf16 dense steps against ``dense_step_reference`` over ``tokens`` tokens
    (each from its own previous state); one row per dtype."""
    rows = []
    for dt in ("float32", "bfloat16"):
        s_k = jnp.copy(s0).astype(dt)          # the kernel donates its state
        s_r = jnp.copy(s0).astype(dt)
        errs = []
        for i in range(tokens):
            tok = token_at(seq, i)
            o_k, s_k = dense_step(s_k, tok)
            o_r, s_r = dense_step_reference(s_r, tok)
            errs.append(rel(o_k, o_r))
        rows.append(dict(check=f"pallas dense {dt} step vs reference", mode=mode, tokens=tokens,
                         o_rel_err=max(errs), state_rel_err=rel(s_k.astype(jnp.float32), s_r.astype(jnp.float32)),
                         finite=bool(jnp.all(jnp.isfinite(s_k.astype(jnp.float32))))))
    return rows


def dense_failures(row) -> list[str]:
    """What a ``dense_step_rows`` row misses: finite; output and state within 1e-5 / 1e-6 of the
    reference's in fp32, 1e-3 in bf16 (both round one fp32 update: at most one step apart)."""
    o_tol, s_tol = (1e-5, 1e-6) if "float32" in row["check"] else (1e-3, 1e-3)
    out = [] if row["finite"] else ["non-finite state"]
    if not row["o_rel_err"] < o_tol:
        out.append(f"output {row['o_rel_err']:.2e} >= {o_tol}")
    if not row["state_rel_err"] < s_tol:
        out.append(f"state {row['state_rel_err']:.2e} >= {s_tol}")
    return out


def ragged_method_row(seq, s0, mode, bits, offsets=RAGGED_OFFSETS):
    """``make_method("leapquant", bits, window 16)`` with ``impl="pallas"`` against
    ``impl="reference"`` over ``seq`` (64 tokens) from ``s0``, sequences starting at ``offsets``;
    both outputs against fp32's on the same ragged decode."""
    per_channel = seq["g"].ndim == 4
    offsets = jnp.array(offsets, jnp.int32)
    res = {}
    for impl in ("pallas", "reference"):
        m = make_method("leapquant", bits=bits, window=16, impl=impl)
        st = m.from_dense(s0, per_channel_decay=per_channel)
        if impl == "pallas":
            tf32 = tf32_fit(m.config, st, "auto", {})
        o, st = jax.jit(lambda st, seq: ragged_decode(m, st, seq, offsets))(st, seq)
        res[impl] = (o, m.to_dense(st))
    fp32 = make_method("fp32")
    o_ex_r, _ = jax.jit(lambda seq: ragged_decode(fp32, fp32.from_dense(s0), seq, offsets))(seq)
    t = seq["q"].shape[1]
    return dict(check=f"leapquant int{bits} impl=pallas vs impl=reference ({t} tokens, window 16, ragged)",
                mode=mode, tokens=t, o_rel_err=rel(res["pallas"][0], res["reference"][0]),
                state_rel_err=rel(res["pallas"][1], res["reference"][1]),
                reference_o_err_vs_fp32=rel(res["reference"][0], o_ex_r),
                pallas_o_err_vs_fp32=rel(res["pallas"][0], o_ex_r),
                finite=bool(jnp.all(jnp.isfinite(res["pallas"][0]))), tf32_fit=tf32)


def ragged_failures(row) -> list[str]:
    """What a ``ragged_method_row`` misses: finite; the kernels' output error against fp32 within
    1% of the reference's; with an fp32 fit, kernels and reference apart by at most a quarter of
    the reference's error (a code one step off at a rounding boundary carries on through the
    window). A TF32 fit (``tf32_fit``) moves codes further, so only the first two hold it."""
    ref = row["reference_o_err_vs_fp32"]
    out = [] if row["finite"] else ["non-finite output"]
    if not row["pallas_o_err_vs_fp32"] <= 1.01 * ref:
        out.append(f"output error vs fp32 {row['pallas_o_err_vs_fp32']:.4e} > 1.01 x the reference's {ref:.4e}")
    if not row.get("tf32_fit") and not row["o_rel_err"] <= 0.25 * ref:
        out.append(f"output {row['o_rel_err']:.2e} from the reference's, over a quarter of its error {ref:.2e}")
    return out


FP32W_TOL = 1e-5      # fp32-w against the reference and the fp32 state: sums in another order only


def check_fp32w(log, kda_modes=(False, True)) -> list[dict]:
    """``fp32-w`` on the compiled kernels (what ``dispatch`` runs under ``impl="pallas"``), one row
    per mode: one step from ragged positions 0, 5, 11, 15 of a 16-slot window and the flush of the
    window it fills (``only_full``), against the reference from the same state (``o_rel_err``,
    ``buffer_rel_err``, ``state_rel_err``: the rebuilt checkpoint; ``kept``: the three unflushed
    checkpoints unchanged bit for bit); and ``ragged_decode`` of ``correctness_inputs`` (64
    tokens) through ``make_method("fp32-w", impl="pallas")`` against ``impl="reference"`` and
    the fp32 state (``method_*``)."""
    rows = []
    bsz, h, dk, dv = CHECK_BATCH, CHECK_HEADS, CHECK_DIM, CHECK_DIM
    for kda in kda_modes:
        config = make_method("fp32-w", window=16, impl="pallas").config
        seq = random_sequence(jax.random.PRNGKey(11 + kda), bsz, 16, h, dk, dv, kda)
        st = windowed.from_dense(config, random_state(jax.random.PRNGKey(5), bsz, h, dk, dv), per_channel_decay=kda)
        for i in range(15):
            _, st = windowed.step_reference(config, st, token_at(seq, i))
        st = st.replace(pos=jnp.array([0, 5, 11, 15], jnp.int32))
        tok = token_at(seq, 15)
        o_r, n_r = windowed.step_reference(config, st, tok)
        o_k, n_k = dispatch.leapquant_step(config, copy_tree(st), tok)
        f_r = windowed.maybe_flush(config, n_r)
        f_k = dispatch.leapquant_flush(config, copy_tree(n_r), only_full=True)
        c_k = f_k.checkpoint.residual.values
        buf_err = max(rel(a, b) for a, b in zip(jax.tree_util.tree_leaves(n_k.buffer),
                                                jax.tree_util.tree_leaves(n_r.buffer)))
        seq64, s0 = correctness_inputs(kda)
        offsets = jnp.array(RAGGED_OFFSETS, jnp.int32)
        runs = {}
        for impl in ("pallas", "reference", "fp32"):
            m = make_method("fp32", impl="reference") if impl == "fp32" else make_method("fp32-w", window=16,
                                                                                         impl=impl)
            start = m.from_dense(s0, per_channel_decay=kda)
            o, s = jax.jit(lambda st, seq, m=m: ragged_decode(m, st, seq, offsets))(start, seq64)
            runs[impl] = (o, m.to_dense(s))
        (o_p, s_p), (o_ref, s_ref), (o_32, s_32) = runs["pallas"], runs["reference"], runs["fp32"]
        row = dict(check="fp32-w one step + one flush vs reference (same state); 64 ragged tokens vs reference, fp32",
                   mode="KDA" if kda else "GDN",
                   step_impl=str(dispatch.resolve("step", "pallas", config, st)),
                   flush_impl=str(dispatch.resolve("flush", "pallas", config, n_r)),
                   o_rel_err=rel(o_k, o_r), buffer_rel_err=buf_err,
                   state_rel_err=rel(c_k[3], f_r.checkpoint.residual.values[3]),
                   kept=bool(jnp.array_equal(c_k[:3], n_r.checkpoint.residual.values[:3])),
                   method_o_rel_err=rel(o_p, o_ref), method_state_rel_err=rel(s_p, s_ref),
                   method_o_err_vs_fp32=rel(o_p, o_32), method_state_err_vs_fp32=rel(s_p, s_32),
                   finite=all(bool(jnp.all(jnp.isfinite(x))) for x in (o_k, c_k, o_p)))
        rows.append(row)
        log(row)
    return rows


def fp32w_failures(row) -> list[str]:
    """What a ``check_fp32w`` row misses: finite; the Triton step and split flush ran; every error
    below ``FP32W_TOL`` (fp32 sums in another order: no rounding anywhere); the unflushed
    checkpoints unchanged."""
    out = [] if row["finite"] else ["non-finite output or checkpoint"]
    if (row["step_impl"], row["flush_impl"]) != ("triton", "split"):
        out.append(f"ran the step on {row['step_impl']} and the flush on {row['flush_impl']}, not triton and split")
    for key in ("o_rel_err", "buffer_rel_err", "state_rel_err", "method_o_rel_err", "method_state_rel_err",
                "method_o_err_vs_fp32", "method_state_err_vs_fp32"):
        if not row[key] < FP32W_TOL:
            out.append(f"{key} {row[key]:.2e} >= {FP32W_TOL}")
    if not row["kept"]:
        out.append("a checkpoint whose window was not full changed in the flush")
    return out


def fla_row(fn, seq, s0, mode):
    """FLA's fp32 kernel ``fn`` (one of ``bench.fla.fla_fns``) against the exact fp32 recurrence."""
    import torch

    o_exact, s_exact = recurrent_scan(s0, **seq)
    tq = {n: torch.from_numpy(np.asarray(x)).cuda() for n, x in seq.items()}
    h0 = torch.from_numpy(np.asarray(s0)).cuda()
    o_f, s_f = fn(tq, h0)
    return dict(check="FLA fp32 fused_recurrent vs reference", mode=mode, tokens=seq["q"].shape[1],
                o_rel_err=rel(o_f.cpu().numpy(), o_exact), state_rel_err=rel(s_f.cpu().numpy(), s_exact))


def check_correctness(log, kda_modes=(False, True), bits_list=(8, 6, 4), fla=None):
    """Per mode: ``dense_step_rows``, ``ragged_method_row`` per bit width and, with ``fla``
    (``bench.fla.fla_fns()``), ``fla_row``; each row logged as it comes."""
    rows = []
    for kda in kda_modes:
        mode = "KDA" if kda else "GDN"
        seq, s0 = correctness_inputs(kda)
        new = dense_step_rows(seq, s0, mode)
        for row in new:
            log(row)
        for bits in bits_list:
            new.append(ragged_method_row(seq, s0, mode, bits))
            log(new[-1])
        if fla is not None:
            new.append(fla_row(fla[kda], seq, s0, mode))
            log(new[-1])
        rows += new
    return rows


def check_long_decode(log, tokens, *, chunk=16384, batch=4, impls=("pallas", "reference"), kda_modes=(False, True)):
    """``studies.stability.extreme_decay_check`` for GDN and KDA with each ``impl``: long decodes of
    the extreme-decay heads (alpha from 0 to exactly 1), finiteness and per-head errors vs fp32."""
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


# ----------------------------------------------------------------------------- decoded-state criterion

# The flush requests' criterion (NVlabs/kda, requests/conless-leapquant-{gdn,kda}-flush/README.md),
# per head: err = mean |decode(checkpoint) - S| over the batch and the head's dk x dv elements, S the
# flush's input state rebuilt in fp64. A candidate passes where err <= (1 + DECODED_REL_TOL) x the
# reference flush's err on every head whose reference err is at least DECODED_FLOOR mean |S|, and
# err <= DECODED_CAP mean |S| on the others (heads the format captures almost exactly, whose
# reference err is rounding noise; an all-zero head must decode to exact zeros).
DECODED_REL_TOL, DECODED_FLOOR, DECODED_CAP = 0.01, 1e-4, 1e-3
CRITERION_BATCH = 16                  # sequences per input set of the compiled check
CRITERION_INPUTS = ("structured", "second window", "random")
# The criterion's reference, compiled once (the same program gives the same bits: a candidate
# that is this flush has ratio 1 exactly).
reference_flush = jax.jit(windowed.flush_reference, static_argnums=0)


def exact_decode(config, ckpt) -> np.ndarray:
    """The state ``[B, H, dk, dv]`` a checkpoint stands for, in float64: ``C Z B + K^T U``."""
    s = np.asarray(config.format.integer_values(ckpt.residual), np.float64)
    s = s * np.asarray(ckpt.residual.scale, np.float64)[..., None, :]
    if ckpt.smooth is not None:
        s = np.asarray(ckpt.smooth, np.float64)[..., :, None] * s
    return s + np.einsum("...rk,...rv->...kv", np.asarray(ckpt.comp_k, np.float64), np.asarray(ckpt.comp_u, np.float64))


def exact_state(config, state) -> np.ndarray:
    """``windowed.reconstruct_reference`` in float64 (NumPy): the state ``[B, H, dk, dv]`` after
    ``pos`` records, ``e^{G_l} S0 + sum_{j < pos} e^{G_l - G_j} k_j u_j^T``."""
    buf = state.buffer
    b, h, dk, dv = state.shape
    p = buf.g.shape[2]
    live = (np.arange(p)[None, :] < np.asarray(state.pos)[:, None])[:, None, :, None]     # [B, 1, p, 1]
    g = np.asarray(buf.g, np.float64)
    g = np.where(live, g if g.ndim == 4 else g[..., None], 0.0)
    G = np.cumsum(np.broadcast_to(g, (b, h, p, dk)), axis=2)
    G_l = G[:, :, -1]                                                                     # dead slots add 0
    k = np.repeat(np.asarray(buf.k, np.float64), h // state.key_heads, axis=1)
    kd = np.where(live, np.exp(np.where(live, G_l[:, :, None] - G, 0.0)) * k, 0.0)
    records = np.einsum("bhpk,bhpv->bhkv", kd, np.where(live, np.asarray(buf.u, np.float64), 0.0))
    return np.exp(G_l)[..., None] * exact_decode(config, state.checkpoint) + records


def criterion_cases(config, kda, *, batch=CRITERION_BATCH, dk=CHECK_DIM, dv=CHECK_DIM, seed=0) -> list[dict]:
    """The criterion's three input sets (``CRITERION_INPUTS``), each ``dict(inputs, state, kinds,
    exact, reference)``: ``structured_flush_state``; the reference's checkpoint of it with a fresh
    full window (``next_window``); ``random_flush_state`` with as many heads (one compiled shape).
    ``exact``: the fp64 state; ``reference``: ``reference_flush``'s flushed state."""
    flush = reference_flush
    first = structured_flush_state(config, seed, batch, dk, dv, kda)
    first_ref = flush(config, first)
    second = next_window(config, seed + 1, first_ref)
    rand = random_flush_state(config, seed + 2, batch, len(FLUSH_HEAD_KINDS), dk, dv, kda)
    cases = []
    for name, state, ref, kinds in ((CRITERION_INPUTS[0], first, first_ref, FLUSH_HEAD_KINDS),
                                    (CRITERION_INPUTS[1], second, None, FLUSH_HEAD_KINDS),
                                    (CRITERION_INPUTS[2], rand, None, ("random",) * len(FLUSH_HEAD_KINDS))):
        cases.append(dict(inputs=name, state=state, kinds=kinds, exact=exact_state(config, state),
                          reference=flush(config, state) if ref is None else ref))
    return cases


def _finite_checkpoint(ckpt) -> bool:
    leaves = [ckpt.residual.scale, ckpt.comp_k, ckpt.comp_u] + ([ckpt.smooth] if ckpt.smooth is not None else [])
    return all(bool(np.all(np.isfinite(np.asarray(x, np.float64)))) for x in leaves)


def decoded_state_row(config, case, flushed, *, mode, impl) -> dict:
    """The criterion (``DECODED_*``) on a candidate's flushed state ``flushed`` for one of
    ``criterion_cases``, as a report row: per head kind the worst ``ratio`` err / reference err over
    its heads held relatively (``None`` if none), the worst ``cap`` err / (``DECODED_CAP`` mean
    |S|) over the others (``None`` if none), the reference's ``ref_err`` = err / mean |S| (mean
    over its heads) and ``ok``; ``worst_ratio`` over every head held relatively; ``finite``
    (checkpoint and decoded state), ``codes_in_range`` (``[-qmax, qmax]``) and ``passed``."""
    S, kinds = case["exact"], case["kinds"]
    dec = exact_decode(config, flushed.checkpoint)
    err = np.abs(dec - S).mean(axis=(0, 2, 3))
    ref = np.abs(exact_decode(config, case["reference"].checkpoint) - S).mean(axis=(0, 2, 3))
    mag = np.abs(S).mean(axis=(0, 2, 3))
    relative = (ref >= DECODED_FLOOR * mag) & (ref > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(relative, err / np.where(relative, ref, 1.0), np.nan)
        cap = np.where(relative, np.nan, np.where(err == 0, 0.0, err / (DECODED_CAP * mag)))
        ref_err = np.where(mag > 0, ref / np.where(mag > 0, mag, 1.0), 0.0)
    head_ok = np.where(relative, err <= (1 + DECODED_REL_TOL) * ref, err <= DECODED_CAP * mag)
    per_kind = {}
    for kind in dict.fromkeys(kinds):
        sel = np.array([k == kind for k in kinds])
        r, c = ratio[sel & relative], cap[sel & ~relative]
        per_kind[kind] = dict(ratio=float(r.max()) if r.size else None, cap=float(c.max()) if c.size else None,
                              ref_err=float(ref_err[sel].mean()), ok=bool(head_ok[sel].all()))
    finite = _finite_checkpoint(flushed.checkpoint) and bool(np.all(np.isfinite(dec)))
    z = np.asarray(config.format.integer_values(flushed.checkpoint.residual))
    in_range = bool(np.abs(z).max() <= config.format.qmax)
    return dict(check="decoded-state criterion (flush)", mode=mode, bits=config.bits, impl=impl,
                inputs=case["inputs"], batch=int(S.shape[0]),
                worst_ratio=float(np.nanmax(ratio)) if relative.any() else None, kinds=per_kind, finite=finite,
                codes_in_range=in_range, passed=finite and in_range and bool(head_ok.all()))


def decoded_state_rows(config, cases, flush, *, mode, impl) -> list[dict]:
    """``decoded_state_row`` of ``flush(config, state)`` (a flushed state; given a copy, since the
    kernels donate theirs) for each of ``cases``."""
    return [decoded_state_row(config, case, flush(config, copy_tree(case["state"])), mode=mode, impl=impl)
            for case in cases]


def decoded_state_failures(row) -> list[str]:
    """What a ``decoded_state_row`` misses, one line per failing head kind (empty: it passes)."""
    out = [] if row["finite"] else ["non-finite checkpoint or decoded state"]
    if not row["codes_in_range"]:
        out.append(f"codes outside [-qmax, qmax] at {row['bits']} bits")
    for kind, k in row["kinds"].items():
        if k["ok"]:
            continue
        n = len(out)
        if k["ratio"] is not None and k["ratio"] > 1 + DECODED_REL_TOL:
            out.append(f"{row['inputs']} {kind}: decoded-state error {k['ratio']:.4f} x the reference's "
                       f"> {1 + DECODED_REL_TOL}")
        if k["cap"] is not None and k["cap"] > 1:
            out.append(f"{row['inputs']} {kind}: decoded-state error {k['cap'] * DECODED_CAP:.2e} of mean |S| "
                       f"> {DECODED_CAP} (reference error below {DECODED_FLOOR} of it)")
        if len(out) == n:
            out.append(f"{row['inputs']} {kind}: decoded-state error not comparable (NaN)")
    return out


def check_decoded_state(log, bits_list=(8, 6, 4), kda_modes=(False, True), flush_impls=("split", "fused", "mosaic"),
                        *, batch=CRITERION_BATCH, window=16) -> list[dict]:
    """The compiled flushes ``flush_impls`` under the decoded-state criterion, 128 x 128 heads,
    window ``window``: three rows per flush, bit width and mode (``CRITERION_INPUTS``); a flush
    that cannot take the config gives one row with ``skipped`` (its reason). A flush is a
    ``run_flush`` name or a dict of ``run_flush`` options with its ``impl`` (the row's ``impl``
    then names the options too). Each row is logged as it comes."""
    rows = []
    for kda in kda_modes:
        mode = "KDA" if kda else "GDN"
        for bits in bits_list:
            config = LeapQuantConfig(bits=bits, window=window, impl="pallas")
            cases = criterion_cases(config, kda, batch=batch)
            for entry in flush_impls:
                options = dict(entry) if isinstance(entry, dict) else dict(impl=entry)
                impl = options.pop("impl", "auto")
                label = impl + "".join(f" {k}={v}" for k, v in sorted(options.items()))
                why = mosaic_flush.unsupported_reason(config, cases[0]["state"]) if impl == "mosaic" else None
                if why is not None:
                    new = [dict(check="decoded-state criterion (flush)", mode=mode, bits=bits, impl=label,
                                inputs="-", skipped=why)]
                else:
                    new = decoded_state_rows(config, cases,
                                             lambda c, s, impl=impl, o=options: run_flush(c, s, impl, **o),
                                             mode=mode, impl=label)
                for row in new:
                    log(row)
                rows += new
    return rows
