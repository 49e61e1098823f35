"""The contract between the model-independent machinery and one architecture module.

The converter, the checkpoint reader, the decode loop and the CLI know nothing about a
particular model. Each architecture (``models/qwen3_next.py`` for Qwen3-Next and Qwen3.5,
``models/kimi_linear.py`` for Kimi-Linear) is a module exposing one object, ``ARCH``, that
satisfies ``Architecture`` below, listed by HF ``model_type`` in ``models/registry.py``.

Everything is functional: parameters are a plain pytree of arrays (dicts, tuples), the config a
frozen, hashable dataclass (static under ``jit``), the cache a plain pytree.

Parameters
    ``convert`` returns the pytree the forward pass reads. Weight layouts are fixed there, once
    (Qwen3-Next's interleaved ``in_proj_qkvz`` becomes Qwen3.5's flat ``qkv``/``z``/``b``/``a``).
    Leaves keep their stored dtype (bf16 stays bf16); the forward pass computes in float32. Dict
    keys are strings and sequences tuples, so ``models.checkpoint.flatten_params`` /
    ``unflatten_params`` round-trip the tree through a safetensors file (``"layers.3.attn.q_proj"``).

Cache
    ``init_cache(config, batch=B, max_len=L, method=M)`` returns a dict with at least ``"pos": [B]
    int32``, the tokens each sequence has consumed (the position of its next token).
    Linear-attention layers keep their recurrent state in the format of the state method ``M``
    (``leapquant_jax.make_method``; ``for_layer(i)`` is the method layer ``i`` uses) plus their
    short-convolution tails; attention layers keep a KV cache of ``L`` positions. The layers'
    caches are ``cache["layers"]`` or, with ``config.scan_layers``, ``cache["head"]``,
    ``cache["blocks"]`` (stacked ``[repeats, B, ...]``) and ``cache["tail"]`` (``finish_cache``);
    ``layer_caches`` gives one per layer either way, ``take_rows``/``put_rows`` cut and write rows.

Runtime
    ``config.compute`` (``"exact"`` or ``"fast"``, ``models/layers.py``) and ``config.scan_layers``
    say how the model runs (``RUNTIME_FIELDS``); ``with_runtime`` sets them and moves the params
    to the matching layout.

Forward
    ``forward(params, config, ids, cache, *, method, mode, lengths=None, active=None,
    record=False) -> (logits, cache, traces)``, traceable with ``config``, ``method``, ``mode``
    and ``record`` static (the decode loop runs it inside ``lax.while_loop``); the modes, shapes
    and traces are in ``Architecture.forward``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from models import layers as L
from models.layers import COMPUTE_MODES

Array = jax.Array
Params = Any
Cache = Any
Traces = dict

MODES = ("prefill", "decode")
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


def _natural(name: str) -> list:
    # "layers.10" after "layers.9": the numbers in a tensor name compared as numbers
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


class ConversionError(ValueError):
    """A checkpoint does not match its config. The message names the first ``SHOWN`` tensors of
    each kind (missing, unexpected, mis-shaped) and how many there are; the attributes hold them
    all."""

    SHOWN = 5

    def __init__(self, *, missing=(), unexpected=(), mis_shaped=(), context: str = ""):
        self.missing = sorted(missing, key=_natural)
        self.unexpected = sorted(unexpected, key=_natural)
        self.mis_shaped = sorted(mis_shaped, key=lambda m: _natural(m[0]))  # (name, expected, found)
        shown = self.SHOWN

        def names(items):
            more = f" and {len(items) - shown} more" if len(items) > shown else ""
            return ", ".join(items[:shown]) + more

        lines = [f"checkpoint does not match its config{(' (' + context + ')') if context else ''}:"]
        if self.missing:
            lines.append(f"  missing tensors ({len(self.missing)}): {names(self.missing)}")
        if self.unexpected:
            lines.append(f"  unexpected tensors ({len(self.unexpected)}): {names(self.unexpected)}")
        if self.mis_shaped:
            lines.append(f"  mis-shaped tensors ({len(self.mis_shaped)}): " + names(
                [f"{name}: expected {tuple(want)}, found {tuple(got)}" for name, want, got in self.mis_shaped]))
        super().__init__("\n".join(lines))


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """A base for the architectures' frozen config dataclasses: the fields every decoder stack
    has, first and in this order (``runtime_free_repr``, hence a model's fingerprint, lists them
    so), and how the model runs (``RUNTIME_FIELDS``: keyword-only with defaults, so that a
    subclass's required fields may follow them)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # LINEAR_ATTENTION or FULL_ATTENTION per layer
    mlp_types: tuple[str, ...]  # "dense" or "moe" per layer
    rms_norm_eps: float
    # how the model runs, not what it is
    compute: str = dataclasses.field(default=L.EXACT, kw_only=True)  # models.layers.COMPUTE_MODES
    scan_layers: bool = dataclasses.field(default=False, kw_only=True)  # run the layers under lax.scan

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)


@runtime_checkable
class ModelConfig(Protocol):
    """What the shared machinery reads from an architecture's frozen config dataclass."""

    model_type: str
    vocab_size: int
    layer_types: tuple[str, ...]  # LINEAR_ATTENTION or FULL_ATTENTION per layer

    @property
    def num_layers(self) -> int: ...


@runtime_checkable
class Architecture(Protocol):
    """One architecture module's ``ARCH`` object (see the module docstring for the details)."""

    model_types: tuple[str, ...]

    def config_from_hf(self, config_json: Mapping[str, Any]) -> ModelConfig:
        """Parses a HF ``config.json`` dict (VLM wrappers: the ``text_config`` part)."""
        ...

    def param_specs(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Canonical HF tensor name -> expected shape, for every tensor ``convert`` reads."""
        ...

    def convert(self, tensors: Mapping[str, np.ndarray], config: ModelConfig) -> Params:
        """HF tensors (canonical or accepted alternate names) -> params pytree.

        Raises ``ConversionError`` naming every missing, unexpected or mis-shaped tensor.
        """
        ...

    def init_cache(self, config: ModelConfig, *, batch: int, max_len: int, method: Any) -> Cache:
        ...

    def forward(
        self,
        params: Params,
        config: ModelConfig,
        ids: Array,
        cache: Cache,
        *,
        method: Any,
        mode: str,
        lengths: Optional[Array] = None,
        active: Optional[Array] = None,
        record: bool = False,
    ) -> tuple[Array, Cache, Traces]:
        """One pass over ``ids``; returns ``(logits, cache, traces)``.

        * ``mode="prefill"``: ``ids [B, T]`` int32, **right-padded**, ``lengths [B]`` int32
          (``1 <= lengths[b] <= T``), from an empty cache. Sequence ``b`` occupies positions
          ``0 .. lengths[b]-1``; the recurrent state is computed exactly in fp32 over those
          tokens (``method.prefill``) and the returned cache has ``pos = lengths``. Logits at
          padded positions are unspecified.
        * ``mode="decode"``: ``ids [B, 1]``, one token per sequence at position ``cache["pos"]``,
          through ``method.step``. ``active [B]`` bool (optional): inactive sequences keep their
          cache unchanged (their logits are unspecified).
        * ``logits``: ``[B, T, vocab]`` float32; ``logits[b, t]`` predicts the token after
          ``ids[b, t]``.
        * ``traces``: ``{}`` unless ``record=True`` (a static flag); then
          ``{layer_index: {"q", "k", "v", "g", "beta"}}`` for every linear-attention layer, each
          ``[B, T, ...]`` float32 with the recurrence inputs exactly as the state method sees
          them: ``q``, ``k`` ``[B, T, H, dk]`` (L2-normalised, ``q`` scaled by ``dk**-0.5``, key
          heads already expanded to the ``H`` value heads), ``v [B, T, H, dv]``, ``beta [B, T, H]``,
          ``g [B, T, H]`` (GDN) or ``[B, T, H, dk]`` (KDA): the trace files of docs/design.md §5.
        """
        ...


def check_shapes(
    tensors: Mapping[str, Any],
    specs: Mapping[str, tuple[int, ...]],
    *,
    optional: Mapping[str, tuple[int, ...]] = None,
    ignored: tuple[str, ...] = (),
    context: str = "",
) -> None:
    """Compares a name -> array mapping against ``specs``; raises ``ConversionError`` listing all
    differences at once. ``optional`` tensors may be absent; names starting with a prefix in
    ``ignored`` (vision towers, MTP heads) are skipped."""
    optional = dict(optional or {})
    missing = [n for n in specs if n not in tensors]
    unexpected, mis_shaped = [], []
    for name, x in tensors.items():
        want = specs.get(name, optional.get(name))
        if want is None:
            if not (ignored and name.startswith(ignored)):
                unexpected.append(name)
            continue
        if tuple(np.shape(x)) != tuple(want):
            mis_shaped.append((name, tuple(want), tuple(np.shape(x))))
    if missing or unexpected or mis_shaped:
        raise ConversionError(missing=missing, unexpected=unexpected, mis_shaped=mis_shaped, context=context)



# ----------------------------------------------------------------------------- runtime options

# Config fields that say how a model runs, not what it is: left out of the model's identity
# (``runtime_free_repr``), so a calibration made on a model stays valid however it runs.
RUNTIME_FIELDS = tuple(f.name for f in dataclasses.fields(DecoderConfig) if f.kw_only)


def runtime_free_repr(config: Any) -> str:
    """``repr(config)`` without the ``RUNTIME_FIELDS`` (the dataclass repr's own format)."""
    fields = [f for f in dataclasses.fields(config) if f.repr and f.name not in RUNTIME_FIELDS]
    return f"{type(config).__qualname__}(" + ", ".join(f"{f.name}={getattr(config, f.name)!r}" for f in fields) + ")"


def check_runtime(config: Any) -> None:
    """Raises ``ValueError`` for a ``compute`` other than ``exact``/``fast`` or a non-bool ``scan_layers``."""
    if config.compute not in COMPUTE_MODES:
        raise ValueError(f"compute must be one of {COMPUTE_MODES}, got {config.compute!r}")
    if not isinstance(config.scan_layers, bool):
        raise ValueError(f"scan_layers must be True or False, got {config.scan_layers!r}")


# ----------------------------------------------------------------------------- scanned layers


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """How a stack of layers runs under ``lax.scan``: the ``head`` layers one by one, then
    ``repeats`` blocks of ``period`` consecutive layers (layer ``start + r * period + j`` is
    position ``j`` of block ``r``; the positions' weights are stacked over ``r``), then the
    ``tail`` layers one by one. Every block has the same kinds of layers in the same order."""

    head: tuple[int, ...]
    start: int
    period: int
    repeats: int
    tail: tuple[int, ...]

    def block_layer(self, r: int, j: int) -> int:
        return self.start + r * self.period + j


# The longest repeating pattern and unscanned head searched for (Qwen3.5: period 4, no head;
# Kimi-Linear: period 4 after one dense-MLP layer).
MAX_PERIOD = 8
MAX_HEAD = 4


def layer_plan(config: Any) -> LayerPlan:
    """The ``LayerPlan`` that scans the most layers: layer ``i``'s kind is ``(layer_types[i],
    mlp_types[i])``; blocks repeat the kinds of the first block exactly."""
    kinds = tuple(zip(config.layer_types, config.mlp_types))
    n = len(kinds)
    best = LayerPlan(head=tuple(range(n)), start=n, period=1, repeats=0, tail=())
    for q in range(min(MAX_HEAD, n) + 1):
        for period in range(1, MAX_PERIOD + 1):
            repeats = 0
            while q + (repeats + 1) * period <= n and \
                    kinds[q + repeats * period: q + (repeats + 1) * period] == kinds[q: q + period]:
                repeats += 1
            if repeats < 2:
                continue
            scanned = repeats * period
            if scanned > best.repeats * best.period:
                best = LayerPlan(head=tuple(range(q)), start=q, period=period, repeats=repeats,
                                 tail=tuple(range(q + scanned, n)))
    return best


def stack_layers(per_layer: Sequence[Any], plan: LayerPlan) -> dict:
    """Per-layer trees (params or caches, one per layer) -> ``{"head": (tree, ...), "blocks":
    (tree stacked over the repeats, one per block position), "tail": (tree, ...)}``. Raises
    ``ValueError`` when the layers of a block position hold trees of different layouts."""
    for j in range(plan.period):
        shapes = {str(jax.tree.map(jnp.shape, per_layer[plan.block_layer(r, j)])) for r in range(plan.repeats)}
        if len(shapes) > 1:
            raise ValueError(f"the layers at block position {j} hold trees of different layouts (a state method "
                             "calibrated per layer, such as stepquant or leapquant-alloc): the scanned layout cannot "
                             "stack them; run without --scan-layers")
    blocks = tuple(
        jax.tree.map(lambda *xs: jnp.stack(xs), *[per_layer[plan.block_layer(r, j)] for r in range(plan.repeats)])
        for j in range(plan.period))
    return {"head": tuple(per_layer[i] for i in plan.head), "blocks": blocks,
            "tail": tuple(per_layer[i] for i in plan.tail)}


def _index(x: Any, r: int) -> Any:
    # ``jax.eval_shape`` results (shapes only) unstack too, for memory accounting
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return x[r]


def unstack_layers(stacked: Mapping[str, Any], plan: LayerPlan) -> tuple:
    """The inverse of ``stack_layers``: a tuple of per-layer trees (``plan.head`` first)."""
    out = dict(zip(plan.head, stacked["head"]))
    out.update(zip(plan.tail, stacked["tail"]))
    for j, tree in enumerate(stacked["blocks"]):
        for r in range(plan.repeats):
            out[plan.block_layer(r, j)] = jax.tree.map(lambda x: _index(x, r), tree)
    return tuple(out[i] for i in sorted(out))


def scan_params(params: Mapping[str, Any], config: Any) -> dict:
    """Per-layer params (``"layers"``, what ``convert`` returns) -> the scanned layout
    ``config.scan_layers`` runs (``stack_layers`` of the layers; embeddings, norm and head kept)."""
    if "layers" not in params:
        raise ValueError("params are already in the scanned layout (no 'layers' entry)")
    rest = {k: v for k, v in params.items() if k != "layers"}
    return dict(rest, **stack_layers(params["layers"], layer_plan(config)))


def with_runtime(config: Any, params: Mapping[str, Any], *, compute: Optional[str] = None,
                 scan_layers: Optional[bool] = None) -> tuple[Any, dict]:
    """``(config, params)`` set to run with ``compute`` and ``scan_layers`` (``None`` keeps the
    config's): the params moved to the matching layout (per-layer or scanned) when it changes."""
    new = dataclasses.replace(config, **{k: v for k, v in (("compute", compute), ("scan_layers", scan_layers))
                                         if v is not None})
    check_runtime(new)
    params = dict(params)
    if new.scan_layers and "layers" in params:
        params = scan_params(params, new)
    elif not new.scan_layers and "blocks" in params:
        rest = {k: v for k, v in params.items() if k not in ("head", "blocks", "tail")}
        params = dict(rest, layers=unstack_layers(params, layer_plan(new)))
    return new, params


def layer_caches(cache: Mapping[str, Any], config: Any) -> tuple:
    """Each layer's cache, whatever the layout (``cache["layers"]``, or unstacked from the scanned
    ``head``/``blocks``/``tail``): for inspection, not for the decode loop (it copies)."""
    if "layers" in cache:
        return tuple(cache["layers"])
    return unstack_layers(cache, layer_plan(config))


def finish_cache(config: Any, per_layer: Sequence[Any], *, batch: int) -> dict:
    """The cache ``init_cache`` returns: ``pos [B]`` zeros and the per-layer caches, stacked by
    ``stack_layers`` when ``config.scan_layers``."""
    pos = jnp.zeros((batch,), jnp.int32)
    if config.scan_layers:
        return dict(pos=pos, **stack_layers(tuple(per_layer), layer_plan(config)))
    return {"pos": pos, "layers": tuple(per_layer)}


# Cache sections whose leaves carry a leading layer axis before the batch axis.
STACKED_SECTIONS = ("blocks",)


def batch_axis(path) -> int:
    """The batch axis of the cache leaf at ``path`` (a ``jax.tree_util`` key path): 1 under a
    scanned ``blocks`` section (``[repeats, B, ...]``), else 0."""
    first = path[0] if path else None
    return 1 if getattr(first, "key", None) in STACKED_SECTIONS else 0


def take_rows(cache: Any, rows: Array) -> Any:
    """The cache of sequences ``rows [n]`` (int) of ``cache``: a cache of batch ``n``."""
    return jax.tree_util.tree_map_with_path(lambda path, x: jnp.take(x, rows, axis=batch_axis(path)), cache)


def put_rows(cache: Any, rows: Array, sub: Any) -> Any:
    """``cache`` with sequences ``rows [n]`` replaced by the batch-``n`` cache ``sub`` (same layout)."""

    def put(path, x, y):
        if batch_axis(path) == 1:
            return x.at[:, rows].set(y.astype(x.dtype))
        return x.at[rows].set(y.astype(x.dtype))

    return jax.tree_util.tree_map_with_path(put, cache, sub)


# ----------------------------------------------------------------------------- the decoder stack


@dataclasses.dataclass(frozen=True)
class LayerParts:
    """What differs between architectures inside the shared pre-norm residual block.

    * ``norm(x, w, *, eps)``: the RMSNorm convention (Qwen's ``(1 + w)``, Kimi's plain ``w``);
    * ``linear_key``, ``linear_mixer(p, h, cache, cfg, *, method, mode, lengths, active) ->
      (h, cache, trace)``: the linear-attention mixer and its params' key (``gdn``, ``kda``);
    * ``attention_key``, ``attention_mixer(p, h, cache, cfg, *, positions, mode, active) ->
      (h, cache)``: the full-attention mixer (``attn``, ``mla``);
    * ``moe_mlp(p, h, cfg)``: the routed MLP (its router; the experts are ``models.moe``'s).
    """

    norm: Callable
    linear_key: str
    linear_mixer: Callable
    attention_key: str
    attention_mixer: Callable
    moe_mlp: Callable


def decoder_layer(parts: LayerParts, p: dict, x: Array, cache: dict, cfg: Any, i: int, *, method: Any, mode: str,
                  positions: Array, lengths: Optional[Array], active: Optional[Array]) -> tuple[Array, dict, dict]:
    """One pre-norm residual block, ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``, with the
    mixer and MLP that ``cfg.layer_types[i]`` and ``cfg.mlp_types[i]`` name. x ``[B, T, D]``.
    Returns ``(x [B, T, D], new_cache, trace or {})``."""
    h = parts.norm(x, p["input_norm"], eps=cfg.rms_norm_eps)
    trace = {}
    if cfg.layer_types[i] == LINEAR_ATTENTION:
        h, cache, trace = parts.linear_mixer(p[parts.linear_key], h, cache, cfg, method=method, mode=mode,
                                             lengths=lengths, active=active)
    else:
        h, cache = parts.attention_mixer(p[parts.attention_key], h, cache, cfg, positions=positions, mode=mode,
                                         active=active)
    x = x + h
    h = parts.norm(x, p["post_norm"], eps=cfg.rms_norm_eps)
    if cfg.mlp_types[i] == "dense":
        h = L.swiglu_mlp(h, **p["mlp"], compute=cfg.compute)
    else:
        h = parts.moe_mlp(p["moe"], h, cfg)
    return x + h, cache, trace



def run_recurrence(method: Any, state: Any, tails: Any, old_tails: Any, *, q: Array, k: Array, v: Array, g: Array,
                   beta: Array, mode: str, lengths: Optional[Array], active: Optional[Array]) -> tuple[Array, Any, Any]:
    """A linear-attention mixer's recurrence over its inputs ``[B, T, H, ...]``: ``method.prefill``
    from an empty state, or in decode (``T = 1``) one ``method.step`` from ``state``, where the
    sequences not ``active`` keep ``old_tails`` (the short-convolution tails ``[B, Kc-1, C]``
    before the step, a pytree like ``tails``; the method keeps their state). Returns
    ``(o [B, T, H, dv], new state, tails)``."""
    if mode == "prefill":
        o, state = method.prefill(q=q, k=k, v=v, g=g, beta=beta, lengths=lengths)
        return o, state, tails
    o, state = method.step(state, q=q[:, 0], k=k[:, 0], v=v[:, 0], g=g[:, 0], beta=beta[:, 0], active=active)
    if active is not None:
        tails = jax.tree.map(lambda new, old: jnp.where(active[:, None, None], new, old), tails, old_tails)
    return o[:, None], state, tails


def _uniform_method(method: Any, layers: Sequence[int]) -> bool:
    return len({method.for_layer(i) for i in layers}) <= 1


def run_decoder_stack(params: dict, config: Any, ids: Array, cache: dict, *, parts: LayerParts, method: Any,
                      mode: str, lengths: Optional[Array] = None, active: Optional[Array] = None,
                      record: bool = False) -> tuple[Array, dict, dict]:
    """The ``forward`` of the contract for a stack of decoder layers (shared by every architecture):
    embedding, ``decoder_layer`` with the architecture's ``parts`` per layer, final norm
    (``parts.norm``) and LM head. ids ``[B, T]`` int32 -> ``(logits [B, T, vocab] f32, cache, traces)``.

    With ``config.scan_layers`` the params and cache are in the scanned layout
    (``scan_params``, ``finish_cache``) and the blocks of ``layer_plan(config)`` run under one
    ``lax.scan``: the program holds one block's layers, whatever the depth. A method that
    differs per layer (``for_layer``, e.g. DAMP) or ``record=True`` walks the same stacked
    layout layer by layer instead.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    check_runtime(config)
    bsz, t = ids.shape
    if mode == "prefill":
        lengths = jnp.full((bsz,), t, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (bsz, t))
        new_pos = lengths
        active = None
    else:
        if t != 1:
            raise ValueError(f"decode takes one token per sequence, got ids of shape {ids.shape}")
        positions = cache["pos"][:, None]
        lengths = None
        new_pos = cache["pos"] + (1 if active is None else active.astype(jnp.int32))
    x = jnp.take(params["embed"], ids, axis=0).astype(jnp.float32)
    traces = {}

    def layer(p, x, c, i):
        x, c, trace = decoder_layer(parts, p, x, c, config, i, method=method.for_layer(i), mode=mode,
                                    positions=positions, lengths=lengths, active=active)
        if record and trace:
            traces[i] = trace
        return x, c

    if not config.scan_layers:
        if "layers" not in params or "layers" not in cache:
            raise ValueError("config.scan_layers is False but the params or the cache are in the scanned layout")
        new_layers = []
        for i, (p, c) in enumerate(zip(params["layers"], cache["layers"])):
            x, c = layer(p, x, c, i)
            new_layers.append(c)
        new_cache = {"pos": new_pos, "layers": tuple(new_layers)}
    else:
        if "blocks" not in params or "blocks" not in cache:
            raise ValueError("config.scan_layers is True: the params need models.base.scan_params and the cache "
                             "init_cache with the same config")
        plan = layer_plan(config)
        head = []
        for i, p, c in zip(plan.head, params["head"], cache["head"]):
            x, c = layer(p, x, c, i)
            head.append(c)
        block_layers = [plan.block_layer(r, j) for r in range(plan.repeats) for j in range(plan.period)]
        if record or not _uniform_method(method, block_layers):
            blocks = list(cache["blocks"])
            for r in range(plan.repeats):
                for j in range(plan.period):
                    p = jax.tree.map(lambda a: a[r], params["blocks"][j])
                    c = jax.tree.map(lambda a: a[r], blocks[j])
                    x, c = layer(p, x, c, plan.block_layer(r, j))
                    blocks[j] = jax.tree.map(lambda a, b: a.at[r].set(b), blocks[j], c)
            blocks = tuple(blocks)
        else:
            def block(x, xs):
                ps, cs = xs
                out = []
                for j in range(plan.period):
                    x, c = layer(ps[j], x, cs[j], plan.block_layer(0, j))
                    out.append(c)
                return x, tuple(out)

            x, blocks = jax.lax.scan(block, x, (params["blocks"], cache["blocks"]))
        tail = []
        for i, p, c in zip(plan.tail, params["tail"], cache["tail"]):
            x, c = layer(p, x, c, i)
            tail.append(c)
        new_cache = {"pos": new_pos, "head": tuple(head), "blocks": blocks, "tail": tuple(tail)}
    x = parts.norm(x, params["final_norm"], eps=config.rms_norm_eps)
    logits = L.linear(x, params["lm_head"], compute=config.compute)
    return logits, new_cache, dict(sorted(traces.items()))


@dataclasses.dataclass(frozen=True)
class DecoderArchitecture:
    """An ``Architecture`` made of a decoder stack: the architecture module's functions and its
    ``LayerParts``; ``forward`` is ``run_decoder_stack`` with those parts."""

    model_types: tuple[str, ...]
    parts: LayerParts
    config_from_hf: Callable
    param_specs: Callable
    convert: Callable
    init_cache: Callable
    tensor_parallel_layout: Callable

    def forward(self, params: dict, config: Any, ids: Array, cache: dict, *, method: Any, mode: str,
                lengths: Optional[Array] = None, active: Optional[Array] = None,
                record: bool = False) -> tuple[Array, dict, dict]:
        """The whole model (contract in ``Architecture.forward``). ids ``[B, T]`` int32 ->
        ``(logits [B, T, vocab] f32, cache, traces)``."""
        return run_decoder_stack(params, config, ids, cache, parts=self.parts, method=method, mode=mode,
                                 lengths=lengths, active=active, record=record)


__all__ = [
    "Architecture",
    "DecoderArchitecture",
    "DecoderConfig",
    "LayerParts",
    "LayerPlan",
    "RUNTIME_FIELDS",
    "batch_axis",
    "check_runtime",
    "decoder_layer",
    "finish_cache",
    "layer_caches",
    "layer_plan",
    "put_rows",
    "run_decoder_stack",
    "run_recurrence",
    "runtime_free_repr",
    "scan_params",
    "stack_layers",
    "take_rows",
    "unstack_layers",
    "with_runtime",
    "ConversionError",
    "FULL_ATTENTION",
    "LINEAR_ATTENTION",
    "MODES",
    "ModelConfig",
    "check_shapes",
]
