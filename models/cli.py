"""``leapquant convert | generate | score | eval | recall | train-data | train | demo | calibrate-damp``: the model commands of the ``leapquant`` CLI.

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

from leapquant_jax.cli import (ArgumentParser, add_method_options, float_in, int_at_least, method_from_args,
                               method_label, run_parser)


def _id_list(text: str) -> list[int]:
    """An ``argparse`` type: comma-separated non-negative integer ids (possibly none)."""
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    negative = [i for i in ids if i < 0]
    if negative:
        raise argparse.ArgumentTypeError(f"token ids are >= 0, got {negative[0]}")
    return ids


def _prompt_ids(text: str) -> list[int]:
    """``_id_list`` with at least one id."""
    ids = _id_list(text)
    if not ids:
        raise argparse.ArgumentTypeError(f"a prompt needs at least one id, got {text!r}")
    return ids


def _add_state_options(p: argparse.ArgumentParser) -> None:
    add_method_options(p, flag="--state", default="fp32")
    p.add_argument("--record-traces", metavar="DIR", help="write each linear layer's recurrence inputs as .npz traces")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _load(path):
    from models.checkpoint import load_model
    from models.decode import to_device

    arch, config, params, config_json = load_model(path)
    return arch, config, to_device(params), config_json


def _add_runtime_options(p: argparse.ArgumentParser, *, compute: str, why: str) -> None:
    """``--compute`` (default ``compute``; ``why`` says why that default) and ``--scan-layers``:
    how the model runs (``models.base.with_runtime``), not what it is."""
    from models.layers import COMPUTE_MODES

    p.add_argument("--compute", choices=COMPUTE_MODES, default=compute,
                   help="matmul precision: exact (fp32 operands) or fast (bf16 operands, fp32 accumulation, "
                        f"bf16 attention caches); {why}")
    p.add_argument("--scan-layers", action="store_true",
                   help="run the repeating blocks of layers under one lax.scan (a smaller program, a slower step "
                        "on a GPU); the same model and tokens up to round-off")


def _load_runtime(args):
    """``_load`` of ``args.checkpoint``, set to run as ``--compute`` and ``--scan-layers`` say."""
    from models.base import with_runtime

    arch, config, params, config_json = _load(args.checkpoint)
    config, params = with_runtime(config, params, compute=args.compute, scan_layers=args.scan_layers)
    return arch, config, params, config_json


def _check_checkpoint(path) -> None:
    if not Path(path).is_dir():
        raise FileNotFoundError(f"checkpoint {path}: no such directory")


def _check_output(path, flag: str, *, folder: bool) -> None:
    # Checked before the model runs, so that a bad path costs nothing and nothing is written.
    if path is None:
        return
    path = Path(path)
    if folder and path.exists() and not path.is_dir():
        raise FileExistsError(f"{flag} {path} exists and is not a folder")
    if not folder and path.is_dir():
        raise IsADirectoryError(f"{flag} {path} is a folder; give a file name")


def _load_ids(path: Path, flag: str = "--ids-file") -> np.ndarray:
    """``--ids-file`` (or ``flag``): a ``.npy`` integer array ``[B, T]`` (or ``[T]``, one row),
    read without pickle; every problem is reported against the flag."""
    try:
        with open(path, "rb") as f:
            is_npy = f.read(6) == b"\x93NUMPY"
            f.seek(0)
            if is_npy:
                version = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, dtype = read_header(f)
    except OSError as err:
        raise type(err)(f"{flag} {path}: {err.strerror or err}") from None
    except ValueError as err:
        raise ValueError(f"{flag} {path}: unreadable .npy header ({err})") from None
    if not is_npy:
        raise ValueError(f"{flag} {path} is not a .npy file (save the ids with numpy.save)")
    # Checked on the header, before loading: an object array would need pickle.
    if len(shape) not in (1, 2) or not np.issubdtype(dtype, np.integer):
        raise ValueError(f"{flag} {path} must hold integer ids [B, T] or [T], got {dtype} {shape}")
    try:
        ids = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"{flag} {path}: unreadable .npy file ({err})") from None
    if ids.ndim == 1:
        ids = ids[None]
    if ids.size == 0:
        raise ValueError(f"{flag} {path} holds no tokens (shape {ids.shape})")
    return ids


def _tokenizer(path):
    tok = Path(path) / "tokenizer.json"
    if not tok.exists():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(tok))
    except Exception as err:  # the tokenizers library raises plain Exception for a malformed file
        raise ValueError(f"{tok} is not a readable tokenizer file ({err})") from None


def run_convert(args) -> int:
    from models.checkpoint import convert_checkpoint

    t0 = time.time()
    out = convert_checkpoint(args.hf_dir, args.out_dir)
    result = {"command": "convert", "hf_dir": str(args.hf_dir), "out_dir": str(out), "seconds": round(time.time() - t0, 3)}
    print(json.dumps(result) if args.json else f"wrote {out}")
    return 0


def run_generate(args) -> int:
    from models.checkpoint import eos_token_ids
    from models.decode import check_token_ids, generate, write_traces
    from models.layers import Sampling
    from models.prefix_state import PrefixStateError, load_prefix, save_prefix
    from models.serving import generate_one

    method = method_from_args(args)
    _check_output(args.record_traces, "--record-traces", folder=True)
    _check_checkpoint(args.checkpoint)
    stateful = args.save_state is not None or args.load_state is not None
    given = args.prompt or args.prompt_ids or []
    if not given and args.load_state is None:
        raise ValueError("generate needs --prompt or --prompt-ids (or --load-state FILE to start from a saved state)")
    if stateful:
        flags = " and ".join(f for f, v in (("--save-state", args.save_state), ("--load-state", args.load_state)) if v)
        if len(given) > 1:
            verb = "take" if " and " in flags else "takes"
            raise ValueError(f"{flags} {verb} one prompt (one sequence), got {len(given)}")
        if args.record_traces:
            raise ValueError(f"--record-traces cannot be combined with {flags}")
    if args.save_state is not None:
        _check_output(args.save_state, "--save-state", folder=False)
        if Path(args.save_state).exists():
            raise FileExistsError(f"--save-state {args.save_state} exists; not overwriting it")
    prefix = None
    if args.load_state is not None:
        prefix = load_prefix(args.load_state)
        if prefix.compute != args.compute:
            raise PrefixStateError(f"--load-state {args.load_state} was saved under --compute {prefix.compute} and "
                                   f"this run has --compute {args.compute}: pass --compute {prefix.compute} to "
                                   "load it")
    tokenizer = _tokenizer(args.checkpoint)
    if args.prompt:
        if tokenizer is None:
            raise ValueError(f"--prompt needs a tokenizer, and {args.checkpoint} has no tokenizer.json; pass --prompt-ids")
        prompts, flag = [tokenizer.encode(text).ids for text in args.prompt], "--prompt"
    else:
        prompts, flag = list(args.prompt_ids or []), "--prompt-ids"
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    arch, config, params, config_json = _load_runtime(args)
    for b, p in enumerate(prompts):
        check_token_ids(p, config.vocab_size, name=flag if len(prompts) == 1 else f"{flag} (prompt {b + 1})")
    if args.stop_ids is not None:
        stop = check_token_ids(args.stop_ids, config.vocab_size, name="--stop-ids").tolist()
    else:
        stop = check_token_ids(eos_token_ids(args.checkpoint, config_json), config.vocab_size,
                               name="the checkpoint's eos ids (pass --stop-ids to override)").tolist()
    t0 = time.time()
    if stateful:
        try:
            tokens, state = generate_one(arch, params, config, method=method, prompt=prompts[0] if prompts else (),
                                         prefix=prefix, max_new_tokens=args.max_new_tokens, stop_ids=stop,
                                         sampling=sampling, seed=args.seed, keep_state=args.save_state is not None)
        except PrefixStateError as err:
            if prefix is None:
                raise PrefixStateError(f"--save-state: {err}") from None
            raise PrefixStateError(f"--load-state {args.load_state}: {err} (load it with the checkpoint, "
                                   "--state options and --compute it was saved with)") from None
        if state is not None:
            save_prefix(args.save_state, state)
        generated = [tokens]
        prompts = [(prefix.all_ids.tolist() if prefix is not None else []) + [int(t) for t in (prompts or [[]])[0]]]
    else:
        gen = generate(arch, params, config, prompts, method=method, max_new_tokens=args.max_new_tokens,
                       sampling=sampling, stop_ids=stop, seed=args.seed, record=bool(args.record_traces))
        generated = gen.tokens
    seconds = time.time() - t0
    traces = [str(p) for p in write_traces(args.record_traces, gen.traces)] if args.record_traces else []
    texts = [tokenizer.decode(t) for t in generated] if tokenizer is not None else None
    if args.json:
        result = {"command": "generate", "checkpoint": str(args.checkpoint), "method": method_label(args),
                  "compute": args.compute, "scan_layers": args.scan_layers,
                  "prompt_ids": [list(map(int, p)) for p in prompts], "generated_ids": generated,
                  "stop_ids": list(stop), "seconds": round(seconds, 3), "traces": traces}
        if args.load_state is not None:
            result["loaded_state"] = str(args.load_state)
        if args.save_state is not None:
            result["saved_state"] = str(args.save_state)
        if texts is not None:
            result["text"] = texts
        print(json.dumps(result))
    else:
        for b, toks in enumerate(generated):
            print(texts[b] if texts is not None else " ".join(map(str, toks)))
    return 0


def run_score(args) -> int:
    from models.decode import check_token_ids, score, write_traces

    method = method_from_args(args)
    _check_checkpoint(args.checkpoint)
    _check_output(args.out, "--out", folder=False)
    _check_output(args.record_traces, "--record-traces", folder=True)
    ids = _load_ids(args.ids_file)
    arch, config, params, _ = _load_runtime(args)
    ids = check_token_ids(ids, config.vocab_size, name="--ids-file ids")
    t0 = time.time()
    logits, traces = score(arch, params, config, ids, method=method, record=bool(args.record_traces))
    seconds = time.time() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, logits.astype(np.float32))
    written = [str(p) for p in write_traces(args.record_traces, traces)] if args.record_traces else []
    if args.json:
        print(json.dumps({"command": "score", "checkpoint": str(args.checkpoint), "method": method_label(args),
                          "compute": args.compute, "scan_layers": args.scan_layers, "shape": list(logits.shape),
                          "out": str(out), "seconds": round(seconds, 3), "traces": written}))
    else:
        print(f"wrote {out} {tuple(logits.shape)}")
    return 0


def add_subcommands(subparsers) -> None:
    """Registers ``convert``, ``generate``, ``score``, ``eval`` (``models.evaluate``), ``recall``
    (``models.recall``), ``train-data`` and ``train`` (``models.training.cli``), ``demo``
    (``models.demo``) and ``calibrate-damp`` (``models.calibrate``) on an argparse subparsers object."""
    p = subparsers.add_parser("convert", help="convert an HF safetensors directory into a leapquant checkpoint")
    p.add_argument("hf_dir", type=Path, help="HF directory: config.json and *.safetensors")
    p.add_argument("out_dir", type=Path, help="checkpoint directory to create (must not exist, or be empty)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run_convert)

    p = subparsers.add_parser("generate", help="generate text with a chosen recurrent-state format")
    p.add_argument("checkpoint", type=Path, help="converted checkpoint or HF directory")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append",
                     help="prompt text (repeat for a batch); with --load-state, text to feed after the saved state")
    src.add_argument("--prompt-ids", action="append", type=_prompt_ids,
                     help="comma-separated ids (repeat for a batch); with --load-state, ids to feed after it")
    p.add_argument("--max-new-tokens", type=int_at_least(1), required=True, help="new tokens per prompt, at most")
    p.add_argument("--temperature", type=float_in(0.0), default=0.0, help="sampling temperature, 0 = greedy")
    p.add_argument("--top-p", type=float_in(0.0, 1.0, low_open=True), default=1.0, help="nucleus mass in (0, 1], 1 = off")
    p.add_argument("--top-k", type=int_at_least(0), default=0, help="keep the k likeliest tokens, 0 = off")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="sampling seed")
    p.add_argument("--stop-ids", type=_id_list,
                   help="comma-separated stop ids, '' for none (default: the checkpoint's eos ids)")
    p.add_argument("--save-state", type=Path, metavar="FILE",
                   help="save the state after the prompt (one prompt) to a new prefix-state file: a windowed "
                        "state (leapquant, ...) at the prompt's last window boundary, with the prompt tokens after "
                        "it, which a load feeds through decode steps; the tokens are those a load of the file "
                        "gives (a run without the file prefills the whole prompt: the same up to round-off)")
    p.add_argument("--load-state", type=Path, metavar="FILE",
                   help="start from a --save-state file of the same checkpoint, --state options and --compute")
    _add_runtime_options(p, compute="fast", why="fast is what serving engines run")
    _add_state_options(p)
    p.set_defaults(func=run_generate)

    p = subparsers.add_parser("score", help="teacher-forced logits through the decode path")
    p.add_argument("checkpoint", type=Path, help="converted checkpoint or HF directory")
    p.add_argument("--ids-file", required=True, type=Path, help=".npy int array [B, T]")
    p.add_argument("--out", required=True, type=Path, help=".npy float32 logits [B, T, vocab]")
    _add_runtime_options(p, compute="exact", why="exact leaves the state format as the only difference between "
                                                 "runs")
    _add_state_options(p)
    p.set_defaults(func=run_score)

    from models.evaluate import add_subcommand as add_eval_subcommand

    add_eval_subcommand(subparsers)  # eval

    from models.recall import add_subcommand as add_recall_subcommand

    add_recall_subcommand(subparsers)  # recall

    from models.training.cli import add_subcommands as add_training_subcommands

    add_training_subcommands(subparsers)  # train-data, train

    from models.demo import add_subcommand as add_demo_subcommand

    add_demo_subcommand(subparsers)  # demo

    from models.calibrate import add_subcommand as add_calibrate_subcommand

    add_calibrate_subcommand(subparsers)  # calibrate-damp
    __import__("importlib").import_module("models.task_eval").add_subcommand(subparsers)  # task


def main(argv=None) -> int:
    """The model commands alone, with the ``leapquant`` CLI's error handling."""
    parser = ArgumentParser(prog="leapquant")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    return run_parser(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
