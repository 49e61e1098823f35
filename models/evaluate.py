"""``leapquant eval``: grad-free accuracy of recurrent-state formats on a trained checkpoint.

Held-out text is decoded teacher-forced through the decode path (``models.decode.score``: one
``method.step`` per token, where the damage of a state format happens), once per state method,
every method from the same exact fp32 prefill of the first ``prefill`` tokens. fp32 is the
reference. Per method:

* ``perplexity``: ``exp`` of the mean negative log-likelihood of the next token, over the
  positions scored by decode steps (``prefill .. context - 2`` of every row);
* ``kl_to_fp32``: mean ``KL(p_fp32 || p_method)`` of the next-token distributions there;
* ``top1_agreement``: the fraction of those positions where the argmax equals fp32's;
* ``greedy_match_tokens``: after the whole context of each row, the number of leading tokens of
  the method's greedy continuation that equal fp32's (at most ``greedy_tokens``), mean over
  rows. fp32's continuation is generated once; each method is then scored teacher-forced on it:
  while the two agree the method sees exactly what its own greedy decoding would, so the first
  argmax that differs from fp32's token is where its own continuation would leave fp32's;
* ``state_rel_error``: per linear-attention layer, ``||S_method - S_fp32||_F / ||S_fp32||_F``
  of the final state, mean over rows and heads, after replaying that layer's recorded fp32
  inputs (the traces of the fp32 run) with the method. Every layer sees the same inputs, so the
  number is the state format's own error, not compounded through earlier layers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from leapquant_jax.methods import PER_STEP_METHODS, make_method
from leapquant_jax.studies.errors import STUDY_METHODS

# The options of `add_method_options` and the method names they apply to: window and kernels to
# every windowed method, the rest to LeapQuant alone.
_WINDOW_OPTIONS = ("window", "impl")
_LEAPQUANT_OPTIONS = ("bits", "rank", "compensators", "smoothing") + _WINDOW_OPTIONS
DEFAULT_STATES = "fp32,bf16,int8,bf16-w,int8-w,leapquant,leapquant-b6,leapquant-b4"


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """context: tokens per row; prefill: leading tokens of each row through the exact fp32
    prefill (the rest one decode step each); batch: rows (disjoint segments of the data);
    greedy_tokens: length of the greedy continuation compared with fp32's."""

    context: int = 512
    prefill: int = 0
    batch: int = 1
    greedy_tokens: int = 16

    def __post_init__(self):
        for name, low in (("context", 2), ("prefill", 0), ("batch", 1), ("greedy_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.prefill > self.context - 2:
            raise ValueError(f"prefill ({self.prefill}) must leave at least one scored decode step in the "
                             f"context ({self.context}): prefill <= context - 2")

    @property
    def scored_per_row(self) -> int:
        """Next-token predictions made by decode steps in each row."""
        return self.context - 1 - self.prefill


def build_methods(labels: Sequence[str], options: Optional[dict] = None) -> dict:
    """The state methods of ``labels`` (names of ``study errors``: ``fp32``, ``int8-w+ct``,
    ``leapquant-b6``, ...), with ``options`` (``bits``, ``window``, ``rank``, ``compensators``,
    ``smoothing``, ``impl``; ``None`` = the label's default) applied where they mean something.

    Returns ``{label: method}`` in the given order, fp32 first (added when missing: it is the
    reference). Raises ``ValueError`` for an unknown or repeated label, or an option that
    contradicts what the label fixes (``leapquant-b6`` with ``bits=4``).
    """
    options = {k: v for k, v in (options or {}).items() if v is not None}
    unknown_opts = set(options) - set(_LEAPQUANT_OPTIONS)
    if unknown_opts:
        raise ValueError(f"unknown state option(s) {sorted(unknown_opts)}; known: {list(_LEAPQUANT_OPTIONS)}")
    labels = [str(x).strip() for x in labels]
    if not labels or any(not x for x in labels):
        raise ValueError(f"--states must be a comma-separated list of methods, got {','.join(labels)!r}")
    for label in labels:
        if label not in STUDY_METHODS:
            raise ValueError(f"--states: unknown method {label!r}; known: {', '.join(STUDY_METHODS)}")
    repeated = sorted({x for x in labels if labels.count(x) > 1})
    if repeated:
        raise ValueError(f"--states names {repeated[0]!r} more than once")
    methods = {}
    for label in ["fp32"] + [x for x in labels if x != "fp32"]:
        name, fixed = STUDY_METHODS[label]
        applies = () if name in PER_STEP_METHODS else (_LEAPQUANT_OPTIONS if name == "leapquant" else _WINDOW_OPTIONS)
        opts = dict(fixed)
        for key in applies:
            if key not in options:
                continue
            if key in fixed and fixed[key] != options[key]:
                raise ValueError(f"--states {label} fixes {key}={fixed[key]!r}, which contradicts "
                                 f"--{key.replace('_', '-')} {options[key]!r}")
            opts[key] = options[key]
        methods[label] = make_method(name, **opts)
    return methods


def segment_rows(ids: np.ndarray, config: EvalConfig, *, source: str = "--data") -> np.ndarray:
    """Cuts the evaluation rows ``[batch, context]`` int32 out of ``ids``: a stream ``[N]`` gives
    ``batch`` consecutive disjoint segments; rows ``[R, N]`` give the first ``context`` tokens of
    the first ``batch`` rows. Raises ``ValueError`` naming ``source`` when the data is too short."""
    ids = np.asarray(ids)
    if ids.ndim not in (1, 2):
        raise ValueError(f"{source} must hold token ids [N] or [rows, N], got shape {ids.shape}")
    if ids.size == 0:
        raise ValueError(f"{source} holds no tokens")
    n = ids.shape[-1]
    if config.context > n:
        raise ValueError(f"--context {config.context} is longer than the data: {source} holds {n} tokens"
                         + (" per row" if ids.ndim == 2 else ""))
    if ids.ndim == 1:
        if config.batch * config.context > n:
            raise ValueError(f"--batch {config.batch} x --context {config.context} = "
                             f"{config.batch * config.context} tokens, but {source} holds {n}")
        return ids[: config.batch * config.context].reshape(config.batch, config.context).astype(np.int32)
    if config.batch > ids.shape[0]:
        raise ValueError(f"--batch {config.batch} is more than the {ids.shape[0]} rows of {source}")
    return ids[: config.batch, : config.context].astype(np.int32)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def next_token_metrics(logits: np.ndarray, ref_logits: np.ndarray, targets: np.ndarray, *,
                       chunk_elements: int = 1 << 24) -> dict:
    """Perplexity, mean KL to the reference and top-1 agreement with it.

    logits, ref_logits: ``[B, N, vocab]``, each position predicting ``targets [B, N]``;
    chunk_elements: logits held in float64 at a time.
    """
    b, n, vocab = logits.shape
    nll = kl = agree = 0.0
    # float64 copies a few positions at a time: a long context of a large vocabulary would not fit twice.
    step = max(1, chunk_elements // max(1, b * vocab))
    for i in range(0, n, step):
        x, ref = logits[:, i:i + step], ref_logits[:, i:i + step]
        logp, logq = _log_softmax(x), _log_softmax(ref)
        nll += -np.take_along_axis(logp, targets[:, i:i + step, None].astype(np.int64), axis=-1).sum()
        kl += np.sum(np.exp(logq) * (logq - logp))
        agree += np.sum(np.argmax(x, axis=-1) == np.argmax(ref, axis=-1))
    count = b * n
    return {"perplexity": float(np.exp(nll / count)), "kl_to_fp32": float(kl / count),
            "top1_agreement": float(agree / count)}


def greedy_match(logits: np.ndarray, continuation: np.ndarray) -> np.ndarray:
    """Leading positions where ``argmax(logits)`` equals the reference ``continuation``.

    logits ``[B, G, vocab]`` (position ``i`` scored after the reference's first ``i`` tokens),
    continuation ``[B, G]``. Returns ``[B]`` int counts in ``[0, G]``.
    """
    same = np.argmax(logits, axis=-1) == continuation
    return np.where(same.all(axis=1), same.shape[1], np.argmin(same, axis=1))


@functools.partial(jax.jit, static_argnames=("method", "prefill"))
def _final_state(inputs: dict, *, method, prefill: int):
    # inputs [N, T, H, ...]: the model's prefill (exact fp32, rounded once), then a step per token.
    b, t, h, dv = inputs["v"].shape
    dk = inputs["k"].shape[-1]
    head = {n: x[:, :prefill] for n, x in inputs.items()}
    tail = {n: x[:, prefill:] for n, x in inputs.items()}
    if prefill:
        _, state = method.prefill(**head)
    else:
        state = method.init(b, h, dk, dv, per_channel_decay=inputs["g"].ndim == 4)
    _, state = method.decode(state, **tail)
    return method.to_dense(state)


def state_errors(method, traces: dict, reference: dict, *, prefill: int) -> dict:
    """Relative final-state error of ``method`` per layer against ``reference``.

    traces: ``{layer: {"q", "k", "v", "g", "beta": [B, T, ...]}}`` (recorded fp32 inputs);
    reference: ``{layer: [B, H, dk, dv]}`` (fp32's final states, ``final_states``). Returns
    ``{layer: mean over rows and heads of ||S - S_ref||_F / ||S_ref||_F}``.
    """
    finals = final_states(method, traces, prefill=prefill)
    out = {}
    for layer, s in finals.items():
        ref = reference[layer]
        num = np.linalg.norm((s - ref).reshape(ref.shape[:2] + (-1,)), axis=-1)
        den = np.linalg.norm(ref.reshape(ref.shape[:2] + (-1,)), axis=-1)
        out[layer] = float(np.mean(num / np.maximum(den, np.finfo(np.float32).tiny)))
    return out


def final_states(method, traces: dict, *, prefill: int) -> dict:
    """Final dense states ``{layer: [B, H, dk, dv]}`` after replaying each layer's traces with
    ``method`` (layers folded into the batch: one compiled replay for all of them)."""
    layers = sorted(traces)
    names = ("q", "k", "v", "g", "beta")
    stacked = {n: np.concatenate([traces[layer][n] for layer in layers], axis=0) for n in names}
    dense = np.asarray(_final_state({n: jnp.asarray(x) for n, x in stacked.items()}, method=method, prefill=prefill))
    return dict(zip(layers, np.split(dense, len(layers), axis=0)))


def evaluate(arch, params, config, rows: np.ndarray, methods: dict, cfg: EvalConfig, *,
             progress: Callable = lambda it, **kw: it) -> dict:
    """Evaluates every method of ``methods`` (``{label: method}``, fp32 first) on ``rows``
    ``[B, context]`` int32 (see the module docstring). Returns the JSON object of ``leapquant
    eval``: ``{"methods": {label: {...}}, "context", "tokens"}``, ``tokens`` being the number of
    scored next-token predictions per method."""
    from models.decode import generate, score

    labels = list(methods)
    if not labels or labels[0] != "fp32":
        raise ValueError(f"methods must start with the fp32 reference, got {labels}")
    rows = np.asarray(rows)
    if rows.shape != (cfg.batch, cfg.context):
        raise ValueError(f"rows must be [batch, context] = {[cfg.batch, cfg.context]}, got {list(rows.shape)}")
    p, t, g = cfg.prefill, cfg.context, cfg.greedy_tokens
    results = {}
    bar = progress(labels, desc="eval")
    for label in bar:
        method = methods[label]
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(label)
        if label == "fp32":
            gen = generate(arch, params, config, list(rows), method=method, max_new_tokens=g)
            continuation = np.asarray(gen.tokens, np.int32)          # [B, G]: stop ids are off
            ids = np.concatenate([rows, continuation], axis=1)        # [B, T + G]
        logits, traces = score(arch, params, config, ids, method=method, prefill_len=p, record=label == "fp32")
        if label == "fp32":
            ref_logits = logits
            ref_traces = {layer: {n: x[:, :t] for n, x in tr.items()} for layer, tr in traces.items()}  # the context
            ref_states = final_states(method, ref_traces, prefill=p)
        entry = next_token_metrics(logits[:, p:t - 1], ref_logits[:, p:t - 1], rows[:, p + 1:])
        entry["greedy_match_tokens"] = float(greedy_match(logits[:, t - 1:t - 1 + g], continuation).mean())
        errors = state_errors(method, ref_traces, ref_states, prefill=p)
        entry["state_rel_error"] = {str(layer): err for layer, err in errors.items()}
        for key, value in [(k, entry[k]) for k in ("perplexity", "kl_to_fp32", "top1_agreement")] + \
                [(f"state_rel_error of layer {layer}", err) for layer, err in errors.items()]:
            if not np.isfinite(value):
                raise FloatingPointError(f"method {label}: {key} is {value} (non-finite logits or states)")
        results[label] = entry
    return {"methods": results, "context": t, "tokens": cfg.batch * cfg.scored_per_row}


def format_table(result: dict) -> str:
    """The human-readable table of an ``evaluate`` result."""
    head = (f"{'method':<16}{'perplexity':>12}{'KL to fp32':>12}{'top-1 agr.':>12}{'greedy':>8}"
            f"{'state err (mean / max over layers)':>38}")
    lines = [head]
    for label, m in result["methods"].items():
        errs = list(m["state_rel_error"].values())
        lines.append(f"{label:<16}{m['perplexity']:>12.4f}{m['kl_to_fp32']:>12.2e}{m['top1_agreement']:>12.4f}"
                     f"{m['greedy_match_tokens']:>8.1f}{np.mean(errs):>26.2e} / {np.max(errs):.2e}")
    lines.append(f"({result['tokens']} scored tokens, context {result['context']})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line


def load_data(path, tokenizer) -> np.ndarray:
    """``--data``: a ``.npy`` of token ids ``[N]`` or ``[rows, N]`` or a UTF-8 text file (encoded
    with ``tokenizer``, a ``tokenizers.Tokenizer`` or ``None``). Raises a ``ValueError`` or
    ``OSError`` naming the file."""
    from models.cli import _load_ids

    path = Path(path)
    if path.suffix == ".npy":
        ids = _load_ids(path, flag="--data")
        return ids[0] if ids.shape[0] == 1 else ids
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--data {path} is neither UTF-8 text nor a .npy file "
                         f"({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise type(err)(f"--data {path}: {err.strerror or err}") from None
    if not text:
        raise ValueError(f"--data {path} is empty")
    if tokenizer is None:
        raise ValueError(f"--data {path} is text, and the checkpoint has no tokenizer.json; pass a .npy of token ids")
    ids = np.asarray(tokenizer.encode(text).ids, np.int64)
    if ids.size == 0:
        raise ValueError(f"--data {path} holds no tokens")
    return ids


def run_eval(args) -> int:
    """The ``leapquant eval`` handler."""
    from leapquant_jax.cli import _progress
    from models.cli import _check_checkpoint, _load, _tokenizer
    from models.decode import check_token_ids

    cfg = EvalConfig(context=args.context, prefill=args.prefill, batch=args.batch, greedy_tokens=args.greedy_tokens)
    options = {k: getattr(args, k) for k in _LEAPQUANT_OPTIONS}
    methods = build_methods(args.states.split(","), options)
    _check_checkpoint(args.checkpoint)
    rows = segment_rows(load_data(args.data, _tokenizer(args.checkpoint)), cfg, source=f"--data {args.data}")
    arch, config, params, _ = _load(args.checkpoint)
    rows = check_token_ids(rows, config.vocab_size, name=f"--data {args.data} ids")
    t0 = time.time()
    result = evaluate(arch, params, config, rows, methods, cfg,
                      progress=lambda it, desc: _progress(it, desc=desc, enabled=True, total=len(methods)))
    result.update(checkpoint=str(args.checkpoint), data=str(args.data), prefill=cfg.prefill, batch=cfg.batch,
                  greedy_tokens=cfg.greedy_tokens, state_options={k: v for k, v in options.items() if v is not None},
                  seconds=round(time.time() - t0, 3))
    print(json.dumps(result) if args.json else format_table(result))
    return 0


def add_subcommand(subparsers) -> None:
    """Registers ``eval`` on an argparse subparsers object."""
    from leapquant_jax.cli import add_method_options, int_at_least

    p = subparsers.add_parser("eval", help="accuracy of state formats against fp32 on held-out text (decode path)")
    p.add_argument("checkpoint", type=Path, help="converted checkpoint or HF directory")
    p.add_argument("--data", required=True, type=Path,
                   help="held-out UTF-8 text (tokenized with the checkpoint's tokenizer.json) "
                        "or .npy ids [N] / [rows, N]")
    p.add_argument("--context", type=int_at_least(2), default=512, help="tokens per row")
    p.add_argument("--prefill", type=int_at_least(0), default=0,
                   help="leading tokens of each row through the exact fp32 prefill, at most context - 2")
    p.add_argument("--batch", type=int_at_least(1), default=1, help="rows: disjoint segments of the data")
    p.add_argument("--greedy-tokens", type=int_at_least(1), default=16,
                   help="greedy continuation after each row compared with fp32's")
    p.add_argument("--states", default=DEFAULT_STATES,
                   help=f"comma-separated methods ({', '.join(STUDY_METHODS)}); fp32, the reference, is always run")
    add_method_options(p, flag=None)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run_eval)


__all__ = ["DEFAULT_STATES", "EvalConfig", "add_subcommand", "build_methods", "evaluate", "final_states",
           "format_table", "greedy_match", "load_data", "next_token_metrics", "run_eval", "segment_rows",
           "state_errors"]
