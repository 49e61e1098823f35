"""Nsight Compute driver: each selected decode kernel at batch 512, 32 heads, 128x128, compiled
once (the warm-up call) and then called ``--iters`` times in a plain loop, so that ``ncu`` can
pick one launch. Nothing is timed here; ``bench.kernels`` times.

    ncu --target-processes all -k regex:leapquant --launch-skip N --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats --csv python -m bench.ncu_kernels --what step --bits 8 --gdn

    ncu --target-processes all -k regex:leapquant_step --launch-skip 1 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats -o bench/results/ncu-step-gdn-int8 python -m bench.ncu_kernels --what step --bits 8 --gdn

The second writes ``bench/results/ncu-step-gdn-int8.ncu-rep`` (read it back with
``ncu --import bench/results/ncu-step-gdn-int8.ncu-rep --page details --csv``).

``N`` (``--launch-skip``) counts only launches that match ``-k``: the warm-up call launches each
kernel once, so ``N = 1`` profiles the first launch after compilation for a one-kernel op
(step, load-only, dense step, fused flush). The split flush (``--flush-opts
'{"impl": "split"}'``, and ``auto`` with every window full) launches two matching kernels per
call, ``reconstruct`` then ``quantize``: ``N = 2`` with ``--launch-count 2``, or name one stage.
With ``--what all`` the order is dense, load, step, flush; pick one with ``-k``.

Kernel names (the Pallas ``name=``, which is the CUDA kernel's name):

* ``leapquant_step_{gdn,kda}_int{8,6,4}``: the LeapQuant step (``--what step``);
* ``leapquant_load_only_{gdn,kda}_int{bits}``: ``pallas_kernels.load_only.load_only_step``, the step's
  bytes with a trivial reduction (``--what load``);
* ``leapquant_flush_{fused,reconstruct,quantize}_{gdn,kda}_int{bits}``: the flush
  (``--what flush``; ``reconstruct`` and ``quantize`` are the split flush's two kernels, its
  middle stage is XLA);
* ``dense_step_{gdn,kda}_{float32,bfloat16}``: the Pallas dense step (``--what dense``; match it
  with ``-k regex:dense_step``).

The step and load-only kernels run at window position ``--pos`` (default ``p / 2``: about the
mean bytes over a window); the flush flushes every sequence (full windows).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp

from bench.inputs import random_sequence, random_state, token_at
from bench.kernel_checks import run_flush
from leapquant_jax import windowed
from leapquant_jax.state import LeapQuantConfig
from pallas_kernels.dense_step import dense_step
from pallas_kernels.leapquant_step import leapquant_step
from pallas_kernels.load_only import load_only_step

ORDER = ("dense", "load", "step", "flush")


def kernel_fns(config, pos, opts):
    """``{what: jitted (state, token) -> (state, out)}`` for the four kernels; the state is donated
    and each call puts ``pos`` back, so every launch moves the same bytes."""
    p = config.window

    def at(state, where):
        return state.replace(pos=jnp.full_like(state.pos, where))

    def step(state, tok):
        o, state = leapquant_step(config, at(state, pos), tok, **opts["step"])
        return state, o

    def load(state, tok):
        o, state = load_only_step(config, at(state, pos), tok, **opts["load"])
        return state, o

    def flush(state, tok):
        state = run_flush(config, at(state, p), only_full=True, **opts["flush"])
        return state, state.pos

    def dense(state, tok):
        o, state = dense_step(state, tok, **opts["dense"])
        return state, o

    return {k: jax.jit(f, donate_argnums=(0,)) for k, f in dict(step=step, load=load, flush=flush, dense=dense).items()}


def drive(name, fn, state, tok, iters):
    """One warm-up call (compiles, launches once), then ``iters`` calls, each waited for."""
    print(f"[ncu_kernels] {name}: warm-up call, then {iters} calls", file=sys.stderr, flush=True)
    state, out = fn(state, tok)
    jax.block_until_ready((state, out))
    for _ in range(iters):
        state, out = fn(state, tok)
        jax.block_until_ready((state, out))
    return state


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=ORDER + ("all",), default="step")
    ap.add_argument("--bits", type=int, default=8)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--gdn", dest="kda", action="store_false", help="scalar decay (default)")
    mode.add_argument("--kda", dest="kda", action="store_true", help="per-channel decay")
    ap.set_defaults(kda=False)   # store_false alone would default to True
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--pos", type=int, default=None, help="window position of the step and load-only kernels (p / 2)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--dense-dtype", choices=("float32", "bfloat16"), default="float32")
    for k, default in (("step", "{}"), ("load", "{}"), ("flush", '{"impl": "auto"}'), ("dense", "{}")):
        ap.add_argument(f"--{k}-opts", default=default, help=f"JSON keyword options of the {k} kernel (default {default})")
    args = ap.parse_args(argv)

    bsz, h, d = args.batch, args.heads, args.dim
    config = LeapQuantConfig(bits=args.bits, window=args.window, impl="pallas")
    pos = args.window // 2 if args.pos is None else args.pos
    if not 0 <= pos < args.window:
        ap.error(f"--pos must be in [0, {args.window})")
    opts = {k: json.loads(getattr(args, f"{k}_opts")) for k in ORDER}
    fns = kernel_fns(config, pos, opts)
    tok = token_at(random_sequence(jax.random.PRNGKey(0), bsz, 1, h, d, d, args.kda), 0)
    dense0 = random_state(jax.random.PRNGKey(3), bsz, h, d, d)
    mode_name = "kda" if args.kda else "gdn"
    for what in ORDER if args.what == "all" else (args.what,):
        if what == "dense":
            state = jnp.array(dense0, dtype=args.dense_dtype)   # a copy: the call donates it
            name = f"dense_step_{mode_name}_{args.dense_dtype}"
        else:
            state = windowed.from_dense(config, dense0, per_channel_decay=args.kda)
            name = {"load": "leapquant_load_only", "step": "leapquant_step"}.get(what, "leapquant_flush_*")
            name += f"_{mode_name}_int{args.bits}" if what != "flush" else f" ({opts['flush']})"
        drive(name, fns[what], state, tok, args.iters)
        del state


if __name__ == "__main__":
    main()
