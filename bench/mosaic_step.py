"""The Mosaic GPU step (``pallas_kernels.mosaic_step``) against the Triton step, in one process:
compiled correctness against the reference at ragged window positions, then µs per step over a
window (``p`` steps from position 0, the state donated), and optionally a whole window with the
flush ``auto`` takes, the same pipeline with its arithmetic left out (``--load-only``) and with the code
sums alone (``--codes-only``).

    python -m bench.mosaic_step [--batch 512] [--heads 32] [--bits 8] [--kda] [--variants JSON] [--window]
                                [--load-only] [--codes-only] [--out DIR]
    python -m bench.mosaic_step --ncu JSON    # only run that variant 4 times, for Nsight Compute

``--variants`` is a JSON list of option dicts for ``mosaic_step.leapquant_step`` (``programs``,
``stages``, ``chunk``, ``dot``, ``slot_copy``); the default is its defaults. GDN (``--kda``: KDA's per-channel
decays), ``--bits`` 8, 6, 4 or 2 (the rank the config takes at that width), 128 x 128, window 16. Writes
``mosaic-step-<UTC time>.json`` and ``.log`` under ``--out`` (default ``bench/results``). Bandwidth
is counted with ``step_bytes`` (the Triton step's masked loads) for the Triton rows and with
``mosaic_step_bytes`` (the record slots it copies, ``slot_copy`` at a time) for the Mosaic rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from leapquant_jax import dispatch, windowed
from leapquant_jax.state import LeapQuantConfig
from pallas_kernels import leapquant_step as triton_step
from pallas_kernels import mosaic_shared, mosaic_step
from bench.fla import time_copy
from bench.harness import git_commit, results_log, time_loop
from bench.inputs import random_sequence, random_state, rel, token_at


def ragged_state(config, bsz, h, dk, dv, seed=0, kda=False):
    """A random dense state rounded into a stream, sequence ``b`` then advanced ``b % p`` steps
    by the reference; and the next token. ``kda``: per-channel decays."""
    p = config.window
    st = windowed.from_dense(config, random_state(jax.random.PRNGKey(seed), bsz, h, dk, dv), per_channel_decay=kda)
    seq = random_sequence(jax.random.PRNGKey(seed + 1), bsz, p, h, dk, dv, kda)
    step = jax.jit(lambda s, t: windowed.step_reference(config, s, t))
    for i in range(p - 1):
        _, nxt = step(st, token_at(seq, i))
        st = windowed.select_batch((jnp.arange(bsz) % p) > i, nxt, st)
    return st, token_at(seq, p - 1)


def window_fn(step, config, flush=False):
    """Jitted ``p`` steps from position 0 (and with ``flush`` the flush of the full windows, as
    ``dispatch`` runs it on the kernels)."""
    def run(state, toks):
        state = state.replace(pos=jnp.zeros_like(state.pos))
        o = None
        for tok in toks:
            o, state = step(config, state, tok)
        if flush:
            state = dispatch.leapquant_flush(config, state, only_full=True, impl="pallas")
        return state, o

    return jax.jit(run, donate_argnums=(0,))


def load_only_head(i, meta_all, rg_all, tiles, *, lay, **_):
    """A head's 'arithmetic' that only reads ``v`` and ``w``: the pipeline's own cost."""
    vcol = mosaic_shared.rows_layout(16).reduce(0)
    v = lay.load(tiles["v"], vcol)
    return v, v, lay.load(tiles["w"], vcol)


def codes_only_head(i, meta_all, rg_all, tiles, *, dk, smoothing, chunk, lay, mm, red, dot, bits=8, **_):
    """A head's arithmetic with the records and Compensator Tokens left out: the code sums alone
    (on the tensor cores or the CUDA cores, as ``dot`` chose; GDN), what the step would cost were
    the other dots free."""
    if dot == "rows":
        mosaic_step.code_vectors(tiles, mm[0], smoothing=smoothing, lay=lay)
        lay.sync()
        parts = mosaic_step.code_partials_rows(tiles, mm[0], dk=dk, lay=lay, bits=bits)
        s1, s2 = mosaic_shared.meet_warps(parts, red, lay=lay)
    elif dot == "fma":
        s1, s2 = mosaic_step.code_sums_fma(tiles, dk=dk, smoothing=smoothing, chunk=chunk, lay=lay, bits=bits)
    else:
        s1, s2 = mosaic_step.code_sums_wgmma(tiles, mm, dk=dk, smoothing=smoothing, lay=lay)
    return s1, s2, lay.load(tiles["w"], mosaic_shared.rows_layout(16).reduce(0))


def label(opts) -> str:
    return "mosaic " + (" ".join(f"{k}={v}" for k, v in opts.items()) or "defaults")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--bits", type=int, default=8, choices=(8, 6, 4, 2))
    ap.add_argument("--kda", action="store_true", help="KDA's per-channel decays instead of GDN's scalar ones")
    ap.add_argument("--variants", default="[{}]", help="JSON list of option dicts for mosaic_step.leapquant_step")
    ap.add_argument("--window", action="store_true", help="also time whole windows with the flush dispatch runs")
    ap.add_argument("--load-only", action="store_true", help="also time the pipeline without the arithmetic")
    ap.add_argument("--codes-only", action="store_true",
                    help="also time the pipeline with the code sums alone (no records, no Compensator Tokens)")
    ap.add_argument("--ncu", default=None, help="JSON options: only run that variant 4 times (for Nsight Compute)")
    ap.add_argument("--skip-steps", action="store_true", help="time only the --window and --load-only rows")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    bsz, h, dk, dv = a.batch, a.heads, 128, 128
    config = LeapQuantConfig(bits=a.bits, impl="reference")
    kda = a.kda
    st, tok = ragged_state(config, bsz, h, dk, dv, kda=kda)
    if a.ncu:
        f = jax.jit(lambda s, t, o=json.loads(a.ncu): mosaic_step.leapquant_step(config, s, t, **o))
        for _ in range(4):
            jax.block_until_ready(f(st, tok))
        return 0
    base, say = results_log(a.out, "mosaic-step")
    rows = []

    say("jax", jax.__version__, jax.devices(), "commit", git_commit(), "command", " ".join(sys.argv),
        "mode", "KDA" if kda else "GDN", "bits", a.bits, "rank", config.effective_rank)
    o_ref, st_ref = jax.jit(lambda s, t: windowed.step_reference(config, s, t))(st, tok)

    def errors(o, new):
        out = dict(o=rel(o, o_ref), nan=bool(jnp.isnan(o).any()))
        for name in ("k", "u", "g"):
            ours, ref = getattr(new.buffer, name), getattr(st_ref.buffer, name)
            out[name] = rel(ours.astype(jnp.float32), ref.astype(jnp.float32))
        return out

    ok = []
    for opts in json.loads(a.variants):
        try:
            t0 = time.time()
            o, new = jax.jit(lambda s, t, o=opts: mosaic_step.leapquant_step(config, s, t, **o))(st, tok)
            err = errors(o, new)
            say(label(opts), "compile + run", f"{time.time() - t0:.1f} s", "errors against the reference", err)
            rows.append(dict(name=label(opts), opts=opts, errors=err))
            ok.append(opts)
        except Exception:
            say(label(opts), "FAILED\n" + traceback.format_exc()[-3000:])
    o, new = jax.jit(lambda s, t: triton_step.leapquant_step(config, s, t))(st, tok)
    say("triton errors against the reference", errors(o, new))

    seq = random_sequence(jax.random.PRNGKey(7), bsz, config.window, h, dk, dv, kda)
    toks = [token_at(seq, i) for i in range(config.window)]
    copy_bw = time_copy() if jax.default_backend() == "gpu" else float("nan")
    say(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s")
    p = config.window
    triton_bytes = np.mean([triton_step.step_bytes(config, dk, dv, pos, kda) for pos in range(p)]) * bsz * h
    mosaic_bytes = lambda o: mosaic_step.mosaic_step_bytes(config, dk, dv, per_channel=kda,
                                                           slot_copy=o.get("slot_copy")) * bsz * h

    def timed(name, step, nbytes, flush=False):
        try:
            fn = window_fn(step, config, flush)
            us = time_loop(lambda c: fn(c[0], toks), (jax.tree_util.tree_map(jnp.copy, st), None)) / p
            bw = None if nbytes is None else nbytes / (us * 1e-6)
            rate = "" if bw is None else f", {bw / 1e9:.0f} GB/s ({bw / copy_bw:.0%} of copy)"
            say(f"{name}: {us:.1f} us per step{rate}")
            rows.append(dict(name=name, us=us, bytes=nbytes))
        except Exception:
            say(name, "TIMING FAILED\n" + traceback.format_exc()[-3000:])

    if not a.skip_steps:
        timed("triton step", triton_step.leapquant_step, triton_bytes)
    for opts in ok if not a.skip_steps else ():
        timed(label(opts), lambda c, s, t, o=opts: mosaic_step.leapquant_step(c, s, t, **o), mosaic_bytes(opts))
    if a.window:
        timed("triton window (p steps + flush)", triton_step.leapquant_step, None, flush=True)
        for opts in ok:
            timed(label(opts) + " window (p steps + flush)",
                  lambda c, s, t, o=opts: mosaic_step.leapquant_step(c, s, t, **o), None, flush=True)
    if a.load_only:
        for opts in ok:
            timed(label(opts) + " LOAD-ONLY",
                  lambda c, s, t, o=opts: mosaic_step.launch(c, s, t, load_only_head, **o), mosaic_bytes(opts))
    if a.codes_only:
        for opts in ok:
            timed(label(opts) + " CODES-ONLY",
                  lambda c, s, t, o=opts: mosaic_step.launch(c, s, t, codes_only_head, **o), mosaic_bytes(opts))
    json.dump(dict(jax=jax.__version__, commit=git_commit(), copy_bw=copy_bw, batch=bsz, heads=h, kda=kda, bits=a.bits,
                   rows=rows), open(base + ".json", "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
