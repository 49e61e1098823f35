"""The two trained architectures: their configs, initial parameters, and the training forward.

Configs are Hugging Face ``config.json`` dicts, so the trained model is exported as it is
described: ``gdn`` is a Qwen3.5 text model (``qwen3_5_text``: Gated DeltaNet and gated full
attention 3:1, GVA, dense SwiGLU MLPs), ``kda`` a Kimi-Linear model (KDA and MLA 3:1, dense
MLPs via ``mlp_layer_types``). Linear-attention heads are 128 x 128 in the shipped size, the
shape the GPU kernels serve. ``SIZES["tiny"]`` is the same architecture at test scale.
``SIZES["recall"]`` (and ``"recall-tiny"``) are the same layers with no softmax attention at
all (``leapquant train --task``): every recalled value crosses the recurrent state.

Parameters are our params pytree (what ``ARCH.convert`` returns), built by drawing HF-named
tensors from ``ARCH.param_specs`` and converting them, so the tree is the converter's by
construction. Initialisation follows transformers' ``_init_weights`` (normal(0, 0.02)
matrices, Qwen's zero-centred norms at 0, other norms at 1, PyTorch's default for the depthwise
convolutions) except for the decay gates of both models, which use FLA's/Mamba-2's rule:
``A_log = log U(1, 16)`` and ``dt_bias = softplus^-1(dt)`` with ``dt`` log-uniform in
``[1e-3, 1e-1]`` (transformers' Kimi-Linear does the same; its Qwen3.5 sets ``dt_bias = 1``,
which starts every head with a short memory).

The training forward is the models' own ``forward`` in prefill mode with a recurrence that
needs no state format: ``TrainingRecurrence`` runs the dense fp32 recurrence (chunked or
token-serial) and keeps nothing, so the decoder is written once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from models.base import FULL_ATTENTION, LINEAR_ATTENTION
from models.registry import architecture_for_config

Array = jax.Array
ARCHS = ("gdn", "kda")
RECURRENCES = ("chunked", "recurrent")

# Shapes of the two architectures. "ship" fits 16 MB as bf16 safetensors (the checkpoints in
# models/checkpoints/); "tiny" is for tests and CPU smoke runs.
SIZES = {
    "ship": {
        "gdn": dict(hidden=256, layers=8, intermediate=288, attn_heads=4, kv_heads=2, attn_head_dim=64,
                    key_heads=2, value_heads=4, head_dim=128),
        "kda": dict(hidden=256, layers=8, intermediate=448, attn_heads=2, kv_lora=128, qk_nope=64, qk_rope=32,
                    v_head_dim=64, kda_heads=2, head_dim=128),
    },
    "tiny": {
        "gdn": dict(hidden=32, layers=4, intermediate=48, attn_heads=2, kv_heads=1, attn_head_dim=16,
                    key_heads=1, value_heads=2, head_dim=16),
        "kda": dict(hidden=32, layers=4, intermediate=48, attn_heads=2, kv_lora=16, qk_nope=8, qk_rope=8,
                    v_head_dim=8, kda_heads=2, head_dim=16),
    },
    # Pure linear-attention stacks for the recall tasks (``attention_every=0``: no softmax
    # attention, so every recalled value crosses the recurrent state). The attention fields only
    # fill the config; no layer uses them.
    "recall": {
        "gdn": dict(hidden=256, layers=2, intermediate=768, attn_heads=4, kv_heads=2, attn_head_dim=64,
                    key_heads=2, value_heads=4, head_dim=128, attention_every=0),
        "kda": dict(hidden=256, layers=2, intermediate=768, attn_heads=2, kv_lora=128, qk_nope=64, qk_rope=32,
                    v_head_dim=64, kda_heads=4, head_dim=128, attention_every=0),
    },
    "recall-tiny": {
        "gdn": dict(hidden=32, layers=1, intermediate=64, attn_heads=2, kv_heads=1, attn_head_dim=16,
                    key_heads=1, value_heads=1, head_dim=16, attention_every=0),
        "kda": dict(hidden=32, layers=1, intermediate=64, attn_heads=2, kv_lora=16, qk_nope=8, qk_rope=8,
                    v_head_dim=8, kda_heads=1, head_dim=16, attention_every=0),
    },
}


def _layer_types(layers: int, attention_every: int = 4) -> list[str]:
    """Every ``attention_every``-th layer full attention, the others linear attention (3:1 at
    the default); ``attention_every = 0``: linear attention only."""
    return [FULL_ATTENTION if attention_every and (i + 1) % attention_every == 0 else LINEAR_ATTENTION
            for i in range(layers)]


def hf_config(arch: str, *, vocab_size: int, eos_token_id: int, size: str = "ship") -> dict:
    """The ``config.json`` dict of architecture ``arch`` (``gdn`` or ``kda``) at ``size``."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {tuple(SIZES)}, got {size!r}")
    s = SIZES[size][arch]
    types = _layer_types(s["layers"], s.get("attention_every", 4))
    common = dict(vocab_size=vocab_size, hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                  num_hidden_layers=s["layers"], layer_types=types, hidden_act="silu", tie_word_embeddings=False,
                  attention_bias=False, initializer_range=0.02, eos_token_id=eos_token_id, pad_token_id=eos_token_id,
                  bos_token_id=None, dtype="bfloat16")
    if arch == "gdn":
        return dict(
            architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", **common,
            num_attention_heads=s["attn_heads"], num_key_value_heads=s["kv_heads"], head_dim=s["attn_head_dim"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            max_position_embeddings=32768, rms_norm_eps=1e-6,
            linear_num_key_heads=s["key_heads"], linear_num_value_heads=s["value_heads"],
            linear_key_head_dim=s["head_dim"], linear_value_head_dim=s["head_dim"], linear_conv_kernel_dim=4,
        )
    kda_layers = [i + 1 for i, t in enumerate(types) if t == LINEAR_ATTENTION]  # 1-indexed, as released
    full_layers = [i + 1 for i, t in enumerate(types) if t == FULL_ATTENTION]
    return dict(
        architectures=["KimiLinearForCausalLM"], model_type="kimi_linear", **common,
        mlp_layer_types=["dense"] * s["layers"],
        num_attention_heads=s["attn_heads"], num_key_value_heads=s["attn_heads"],
        q_lora_rank=None, kv_lora_rank=s["kv_lora"], qk_nope_head_dim=s["qk_nope"], qk_rope_head_dim=s["qk_rope"],
        v_head_dim=s["v_head_dim"], mla_use_nope=True, rms_norm_eps=1e-5, model_max_length=32768,
        linear_attn_config={"num_heads": s["kda_heads"], "head_dim": s["head_dim"], "short_conv_kernel_size": 4,
                            "kda_layers": kda_layers, "full_attn_layers": full_layers},
    )


# ----------------------------------------------------------------------------- initialisation


def _fla_decay_gate(rng: np.random.Generator, n_heads: int, n_bias: int) -> tuple[np.ndarray, np.ndarray]:
    """``A_log [n_heads]`` and ``dt_bias [n_bias]`` (FLA / Mamba-2 initialisation)."""
    a_log = np.log(rng.uniform(1.0, 16.0, n_heads))
    dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), n_bias))
    dt_bias = dt + np.log(-np.expm1(-dt))  # softplus(dt_bias) = dt
    return a_log.astype(np.float32), dt_bias.astype(np.float32)


def _init_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator, *, zero_centred_norms: bool,
                 std: float) -> np.ndarray:
    if name.endswith("conv1d.weight"):
        bound = 1.0 / math.sqrt(shape[-1])  # nn.Conv1d default for a depthwise [C, 1, Kc] weight
        return rng.uniform(-bound, bound, shape).astype(np.float32)
    if name.endswith("norm.weight"):
        # Qwen's (1 + w) norms start at 0; the gated GDN output norm and every Kimi norm at 1
        plain = not zero_centred_norms or name.endswith("linear_attn.norm.weight")
        return np.full(shape, 1.0 if plain else 0.0, np.float32)
    if len(shape) >= 2:
        return (std * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("e_score_correction_bias"):
        return np.zeros(shape, np.float32)  # Kimi's router starts unbiased (transformers: zeros)
    raise ValueError(f"no initialisation rule for tensor {name} {shape}")


def init_params(config_json: dict, *, seed: int) -> dict:
    """Initial params pytree (numpy float32) for a ``hf_config`` dict; see the module docstring."""
    arch = architecture_for_config(config_json)
    config = arch.config_from_hf(config_json)
    specs = arch.param_specs(config)
    rng = np.random.default_rng(seed)
    qwen = config.model_type.startswith("qwen")
    std = float(config_json.get("initializer_range", 0.02))
    tensors = {}
    for name, shape in specs.items():
        if name.endswith("A_log") or name.endswith("dt_bias"):
            continue
        tensors[name] = _init_tensor(name, shape, rng, zero_centred_norms=qwen, std=std)
    for name, shape in specs.items():
        if name.endswith("A_log"):
            bias_name = name[: -len("A_log")] + "dt_bias"
            n_heads = int(np.prod(shape))
            a_log, dt_bias = _fla_decay_gate(rng, n_heads, int(np.prod(specs[bias_name])))
            tensors[name] = a_log.reshape(shape)
            tensors[bias_name] = dt_bias.reshape(specs[bias_name])
    return arch.convert(tensors, config)


def parameter_count(params) -> int:
    """Number of scalars in a params pytree."""
    return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(params)))


# Leaves that the exported architecture has no tensor for: they stay at their initial zeros
# (Kimi's g_b bias exists in fla's layer, not in the released one or in transformers).
FROZEN_KEYS = ("g_b_bias",)


def _path_keys(path) -> list[str]:
    return [str(getattr(p, "key", getattr(p, "idx", p))) for p in path]


def trainable_mask(params) -> Any:
    """Pytree of bools: False for ``FROZEN_KEYS`` leaves."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _path_keys(path)[-1] not in FROZEN_KEYS, params)


def weight_decay_mask(params) -> Any:
    """Pytree of bools: decay the matrices (embeddings, projections), not norms, gates, biases or
    the short-convolution taps."""
    def decay(path, x):
        key = _path_keys(path)[-1]
        return bool(np.ndim(x) >= 2 and not key.endswith("conv") and key not in FROZEN_KEYS)

    return jax.tree_util.tree_map_with_path(decay, params)


# ----------------------------------------------------------------------------- forward


@dataclasses.dataclass(frozen=True)
class TrainingRecurrence:
    """The state-method interface reduced to what a full-sequence forward needs.

    ``prefill`` runs the dense fp32 recurrence from a zero state: ``"chunked"`` through
    ``leapquant_jax.chunked.chunk_delta_rule`` (matmul-parallel within chunks of ``chunk``
    tokens; the fast path for training), ``"recurrent"`` through
    ``leapquant_jax.recurrence.recurrent_scan`` (token-serial; the reference). Both are
    differentiable. No state is kept: the cache entry is ``None``, and asking to decode with
    this object is an error.
    """

    kind: str = "chunked"
    chunk: int = 64

    def __post_init__(self):
        if self.kind not in RECURRENCES:
            raise ValueError(f"recurrence must be one of {RECURRENCES}, got {self.kind!r}")
        if self.chunk < 1 or self.chunk & (self.chunk - 1):
            raise ValueError(f"chunk must be a power of two, got {self.chunk}")

    def for_layer(self, layer: int) -> "TrainingRecurrence":
        """The same recurrence in every layer."""
        return self

    def init(self, batch: int, heads: int, dk: int, dv: int, per_channel_decay: bool = False, *, key_heads=None):
        """No state: training runs the chunked form from zeros."""
        return None

    def prefill(self, *, q: Array, k: Array, v: Array, g: Array, beta: Array,
                lengths: Optional[Array] = None, state=None):
        """``q, k [B, T, Hk, dk]``, ``v [B, T, H, dv]``, ``g [B, T, H(, dk)]``, ``beta [B, T, H]``
        -> ``(o [B, T, H, dv] fp32, None)``.

        ``lengths`` is not needed: an output at a valid position never depends on later tokens,
        outputs past a row's length are unspecified by the contract, and no state is returned.
        """
        if state is not None:
            raise ValueError("TrainingRecurrence starts from a zero state; got a state")
        if self.kind == "chunked":
            from leapquant_jax.chunked import chunk_delta_rule

            o, _ = chunk_delta_rule(q=q, k=k, v=v, g=g, beta=beta, chunk=self.chunk)
        else:
            from leapquant_jax.recurrence import recurrent_scan

            o, _ = recurrent_scan(None, q=q, k=k, v=v, g=g, beta=beta)
        return o, None

    def step(self, *args, **kwargs):
        raise TypeError("TrainingRecurrence only runs full sequences (prefill); decode with a state method")


def forward_logits(arch, config, params, ids: Array, recurrence: TrainingRecurrence, *, record: bool = False):
    """Causal full-sequence forward of the model's own ``forward`` (prefill mode).

    ids ``[B, T]`` int32 -> ``logits [B, T, vocab]`` float32 (and, with ``record``, the
    linear-attention layers' recurrence inputs ``{layer: {"q", "k", "v", "g", "beta"}}``)."""
    bsz, t = ids.shape
    cache = arch.init_cache(config, batch=bsz, max_len=t, method=recurrence)
    logits, _, traces = arch.forward(params, config, ids, cache, method=recurrence, mode="prefill", record=record)
    return (logits, traces) if record else logits


def masked_loss(logits: Array, targets: Array, mask: Array) -> tuple[Array, Array]:
    """Mean next-token cross-entropy over ``mask``: logits ``[B, T, V]``, targets, mask
    ``[B, T]``. Returns ``(loss, per_token [B, T])``."""
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0), per_token


__all__ = [
    "ARCHS",
    "FROZEN_KEYS",
    "RECURRENCES",
    "SIZES",
    "TrainingRecurrence",
    "forward_logits",
    "hf_config",
    "init_params",
    "masked_loss",
    "parameter_count",
    "trainable_mask",
    "weight_decay_mask",
]
