"""Flush variants alone: µs per flush at batch 512 (one layer, 32 heads, 128 x 128, window 16,
every window full, or one in ``--full-every``), after single-op checks of flush implementations against the reference.

    python -m bench.flush_time --out DIR [--bits 8] [--modes gdn kda] [--check-bits 8] [--check-impls split]
                               [--check-configs '[{}, {"warm_start": true}]'] [--full-every 1 16]
                               [--variants '[{"impl": "split"}, {"impl": "fused", "num_warps": 4}]']
                               [--configs '[{}, {"rank": 0}, {"fit_iters": 2}]']

``impl="mosaic"`` (in ``--variants`` and ``--check-impls``) is the Mosaic GPU flush
(``pallas_kernels.mosaic_flush``) with its own options; a ``--check-impls`` entry may be a JSON
object of such options.

A short device call next to ``bench.kernels`` (which times the flush inside whole windows):
each variant is compiled, then timed with ``bench.harness.time_loop`` (host clock, median) on a
donated state flushed again and again in place.
Rows go to ``DIR/flush_time.jsonl`` and the console.
"""
import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

from bench.harness import time_loop
from bench.inputs import random_state
from bench.kernel_checks import check_single_ops, run_flush
from leapquant_jax import windowed
from leapquant_jax.state import LeapQuantConfig


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--bits", type=int, nargs="+", default=[8])
    ap.add_argument("--modes", nargs="+", choices=("gdn", "kda"), default=["gdn", "kda"])
    ap.add_argument("--variants", default='[{"impl": "split"}, {"impl": "fused"}]',
                    help="JSON list of leapquant_flush keyword options, one per variant "
                         '(impl "mosaic": the Mosaic GPU flush, with its options)')
    ap.add_argument("--check-bits", type=int, nargs="*", default=[8])
    ap.add_argument("--check-impls", nargs="+", default=["split"],
                    help="flush implementations checked (leapquant_flush's impl, or mosaic: the Mosaic GPU flush; "
                         "or a JSON object of run_flush options with its impl)")
    ap.add_argument("--check-configs", default="[{}]",
                    help="JSON list of further LeapQuantConfig fields, one check per entry "
                         "(e.g. warm_start, fit_iters)")
    ap.add_argument("--configs", default="[{}]",
                    help="JSON list of further LeapQuantConfig fields of the timed flush, one row per entry and "
                         "variant (e.g. rank, fit_iters: what the fit costs)")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--full-every", type=int, nargs="+", default=[1],
                    help="one sequence in N has a full window (the others hold 5 records; 0: none): one row per N")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = open(os.path.join(args.out, "flush_time.jsonl"), "a")

    def log(x):
        print(json.dumps(x) if isinstance(x, dict) else x, flush=True)
        if isinstance(x, dict):
            rows.write(json.dumps(x) + "\n")
            rows.flush()

    log(dict(devices=str(jax.devices()), jax=jax.__version__))
    if args.check_bits:
        t0 = time.time()
        impls = tuple(json.loads(x) if x.startswith("{") else x for x in args.check_impls)
        for options in json.loads(args.check_configs):
            log(dict(check_config=options))
            check_single_ops(log, tuple(args.check_bits), tuple(m == "kda" for m in args.modes), flush_impls=impls,
                             config_options=options)
        log(dict(check_seconds=time.time() - t0))
    for bits in args.bits:
        for fields in json.loads(args.configs):
            config = LeapQuantConfig(bits=bits, window=16, impl="pallas", **fields)
            for mode in args.modes:
                full = windowed.from_dense(config, random_state(jax.random.PRNGKey(3), args.batch, 32, 128, 128),
                                           per_channel_decay=mode == "kda")
                for every in args.full_every:
                    full_at = jnp.arange(args.batch) % every == 0 if every else jnp.zeros((args.batch,), bool)
                    pos = jnp.where(full_at, 16, 5).astype(full.pos.dtype)
                    for v in json.loads(args.variants):
                        row = dict(bits=bits, fields=fields, mode=mode, full_every=every)
                        log(time_variant(config, full.replace(pos=pos), v, **row))
                full = None
    rows.close()


def time_variant(config, full, options, **row):
    """``row`` with ``us`` per flush of ``full`` (the sequences whose window is full flush) and the
    compile seconds, or the error.

    The state is donated and carried from call to call, its positions set back after each flush,
    so that the checkpoint is written in place as in a decode loop (a state that is not donated
    would be copied before every in-place kernel)."""
    pos = full.pos

    def flush_again(s):
        return run_flush(config, s, only_full=True, **options).replace(pos=pos)

    fn = jax.jit(flush_again, donate_argnums=0)
    try:
        t0 = time.time()
        state = jax.block_until_ready(fn(jax.tree_util.tree_map(jnp.copy, full)))
        compile_s = time.time() - t0
        return dict(row, variant=options, us=time_loop(fn, state), compile_s=compile_s)
    except Exception as err:
        return dict(row, variant=options, error=f"{type(err).__name__}: {str(err)[:300]}")


if __name__ == "__main__":
    main()
