"""``leapquant convert | generate | score``: the model commands of the ``leapquant`` CLI.

``add_subcommands(subparsers)`` registers them on an ``argparse`` subparsers object; each sets
``func`` to a handler taking the parsed namespace and returning an exit code. ``main`` runs
them stand-alone (``python -m models.cli ...``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _add_state_options(p: argparse.ArgumentParser) -> None:
    # names are checked by leapquant_jax.make_method, so new baselines need no change here
    p.add_argument("--state", default="fp32", metavar="METHOD",
                   help="recurrent-state format: fp32 (default), bf16, fp16, int8, fp8, bf16-w, int8-w, leapquant, ...")
    p.add_argument("--bits", type=int, choices=(8, 6, 4), help="leapquant residual bits")
    p.add_argument("--window", type=int, help="window length p of windowed methods")
    p.add_argument("--rank", type=int, help="compensator rank r")
    p.add_argument("--no-compensators", dest="compensators", action="store_false", default=None)
    p.add_argument("--no-smoothing", dest="smoothing", action="store_false", default=None)
    p.add_argument("--record-traces", metavar="DIR", help="write each linear layer's recurrence inputs as .npz traces")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _method(args):
    from models.decode import make_state_method

    return make_state_method(args.state, bits=args.bits, window=args.window, rank=args.rank,
                             compensators=args.compensators, smoothing=args.smoothing)


def _method_label(args) -> dict:
    return {k: getattr(args, k) for k in ("state", "bits", "window", "rank", "compensators", "smoothing")
            if getattr(args, k) is not None}


def _load(path):
    from models.checkpoint import load_model
    from models.decode import to_device

    arch, config, params, config_json = load_model(path)
    return arch, config, to_device(params), config_json


def _tokenizer(path):
    tok = Path(path) / "tokenizer.json"
    if not tok.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok))


def run_convert(args) -> int:
    from models.checkpoint import convert_checkpoint

    t0 = time.time()
    try:
        out = convert_checkpoint(args.hf_dir, args.out_dir)
    except FileExistsError as err:
        print(f"leapquant convert: error: {err}", file=sys.stderr)
        return 2
    result = {"command": "convert", "hf_dir": str(args.hf_dir), "out_dir": str(out), "seconds": round(time.time() - t0, 3)}
    print(json.dumps(result) if args.json else f"wrote {out}")
    return 0


def run_generate(args) -> int:
    from models.checkpoint import eos_token_ids
    from models.decode import generate, write_traces
    from models.layers import Sampling

    tokenizer = _tokenizer(args.checkpoint)
    if args.prompt:
        if tokenizer is None:
            raise SystemExit(f"{args.checkpoint} has no tokenizer.json; pass --prompt-ids instead of --prompt")
        prompts = [tokenizer.encode(text).ids for text in args.prompt]
    else:
        prompts = args.prompt_ids
    arch, config, params, config_json = _load(args.checkpoint)
    stop = args.stop_ids if args.stop_ids is not None else list(eos_token_ids(args.checkpoint, config_json))
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    t0 = time.time()
    gen = generate(arch, params, config, prompts, method=_method(args), max_new_tokens=args.max_new_tokens,
                   sampling=sampling, stop_ids=stop, seed=args.seed, record=bool(args.record_traces))
    seconds = time.time() - t0
    traces = [str(p) for p in write_traces(args.record_traces, gen.traces)] if args.record_traces else []
    texts = [tokenizer.decode(t) for t in gen.tokens] if tokenizer is not None else None
    if args.json:
        result = {"command": "generate", "checkpoint": str(args.checkpoint), "method": _method_label(args),
                  "prompt_ids": [list(map(int, p)) for p in prompts], "generated_ids": gen.tokens,
                  "stop_ids": list(stop), "seconds": round(seconds, 3), "traces": traces}
        if texts is not None:
            result["text"] = texts
        print(json.dumps(result))
    else:
        for b, toks in enumerate(gen.tokens):
            print(texts[b] if texts is not None else " ".join(map(str, toks)))
    return 0


def run_score(args) -> int:
    from models.decode import score, write_traces

    ids = np.load(args.ids_file)
    if ids.ndim == 1:
        ids = ids[None]
    arch, config, params, _ = _load(args.checkpoint)
    t0 = time.time()
    logits, traces = score(arch, params, config, ids.astype(np.int32), method=_method(args),
                           record=bool(args.record_traces))
    seconds = time.time() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, logits.astype(np.float32))
    written = [str(p) for p in write_traces(args.record_traces, traces)] if args.record_traces else []
    if args.json:
        print(json.dumps({"command": "score", "checkpoint": str(args.checkpoint), "method": _method_label(args),
                          "shape": list(logits.shape), "out": str(out), "seconds": round(seconds, 3),
                          "traces": written}))
    else:
        print(f"wrote {out} {tuple(logits.shape)}")
    return 0


def add_subcommands(subparsers) -> None:
    """Registers ``convert``, ``generate`` and ``score`` on an argparse subparsers object."""
    p = subparsers.add_parser("convert", help="convert an HF safetensors directory into a leapquant checkpoint")
    p.add_argument("hf_dir", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_convert)

    p = subparsers.add_parser("generate", help="generate text with a chosen recurrent-state format")
    p.add_argument("checkpoint", type=Path, help="converted checkpoint or HF directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    src.add_argument("--prompt-ids", action="append", type=_int_list, help="comma-separated ids (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-ids", type=_int_list, help="comma-separated stop ids (default: the checkpoint's eos ids)")
    _add_state_options(p)
    p.set_defaults(func=run_generate)

    p = subparsers.add_parser("score", help="teacher-forced logits through the decode path")
    p.add_argument("checkpoint", type=Path, help="converted checkpoint or HF directory")
    p.add_argument("--ids-file", required=True, type=Path, help=".npy int array [B, T]")
    p.add_argument("--out", required=True, type=Path, help=".npy float32 logits [B, T, vocab]")
    _add_state_options(p)
    p.set_defaults(func=run_score)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="leapquant")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
