"""Qwen3-Next and Qwen3.5 (dense and MoE): hybrid Gated DeltaNet + gated attention decoders.

Follows transformers' ``qwen3_next``, ``qwen3_5`` and ``qwen3_5_moe`` text models (MODELS.md
has the weight names, shapes and maths). One code path serves all of them: the converter
fixes Qwen3-Next's interleaved ``in_proj_qkvz``/``in_proj_ba`` into Qwen3.5's flat
``qkv``/``z``/``b``/``a`` once, at load.

A decoder layer is ``x + mixer(norm(x))`` then ``x + mlp(norm(x))`` with zero-centred
``(1 + w)`` RMSNorms; the mixer is a GDN layer or a full-attention layer as ``layer_types``
says, the MLP a SwiGLU or a routed mixture of SwiGLU experts with a gated shared expert.

Matmuls run as ``config.compute`` says (``models/layers.py``: exact fp32 or bf16 operands with
fp32 accumulation); everything else in fp32 (weights may stay bf16). The recurrent state of
the GDN layers lives in whatever format the state method of the decode loop uses; attention
layers keep a KV cache in fp32 (exact) or bf16 (fast). See ``models/base.py`` for the contract.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from leapquant_jax.recurrence import expand_heads
from models import layers as L
from models.base import (FULL_ATTENTION, LINEAR_ATTENTION, STACKED_SECTIONS, DecoderArchitecture,
                         DecoderConfig, LayerParts, check_shapes, finish_cache, run_recurrence)
from models.moe import expert_specs, group_experts, routed_experts, swiglu_specs

Array = jax.Array
F32 = jnp.float32

QWEN3_NEXT = "qwen3_next"
# Checkpoint sections that are not part of the text decoder (vision tower, multi-token
# prediction head): present in released Qwen3.5 files, never read.
IGNORED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")


# ============================================================================= config


@dataclasses.dataclass(frozen=True)
class QwenHybridConfig(DecoderConfig):
    """Qwen3-Next / Qwen3.5 text-decoder config (frozen: a static argument under ``jit``): the
    attention, GDN and MoE fields (``DecoderConfig`` holds those every decoder has, and the runtime)."""

    # full attention
    num_attention_heads: int
    num_key_value_heads: int  # GQA: divides num_attention_heads
    head_dim: int
    partial_rotary_factor: float
    rope_theta: float
    attention_bias: bool
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MLPs
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    tie_word_embeddings: bool

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def gva_ratio(self) -> int:
        return self.linear_num_value_heads // self.linear_num_key_heads


def _rope_settings(text: Mapping[str, Any]) -> tuple[float, float]:
    """``(rope_theta, partial_rotary_factor)`` from a v5 ``rope_parameters`` dict or the older
    top-level keys. Only plain RoPE is supported; Qwen3.5's interleaved MRoPE reduces to it for
    text, where all three position components are equal."""
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ValueError(f"rope_type {rope_type!r} is not supported (only default RoPE)")
    theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
    return float(theta), float(factor)


def _layer_types(text: Mapping[str, Any], n: int) -> tuple[str, ...]:
    types = text.get("layer_types")
    if types is None:
        interval = int(text.get("full_attention_interval", 4))
        types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(n)]
    types = tuple(types)[:n]
    if len(types) != n or set(types) - {LINEAR_ATTENTION, FULL_ATTENTION}:
        raise ValueError(f"layer_types must give {LINEAR_ATTENTION!r} or {FULL_ATTENTION!r} for {n} layers, got {types}")
    return types


def _mlp_types(model_type: str, text: Mapping[str, Any], n: int) -> tuple[str, ...]:
    experts = int(text.get("num_experts") or 0)
    if model_type.startswith("qwen3_5_moe"):
        return ("moe",) * n
    if model_type.startswith("qwen3_5"):
        return ("dense",) * n
    # Qwen3-Next: HF Qwen3NextDecoderLayer's rule
    only = set(text.get("mlp_only_layers") or ())
    step = int(text.get("decoder_sparse_step", 1))
    return tuple("moe" if i not in only and experts > 0 and (i + 1) % step == 0 else "dense" for i in range(n))


def config_from_hf(config_json: Mapping[str, Any]) -> QwenHybridConfig:
    """Parses a HF ``config.json``: ``qwen3_next``, ``qwen3_5``/``qwen3_5_moe`` (VLM: the
    ``text_config`` part) or their ``*_text`` causal-LM variants."""
    model_type = config_json["model_type"]
    if model_type not in ARCH.model_types:
        raise ValueError(f"not a Qwen3-Next/Qwen3.5 config: model_type {model_type!r}")
    text = dict(config_json.get("text_config") or config_json)
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (Qwen3-Next/Qwen3.5 use silu)")
    n = int(text["num_hidden_layers"])
    theta, factor = _rope_settings(text)
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    tie = config_json.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    cfg = QwenHybridConfig(
        model_type=model_type,
        vocab_size=int(text["vocab_size"]),
        hidden_size=hidden,
        layer_types=_layer_types(text, n),
        mlp_types=_mlp_types(model_type, text, n),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads", heads)),
        head_dim=int(text.get("head_dim") or hidden // heads),
        partial_rotary_factor=factor,
        rope_theta=theta,
        attention_bias=bool(text.get("attention_bias", False)),
        linear_num_key_heads=int(text["linear_num_key_heads"]),
        linear_num_value_heads=int(text["linear_num_value_heads"]),
        linear_key_head_dim=int(text["linear_key_head_dim"]),
        linear_value_head_dim=int(text["linear_value_head_dim"]),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        intermediate_size=int(text.get("intermediate_size") or 0),
        num_experts=int(text.get("num_experts") or 0),
        num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
        # Qwen3.5-MoE always renormalises its top-k weights (its router has no switch)
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        tie_word_embeddings=bool(tie),
    )
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads (GVA)")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads (GQA)")
    return cfg


# ============================================================================= converter


def _prefix(tensors: Mapping[str, Any]) -> str:
    # Qwen3.5 VLM files keep the text decoder under model.language_model.; causal-LM saves
    # (Qwen3-Next, Qwen3_5ForCausalLM) under model.
    return "model.language_model." if any(n.startswith("model.language_model.") for n in tensors) else "model."


def _gdn_specs(cfg: QwenHybridConfig, p: str, interleaved: bool) -> dict[str, tuple[int, ...]]:
    d, hv = cfg.hidden_size, cfg.linear_num_value_heads
    specs = {}
    if interleaved:
        specs[p + "in_proj_qkvz.weight"] = (2 * cfg.key_dim + 2 * cfg.value_dim, d)
        specs[p + "in_proj_ba.weight"] = (2 * hv, d)
    else:
        specs[p + "in_proj_qkv.weight"] = (cfg.conv_dim, d)
        specs[p + "in_proj_z.weight"] = (cfg.value_dim, d)
        specs[p + "in_proj_b.weight"] = (hv, d)
        specs[p + "in_proj_a.weight"] = (hv, d)
    specs[p + "conv1d.weight"] = (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim)
    specs[p + "A_log"] = (hv,)
    specs[p + "dt_bias"] = (hv,)
    specs[p + "norm.weight"] = (cfg.linear_value_head_dim,)
    specs[p + "out_proj.weight"] = (d, cfg.value_dim)
    return specs


def _attention_specs(cfg: QwenHybridConfig, p: str) -> tuple[dict, dict]:
    d, h, hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    specs = {
        p + "q_proj.weight": (2 * h * hd, d),
        p + "k_proj.weight": (hkv * hd, d),
        p + "v_proj.weight": (hkv * hd, d),
        p + "o_proj.weight": (d, h * hd),
        p + "q_norm.weight": (hd,),
        p + "k_norm.weight": (hd,),
    }
    biases = {
        p + "q_proj.bias": (2 * h * hd,),
        p + "k_proj.bias": (hkv * hd,),
        p + "v_proj.bias": (hkv * hd,),
        p + "o_proj.bias": (d,),
    }
    return (dict(specs, **biases), {}) if cfg.attention_bias else (specs, {})


def _mlp_specs(cfg: QwenHybridConfig, p: str, kind: str, fused_experts: bool) -> dict[str, tuple[int, ...]]:
    d = cfg.hidden_size
    if kind == "dense":
        return swiglu_specs(p, cfg.intermediate_size, d)
    e, i, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    specs = {p + "gate.weight": (e, d)}
    # fused: the transformers v5 in-memory layout, accepted when a file was saved that way
    specs.update(expert_specs(p, e, i, d, fused=fused_experts))
    if s:
        specs.update(swiglu_specs(p + "shared_expert.", s, d))
        specs[p + "shared_expert_gate.weight"] = (1, d)
    return specs


def _layout(cfg: QwenHybridConfig, tensors: Mapping[str, Any]) -> dict:
    """Which of the accepted layouts the file uses, per layer (decided by the names present)."""
    pre = _prefix(tensors)
    interleaved, fused = [], []
    for i in range(cfg.num_layers):
        la = f"{pre}layers.{i}.linear_attn."
        # with neither projection present, expect the model type's own layout, so the error
        # names the tensors its files carry
        interleaved.append(la + "in_proj_qkvz.weight" in tensors
                           or (la + "in_proj_qkv.weight" not in tensors and cfg.model_type == QWEN3_NEXT))
        fused.append(f"{pre}layers.{i}.mlp.experts.gate_up_proj" in tensors)
    return dict(prefix=pre, interleaved=tuple(interleaved), fused=tuple(fused))


def _specs_for(cfg: QwenHybridConfig, layout: dict) -> tuple[dict, dict]:
    pre = layout["prefix"]
    d = cfg.hidden_size
    specs = {pre + "embed_tokens.weight": (cfg.vocab_size, d), pre + "norm.weight": (d,)}
    optional = {}
    if cfg.tie_word_embeddings:
        optional["lm_head.weight"] = (cfg.vocab_size, d)
    else:
        specs["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"{pre}layers.{i}."
        specs[p + "input_layernorm.weight"] = (d,)
        specs[p + "post_attention_layernorm.weight"] = (d,)
        if cfg.layer_types[i] == LINEAR_ATTENTION:
            specs.update(_gdn_specs(cfg, p + "linear_attn.", layout["interleaved"][i]))
        else:
            req, opt = _attention_specs(cfg, p + "self_attn.")
            specs.update(req)
            optional.update(opt)
        specs.update(_mlp_specs(cfg, p + "mlp.", cfg.mlp_types[i], layout["fused"][i]))
    return specs, optional


def param_specs(config: QwenHybridConfig) -> dict[str, tuple[int, ...]]:
    """Canonical HF name -> shape of every tensor the converter reads (the on-disk layout of
    the config's own model type: Qwen3-Next interleaved, Qwen3.5 flat, per-expert MoE weights)."""
    prefix = "model.language_model." if config.model_type in ("qwen3_5", "qwen3_5_moe") else "model."
    layout = dict(prefix=prefix, interleaved=(config.model_type == QWEN3_NEXT,) * config.num_layers,
                  fused=(False,) * config.num_layers)
    return _specs_for(config, layout)[0]


def split_interleaved_qkvz(qkvz: np.ndarray, ba: np.ndarray, cfg: QwenHybridConfig) -> dict[str, np.ndarray]:
    """Qwen3-Next's per-key-head-group ``in_proj_qkvz`` ``[Hk*(2dk + 2r*dv), D]`` and
    ``in_proj_ba`` ``[Hk*2r, D]`` -> Qwen3.5's flat ``qkv [2Hk*dk + Hv*dv, D]``, ``z [Hv*dv, D]``,
    ``b``, ``a`` ``[Hv, D]`` (HF ``fix_query_key_value_ordering``). The value-head order this
    gives (key group major, then ``r``) is the order the conv weight and ``A_log`` already use."""
    hk, dk, dv, r = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.gva_ratio
    d = qkvz.shape[-1]
    g = qkvz.reshape(hk, 2 * dk + 2 * r * dv, d)
    q, k = g[:, :dk], g[:, dk : 2 * dk]
    v, z = g[:, 2 * dk : 2 * dk + r * dv], g[:, 2 * dk + r * dv :]
    flat = lambda x: x.reshape(-1, d)  # noqa: E731
    gba = ba.reshape(hk, 2 * r, d)
    return {
        "qkv": np.concatenate([flat(q), flat(k), flat(v)], axis=0),
        "z": flat(z),
        "b": flat(gba[:, :r]),
        "a": flat(gba[:, r:]),
    }


def convert(tensors: Mapping[str, np.ndarray], config: QwenHybridConfig) -> dict:
    """HF tensors -> params pytree (see ``_layer_params`` for the per-layer keys).

    Accepts the Qwen3-Next interleaved or Qwen3.5 flat GDN projections, the ``model.`` or
    ``model.language_model.`` prefix, per-expert or fused expert weights, and ignores vision and
    MTP tensors. Raises ``models.base.ConversionError`` naming every missing/unexpected/mis-shaped tensor.
    """
    layout = _layout(config, tensors)
    specs, optional = _specs_for(config, layout)
    check_shapes(tensors, specs, optional=optional, ignored=IGNORED_PREFIXES, context=config.model_type)
    pre = layout["prefix"]
    t = lambda name: np.asarray(tensors[name])  # noqa: E731
    layer_params = tuple(_layer_params(config, t, f"{pre}layers.{i}.", i, layout) for i in range(config.num_layers))
    head = t("lm_head.weight") if "lm_head.weight" in tensors else t(pre + "embed_tokens.weight")
    return {
        "embed": t(pre + "embed_tokens.weight"),
        "final_norm": t(pre + "norm.weight"),
        "lm_head": head,
        "layers": layer_params,
    }


def _layer_params(cfg: QwenHybridConfig, t, p: str, i: int, layout: dict) -> dict:
    out = {"input_norm": t(p + "input_layernorm.weight"), "post_norm": t(p + "post_attention_layernorm.weight")}
    if cfg.layer_types[i] == LINEAR_ATTENTION:
        la = p + "linear_attn."
        if layout["interleaved"][i]:
            proj = split_interleaved_qkvz(t(la + "in_proj_qkvz.weight"), t(la + "in_proj_ba.weight"), cfg)
        else:
            proj = {n: t(la + f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")}
        out["gdn"] = dict(
            proj,
            conv=t(la + "conv1d.weight")[:, 0, :],
            a_log=t(la + "A_log"),
            dt_bias=t(la + "dt_bias"),
            norm=t(la + "norm.weight"),
            out=t(la + "out_proj.weight"),
        )
    else:
        sa = p + "self_attn."
        attn = {n: t(sa + f"{n}_proj.weight") for n in ("q", "k", "v", "o")}
        attn.update(q_norm=t(sa + "q_norm.weight"), k_norm=t(sa + "k_norm.weight"))
        if cfg.attention_bias:
            attn.update({f"{n}_bias": t(sa + f"{n}_proj.bias") for n in ("q", "k", "v", "o")})
        out["attn"] = attn
    m = p + "mlp."
    if cfg.mlp_types[i] == "dense":
        out["mlp"] = {n: t(m + f"{n}_proj.weight") for n in ("gate", "up", "down")}
    else:
        if layout["fused"][i]:
            gate_up = t(m + "experts.gate_up_proj")
            gate, up = np.split(gate_up, 2, axis=1)
            down = t(m + "experts.down_proj")
        else:
            stack = lambda n: np.stack([t(f"{m}experts.{j}.{n}_proj.weight") for j in range(cfg.num_experts)])  # noqa: E731
            gate, up, down = stack("gate"), stack("up"), stack("down")
        io = lambda w: np.ascontiguousarray(np.swapaxes(w, 1, 2))  # noqa: E731  [E, out, in] -> [E, in, out]
        moe = {"router": t(m + "gate.weight"), "w1": io(gate), "w3": io(up), "w2": io(down)}
        if cfg.shared_expert_intermediate_size:
            moe["shared"] = {n: t(m + f"shared_expert.{n}_proj.weight") for n in ("gate", "up", "down")}
            moe["shared_gate"] = t(m + "shared_expert_gate.weight")
        out["moe"] = moe
    return out


# ============================================================================= layers


def gdn_projections(p: dict, x: Array, cfg: QwenHybridConfig, *, tail: Array, lengths: Optional[Array]):
    """Input side of a GDN layer: projections, short conv + SiLU, gates, l2norm.

    x ``[B, T, D]``. Returns ``(q, k [B, T, Hk, dk], v [B, T, Hv, dv], z [B, T, Hv, dv],
    g, beta [B, T, Hv], new_tail)`` with ``q`` L2-normalised and scaled by ``dk**-0.5``, ``k``
    L2-normalised: the inputs the state method takes. ``p["qkv"]`` ``[C, D]`` and ``p["conv"]``
    ``[C, Kc]`` are flat (rows ``[q | k | v]``) or grouped ``[G, C/G, ...]``
    (``tensor_parallel_layout``); ``tail`` ``[B, Kc-1, C]`` follows the same channel order.
    """
    bsz, t, _ = x.shape
    hk, dk, hv, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    w, conv, groups = p["qkv"], p["conv"], 1
    if w.ndim == 3:  # grouped (tensor_parallel_layout): [G, C/G, D], the merge is free on a split G
        groups = w.shape[0]
        w, conv = w.reshape(-1, w.shape[-1]), conv.reshape(-1, conv.shape[-1])
    mixed, new_tail = L.causal_conv1d(L.linear(x, w, compute=cfg.compute), conv, tail=tail, lengths=lengths)
    mixed = jax.nn.silu(mixed).reshape(bsz, t, groups, cfg.conv_dim // groups)
    q, k, v = jnp.split(mixed, [cfg.key_dim // groups, 2 * cfg.key_dim // groups], axis=-1)
    q, k, v = (y.reshape(bsz, t, -1) for y in (q, k, v))
    q = L.l2norm(q.reshape(bsz, t, hk, dk)) * dk**-0.5
    k = L.l2norm(k.reshape(bsz, t, hk, dk))
    v = v.reshape(bsz, t, hv, dv)
    z = L.linear(x, p["z"], compute=cfg.compute).reshape(bsz, t, hv, dv)
    beta = L.write_strength(L.linear(x, p["b"], compute=cfg.compute))
    g = L.gdn_log_decay(L.linear(x, p["a"], compute=cfg.compute), a_log=p["a_log"], dt_bias=p["dt_bias"])
    return q, k, v, z, g, beta, new_tail


def gdn_output(p: dict, o: Array, z: Array, cfg: QwenHybridConfig) -> Array:
    """Gated RMSNorm per head, then ``out_proj``: ``o``, ``z`` ``[B, T, Hv, dv] -> [B, T, D]``."""
    y = L.gated_rms_norm_silu(o, z, p["norm"], eps=cfg.rms_norm_eps)
    return L.linear(y.reshape(*y.shape[:2], -1), p["out"], compute=cfg.compute)


def gdn_layer(p: dict, x: Array, cache: dict, cfg: QwenHybridConfig, *, method, mode: str,
              lengths: Optional[Array], active: Optional[Array]) -> tuple[Array, dict, dict]:
    """Gated DeltaNet mixer. x ``[B, T, D]``; cache ``{"conv": [B, Kc-1, conv_dim], "state": ...}``.

    Returns ``(out [B, T, D], new_cache, trace)``; trace holds the recurrence inputs with key
    heads expanded to the value heads (``[B, T, Hv, ...]``).
    """
    q, k, v, z, g, beta, tail = gdn_projections(p, x, cfg, tail=cache["conv"], lengths=lengths)
    o, state, tail = run_recurrence(method, cache["state"], tail, cache["conv"], q=q, k=k, v=v, g=g, beta=beta,
                                    mode=mode, lengths=lengths, active=active)
    hv = cfg.linear_num_value_heads
    trace = dict(q=expand_heads(q, hv, axis=2), k=expand_heads(k, hv, axis=2), v=v, g=g, beta=beta)
    return gdn_output(p, o, z, cfg), {"conv": tail, "state": state}, trace


def attention_layer(p: dict, x: Array, cache: dict, cfg: QwenHybridConfig, *, positions: Array, mode: str,
                    active: Optional[Array]) -> tuple[Array, dict]:
    """Gated full attention (HF ``Qwen3NextAttention``): per-head ``q_norm``/``k_norm``
    (zero-centred), partial RoPE, GQA, output times ``sigmoid(gate)``.

    x ``[B, T, D]``; positions ``[B, T]``; cache ``{"k", "v": [B, L, Hkv, hd]}``. Prefill
    writes positions ``0..T-1``; decode writes each row at its own position.
    """
    bsz, t, _ = x.shape
    h, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qg = L.linear(x, p["q"], p.get("q_bias"), compute=cfg.compute).reshape(bsz, t, h, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(bsz, t, h * hd)
    q = L.rms_norm_zero_centred(q, p["q_norm"], eps=cfg.rms_norm_eps)
    k = L.rms_norm_zero_centred(L.linear(x, p["k"], p.get("k_bias"), compute=cfg.compute).reshape(bsz, t, hkv, hd), p["k_norm"],
                                eps=cfg.rms_norm_eps)
    v = L.linear(x, p["v"], p.get("v_bias"), compute=cfg.compute).reshape(bsz, t, hkv, hd)
    inv_freq = L.rope_inv_freq(head_dim=hd, partial_rotary_factor=cfg.partial_rotary_factor, theta=cfg.rope_theta)
    q = L.apply_partial_rope(q, positions, inv_freq)
    k = L.apply_partial_rope(k, positions, inv_freq)
    if mode == "prefill":
        kc = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), (0, 0, 0, 0))
        vc = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), (0, 0, 0, 0))
        # right padding: a valid query only sees earlier tokens of its own row, all valid
        out = L.causal_attention(q, k, v, scale=hd**-0.5, compute=cfg.compute)
    else:
        pos = positions[:, 0]
        kc, vc = L.set_rows(cache["k"], pos, k[:, 0]), L.set_rows(cache["v"], pos, v[:, 0])
        if active is not None:
            keep = active[:, None, None, None]
            kc, vc = jnp.where(keep, kc, cache["k"]), jnp.where(keep, vc, cache["v"])
        mask = (jnp.arange(kc.shape[1])[None, :] <= pos[:, None])[:, None, :]  # [B, 1, L]
        out = L.grouped_attention(q, kc, vc, mask=mask, scale=hd**-0.5, compute=cfg.compute)
    out = out.reshape(bsz, t, h * hd) * jax.nn.sigmoid(gate)
    return L.linear(out, p["o"], p.get("o_bias"), compute=cfg.compute), {"k": kc, "v": vc}


def route_top_k(router_logits: Array, *, top_k: int, normalize: bool) -> tuple[Array, Array]:
    """Softmax router (HF ``Qwen3NextTopKRouter``): fp32 softmax over experts, top-k, optional
    renormalisation. ``[N, E] -> (weights [N, k], indices [N, k])``."""
    probs = jax.nn.softmax(router_logits.astype(F32), axis=-1)
    weights, idx = L.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, idx


def moe_mlp(p: dict, x: Array, cfg: QwenHybridConfig) -> Array:
    """Routed SwiGLU experts (``models.moe``) plus a sigmoid-gated shared expert. ``[B, T, D] -> [B, T, D]``."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1]).astype(F32)  # [N, D]
    weights, idx = route_top_k(L.linear(xf, p["router"], compute=cfg.compute), top_k=cfg.num_experts_per_tok,
                               normalize=cfg.norm_topk_prob)
    out = routed_experts(xf, weights, idx, w1=p["w1"], w3=p["w3"], w2=p["w2"], compute=cfg.compute)
    if "shared" in p:
        shared = L.swiglu_mlp(xf, **p["shared"], compute=cfg.compute)
        out = out + jax.nn.sigmoid(L.linear(xf, p["shared_gate"], compute=cfg.compute)) * shared
    return out.reshape(shape)


def _group_rows(x: Array, sections: tuple[int, ...], groups: int, axis: int) -> Array:
    # rows [s_0 | s_1 | ...] along ``axis`` -> [G, sum(s) / G] there, group g holding the g-th
    # share of every section in order
    parts = jnp.split(x, np.cumsum(sections)[:-1].tolist(), axis=axis)
    parts = [y.reshape(y.shape[:axis] + (groups, y.shape[axis] // groups) + y.shape[axis + 1:]) for y in parts]
    return jnp.concatenate(parts, axis=axis + 1)


def tensor_parallel_layout(params: Mapping[str, Any], config: QwenHybridConfig, model: int) -> dict:
    """``params`` in the layout a model axis of ``model`` devices splits without re-layout: each GDN
    layer's fused ``qkv [C, D]`` (rows ``[q | k | v]``) and short convolution ``conv [C, Kc]``
    grouped as ``[model, C/model, ...]``, group ``g`` holding rows ``[q_g | k_g | v_g]``, the
    ``g``-th share of the key and value heads (``gdn_projections`` reads either layout). Split
    over ``model`` by that leading axis, each device computes exactly its own heads' q, k and v.
    Routed experts in ``model`` groups (``models.moe.group_experts``). Per-layer or scanned params
    (``models.base.scan_params``); the identity for ``model`` 1."""
    if model == 1:
        return dict(params)
    for name, n in (("linear_num_key_heads", config.linear_num_key_heads),
                    ("linear_num_value_heads", config.linear_num_value_heads)):
        if n % model:
            raise ValueError(f"a model axis of {model} does not divide the {n} GDN heads ({name})")
    sections = (config.key_dim, config.key_dim, config.value_dim)

    def regroup(path, x):
        keys = [str(getattr(k, "key", k)) for k in path]
        if len(keys) < 2 or keys[-2] != PARTS.linear_key or keys[-1] not in ("qkv", "conv"):
            return x
        if np.ndim(x) == 3 + (keys[0] in STACKED_SECTIONS):
            raise ValueError(f"{'.'.join(keys)} is already grouped ({np.shape(x)})")
        return _group_rows(x, sections, model, axis=1 if keys[0] in STACKED_SECTIONS else 0)

    return group_experts(jax.tree_util.tree_map_with_path(regroup, dict(params)), model)


# ============================================================================= model


def init_cache(config: QwenHybridConfig, *, batch: int, max_len: int, method) -> dict:
    """Empty cache: ``pos [B]`` int32, and per layer either ``{"conv": [B, Kc-1, conv_dim],
    "state": method.init(B, Hv, dk, dv, key_heads=Hk)}`` (GDN: a LeapQuant stream keeps its key
    records once per key head) or ``{"k", "v": [B, max_len, Hkv, hd]}`` (attention, in
    ``layers.kv_dtype(config.compute)``); the layers stacked as ``models.base.finish_cache`` says."""
    layer_caches = []
    for i, kind in enumerate(config.layer_types):
        if kind == LINEAR_ATTENTION:
            layer_caches.append({
                "conv": jnp.zeros((batch, config.linear_conv_kernel_dim - 1, config.conv_dim), F32),
                "state": method.for_layer(i).init(batch, config.linear_num_value_heads, config.linear_key_head_dim,
                                     config.linear_value_head_dim, key_heads=config.linear_num_key_heads),
            })
        else:
            kv = jnp.zeros((batch, max_len, config.num_key_value_heads, config.head_dim), L.kv_dtype(config.compute))
            layer_caches.append({"k": kv, "v": kv})
    return finish_cache(config, layer_caches, batch=batch)


# The shared residual block's architecture-specific pieces (``models.base.decoder_layer``).
PARTS = LayerParts(norm=L.rms_norm_zero_centred, linear_key="gdn", linear_mixer=gdn_layer, attention_key="attn",
                   attention_mixer=attention_layer, moe_mlp=moe_mlp)


# ``models.base.Architecture`` for Qwen3-Next and Qwen3.5 (dense and MoE).
ARCH = DecoderArchitecture(model_types=("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"), parts=PARTS,
                           config_from_hf=config_from_hf, param_specs=param_specs, convert=convert,
                           init_cache=init_cache, tensor_parallel_layout=tensor_parallel_layout)

__all__ = [
    "ARCH",
    "QwenHybridConfig",
    "attention_layer",
    "config_from_hf",
    "convert",
    "PARTS",
    "gdn_layer",
    "gdn_output",
    "gdn_projections",
    "init_cache",
    "moe_mlp",
    "param_specs",
    "route_top_k",
    "split_interleaved_qkvz",
    "tensor_parallel_layout",
]
