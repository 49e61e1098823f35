"""``leapquant calibrate-damp``: DAMP's offline calibration on a checkpoint.

    leapquant calibrate-damp CKPT --data FILE --out CAL.json [--rows 32] [--tokens 256]
                             [--every 8] [--channels 16] [--tau 4096] [--json]

The calibration rows (``--rows`` disjoint segments of ``--tokens`` tokens of ``--data``) go through
the decode path with the fp32 state, recording every linear-attention layer's inputs; the fp32
state every ``--every`` tokens is a sample (DAMP's protocol: 32 documents of 256 tokens, a state
every 8 tokens). ``leapquant_jax.damp.calibrate`` ranks the key channels; the file also keeps the
scores and the model's fingerprint (``models.fingerprint``). ``eval``, ``recall``, ``demo``,
``generate`` and ``score`` take it with ``--damp-calibration CAL.json`` and refuse one made on
another model (``check_state_method``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from leapquant_jax.cli_support import check_output, int_at_least
from leapquant_jax.damp import DEFAULT_CHANNELS, DEFAULT_TAU, DampCalibrationError, bits_per_value, calibrate
from leapquant_jax.methods import make_method
from models.decode import score
from models.evaluate import EvalConfig, load_model_and_data, segment_rows
from models.fingerprint import check_state_method, linear_state_layout, model_fingerprint
from models.loading import check_checkpoint


def record_traces(arch, params, config, rows: np.ndarray) -> dict:
    """Every linear-attention layer's fp32 inputs on ``rows [R, T]`` token ids, through the decode
    path with the fp32 state: ``{layer: {"q", "k", "v", "g", "beta": [R, T, ...]}}``."""
    return score(arch, params, config, rows, method=make_method("fp32"), record=True)[1]


def calibrate_model(arch, params, config, rows: np.ndarray, *, k_hi: int, tau: int, every: int):
    """DAMP calibration of a model on ``rows [R, T]`` token ids. Returns ``(calibration, scores)``."""
    traces = record_traces(arch, params, config, rows)
    return calibrate(traces, k_hi=k_hi, tau=tau, every=every, model=model_fingerprint(config, params))


def calibration_rows(args):
    """The model and calibration rows of a calibration command's ``checkpoint``, ``--data``,
    ``--rows``, ``--tokens``, ``--every`` and ``--out`` (checked first, before the model loads).
    Returns ``(arch, config, params, rows [rows, tokens] int32)``."""
    check_checkpoint(args.checkpoint)
    check_output(args.out, "--out", folder=False)
    if args.every > args.tokens:
        raise ValueError(f"--every {args.every} is more than --tokens {args.tokens}: no calibration sample")
    cfg = EvalConfig(context=args.tokens, prefill=0, batch=args.rows, greedy_tokens=1)
    return load_model_and_data(args.checkpoint, args.data, lambda ids, source: segment_rows(ids, cfg, source=source))


def save_calibration(args, cal, scores: dict, **settings) -> Path:
    """Writes the calibration ``cal`` to a calibration command's ``--out`` (its folder made), with
    what made it: the checkpoint, ``--data``, ``--rows``, ``--tokens``, ``--every``, ``settings`` and
    the ``scores``. Returns the path."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cal.save(str(out), extra={"checkpoint": str(args.checkpoint), "data": str(args.data), "rows": args.rows,
                              "tokens": args.tokens, "every": args.every, **settings, "scores": scores})
    return out


def run_calibrate(args) -> int:
    """The ``leapquant calibrate-damp`` handler."""
    arch, config, params, rows = calibration_rows(args)
    _, _, dk, _ = linear_state_layout(arch, config)
    if not 0 < args.channels < dk:
        raise ValueError(f"--channels {args.channels}: the protected key channels per head must be in "
                         f"[1, dk - 1] = [1, {dk - 1}]")
    t0 = time.time()
    cal, scores = calibrate_model(arch, params, config, rows, k_hi=args.channels, tau=args.tau, every=args.every)
    out = save_calibration(args, cal, scores)
    result = {"command": "calibrate-damp", "checkpoint": str(args.checkpoint), "out": str(out),
              "layers": list(cal.layers), "heads": cal.heads, "k_hi": cal.k_hi, "tau": cal.tau,
              "bits_per_value": bits_per_value(cal.dk, cal.dv, cal.k_hi), "seconds": round(time.time() - t0, 3)}
    print(json.dumps(result) if args.json else
          f"wrote {out}: {cal.k_hi} of {cal.dk} key channels per head in fp16 over layers {list(cal.layers)} "
          f"({result['bits_per_value']:.3f} bits per state value)")
    return 0


def add_calibration_options(p, *, every: int) -> None:
    """The options ``calibration_rows`` reads: ``checkpoint``, ``--data``, ``--out``, ``--rows``,
    ``--tokens`` and ``--every`` (default ``every``)."""
    p.add_argument("checkpoint", type=Path, help="converted checkpoint or HF directory")
    p.add_argument("--data", required=True, type=Path,
                   help="calibration text (tokenized with the checkpoint's tokenizer.json) or .npy ids [N] / [rows, N]")
    p.add_argument("--out", required=True, type=Path, help="calibration file to write (JSON)")
    p.add_argument("--rows", type=int_at_least(1), default=32, help="calibration segments")
    p.add_argument("--tokens", type=int_at_least(1), default=256, help="tokens per segment")
    p.add_argument("--every", type=int_at_least(1), default=every, help="tokens between state samples")


def add_subcommand(subparsers) -> None:
    """Registers ``calibrate-damp`` on an argparse subparsers object."""
    p = subparsers.add_parser("calibrate-damp", help="DAMP's offline calibration: which key channels stay in fp16")
    add_calibration_options(p, every=8)
    p.add_argument("--channels", type=int_at_least(1), default=DEFAULT_CHANNELS,
                   help="key channels per head kept in fp16 (K_hi)")
    p.add_argument("--tau", type=int_at_least(1), default=DEFAULT_TAU, help="persistence horizon in tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run_calibrate)


# check_state_method, linear_state_layout and model_fingerprint live in models.fingerprint; they
# are part of this module's API too, as the calibration's checks.
__all__ = ["DampCalibrationError", "add_calibration_options", "add_subcommand", "calibrate_model", "calibration_rows", "check_state_method",
           "linear_state_layout", "model_fingerprint", "record_traces", "run_calibrate", "save_calibration"]
