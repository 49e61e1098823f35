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

Each entry also holds ``per_row``: the same five numbers for every row (``[B]`` lists; the state
error there is the mean over layers and heads). Rows are disjoint segments of the data, so their
spread is the segment-to-segment spread. ``perplexity`` is ``exp`` of the mean NLL over every
scored position, which equals ``exp`` of the mean of the per-row ``log`` perplexities (every row
scores as many positions); the other means are the means of the per-row values.

With ``error_every = N`` the replay also records the dense state every ``N`` decoded tokens (one
scan, as ``studies.errors.trajectory``), and each entry gains ``state_error_curve``:
``{"tokens": [N, 2N, ..., decoded], "per_layer": {layer: [...]}, "mean": [...]}``, the relative
state error at those points (mean over rows and heads, then over layers for ``mean``); its last
point is the final state, so it equals ``state_rel_error``. ``tokens`` counts decode steps after
the prefill, and a last point at the end of the row is added when ``N`` does not divide them.

``reference_run`` computes what every method is compared with (fp32's logits, continuation,
traces and replayed states) once; ``score_method`` scores one method against it; ``evaluate``
is the two together.

``--generate G`` runs free-running generation instead (``generation_study``, whose docstring
gives its measures): first divergence from fp32's continuation, KL along it, repetition rate.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from leapquant_jax.checks import check_integer
from leapquant_jax.cli_support import add_states_option, int_at_least, progress, state_options, warn
from leapquant_jax.method_names import methods_for_labels
from leapquant_jax.methods import make_method
from models.decode import check_token_ids, generate, score
from models.fingerprint import check_state_method
from models.loading import check_checkpoint, load_checkpoint, load_token_ids, load_tokenizer, training_file

DEFAULT_STATES = "fp32,bf16,int8,bf16-w,int8-w,leapquant,leapquant-b6,leapquant-b4"


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """context: tokens per row; prefill: leading tokens of each row through the exact fp32
    prefill (the rest one decode step each); batch: rows (disjoint segments of the data);
    greedy_tokens: length of the greedy continuation compared with fp32's; error_every: decoded
    tokens between the recorded states of ``state_error_curve`` (``None``: no curve)."""

    context: int = 512
    prefill: int = 0
    batch: int = 1
    greedy_tokens: int = 16
    error_every: Optional[int] = None

    def __post_init__(self):
        checks = [("context", 2), ("prefill", 0), ("batch", 1), ("greedy_tokens", 1)]
        for name, low in checks + ([("error_every", 1)] if self.error_every is not None else []):
            check_integer(name, getattr(self, name), low)
        if self.prefill > self.context - 2:
            raise ValueError(f"prefill ({self.prefill}) must leave at least one scored decode step in the "
                             f"context ({self.context}): prefill <= context - 2")
        if self.error_every is not None and self.error_every > self.decoded_per_row:
            raise ValueError(f"error_every ({self.error_every}) is more than the {self.decoded_per_row} tokens "
                             f"decoded per row (context {self.context} - prefill {self.prefill})")

    @property
    def scored_per_row(self) -> int:
        """Next-token predictions made by decode steps in each row."""
        return self.context - 1 - self.prefill

    @property
    def decoded_per_row(self) -> int:
        """Tokens of each row that go through decode steps (the rest through the prefill)."""
        return self.context - self.prefill

    @property
    def curve_tokens(self) -> list:
        """Decoded tokens at the points of ``state_error_curve`` (empty without ``error_every``)."""
        if self.error_every is None:
            return []
        n, every = self.decoded_per_row, self.error_every
        return list(range(every, n + 1, every)) + ([n] if n % every else [])


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
                       chunk_elements: int = 1 << 24, per_row: bool = False) -> dict:
    """Perplexity, mean KL to the reference and top-1 agreement with it.

    logits, ref_logits: ``[B, N, vocab]``, each position predicting ``targets [B, N]``;
    chunk_elements: logits held in float64 at a time. Returns floats over all ``B x N``
    positions; with ``per_row``, also ``"per_row": {name: [B] float64}`` of each row's own
    ``N`` positions (the overall numbers are the sums of the same per-row float64 sums).
    """
    b, n, vocab = logits.shape
    nll, kl, agree = np.zeros(b), np.zeros(b), np.zeros(b)
    # float64 copies a few positions at a time: a long context of a large vocabulary would not fit twice.
    step = max(1, chunk_elements // max(1, b * vocab))
    for i in range(0, n, step):
        x, ref = logits[:, i:i + step], ref_logits[:, i:i + step]
        logp, logq = _log_softmax(x), _log_softmax(ref)
        nll -= np.take_along_axis(logp, targets[:, i:i + step, None].astype(np.int64), axis=-1).sum(axis=(1, 2))
        kl += np.sum(np.exp(logq) * (logq - logp), axis=(1, 2))
        agree += np.sum(np.argmax(x, axis=-1) == np.argmax(ref, axis=-1), axis=1)
    count = b * n
    out = {"perplexity": float(np.exp(nll.sum() / count)), "kl_to_fp32": float(kl.sum() / count),
           "top1_agreement": float(agree.sum() / count)}
    if per_row:
        out["per_row"] = {"perplexity": np.exp(nll / n), "kl_to_fp32": kl / n, "top1_agreement": agree / n}
    return out


def greedy_match(logits: np.ndarray, continuation: np.ndarray) -> np.ndarray:
    """Leading positions where ``argmax(logits)`` equals the reference ``continuation``.

    logits ``[B, G, vocab]`` (position ``i`` scored after the reference's first ``i`` tokens),
    continuation ``[B, G]``. Returns ``[B]`` int counts in ``[0, G]``.
    """
    same = np.argmax(logits, axis=-1) == continuation
    return np.where(same.all(axis=1), same.shape[1], np.argmin(same, axis=1))


@functools.partial(jax.jit, static_argnames=("method", "prefill", "every"))
def _replay(inputs: dict, state, *, method, prefill: int, every: Optional[int]):
    # inputs [N, T, H, ...]: the model's prefill (exact fp32, rounded once), then a step per token;
    # state: the zero state when there is no prefill (an argument, not built in here: XLA would
    # spend seconds constant-folding the quantization of a constant zero state at compile time).
    b, t = inputs["v"].shape[:2]
    head = {n: x[:, :prefill] for n, x in inputs.items()}
    tail = {n: x[:, prefill:] for n, x in inputs.items()}
    if prefill:
        _, state = method.prefill(**head)
    if every is None:
        _, state = method.decode(state, **tail)
        return method.to_dense(state), None
    # One scan over blocks of `every` tokens, the dense state kept after each (studies.errors.trajectory),
    # then the tokens left over; the final state is the scan's own carry.
    n = t - prefill
    full = n // every * every
    blocks = {name: jnp.moveaxis(x[:, :full].reshape((b, n // every, every) + x.shape[2:]), 1, 0)
              for name, x in tail.items()}

    def body(state, xs):
        _, state = method.decode(state, **xs)
        return state, method.to_dense(state)

    state, snapshots = jax.lax.scan(body, state, blocks)
    if full < n:
        _, state = method.decode(state, **{name: x[:, full:] for name, x in tail.items()})
        snapshots = jnp.concatenate([snapshots, method.to_dense(state)[None]], axis=0)
    return method.to_dense(state), snapshots


def replay_states(method, traces: dict, *, prefill: int, every: Optional[int] = None) -> tuple[dict, Optional[dict]]:
    """Replays each layer's traces ``{layer: {name: [B, T, ...]}}`` with ``method`` (layers folded
    into the batch: one compiled replay for all of them).

    Returns ``(final, snapshots)``: final dense states ``{layer: [B, H, dk, dv]}``, and with
    ``every`` the dense states after every ``every`` decoded tokens ``{layer: [S, B, H, dk, dv]}``
    (``EvalConfig.curve_tokens`` gives the points; the last is the final state), else ``None``.
    """
    if every is not None and (isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1):
        raise ValueError(f"every must be an integer >= 1 or None, got {every!r}")
    # Layers whose method is the same (every method but damp's per-layer channels) share one replay.
    groups = {}
    for layer in sorted(traces):
        groups.setdefault(method.for_layer(layer), []).append(layer)
    final, snapshots = {}, {}
    for m, layers in groups.items():
        names = ("q", "k", "v", "g", "beta")
        stacked = {n: np.concatenate([traces[layer][n] for layer in layers], axis=0) for n in names}
        b, _, h, dv = stacked["v"].shape
        state = None if prefill else m.init(b, h, stacked["k"].shape[-1], dv, per_channel_decay=stacked["g"].ndim == 4)
        dense, snaps = _replay({n: jnp.asarray(x) for n, x in stacked.items()}, state, method=m, prefill=prefill,
                               every=every)
        final.update(zip(layers, np.split(np.asarray(dense), len(layers), axis=0)))
        if snaps is not None:
            snapshots.update(zip(layers, np.split(np.asarray(snaps), len(layers), axis=1)))
    final = {layer: final[layer] for layer in sorted(final)}
    if every is None:
        return final, None
    return final, {layer: snapshots[layer] for layer in sorted(snapshots)}


def final_states(method, traces: dict, *, prefill: int) -> dict:
    """Final dense states ``{layer: [B, H, dk, dv]}`` after replaying each layer's traces with
    ``method`` (layers folded into the batch: one compiled replay for all of them)."""
    return replay_states(method, traces, prefill=prefill)[0]


def relative_state_errors(states: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """``||S - S_ref||_F / ||S_ref||_F`` per head: ``[..., H, dk, dv]`` twice -> ``[..., H]``."""
    lead = reference.shape[:-2]
    num = np.linalg.norm((states - reference).reshape(lead + (-1,)), axis=-1)
    den = np.linalg.norm(reference.reshape(lead + (-1,)), axis=-1)
    return num / np.maximum(den, np.finfo(np.float32).tiny)


def state_errors(method, traces: dict, reference: dict, *, prefill: int) -> dict:
    """Relative final-state error of ``method`` per layer against ``reference``.

    traces: ``{layer: {"q", "k", "v", "g", "beta": [B, T, ...]}}`` (recorded fp32 inputs);
    reference: ``{layer: [B, H, dk, dv]}`` (fp32's final states, ``final_states``). Returns
    ``{layer: mean over rows and heads of ||S - S_ref||_F / ||S_ref||_F}``.
    """
    finals = final_states(method, traces, prefill=prefill)
    return {layer: float(np.mean(relative_state_errors(s, reference[layer]))) for layer, s in finals.items()}


@dataclasses.dataclass(frozen=True, eq=False)
class Reference:
    """What every method is compared with, from one fp32 run (``reference_run``).

    rows ``[B, T]`` and ids ``[B, T + G]`` (the rows, then fp32's greedy continuation
    ``continuation [B, G]``); logits ``[B, T + G, vocab]``; traces ``{layer: {name: [B, T, ...]}}``
    (the recorded inputs of the context); final ``{layer: [B, H, dk, dv]}`` and, with
    ``cfg.error_every``, snapshots ``{layer: [S, B, H, dk, dv]}`` of the fp32 replay.
    """

    cfg: EvalConfig
    method: object
    rows: np.ndarray
    continuation: np.ndarray
    ids: np.ndarray
    logits: np.ndarray
    traces: dict
    final: dict
    snapshots: Optional[dict]


def reference_run(arch, params, config, rows: np.ndarray, cfg: EvalConfig, *, method=None) -> Reference:
    """The fp32 reference (``method``, default ``fp32``) on ``rows [B, context]`` int32: greedy
    continuation, teacher-forced logits through the decode path with recorded traces, and the
    per-layer replay of those traces."""
    method = make_method("fp32") if method is None else method
    rows = np.asarray(rows)
    if rows.shape != (cfg.batch, cfg.context):
        raise ValueError(f"rows must be [batch, context] = {[cfg.batch, cfg.context]}, got {list(rows.shape)}")
    p, t = cfg.prefill, cfg.context
    gen = generate(arch, params, config, list(rows), method=method, max_new_tokens=cfg.greedy_tokens)
    continuation = np.asarray(gen.tokens, np.int32)          # [B, G]: stop ids are off
    ids = np.concatenate([rows, continuation], axis=1)        # [B, T + G]
    logits, traces = score(arch, params, config, ids, method=method, prefill_len=p, record=True)
    traces = {layer: {n: x[:, :t] for n, x in tr.items()} for layer, tr in traces.items()}  # the context
    final, snapshots = replay_states(method, traces, prefill=p, every=cfg.error_every)
    return Reference(cfg=cfg, method=method, rows=rows, continuation=continuation, ids=ids, logits=logits,
                     traces=traces, final=final, snapshots=snapshots)


def score_method(arch, params, config, ref: Reference, method, *, label: str = "method") -> dict:
    """One method's entry of ``evaluate``'s ``methods`` (see the module docstring) against ``ref``;
    ``label`` names it in errors. The reference's own method reuses the reference's logits."""
    cfg = ref.cfg
    p, t, g = cfg.prefill, cfg.context, cfg.greedy_tokens
    if method == ref.method:
        logits = ref.logits
    else:
        logits, _ = score(arch, params, config, ref.ids, method=method, prefill_len=p)
    entry = next_token_metrics(logits[:, p:t - 1], ref.logits[:, p:t - 1], ref.rows[:, p + 1:], per_row=True)
    per_row = entry.pop("per_row")
    greedy = greedy_match(logits[:, t - 1:t - 1 + g], ref.continuation)       # [B]
    entry["greedy_match_tokens"] = float(greedy.mean())
    final, snapshots = replay_states(method, ref.traces, prefill=p, every=cfg.error_every)
    errors = {layer: relative_state_errors(s, ref.final[layer]) for layer, s in final.items()}   # [B, H]
    entry["state_rel_error"] = {str(layer): float(np.mean(e)) for layer, e in errors.items()}
    checks = [(k, entry[k]) for k in ("perplexity", "kl_to_fp32", "top1_agreement")] + \
        [(f"state_rel_error of layer {layer}", err) for layer, err in entry["state_rel_error"].items()]
    if snapshots is not None:
        # each point reduced as the final error is ([B, H] -> mean), so the last point equals it exactly
        curves = {str(layer): np.array([np.mean(e) for e in relative_state_errors(s, ref.snapshots[layer])], np.float64)
                  for layer, s in snapshots.items()}                              # [S] per layer
        entry["state_error_curve"] = {"tokens": cfg.curve_tokens,
                                      "per_layer": {k: [float(x) for x in c] for k, c in curves.items()},
                                      "mean": [float(x) for x in np.mean(list(curves.values()), axis=0)]}
        checks += [(f"state_error_curve of layer {k}", float(np.max(c))) for k, c in curves.items()]
    per_row["greedy_match_tokens"] = greedy
    per_row["state_rel_error"] = np.mean([e.mean(axis=-1, dtype=np.float64) for e in errors.values()], axis=0)  # [B]
    entry["per_row"] = {k: [float(x) if k != "greedy_match_tokens" else int(x) for x in v] for k, v in per_row.items()}
    for key, value in checks:
        if not np.isfinite(value):
            raise FloatingPointError(f"method {label}: {key} is {value} (non-finite logits or states)")
    return entry


def lineup_labels(methods: dict) -> list:
    """The labels of ``methods`` (``{label: method}``); ``ValueError`` unless the fp32 reference
    comes first."""
    labels = list(methods)
    if not labels or labels[0] != "fp32":
        raise ValueError(f"methods must start with the fp32 reference, got {labels}")
    return labels


def in_turn(labels: list, methods: dict, arch, params, config, progress: Callable, *, desc: str):
    """``labels`` one after another in the bar ``progress(labels, desc=desc)``, which shows the
    one running; every method of ``methods`` is checked against the model first
    (``check_state_method``: a mismatched calibration is refused before any run)."""
    for method in methods.values():
        check_state_method(method, arch, config, params)
    bar = progress(labels, desc=desc)

    def shown():
        for label in bar:
            if hasattr(bar, "set_postfix_str"):
                bar.set_postfix_str(label)
            yield label

    return shown()


def evaluate(arch, params, config, rows: np.ndarray, methods: dict, cfg: EvalConfig, *,
             progress: Callable = lambda it, **kw: it) -> dict:
    """Evaluates every method of ``methods`` (``{label: method}``, fp32 first) on ``rows``
    ``[B, context]`` int32 (see the module docstring). Returns the JSON object of ``leapquant
    eval``: ``{"methods": {label: {...}}, "context", "tokens"}``, ``tokens`` being the number of
    scored next-token predictions per method."""
    labels = lineup_labels(methods)
    rows = np.asarray(rows)
    if rows.shape != (cfg.batch, cfg.context):
        raise ValueError(f"rows must be [batch, context] = {[cfg.batch, cfg.context]}, got {list(rows.shape)}")
    results = {}
    for label in in_turn(labels, methods, arch, params, config, progress, desc="eval"):
        if label == "fp32":
            ref = reference_run(arch, params, config, rows, cfg, method=methods[label])
        results[label] = score_method(arch, params, config, ref, methods[label], label=label)
    return {"methods": results, "context": cfg.context, "tokens": cfg.batch * cfg.scored_per_row}


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
    for label, m in result["methods"].items():
        if "state_error_curve" in m:
            curve = m["state_error_curve"]
            points = ", ".join(f"{n}: {x:.2e}" for n, x in zip(curve["tokens"], curve["mean"]))
            lines.append(f"state error of {label} after decoded tokens (mean over layers): {points}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line


def load_data(path, tokenizer) -> np.ndarray:
    """``--data``: a ``.npy`` of token ids ``[N]`` or ``[rows, N]`` or a UTF-8 text file (encoded
    with ``tokenizer``, a ``tokenizers.Tokenizer`` or ``None``). Raises a ``ValueError`` or
    ``OSError`` naming the file."""
    path = Path(path)
    if path.suffix == ".npy":
        ids = load_token_ids(path, flag="--data")
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


def warn_if_training_data(checkpoint, data) -> None:
    """Warns (one line on stderr) when ``--data`` is a file the checkpoint's ``DATA_FILES.txt``
    lists in its training split: its numbers are not held-out numbers."""
    listed = training_file(checkpoint, data)
    if listed is not None:
        warn(f"--data {data} is training data of {checkpoint} (its DATA_FILES.txt lists it in the train split as "
             f"{listed}): the numbers are not held-out numbers")


# ----------------------------------------------------------------------------- free-running generation

REPETITION_N = 4


def repetition_rate(tokens: np.ndarray, n: int = REPETITION_N) -> float:
    """``1 - distinct n-grams / n-grams`` of one token sequence ``[G]`` (0 when shorter than ``n``)."""
    tokens = np.asarray(tokens)
    if tokens.size < n:
        return 0.0
    grams = np.lib.stride_tricks.sliding_window_view(tokens, n)
    return float(1.0 - len(np.unique(grams, axis=0)) / len(grams))


def first_divergence(tokens: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Index of the first token of each row of ``tokens [P, G]`` that differs from
    ``reference [P, G]`` (``G`` where none does): ``[P]`` int."""
    same = np.asarray(tokens) == np.asarray(reference)
    return np.where(same.all(axis=1), same.shape[1], np.argmin(same, axis=1))


def _kl(ref_logits, logits):
    logq = jax.nn.log_softmax(ref_logits.astype(jnp.float32), axis=-1)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.maximum(jnp.sum(jnp.exp(logq) * (logq - logp), axis=-1), 0.0)  # >= 0 up to round-off


@functools.partial(jax.jit, static_argnames=("arch", "config", "method", "reference"))
def _kl_along(arch, params, config, ref_cache, cache, prompts, continuation, *, method, reference):
    # Both models prefill the prompts [P, C], then step side by side on continuation[:, :-1]:
    # KL(p_ref || p_method) of the G predictions of continuation [P, G] -> [P, G].
    ref_logits, ref_cache, _ = arch.forward(params, config, prompts, ref_cache, method=reference, mode="prefill")
    logits, cache, _ = arch.forward(params, config, prompts, cache, method=method, mode="prefill")
    first = _kl(ref_logits[:, -1], logits[:, -1])

    def body(carry, tok):
        ref_cache, cache = carry
        ref_logits, ref_cache, _ = arch.forward(params, config, tok[:, None], ref_cache, method=reference, mode="decode")
        logits, cache, _ = arch.forward(params, config, tok[:, None], cache, method=method, mode="decode")
        return (ref_cache, cache), _kl(ref_logits[:, 0], logits[:, 0])

    _, rest = jax.lax.scan(body, (ref_cache, cache), jnp.moveaxis(continuation[:, :-1], 1, 0))
    return jnp.concatenate([first[:, None], jnp.moveaxis(rest, 0, 1)], axis=1)


def kl_along(arch, params, config, method, prompts: np.ndarray, continuation: np.ndarray, *, reference=None):
    """``KL(p_reference || p_method)`` ``[P, G]`` at each prediction of ``continuation [P, G]``
    after ``prompts [P, C]``, both methods teacher-forced on the same tokens (reference: fp32)."""
    reference = make_method("fp32") if reference is None else reference
    p, c = prompts.shape
    g = continuation.shape[1]
    # zero states built outside jit (their quantization would be constant-folded at compile time)
    caches = [arch.init_cache(config, batch=p, max_len=c + g, method=m) for m in (reference, method)]
    return np.asarray(_kl_along(arch, params, config, *caches, jnp.asarray(prompts, jnp.int32),
                                jnp.asarray(continuation, jnp.int32), method=method, reference=reference))


def _spread(x: np.ndarray) -> dict:
    x = np.asarray(x, np.float64)
    return {"median": float(np.median(x)), "p25": float(np.quantile(x, 0.25)), "p75": float(np.quantile(x, 0.75)),
            "min": float(x.min()), "max": float(x.max())}


def generation_study(arch, params, config, prompts: np.ndarray, methods: dict, generate_tokens: int, *,
                     progress: Callable = lambda it, **kw: it) -> dict:
    """Free-running greedy generation of ``generate_tokens`` tokens after each of ``prompts
    [P, C]`` with every method of ``methods`` (``{label: method}``, fp32 first). Each prompt is
    prefilled exactly in fp32 and rounded once into the method's state; the method then generates
    on its own. ``first_divergence``: the index of its first token unlike fp32's continuation
    (``G`` when none; median, quartiles and range over the prompts); ``kl_to_fp32``: the mean
    ``KL(p_fp32 || p_method)`` along fp32's own continuation, both teacher-forced on it (every
    method measured on the same tokens); ``repetition_rate``: ``1 - distinct / all`` of the
    ``REPETITION_N``-grams of the method's own continuation (seq-rep-n; fp32's is the baseline). Returns ``{"methods": {label: {"first_divergence": {median, p25, p75, min, max,
    "per_prompt"}, "kl_to_fp32", "kl_per_prompt", "repetition_rate", "repetition_per_prompt"}},
    "generate", "prompts", "context"}``."""
    labels = lineup_labels(methods)
    lineup = in_turn(labels, methods, arch, params, config, progress, desc="generate")
    prompts = np.asarray(prompts, np.int32)
    results, reference = {}, None
    for label in lineup:
        gen = generate(arch, params, config, list(prompts), method=methods[label], max_new_tokens=generate_tokens,
                       stop_ids=())
        tokens = np.asarray(gen.tokens, np.int32)                                  # [P, G]: no stop ids
        if reference is None:
            reference = tokens
            kl = np.zeros(tokens.shape)
        else:
            kl = kl_along(arch, params, config, methods[label], prompts, reference, reference=methods["fp32"])
        if not np.all(np.isfinite(kl)):
            raise FloatingPointError(f"method {label}: non-finite KL to fp32 along fp32's continuation")
        div = first_divergence(tokens, reference)
        rep = np.array([repetition_rate(row) for row in tokens])
        results[label] = {"first_divergence": dict(_spread(div), per_prompt=[int(x) for x in div]),
                          "kl_to_fp32": float(kl.mean()), "kl_per_prompt": [float(x) for x in kl.mean(axis=1)],
                          "repetition_rate": float(rep.mean()), "repetition_per_prompt": [float(x) for x in rep]}
    return {"methods": results, "generate": int(generate_tokens), "prompts": int(prompts.shape[0]),
            "context": int(prompts.shape[1]), "repetition_n": REPETITION_N}


def format_generation_table(result: dict) -> str:
    """The human-readable table of a ``generation_study`` result."""
    lines = [f"{'method':<16}{'first divergence: median [p25, p75] (min-max)':>48}{'KL to fp32':>12}"
             f"{'repetition':>12}"]
    for label, m in result["methods"].items():
        d = m["first_divergence"]
        cell = f"{d['median']:.0f} [{d['p25']:.0f}, {d['p75']:.0f}] ({d['min']:.0f}-{d['max']:.0f})"
        lines.append(f"{label:<16}{cell:>48}{m['kl_to_fp32']:>12.2e}{m['repetition_rate']:>12.4f}")
    lines.append(f"({result['prompts']} prompts of {result['context']} tokens, {result['generate']} greedy tokens each; "
                 f"divergence: first token unlike fp32's ({result['generate']} = never); KL along fp32's continuation; "
                 f"repetition: share of repeated {result['repetition_n']}-grams of the method's own text)")
    return "\n".join(lines)


def load_model_and_data(checkpoint, data, cut: Callable[[np.ndarray, str], np.ndarray]):
    """A command's model and token ids: ``load_data(data)`` with the checkpoint's tokenizer, cut by
    ``cut(ids, source)`` (``source`` names ``--data`` in its errors), both checked before the model
    loads. Returns ``(arch, config, params, ids int32)``, every id within the vocabulary."""
    check_checkpoint(checkpoint)
    source = f"--data {data}"
    ids = cut(load_data(data, load_tokenizer(checkpoint)), source)
    arch, config, params, _ = load_checkpoint(checkpoint)
    return arch, config, params, check_token_ids(ids, config.vocab_size, name=f"{source} ids")


def run_study(args, cut: Callable[[np.ndarray, str], np.ndarray], study: Callable, table: Callable[[dict], str],
              **record) -> int:
    """A command that compares the ``--states`` on a checkpoint's ``--data``: the methods, then the
    model and ids (``load_model_and_data`` with ``cut``), then ``study(arch, params, config, ids,
    methods, progress) -> result``, timed. Prints the result with the checkpoint, data, ``record``,
    state options and seconds added: one JSON object with ``--json``, else ``table(result)``."""
    options = state_options(args)
    methods = methods_for_labels(args.states.split(","), options)
    arch, config, params, ids = load_model_and_data(args.checkpoint, args.data, cut)
    warn_if_training_data(args.checkpoint, args.data)
    t0 = time.time()
    result = study(arch, params, config, ids, methods,
                   lambda it, desc: progress(it, desc=desc, enabled=True, total=len(methods)))
    result.update(checkpoint=str(args.checkpoint), data=str(args.data), **record,
                  state_options={k: v for k, v in options.items() if v is not None},
                  seconds=round(time.time() - t0, 3))
    print(json.dumps(result) if args.json else table(result))
    return 0


def run_generation(args) -> int:
    """``leapquant eval --generate G``: ``generation_study`` on ``--batch`` prompts of ``--context`` tokens."""
    if args.error_every is not None or args.prefill:
        raise ValueError("--generate prefills each prompt exactly: leave out --prefill and --error-every")
    cfg = EvalConfig(context=args.context, batch=args.batch)
    return run_study(args, lambda ids, source: segment_rows(ids, cfg, source=source),
                     lambda arch, params, config, rows, methods, prog: generation_study(
                         arch, params, config, rows, methods, args.generate, progress=prog),
                     format_generation_table)


def run_eval(args) -> int:
    """The ``leapquant eval`` handler."""
    if args.generate is not None:
        return run_generation(args)
    cfg = EvalConfig(context=args.context, prefill=args.prefill, batch=args.batch, greedy_tokens=args.greedy_tokens,
                     error_every=args.error_every)
    return run_study(args, lambda ids, source: segment_rows(ids, cfg, source=source),
                     lambda arch, params, config, rows, methods, prog: evaluate(
                         arch, params, config, rows, methods, cfg, progress=prog),
                     format_table, prefill=cfg.prefill, batch=cfg.batch, greedy_tokens=cfg.greedy_tokens,
                     error_every=cfg.error_every)


def add_subcommand(subparsers) -> None:
    """Registers ``eval`` on an argparse subparsers object."""
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
    p.add_argument("--error-every", type=int_at_least(1), default=None,
                   help="also record the state error every N decoded tokens (state_error_curve; default off)")
    p.add_argument("--generate", type=int_at_least(1), metavar="G",
                   help="instead: free-running greedy generation of G tokens after each row (the prompts): first "
                        "divergence from fp32, KL to fp32 along fp32's continuation, repetition rate")
    add_states_option(p, DEFAULT_STATES)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run_eval)


__all__ = ["DEFAULT_STATES", "REPETITION_N", "EvalConfig", "Reference", "add_subcommand", "evaluate", "final_states",
           "first_divergence", "format_generation_table", "format_table", "generation_study", "greedy_match", "in_turn",
           "kl_along", "lineup_labels", "load_data", "load_model_and_data", "next_token_metrics", "reference_run",
           "relative_state_errors", "repetition_rate", "replay_states", "run_eval", "run_generation", "run_study",
           "score_method", "segment_rows", "state_errors", "warn_if_training_data"]
