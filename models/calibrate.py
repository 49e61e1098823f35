"""``leapquant calibrate-damp``: DAMP's offline calibration on a checkpoint, and the check that a
calibration belongs to the model it is used with.

    leapquant calibrate-damp CKPT --data FILE --out CAL.json [--rows 32] [--tokens 256]
                             [--every 8] [--channels 16] [--tau 4096] [--json]

The calibration rows (``--rows`` disjoint segments of ``--tokens`` tokens of ``--data``) go through
the decode path with the fp32 state, recording every linear-attention layer's inputs; the fp32
state every ``--every`` tokens is a sample (DAMP's protocol: 32 documents of 256 tokens, a state
every 8 tokens). ``leapquant_jax.damp.calibrate`` ranks the key channels; the file also keeps the
scores. ``eval``, ``recall``, ``demo``, ``generate`` and ``score`` take it with
``--damp-calibration CAL.json`` and refuse one made on another model.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import jax
import numpy as np

from leapquant_jax.damp import DampCalibrationError, DampMethod, calibrate
from models.base import layer_caches, runtime_free_repr


def model_fingerprint(config, params) -> str:
    """sha256 of the model's configuration (without how it runs: ``models.base.RUNTIME_FIELDS``)
    and of a few of its weights (the first embedding rows and the final norm): a calibration made
    on other weights of the same shape is told apart."""
    h = hashlib.sha256(runtime_free_repr(config).encode())
    for x in (params["embed"][:8], params["final_norm"]):
        h.update(np.ascontiguousarray(np.asarray(x, np.float32)).tobytes())
    return h.hexdigest()


def linear_state_layout(arch, config) -> tuple[tuple, int, int, int]:
    """``(layers, heads, dk, dv)``: the model's linear-attention layer indices and their state shape."""
    from leapquant_jax import make_method

    cache = jax.eval_shape(lambda: arch.init_cache(config, batch=1, max_len=1, method=make_method("fp32")))
    layers, shape = [], None
    for i, c in enumerate(layer_caches(cache, config)):
        if "state" in c:
            layers.append(i)
            shape = c["state"].shape
    if shape is None:
        raise ValueError("the model has no linear-attention layer: DAMP has nothing to calibrate")
    return tuple(layers), shape[1], shape[2], shape[3]


def check_state_method(method, arch, config, params) -> None:
    """Raises ``DampCalibrationError`` when ``method`` is ``damp`` with a calibration made for
    another model (fingerprint, layers or head shape); any other method passes."""
    if not isinstance(method, DampMethod) or method.calibration is None:
        return
    layers, heads, dk, dv = linear_state_layout(arch, config)
    method.calibration.check_model(fingerprint=model_fingerprint(config, params), layers=layers, heads=heads,
                                   dk=dk, dv=dv)


def calibrate_model(arch, params, config, rows: np.ndarray, *, k_hi: int, tau: int, every: int):
    """DAMP calibration of a model on ``rows [R, T]`` token ids. Returns ``(calibration, scores)``."""
    from leapquant_jax import make_method
    from models.decode import score

    _, traces = score(arch, params, config, rows, method=make_method("fp32"), record=True)
    return calibrate(traces, k_hi=k_hi, tau=tau, every=every, model=model_fingerprint(config, params))


def run_calibrate(args) -> int:
    """The ``leapquant calibrate-damp`` handler."""
    from models.cli import _check_checkpoint, _check_output, _load, _tokenizer
    from models.decode import check_token_ids
    from models.evaluate import EvalConfig, load_data, segment_rows

    _check_checkpoint(args.checkpoint)
    _check_output(args.out, "--out", folder=False)
    if args.every > args.tokens:
        raise ValueError(f"--every {args.every} is more than --tokens {args.tokens}: no calibration sample")
    cfg = EvalConfig(context=args.tokens, prefill=0, batch=args.rows, greedy_tokens=1)
    rows = segment_rows(load_data(args.data, _tokenizer(args.checkpoint)), cfg, source=f"--data {args.data}")
    arch, config, params, _ = _load(args.checkpoint)
    rows = check_token_ids(rows, config.vocab_size, name=f"--data {args.data} ids")
    _, _, dk, _ = linear_state_layout(arch, config)
    if not 0 < args.channels < dk:
        raise ValueError(f"--channels {args.channels}: the protected key channels per head must be in "
                         f"[1, dk - 1] = [1, {dk - 1}]")
    t0 = time.time()
    cal, scores = calibrate_model(arch, params, config, rows, k_hi=args.channels, tau=args.tau, every=args.every)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cal.save(str(out), extra={"checkpoint": str(args.checkpoint), "data": str(args.data), "rows": args.rows,
                              "tokens": args.tokens, "every": args.every, "scores": scores})
    from leapquant_jax.damp import bits_per_value

    result = {"command": "calibrate-damp", "checkpoint": str(args.checkpoint), "out": str(out),
              "layers": list(cal.layers), "heads": cal.heads, "k_hi": cal.k_hi, "tau": cal.tau,
              "bits_per_value": bits_per_value(cal.dk, cal.dv, cal.k_hi), "seconds": round(time.time() - t0, 3)}
    print(json.dumps(result) if args.json else
          f"wrote {out}: {cal.k_hi} of {cal.dk} key channels per head in fp16 over layers {list(cal.layers)} "
          f"({result['bits_per_value']:.3f} bits per state value)")
    return 0


def add_subcommand(subparsers) -> None:
    """Registers ``calibrate-damp`` on an argparse subparsers object."""
    from leapquant_jax.cli import int_at_least
    from leapquant_jax.damp import DEFAULT_CHANNELS, DEFAULT_TAU

    p = subparsers.add_parser("calibrate-damp", help="DAMP's offline calibration: which key channels stay in fp16")
    p.add_argument("checkpoint", type=Path, help="converted checkpoint or HF directory")
    p.add_argument("--data", required=True, type=Path,
                   help="calibration text (tokenized with the checkpoint's tokenizer.json) or .npy ids [N] / [rows, N]")
    p.add_argument("--out", required=True, type=Path, help="calibration file to write (JSON)")
    p.add_argument("--rows", type=int_at_least(1), default=32, help="calibration segments")
    p.add_argument("--tokens", type=int_at_least(1), default=256, help="tokens per segment")
    p.add_argument("--every", type=int_at_least(1), default=8, help="tokens between state samples")
    p.add_argument("--channels", type=int_at_least(1), default=DEFAULT_CHANNELS,
                   help="key channels per head kept in fp16 (K_hi)")
    p.add_argument("--tau", type=int_at_least(1), default=DEFAULT_TAU, help="persistence horizon in tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run_calibrate)


__all__ = ["DampCalibrationError", "add_subcommand", "calibrate_model", "check_state_method", "linear_state_layout",
           "model_fingerprint", "run_calibrate"]
