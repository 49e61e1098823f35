"""The contract between the model-independent machinery and one architecture module.

The converter, the checkpoint reader, the decode loop and the CLI (``models/checkpoint.py``,
``models/decode.py``, ``models/cli.py``) know nothing about a particular model. Each
architecture (``models/qwen3_next.py`` for Qwen3-Next and Qwen3.5, ``models/kimi_linear.py``
for Kimi-Linear) is a module that exposes one object, ``ARCH``, satisfying ``Architecture``
below, and is listed by HF ``model_type`` in ``models/registry.py``.

Everything is functional: parameters are a plain pytree of arrays (dicts, tuples), the
config is a frozen, hashable dataclass (static under ``jit``), the cache is a plain pytree.

Parameters
    ``convert`` returns the pytree the forward pass reads. Weight layouts are fixed there,
    once (for example Qwen3-Next's interleaved ``in_proj_qkvz`` becomes Qwen3.5's flat
    ``qkv``/``z``/``b``/``a``). Leaves keep their stored dtype (bf16 stays bf16); the forward
    pass computes in float32. Dict keys are strings and sequences are tuples, so that
    ``models.checkpoint.flatten_params`` / ``unflatten_params`` round-trip the tree through a
    safetensors file (``"layers.3.attn.q_proj"``).

Cache
    ``init_cache(config, batch=B, max_len=L, method=M)`` returns a dict with at least
    ``"pos": [B] int32``, the number of tokens each sequence has consumed, which is also the
    position of its next token. Linear-attention layers keep their recurrent state in the
    format of the state method ``M`` (``leapquant_jax.make_method(...)``: ``init``,
    ``prefill``, ``step``, ``to_dense``, and ``for_layer(i)``, the method layer ``i`` uses, which
    ``run_decoder_stack`` applies) plus their short-convolution tails; attention layers keep a
    KV cache of ``L`` positions.

Forward
    ``forward(params, config, ids, cache, *, method, mode, lengths=None, active=None,
    record=False) -> (logits, cache, traces)``

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
      ``g [B, T, H]`` (GDN) or ``[B, T, H, dk]`` (KDA). These are the trace files of docs/design.md §5.

``forward`` must be traceable with ``config``, ``method``, ``mode`` and ``record`` static, so
the decode loop can ``jit`` it and run it inside ``lax.while_loop``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Protocol, runtime_checkable

import jax
import numpy as np

Array = jax.Array
Params = Any
Cache = Any
Traces = dict

MODES = ("prefill", "decode")
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


class ConversionError(ValueError):
    """A checkpoint does not match its config; the message names every offending tensor."""

    def __init__(self, *, missing=(), unexpected=(), mis_shaped=(), context: str = ""):
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.mis_shaped = sorted(mis_shaped)  # (name, expected, found)
        lines = [f"checkpoint does not match its config{(' (' + context + ')') if context else ''}:"]
        if self.missing:
            lines.append(f"  missing tensors ({len(self.missing)}): " + ", ".join(self.missing))
        if self.unexpected:
            lines.append(f"  unexpected tensors ({len(self.unexpected)}): " + ", ".join(self.unexpected))
        for name, want, got in self.mis_shaped:
            lines.append(f"  mis-shaped tensor {name}: expected {tuple(want)}, found {tuple(got)}")
        super().__init__("\n".join(lines))


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



def run_decoder_stack(params: dict, config: Any, ids: Array, cache: dict, *, decoder_layer: Callable,
                      final_norm: Callable, method: Any, mode: str, lengths: Optional[Array] = None,
                      active: Optional[Array] = None, record: bool = False) -> tuple[Array, dict, dict]:
    """The ``forward`` of the contract for a stack of decoder layers (shared by every architecture).

    ``decoder_layer(p, x, cache, config, i, *, method, mode, positions, lengths, active) ->
    (x, cache, trace)`` is the architecture's layer; ``final_norm(x, w, eps)`` its output norm
    (the norm conventions differ: Qwen's ``(1 + w)``, Kimi's plain ``w``). ids ``[B, T]`` int32
    -> ``(logits [B, T, vocab] f32, cache, traces)``.
    """
    import jax.numpy as jnp

    from models import layers as L

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
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
    new_layers, traces = [], {}
    for i, (p, c) in enumerate(zip(params["layers"], cache["layers"])):
        x, c, trace = decoder_layer(p, x, c, config, i, method=method.for_layer(i), mode=mode, positions=positions,
                                    lengths=lengths, active=active)
        new_layers.append(c)
        if record and trace:
            traces[i] = trace
    x = final_norm(x, params["final_norm"], eps=config.rms_norm_eps)
    logits = L.linear(x, params["lm_head"])
    return logits, {"pos": new_pos, "layers": tuple(new_layers)}, traces

__all__ = [
    "Architecture",
    "ConversionError",
    "FULL_ATTENTION",
    "LINEAR_ATTENTION",
    "MODES",
    "ModelConfig",
    "check_shapes",
]
