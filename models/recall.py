"""``leapquant recall``: an exact-copy recall probe, scored per recurrent-state format.

Row ``b`` of the probe is ``[span_b | gap_b | span_b]``: ``span`` tokens of held-out text, ``gap``
tokens of other held-out text, then the same span again. Once the second copy has started
(``skip`` tokens in, so that the repeat can be recognised), a model that remembers the first copy
predicts the rest of it exactly. The second copy is scored teacher-forced through the decode path
(``models.decode.score``: one ``method.step`` per token, after an exact fp32 prefill of the first
``prefill`` tokens, as in ``leapquant eval``), once per state method. Per method:

* ``copy_accuracy``: the fraction of scored positions where the argmax of the logits is the next
  span token;
* ``copy_nll``: the mean negative log-likelihood of that token;
* ``recall_gain``: ``copy_accuracy`` minus the accuracy of fp32 on the control rows, which are the
  same rows with the first copy replaced by another span (nothing planted: what local context
  alone predicts);
* ``agreement_with_fp32``: the fraction of scored positions where the argmax equals fp32's.

Each is also given per row (``per_row``): the rows are independent draws, so their spread is the
uncertainty of the mean.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import numpy as np

from leapquant_jax.checks import check_integer
from leapquant_jax.cli_support import add_states_option, int_at_least
from models.decode import check_token_ids, score
from models.evaluate import DEFAULT_STATES, in_turn, lineup_labels, next_token_metrics, run_study

METRICS = ("copy_accuracy", "copy_nll", "recall_gain", "agreement_with_fp32")


@dataclasses.dataclass(frozen=True)
class RecallConfig:
    """The recall probe's rows: a span of text, a gap of other text, the span again, its second
    copy scored."""

    span: int = 64  # S: tokens planted and repeated
    gap: int = 1024  # G: tokens of other text between the copies
    batch: int = 4  # B: rows
    skip: int = 2  # leading tokens of the second copy left unscored
    prefill: int = 0  # leading tokens of each row through the exact fp32 prefill (the rest: one decode step each)
    seed: int = 0  # picks where in the data the pieces of the rows come from

    def __post_init__(self):
        for name, low in (("span", 1), ("gap", 0), ("batch", 1), ("skip", 0), ("prefill", 0), ("seed", 0)):
            check_integer(name, getattr(self, name), low)
        if self.skip >= self.span:
            raise ValueError(f"skip ({self.skip}) must leave at least one scored token of the span ({self.span}): "
                             f"skip <= span - 1")
        if self.prefill > self.first_scored:
            raise ValueError(f"prefill ({self.prefill}) must end before the first scored position: "
                             f"prefill <= span + gap + skip - 1 = {self.first_scored}")

    @property
    def row_length(self) -> int:
        """Tokens per row: ``2 * span + gap``."""
        return 2 * self.span + self.gap

    @property
    def first_scored(self) -> int:
        """Position whose logits predict the first scored token of the second copy."""
        return self.span + self.gap + self.skip - 1

    @property
    def scored_per_row(self) -> int:
        """Scored predictions per row: ``span - skip``."""
        return self.span - self.skip

    @property
    def tokens_needed(self) -> int:
        """Tokens of data the rows are cut from: per row a span, a control span and a gap."""
        return self.batch * (2 * self.span + self.gap)


def build_recall_rows(stream: np.ndarray, cfg: RecallConfig, *, source: str = "--data"):
    """Cuts the probe rows out of a held-out token stream ``[N]``.

    A window of ``cfg.tokens_needed`` tokens at an offset drawn from ``cfg.seed`` holds three
    zones: ``batch`` spans, ``batch`` control spans, ``batch`` gaps, each zone's pieces given to
    the rows in an order drawn from the seed. Every piece is disjoint from every other, and a
    row's span and gap come from different zones.

    Returns ``(rows, control, scored)``: ``rows [B, 2S + G]`` int32 ``[span_b | gap_b | span_b]``;
    ``control [B, 2S + G]`` int32 ``[other_b | gap_b | span_b]``; ``scored`` the slice of
    positions whose logits are scored (``logits[:, scored]`` predicts
    ``rows[:, scored.start + 1 : scored.stop + 1]``). Raises ``ValueError`` naming ``source``
    when the stream is not ``[N]`` integers or is shorter than ``cfg.tokens_needed``.
    """
    stream = np.asarray(stream)
    if stream.ndim != 1:
        raise ValueError(f"{source}: the recall probe cuts its rows from a token stream [N], got shape {stream.shape}")
    if not np.issubdtype(stream.dtype, np.integer):
        raise ValueError(f"{source} must hold integer token ids, got dtype {stream.dtype}")
    s, g, b = cfg.span, cfg.gap, cfg.batch
    need, n = cfg.tokens_needed, stream.shape[0]
    if n < need:
        raise ValueError(f"--batch {b} x (2 x --span {s} + --gap {g}) = {need} tokens are needed, "
                         f"but {source} holds {n}")
    rng = np.random.default_rng(cfg.seed)
    offset = int(rng.integers(0, n - need + 1))
    spans = stream[offset: offset + b * s].reshape(b, s)[rng.permutation(b)]
    others = stream[offset + b * s: offset + 2 * b * s].reshape(b, s)[rng.permutation(b)]
    gaps = stream[offset + 2 * b * s: offset + need].reshape(b, g)[rng.permutation(b)]
    rows = np.concatenate([spans, gaps, spans], axis=1).astype(np.int32)
    control = np.concatenate([others, gaps, spans], axis=1).astype(np.int32)
    return rows, control, slice(cfg.first_scored, cfg.row_length - 1)


def _row_metrics(logits: np.ndarray, ref_logits: np.ndarray, targets: np.ndarray) -> dict:
    # logits, ref_logits [B, M, vocab], targets [B, M] -> {name: [B]}: next_token_metrics row by row,
    # so that the NLL and the agreement are those of `leapquant eval`.
    per = [next_token_metrics(logits[i:i + 1], ref_logits[i:i + 1], targets[i:i + 1]) for i in range(len(targets))]
    return {"accuracy": np.mean(np.argmax(logits, axis=-1) == targets, axis=1),
            "nll": np.log([m["perplexity"] for m in per]),
            "agreement": np.asarray([m["top1_agreement"] for m in per])}


def recall_probe(arch, params, config, methods: dict, stream: np.ndarray, cfg: RecallConfig, *,
                 progress: Callable = lambda it, **kw: it) -> dict:
    """Runs the probe (see the module docstring) for every method of ``methods`` (``{label:
    method}``, fp32 first) on rows cut from ``stream [N]`` by ``build_recall_rows``.

    Returns the JSON object of ``leapquant recall``: ``{"methods": {label: {metric: mean, ...,
    "per_row": {metric: [B]}}}, "span", "gap", "batch", "skip", "prefill", "seed",
    "scored_per_row", "control_accuracy", "control_nll", "control_per_row": {"accuracy": [B],
    "nll": [B]}}``. Raises ``ValueError`` for a bad stream or method list, ``FloatingPointError``
    for non-finite logits.
    """
    labels = lineup_labels(methods)
    rows, control, scored = build_recall_rows(stream, cfg, source="stream")
    rows = check_token_ids(rows, config.vocab_size, name="stream ids (recall rows)")
    control = check_token_ids(control, config.vocab_size, name="stream ids (control rows)")
    targets = rows[:, scored.start + 1: scored.stop + 1]
    p = cfg.prefill
    results = {}
    for label in in_turn(labels, methods, arch, params, config, progress, desc="recall"):
        logits = score(arch, params, config, rows, method=methods[label], prefill_len=p)[0][:, scored]
        if label == "fp32":
            ref = logits
            ctrl_logits = score(arch, params, config, control, method=methods[label], prefill_len=p)[0][:, scored]
            ctrl = _row_metrics(ctrl_logits, ctrl_logits, targets)
            if not np.all(np.isfinite(ctrl["nll"])):
                raise FloatingPointError("method fp32: non-finite NLL on the control rows (non-finite logits)")
        m = _row_metrics(logits, ref, targets)
        per_row = {"copy_accuracy": m["accuracy"], "copy_nll": m["nll"],
                   "recall_gain": m["accuracy"] - ctrl["accuracy"], "agreement_with_fp32": m["agreement"]}
        if not np.all(np.isfinite(m["nll"])):
            raise FloatingPointError(f"method {label}: non-finite copy NLL (non-finite logits)")
        entry = {k: float(np.mean(per_row[k])) for k in METRICS}
        entry["per_row"] = {k: [float(x) for x in per_row[k]] for k in METRICS}
        results[label] = entry
    return {"methods": results, "span": cfg.span, "gap": cfg.gap, "batch": cfg.batch, "skip": cfg.skip,
            "prefill": p, "seed": cfg.seed, "scored_per_row": cfg.scored_per_row,
            "control_accuracy": float(np.mean(ctrl["accuracy"])), "control_nll": float(np.mean(ctrl["nll"])),
            "control_per_row": {"accuracy": [float(x) for x in ctrl["accuracy"]],
                                "nll": [float(x) for x in ctrl["nll"]]}}


def format_recall_table(result: dict) -> str:
    """The human-readable table of a ``recall_probe`` result."""
    lines = [f"{'method':<16}{'copy acc.':>11}{'copy NLL':>10}{'recall gain':>13}{'agr. fp32':>11}"
             f"{'copy acc. per row (min / max)':>32}"]
    for label, m in result["methods"].items():
        acc = m["per_row"]["copy_accuracy"]
        lines.append(f"{label:<16}{m['copy_accuracy']:>11.4f}{m['copy_nll']:>10.4f}{m['recall_gain']:>+13.4f}"
                     f"{m['agreement_with_fp32']:>11.4f}{min(acc):>22.4f} / {max(acc):.4f}")
    lines.append(f"(control, nothing planted, fp32: accuracy {result['control_accuracy']:.4f}, "
                 f"NLL {result['control_nll']:.4f}; {result['batch']} rows x {result['scored_per_row']} scored "
                 f"tokens; span {result['span']}, gap {result['gap']}, skip {result['skip']}, "
                 f"prefill {result['prefill']})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line


def run_recall(args) -> int:
    """The ``leapquant recall`` handler."""
    cfg = RecallConfig(span=args.span, gap=args.gap, batch=args.batch, skip=args.skip, prefill=args.prefill,
                       seed=args.seed)

    def checked(stream, source):
        build_recall_rows(stream, cfg, source=source)  # shape and length checked before the model loads
        return stream

    return run_study(args, checked,
                     lambda arch, params, config, stream, methods, prog: recall_probe(
                         arch, params, config, methods, stream, cfg, progress=prog),
                     format_recall_table)


def add_subcommand(subparsers) -> None:
    """Registers ``recall`` on an argparse subparsers object."""
    p = subparsers.add_parser("recall", help="exact-copy recall of state formats against fp32 (decode path)")
    p.add_argument("checkpoint", type=Path, help="converted checkpoint or HF directory")
    p.add_argument("--data", required=True, type=Path,
                   help="held-out UTF-8 text (tokenized with the checkpoint's tokenizer.json) or .npy ids [N]")
    p.add_argument("--span", type=int_at_least(1), default=64, help="tokens planted, then repeated after the gap")
    p.add_argument("--gap", type=int_at_least(0), default=1024, help="tokens of other text between the two copies")
    p.add_argument("--batch", type=int_at_least(1), default=4, help="rows, cut from disjoint pieces of the data")
    p.add_argument("--skip", type=int_at_least(0), default=2,
                   help="leading tokens of the second copy left unscored (the repeat is recognised there)")
    p.add_argument("--prefill", type=int_at_least(0), default=0,
                   help="leading tokens of each row through the exact fp32 prefill, at most span + gap + skip - 1")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="where in the data the rows' pieces come from")
    add_states_option(p, DEFAULT_STATES)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run_recall)


__all__ = ["METRICS", "RecallConfig", "add_subcommand", "build_recall_rows", "format_recall_table", "recall_probe",
           "run_recall"]
