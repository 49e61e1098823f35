"""The model commands of the ``leapquant`` CLI: ``convert``, ``generate`` and ``score`` here, and the
commands of the modules in ``COMMAND_MODULES`` (``eval``, ``recall``, ``task``, ``train-data``,
``train``, ``demo``, ``calibrate-damp``, ``calibrate-stepquant``).

``add_subcommands(subparsers)`` registers them all on an ``argparse`` subparsers object; each sets
``func`` to a handler taking the parsed namespace and returning an exit code
(``leapquant_jax.cli_support.run_parser`` runs it). A command module has one function,
``add_subcommand(subparsers)``, that registers its own commands.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

from leapquant_jax.cli_support import (add_method_options, check_output, float_in, int_at_least, int_in,
                                       method_from_args, method_label)
from models import calibrate, calibrate_stepquant, demo, evaluate, recall, task_eval
from models.base import with_runtime
from models.checkpoint import convert_checkpoint, eos_token_ids
from models.decode import (available_memory, check_token_ids, generate, generation_memory, generation_program_bytes,
                           score, write_traces)
from models.distributed import add_mesh_options, is_primary, mesh_from_args, start
from models.layers import COMPUTE_MODES, Sampling
from models.loading import check_checkpoint, load_checkpoint, load_token_ids, load_tokenizer
from models.prefix_state import PrefixStateError, load_prefix, save_prefix
from models.serving import generate_one
from models.training import cli as training_cli

# The command modules, in `leapquant --help` order; a new one is imported above and named here.
COMMAND_MODULES = (evaluate, recall, task_eval, training_cli, demo, calibrate, calibrate_stepquant)


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


def _add_runtime_options(p: argparse.ArgumentParser, *, compute: str, why: str) -> None:
    """``--compute`` (default ``compute``; ``why`` says why that default) and ``--scan-layers``:
    how the model runs (``models.base.with_runtime``), not what it is."""
    p.add_argument("--compute", choices=COMPUTE_MODES, default=compute,
                   help="matmul precision: exact (fp32 operands) or fast (bf16 operands, fp32 accumulation, "
                        f"bf16 attention caches); {why}")
    p.add_argument("--scan-layers", action="store_true",
                   help="run the repeating blocks of layers under one lax.scan (a smaller program, a slower step "
                        "on a GPU); the same model and tokens up to round-off")


def _load_runtime(args):
    """``load_checkpoint`` of ``args.checkpoint``, set to run as ``--compute`` and ``--scan-layers`` say."""
    arch, config, params, config_json = load_checkpoint(args.checkpoint)
    config, params = with_runtime(config, params, compute=args.compute, scan_layers=args.scan_layers)
    return arch, config, params, config_json


# Caches and buffers below this share of the device's memory need no compiled count (see
# check_generation_fits); positions are int32, and the new tokens are bounded well inside them.
SHAPE_SHARE = 1 / 8
MAX_NEW_TOKENS = 2**30


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def check_generation_fits(arch, params, config, prompts, *, method, max_new_tokens: int, sampling, stop_ids,
                          seed: int, record: bool, prefix_tokens: int = 0, devices: int = 1) -> None:
    """Refuses (``ValueError`` naming ``--max-new-tokens``) a generation that would not fit in the
    device's memory (``models.decode.available_memory``), before anything is allocated, with about
    how many new tokens would. ``prompts``: the batch (one sequence when ``prefix_tokens``, the
    tokens of a loaded state, come first: what ``generate_one`` runs). ``devices``: a mesh's
    devices, whose memory counts together (the caches split over them).

    A run whose caches and buffers, measured on their shapes (``generation_memory``), take at
    most ``SHAPE_SHARE`` of the memory goes ahead. Above that, XLA's count for the compiled
    program (``generation_program_bytes``) decides: its temporaries, attention over the whole
    cache among them, take a few times the caches' own bytes."""
    fed = max((len(p) for p in prompts), default=0) + prefix_tokens
    batch = 1 if prefix_tokens else len(prompts)
    free, where = available_memory(jax.local_devices()[0])
    if devices > 1:
        free, where = free * devices, f"{where}, times the mesh's {devices} devices"
    memory = generation_memory(arch, params, config, batch=batch, prompt_len=fed, method=method, record=record)
    if memory.bytes(max_new_tokens) <= free * SHAPE_SHARE:
        return
    program_prompts = [[0] * fed] if prefix_tokens else prompts
    need = generation_program_bytes(arch, params, config, program_prompts, method=method,
                                    max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids, seed=seed,
                                    record=record)
    if need > free:
        fit = int(max_new_tokens * free / need)  # the new tokens' positions take nearly all of it
        raise ValueError(f"--max-new-tokens {max_new_tokens}: decoding {batch} sequence(s) of {fed} + "
                         f"{max_new_tokens} tokens needs {_gib(need)} (XLA's count for the compiled program: "
                         f"caches, attention over them, outputs), more than the {_gib(free)} {where}; at most about "
                         f"{fit:,} new tokens would fit")


def run_convert(args) -> int:
    check_checkpoint(args.hf_dir, what="hf_dir")
    t0 = time.time()
    out = convert_checkpoint(args.hf_dir, args.out_dir)
    result = {"command": "convert", "hf_dir": str(args.hf_dir), "out_dir": str(out), "seconds": round(time.time() - t0, 3)}
    print(json.dumps(result) if args.json else f"wrote {out}")
    return 0


def run_generate(args) -> int:
    start(args)
    method = method_from_args(args)
    check_output(args.record_traces, "--record-traces", folder=True)
    check_checkpoint(args.checkpoint)
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
        if args.mesh:
            raise ValueError(f"{flags} run on one device: drop --mesh")
    if args.save_state is not None:
        check_output(args.save_state, "--save-state", folder=False)
        if Path(args.save_state).exists():
            raise FileExistsError(f"--save-state {args.save_state} exists; not overwriting it")
    prefix = None
    if args.load_state is not None:
        prefix = load_prefix(args.load_state)
        if prefix.compute != args.compute:
            raise PrefixStateError(f"--load-state {args.load_state} was saved under --compute {prefix.compute} and "
                                   f"this run has --compute {args.compute}: pass --compute {prefix.compute} to "
                                   "load it")
    tokenizer = load_tokenizer(args.checkpoint)
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
    mesh = mesh_from_args(args, config, batch=len(prompts))
    if args.stop_ids is not None:
        stop = check_token_ids(args.stop_ids, config.vocab_size, name="--stop-ids").tolist()
    else:
        stop = check_token_ids(eos_token_ids(args.checkpoint, config_json), config.vocab_size,
                               name="the checkpoint's eos ids (pass --stop-ids to override)").tolist()
    check_generation_fits(arch, params, config, prompts, method=method, max_new_tokens=args.max_new_tokens,
                          sampling=sampling, stop_ids=stop, seed=args.seed, record=bool(args.record_traces),
                          prefix_tokens=0 if prefix is None else prefix.length + prefix.pending.shape[0],
                          devices=1 if mesh is None else mesh.size)
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
                       sampling=sampling, stop_ids=stop, seed=args.seed, record=bool(args.record_traces), mesh=mesh)
        generated = gen.tokens
    seconds = time.time() - t0
    if not is_primary():  # every process computed the same tokens; process 0 reports them
        return 0
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
        if mesh is not None:
            result.update(mesh=list(args.mesh), processes=jax.process_count())
        print(json.dumps(result))
    else:
        for b, toks in enumerate(generated):
            print(texts[b] if texts is not None else " ".join(map(str, toks)))
    return 0


def run_score(args) -> int:
    start(args)
    method = method_from_args(args)
    check_checkpoint(args.checkpoint)
    check_output(args.out, "--out", folder=False)
    check_output(args.record_traces, "--record-traces", folder=True)
    ids = load_token_ids(args.ids_file)
    arch, config, params, _ = _load_runtime(args)
    ids = check_token_ids(ids, config.vocab_size, name="--ids-file ids")
    mesh = mesh_from_args(args, config, batch=ids.shape[0] if ids.ndim == 2 else None)
    t0 = time.time()
    logits, traces = score(arch, params, config, ids, method=method, record=bool(args.record_traces), mesh=mesh)
    seconds = time.time() - t0
    if not is_primary():  # every process computed the same logits; process 0 writes them
        return 0
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
    """Registers ``convert``, ``generate``, ``score`` and the commands of ``COMMAND_MODULES`` on an
    argparse subparsers object."""
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
    p.add_argument("--max-new-tokens", type=int_in(1, MAX_NEW_TOKENS, why="token positions are int32"), required=True,
                   help="new tokens per prompt, at most; refused when they would not fit in the device's memory")
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
    add_mesh_options(p)
    p.set_defaults(func=run_generate)

    p = subparsers.add_parser("score", help="teacher-forced logits through the decode path")
    p.add_argument("checkpoint", type=Path, help="converted checkpoint or HF directory")
    p.add_argument("--ids-file", required=True, type=Path, help=".npy int array [B, T]")
    p.add_argument("--out", required=True, type=Path, help=".npy float32 logits [B, T, vocab]")
    _add_runtime_options(p, compute="exact", why="exact leaves the state format as the only difference between "
                                                 "runs")
    _add_state_options(p)
    add_mesh_options(p)
    p.set_defaults(func=run_score)

    for module in COMMAND_MODULES:
        module.add_subcommand(subparsers)


__all__ = ["COMMAND_MODULES", "add_subcommands", "check_generation_fits", "run_convert", "run_generate", "run_score"]
