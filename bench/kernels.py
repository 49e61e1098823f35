"""Kernel benchmark (docs/design.md §6): correctness, variant sweep, then µs per token-step on one layer.

    python -m bench.kernels [--batches 32 128 512] [--heads 32] [--window 16] [--bits 8] [--sweep]
                            [--load-only] [--extra-bits 6 4] [--no-dense] [--correctness full|ops|none]
                            [--check-bits 8 6 4]
                            [--check-flush-impls auto split] [--decoded-state-impls split fused mosaic]
                            [--decoded-state-batch 16] [--modes gdn kda] [--time-budget SECONDS]
                            [--long-decode TOKENS] [--commit HASH] [--out bench/results]

In this order:

1. Correctness of the compiled kernels on one step and one flush from the same state (ragged
   positions), against ``windowed``'s reference, and ``fp32-w`` on its kernels
   (``kernel_checks.check_fp32w``); then each flush of ``--decoded-state-impls`` at
   every ``--check-bits`` under the decoded-state criterion of the NVlabs/kda flush requests
   (``kernel_checks.check_decoded_state``: per head kind, the decoded state's error within 1% of
   the reference flush's, on structured, second-window and random heads).
2. ``--sweep``: at the largest batch, block/warp/stage variants of the Pallas fp32 dense step,
   the LeapQuant step (``heads_per_program`` too; on Hopper the Mosaic GPU step, with the Triton
   step's defaults timed beside it when it is the fastest) and the flush (``fused``, ``split``,
   ``auto``); the timings below use the fastest of each. A variant the kernels do not
   (yet) accept is reported with its error, not fatal.
   ``--load-only`` (on with ``--sweep``): ``pallas_kernels.load_only``, a kernel that reads exactly
   the bytes the LeapQuant step reads (``step_bytes``) and does only a trivial reduction of each,
   at 1, 2 and 4 warps: the bandwidth Pallas Triton reaches on the step's access pattern, the
   step's ceiling. Off the GPU it runs in interpret mode (a smoke test; its times mean nothing).
3. Timings, one layer of ``--heads`` heads, ``dk = dv = 128``, per batch size, GDN and KDA:
   FLA's fp32 ``fused_recurrent_gated_delta_rule`` / ``fused_recurrent_kda`` (CUDA events via
   ``triton.testing.do_bench``, median), the Pallas fp32 and bf16 dense steps and the LeapQuant
   step amortised over a full window including its flush (``p`` steps + 1 flush, divided by
   ``p``), the step alone and the flush alone (host clock around many back-to-back calls of a
   jitted window after warm-up, median over repeats), and a device-to-device copy (bytes read +
   written) for the bandwidth ceiling. ``--extra-bits``: the window, steps and flush at other
   widths, at every batch (the largest first), on the step ``auto`` runs at that width (with
   ``--sweep``, the sweep's fastest options where they fit it); each row names its step kernel.
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
(``kernel_report.TARGETS``) evaluated at the largest batch against FLA timed in the same run.

The parts live in ``bench.inputs`` (inputs), ``bench.kernel_checks`` (the checks, which
``pytest -m gpu`` also runs), ``bench.kernel_timing`` (timed loops, variants, phases),
``bench.kernel_report`` (targets, Markdown), ``bench.fla`` (FLA and the copy bandwidth).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with PyTorch

from bench.fla import fla_fns, time_copy  # noqa: E402
from bench.harness import environment, git_commit, on_gpu  # noqa: E402
from bench.kernel_checks import (  # noqa: E402
    CRITERION_BATCH, FLUSH_IMPLS, check_correctness, check_decoded_state, check_fp32w, check_long_decode,
    check_single_ops,
)
from bench.kernel_report import markdown, targets  # noqa: E402
from bench.kernel_timing import (  # noqa: E402
    Run, default_variants, flush_stages, sweep, time_batch, time_load_only, time_other_bits,
)
from leapquant_jax.state import LeapQuantConfig  # noqa: E402


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
    ap.add_argument("--decoded-state-impls", nargs="*", default=["split", "fused", "mosaic"],
                    choices=list(FLUSH_IMPLS),
                    help="flushes judged by the decoded-state criterion with --correctness ops or full (none: skip); "
                         "a flush that cannot take a bit width is reported as skipped")
    ap.add_argument("--decoded-state-batch", type=int, default=CRITERION_BATCH,
                    help="sequences per input set of the decoded-state criterion")
    ap.add_argument("--flush", default="{}", metavar="JSON",
                    help='the timed flush: run_flush options (default {}: impl auto; {"impl": "mosaic"}: the Mosaic '
                         'GPU flush); --sweep replaces it with the fastest of its flush variants')
    ap.add_argument("--flush-stages", action="store_true",
                    help="time the split flush's stages at the largest batch (also done by --sweep)")
    ap.add_argument("--no-dense", action="store_true",
                    help="leave out the Pallas dense-step rows (FLA and the LeapQuant rows only): a shorter device call")
    ap.add_argument("--extra-bits", type=int, nargs="*", default=[],
                    help="other bit widths to time (window, steps, flush) at every batch")
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
        # each row printed with the seconds since the start: what a device call's budget must fit
        elapsed = round(time.monotonic() - started, 1)
        print(json.dumps(dict(x, elapsed_s=elapsed)) if isinstance(x, dict) else f"[{elapsed} s] {x}", flush=True)

    env = environment(args.commit or git_commit())
    log(env)
    gpu = on_gpu()
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
        results["correctness"] += check_fp32w(log, kda_modes)
        save()
        if args.decoded_state_impls:
            results["decoded_state"] = check_decoded_state(log, tuple(args.check_bits), kda_modes,
                                                           tuple(args.decoded_state_impls),
                                                           batch=args.decoded_state_batch, window=args.window)
            save()
    if args.long_decode:
        results["long_decode"] = check_long_decode(log, args.long_decode,
                                                   impls=("pallas", "reference") if gpu else ("reference",),
                                                   kda_modes=kda_modes)
        save()
    if args.checks_only:
        return results
    config = LeapQuantConfig(bits=args.bits, window=args.window, impl="pallas")
    run = Run(results=results, log=log, save=save, over=over, config=config, heads=args.heads, dim=args.dim)
    largest = max(args.batches)
    if not gpu:
        if args.correctness == "full":
            results["correctness"] += check_correctness(log, kda_modes, bits_list=tuple(args.check_bits),
                                                        fla=fla_fns())
        if args.load_only:
            results["load_only"] = time_load_only(log, config, largest, args.heads, args.dim, args.dim, None,
                                                  kda_modes, over)
            results["notes"].append("no GPU: the load-only kernel ran in interpret mode (its times mean nothing)")
        log("no GPU: timings skipped")
        save()
        return results

    fla = fla_fns()
    copy_bw = time_copy()
    results["copy_bandwidth_Bps"] = copy_bw
    log(dict(copy_bandwidth_TBps=copy_bw / 1e12))
    if args.flush_stages and not args.sweep:
        for kda in kda_modes:
            flush_stages(run, kda, largest)
    # Sweep first (largest batch): the main timings use the fastest variant of each kernel.
    best = default_variants(run, args.flush)
    if args.load_only or args.sweep:
        results["load_only"] = time_load_only(log, config, largest, args.heads, args.dim, args.dim, copy_bw,
                                              kda_modes, over)
        save()
    if args.sweep:
        sweep(run, best, largest, kda_modes)
    results["chosen_variants"] = {("KDA" if k else "GDN"): v for k, v in best.items()}
    log(results["chosen_variants"])
    for bsz in args.batches:
        for kda in kda_modes:
            time_batch(run, best, bsz, kda, fla=fla, copy_bw=copy_bw, swept=args.sweep, dense=not args.no_dense)
    for bsz in sorted(args.batches, reverse=True):      # the targets' batch first, before the budget runs out
        for bits in args.extra_bits:
            time_other_bits(run, best, bits, bsz, kda_modes, swept=args.sweep)
    if args.correctness == "full":
        results["correctness"] += check_correctness(log, kda_modes, bits_list=tuple(args.check_bits), fla=fla)
        save()
    results["targets"] = targets(results)
    save()
    log(markdown(results))
    return results


if __name__ == "__main__":
    main()
