"""Bytes of a state, measured on the real pytrees (``jax.eval_shape``), never from a formula."""

from __future__ import annotations

import dataclasses

import jax

from ..method_names import METHOD_LABELS
from ..methods import make_method
from ..quantizers import tree_bytes
from ..state import LeapQuantState


@dataclasses.dataclass(frozen=True)
class MemoryQuery:
    """dk, dv: head size; bits, rank, window: LeapQuant settings (rank None = default);
    layers, heads: model size for the totals; key_heads: GVA's key heads per layer (``None``:
    ``heads``), whose key records a live stream keeps once per key head."""

    dk: int = 128
    dv: int = 128
    bits: int = 8
    rank: int | None = None
    window: int = 16
    layers: int = 48
    heads: int = 32
    key_heads: int | None = None

    def __post_init__(self):
        # The other fields are checked where they are used (make_method, method.init).
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 1:
            raise ValueError(f"layers must be a positive integer, got {self.layers!r}")


def boundary_state(state):
    """What a stream keeps at a window boundary (a prefix cache's share): a LeapQuant stream's
    checkpoint, each group's checkpoint of a ``leapquant_alloc.AllocState``, any other state whole."""
    from ..leapquant_alloc import AllocState

    if isinstance(state, LeapQuantState):
        return state.checkpoint
    if isinstance(state, AllocState):
        return [g.checkpoint for g in state.groups]
    return state


def state_shapes(method, heads: int, dk: int, dv: int, kda: bool, key_heads: int | None = None):
    """The shapes and dtypes (``ShapeDtypeStruct`` pytree) of ``method``'s state for one stream of
    ``heads`` heads (``key_heads`` key heads with GVA)."""
    return jax.eval_shape(lambda: method.init(1, heads, dk, dv, per_channel_decay=kda, key_heads=key_heads))


def measure_memory(query: MemoryQuery) -> dict:
    """Bytes per head and per element for fp32, bf16, a checkpoint and live GDN/KDA streams,
    the lossless ``fp32-w`` (a live GDN stream at the query's window), and totals for
    ``layers x heads`` heads. A live stream's per-sequence position is shared
    by its heads, so per-head figures divide it among them, and so are key records shared by
    the value heads of a key head (``key_heads``)."""
    q = query
    elems = q.dk * q.dv
    lq = make_method("leapquant", bits=q.bits, rank=q.rank, window=q.window)
    kh = q.key_heads
    per_head = {
        "fp32": tree_bytes(state_shapes(make_method("fp32"), q.heads, q.dk, q.dv, False)) / q.heads,
        "bf16": tree_bytes(state_shapes(make_method("bf16"), q.heads, q.dk, q.dv, False)) / q.heads,
        "checkpoint": tree_bytes(state_shapes(lq, q.heads, q.dk, q.dv, False).checkpoint) / q.heads,
        "live_gdn": tree_bytes(state_shapes(lq, q.heads, q.dk, q.dv, False, kh)) / q.heads,
        "live_kda": tree_bytes(state_shapes(lq, q.heads, q.dk, q.dv, True, kh)) / q.heads,
        "fp32-w": tree_bytes(state_shapes(make_method("fp32-w", window=q.window), q.heads, q.dk, q.dv, False, kh))
        / q.heads,
    }
    heads_total = q.layers * q.heads
    return {
        "query": dataclasses.asdict(q) | {"rank": lq.config.effective_rank},
        "bytes_per_head": per_head,
        "bytes_per_element": {k: v / elems for k, v in per_head.items()},
        "checkpoint_bytes_per_element": per_head["checkpoint"] / elems,
        "live_gdn_bytes_per_element": per_head["live_gdn"] / elems,
        "live_kda_bytes_per_element": per_head["live_kda"] / elems,
        "model_bytes": {k: int(round(v * heads_total)) for k, v in per_head.items()},
    }


def method_memory(labels, *, dk: int = 128, dv: int = 128, heads: int = 32, key_heads: int | None = None,
                  calibration=None) -> dict:
    """Per method label of ``labels`` (``method_names.METHOD_LABELS``, each with the options its
    label fixes and the defaults otherwise; ``"all"`` for every one), measured on the state
    pytrees of ``heads`` heads of ``[dk, dv]``: ``{label: {"checkpoint_bytes_per_head",
    "checkpoint_bits_per_value", "live_gdn_bytes_per_head", "live_gdn_bits_per_value",
    "live_kda_bytes_per_head", "live_kda_bits_per_value"}}``. ``checkpoint`` is the
    window-boundary state (a per-step method's state itself); ``live_gdn`` / ``live_kda`` a
    decoding stream with scalar (GDN) or per-channel (KDA) decays, a windowed method's window
    buffer and position included (shared by the heads; key records by ``key_heads``). Raises
    ``ValueError`` naming an unknown label.

    calibration: a ``lifetime.LifetimeCalibration`` (or its path): the ``LIFETIME_METHODS`` are then
    measured with its plans, the mean over the layers it covers, at its head shape, which must be
    ``heads x dk x dv``; without one they have the layout of their name's width on every head.
    """
    from ..lifetime import as_calibration
    from ..methods import LIFETIME_METHODS

    labels = list(METHOD_LABELS) if labels == "all" else list(labels)
    calibration = as_calibration(calibration)
    if calibration is not None:
        calibration.check_model(fingerprint="", layers=calibration.layers, heads=heads, dk=dk, dv=dv,
                                source="calibration of --stepquant-calibration")
    out = {}
    for label in labels:
        if label not in METHOD_LABELS:
            raise ValueError(f"unknown method {label!r}; known: {', '.join(METHOD_LABELS)}")
        name, fixed = METHOD_LABELS[label]
        if calibration is not None and name in LIFETIME_METHODS:
            method = make_method(name, calibration=calibration, **fixed)
            layers = [method.for_layer(x) for x in calibration.layers]
        else:
            layers = [make_method(name, **fixed)]
        entry = {}
        for stream, kda in (("live_gdn", False), ("live_kda", True)):
            shapes = [state_shapes(m, heads, dk, dv, kda, key_heads) for m in layers]
            entry[stream] = tree_bytes(shapes) / heads / len(layers)
            if not kda:
                entry["checkpoint"] = tree_bytes([boundary_state(s) for s in shapes]) / heads / len(layers)
        out[label] = {}
        for part in ("checkpoint", "live_gdn", "live_kda"):
            out[label][f"{part}_bytes_per_head"] = entry[part]
            out[label][f"{part}_bits_per_value"] = 8 * entry[part] / (dk * dv)
    return out


__all__ = ["MemoryQuery", "boundary_state", "measure_memory", "method_memory"]
