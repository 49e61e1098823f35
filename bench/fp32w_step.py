"""The ``fp32-w`` step (LeapQuant's Triton step reading an fp32 checkpoint tile) swept over its
launch options, against the fp32 dense step the model runs otherwise, in one process.

    python -m bench.fp32w_step [--batch 512] [--heads 32] [--key-heads 16] [--kda] [--variants JSON] [--out DIR]

For each variant (options of ``pallas_kernels.leapquant_step.leapquant_step``: ``num_warps``,
``block_v``, ``chunk``, ``heads_per_program``, ``num_stages``): the compiled step's output at
ragged window positions against the reference, then µs per step over a window (``p`` steps from
position 0, the state donated) and the bandwidth of its bytes (``step_bytes``, the mean over the
window) against a device-to-device copy. Then the window with its flush (the split flush's
first stage), and the fp32 dense step (``dispatch.dense_step``, impl auto) on the dense state of
the same shape. 128 x 128 heads, window 16, fp32 records. Writes ``fp32w-step-<UTC time>.json``
and ``.log`` under ``--out`` (default ``bench/results``).
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
from leapquant_jax.fp32w import fp32w_config
from pallas_kernels import leapquant_step as triton_step
from bench.fla import time_copy
from bench.harness import git_commit, results_log, time_loop
from bench.inputs import random_sequence, random_state, rel, token_at

DEFAULT_VARIANTS = [
    {},                                                  # the defaults (what the model runs)
    dict(num_warps=4), dict(num_warps=16),
    dict(block_v=64, num_warps=4), dict(block_v=64, num_warps=8), dict(block_v=32, num_warps=4),
    dict(block_v=32, num_warps=2),
    dict(chunk=32, num_warps=4), dict(chunk=64, num_warps=8), dict(chunk=32, block_v=64, num_warps=4),
    dict(num_stages=2), dict(block_v=64, num_warps=4, num_stages=2),
    dict(heads_per_program=2, num_warps=8),
]


def ragged_state(config, bsz, h, hk, dk, dv, kda, seed=0):
    """A random dense state as an ``fp32-w`` stream, sequence ``b`` advanced ``b % p`` steps by
    the reference; and the next token (keys at ``hk`` key heads)."""
    p = config.window
    st = windowed.from_dense(config, random_state(jax.random.PRNGKey(seed), bsz, h, dk, dv), per_channel_decay=kda,
                             key_heads=hk)
    seq = random_sequence(jax.random.PRNGKey(seed + 1), bsz, p, h, dk, dv, kda)
    step = jax.jit(lambda s, t: windowed.step_reference(config, s, t))
    for i in range(p - 1):
        _, nxt = step(st, token_at(seq, i, hk))
        st = windowed.select_batch((jnp.arange(bsz) % p) > i, nxt, st)
    return st, token_at(seq, p - 1, hk)


def label(opts) -> str:
    return " ".join(f"{k}={v}" for k, v in opts.items()) or "defaults"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--heads", type=int, default=32, help="value heads")
    ap.add_argument("--key-heads", type=int, default=16, help="key heads (GVA; equal to --heads: none)")
    ap.add_argument("--kda", action="store_true", help="KDA's per-channel decays instead of GDN's scalar ones")
    ap.add_argument("--variants", default=None, help="JSON list of option dicts (default: DEFAULT_VARIANTS)")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    bsz, h, hk, dk, dv, kda = a.batch, a.heads, a.key_heads, 128, 128, a.kda
    config = fp32w_config(impl="reference")
    variants = DEFAULT_VARIANTS if a.variants is None else json.loads(a.variants)
    base, say = results_log(a.out, "fp32w-step")
    say("jax", jax.__version__, jax.devices(), "commit", git_commit(), "command", " ".join(sys.argv),
        "mode", "KDA" if kda else "GDN", f"batch {bsz}, {h} value heads, {hk} key heads")

    st, tok = ragged_state(config, bsz, h, hk, dk, dv, kda)
    o_ref, _ = jax.jit(lambda s, t: windowed.step_reference(config, s, t))(st, tok)
    ok, rows = [], []
    for opts in variants:
        try:
            t0 = time.time()
            o, _ = jax.jit(lambda s, t, o=opts: triton_step.leapquant_step(config, s, t, **o))(st, tok)
            err = rel(o, o_ref)
            say(label(opts), f"compile + run {time.time() - t0:.1f} s, output error against the reference {err:.2e}")
            if not err < 1e-5:
                say(label(opts), "REJECTED: output differs from the reference")
                continue
            ok.append(opts)
        except Exception:
            say(label(opts), "FAILED\n" + traceback.format_exc()[-1500:])

    p = config.window
    seq = random_sequence(jax.random.PRNGKey(7), bsz, p, h, dk, dv, kda)
    toks = [token_at(seq, i, hk) for i in range(p)]
    copy_bw = time_copy() if jax.default_backend() == "gpu" else float("nan")
    say(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s")
    step_bytes = np.mean([triton_step.step_bytes(config, dk, dv, i, kda, group=h // hk) for i in range(p)]) * bsz * h

    def window_fn(opts, flush):
        def run(state, toks):
            state = state.replace(pos=jnp.zeros_like(state.pos))
            o = None
            for t in toks:
                o, state = triton_step.leapquant_step(config, state, t, **opts)
            if flush:
                state = dispatch.leapquant_flush(config, state, only_full=True, impl="pallas")
            return state, o
        return jax.jit(run, donate_argnums=(0,))

    def timed(name, fn, carry, nbytes, steps):
        try:
            us = time_loop(lambda c: fn(c[0], toks), (carry, None)) / steps
            rate = ""
            if nbytes is not None:
                bw = nbytes / (us * 1e-6)
                rate = f", {bw / 1e9:.0f} GB/s ({bw / copy_bw:.0%} of copy)"
            say(f"{name}: {us:.1f} us per step{rate}")
            rows.append(dict(name=name, us=us, bytes=nbytes))
            return us
        except Exception:
            say(name, "TIMING FAILED\n" + traceback.format_exc()[-1500:])
            return None

    times = {}
    for opts in ok:
        times[label(opts)] = timed("fp32-w step " + label(opts), window_fn(opts, False),
                                   jax.tree_util.tree_map(jnp.copy, st), step_bytes, p)
    done = {k: v for k, v in times.items() if v is not None}
    best = min(done, key=done.get) if done else None
    if best is not None:
        say(f"fastest step: {best} ({done[best]:.1f} us; defaults {done.get('defaults', float('nan')):.1f} us)")
        opts = ok[[label(o) for o in ok].index(best)]
        timed("fp32-w window (p steps + flush) " + best, window_fn(opts, True), jax.tree_util.tree_map(jnp.copy, st),
              None, p)
        if best != "defaults":
            timed("fp32-w window (p steps + flush) defaults", window_fn({}, True),
                  jax.tree_util.tree_map(jnp.copy, st), None, p)

    dense = random_state(jax.random.PRNGKey(3), bsz, h, dk, dv)
    dense_toks = [token_at(seq, i) for i in range(p)]

    def dense_run(s, toks):
        o = None
        for t in dense_toks:
            o, s = dispatch.dense_step(s, t)
        return s, o

    dense_fn = jax.jit(dense_run, donate_argnums=(0,))
    timed("fp32 dense step (dispatch.dense_step, auto)", dense_fn, dense, 2 * 4 * dk * dv * bsz * h, p)
    json.dump(dict(jax=jax.__version__, commit=git_commit(), copy_bw=copy_bw, batch=bsz, heads=h, key_heads=hk, kda=kda,
                   best=best, rows=rows), open(base + ".json", "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
