"""Kimi-Linear: a hybrid of Kimi Delta Attention (KDA) and Multi-head Latent Attention (MLA).

Follows the released checkpoints (``moonshotai/Kimi-Linear-48B-A3B``, names as vLLM's loader reads
them) and transformers' ``kimi_linear`` port (the same maths, some KDA and MoE weights named its
own way in memory). The converter accepts every naming seen:

* released / on-disk (what ``save_pretrained`` writes): ``self_attn.{q,k,v}_conv1d``,
  ``self_attn.f_a_proj``, ``f_b_proj``, ``dt_bias``, ``A_log [1, 1, H, 1]``;
  ``block_sparse_moe.experts.{e}.{w1,w3,w2}``;
* the transformers port's module tree (a ``state_dict()`` saved as is): one packed
  ``self_attn.conv1d [3P, 1, Kc]`` (q | k | v channels), ``self_attn.forget_gate.*``,
  ``mlp.gate``, fused ``mlp.experts.gate_up_proj [E, 2I, D]`` (gate | up) and ``down_proj``;
* fla's ``KimiDeltaAttention`` layer: ``f_proj.{0,1}``, ``g_proj.{0,1}`` (with a bias), ``A_log [H]``.

A decoder layer is ``x + mixer(norm(x))`` then ``x + mlp(norm(x))`` (plain-``w`` RMSNorms, eps
``rms_norm_eps``); the mixer is KDA or MLA by ``layer_types``, the MLP a SwiGLU for the first
``first_k_dense_replace`` layers, then sigmoid-routed SwiGLU experts with shared experts.

KDA (per layer, ``H`` heads of ``d`` channels, ``P = H d``):
  1. ``q, k, v = silu(conv_q(q_proj x)), ...``: three separate depthwise causal convolutions.
  2. ``g = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias)`` per (head, channel), or the
     bounded gate ``lb * sigmoid(exp(A_log[h]) * (f + dt_bias))`` when the config sets
     ``gate_lower_bound``.
  3. ``beta = sigmoid(b_proj x)``; ``q, k = l2norm(q), l2norm(k)`` (eps 1e-6), ``q *= d**-0.5``.
  4. The recurrence (``S = Diag(exp g) S``, delta update, ``o = S^T q``) through the state method.
  5. ``o = o_norm(o) * sigmoid(g_b(g_a(x)))`` per head (plain ``w``, eps ``rms_norm_eps``), ``o_proj``.

MLA (``mla_use_nope`` = true in the released configs: no RoPE anywhere):
  ``q = q_proj x`` per head ``[nope | rope]``; ``[c | k_rot] = kv_a_proj_with_mqa x``;
  ``c = kv_a_layernorm(c)`` (plain RMSNorm, eps 1e-6 as in the port and the released remote
  code; vLLM uses ``rms_norm_eps``); ``[k_nope | v] = kv_b_proj c`` per head; ``k_rot`` shared by
  all heads; softmax scale ``(qk_nope + qk_rope)**-0.5``. The KV cache holds the latent ``c``
  and ``k_rot`` only; decode attends in the absorbed form (``q_nope`` mapped into latent space).
  With ``mla_use_nope`` false, RoPE (``rope_theta``, DeepSeek's interleaved pairs unless
  ``rope_interleave`` is false) rotates ``q_rope`` and ``k_rot``; the port never applies RoPE,
  so that path is not checked against a reference.

Matmuls run as ``config.compute`` says (``models/layers.py``; ``fast`` keeps a bf16 latent cache),
everything else in fp32. ``models/base.py`` has the contract; the state's format is ``method``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from models import layers as L
from models.base import (FULL_ATTENTION, LINEAR_ATTENTION, DecoderArchitecture, DecoderConfig,
                         LayerParts, check_shapes, finish_cache, run_recurrence)
from models.kimi_layers import kda_log_decay, kda_lower_bound_log_decay, route_sigmoid_grouped
from models.moe import expert_specs, group_experts, routed_experts, swiglu_specs

Array = jax.Array
F32 = jnp.float32

KIMI_LINEAR = "kimi_linear"
DENSE, MOE = "dense", "moe"
# Multi-token-prediction heads that some releases may carry: never read.
IGNORED_PREFIXES = ("mtp.", "model.mtp.")
# HF ``KimiLinearAttention.kv_a_layernorm = KimiLinearRMSNorm(kv_lora_rank)``: the default eps.
KV_A_NORM_EPS = 1e-6


# ============================================================================= config


@dataclasses.dataclass(frozen=True)
class KimiLinearConfig(DecoderConfig):
    """Kimi-Linear text-decoder config (frozen: a static argument under ``jit``): the KDA, MLA and
    MoE fields; the fields every decoder has, and how it runs, are ``DecoderConfig``'s."""

    # KDA
    kda_num_heads: int  # H: each KDA layer's state is [B, H, d, d]
    kda_head_dim: int  # d
    kda_conv_kernel: int  # taps of the short causal convolutions
    gate_lower_bound: Optional[float]
    # MLA
    num_attention_heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_nope: bool
    rope_theta: float
    rope_interleave: bool
    attention_bias: bool
    # MLPs
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    num_expert_group: int
    topk_group: int
    router_activation: str
    tie_word_embeddings: bool
    kv_a_norm_eps: float = KV_A_NORM_EPS

    @property
    def kda_dim(self) -> int:
        """``P = H * d``: the width of the KDA q, k, v projections."""
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _first(d: Mapping[str, Any], *keys: str, default=None):
    """The value of the first key present (the released config and the transformers port
    spell several MoE fields differently: ``num_experts``/``num_local_experts``, ...)."""
    for key in keys:
        if d.get(key) is not None:
            return d[key]
    return default


def _layer_types(text: Mapping[str, Any], lac: Mapping[str, Any], n: int) -> tuple[str, ...]:
    """``layer_types`` (port) or ``linear_attn_config.{kda,full_attn}_layers`` (released,
    **1-indexed**), which must agree when both are given; the port's default otherwise."""
    from_lists = None
    if lac.get("full_attn_layers") is not None and lac.get("kda_layers") is not None:
        types = [None] * n
        for i in lac["full_attn_layers"]:
            types[int(i) - 1] = FULL_ATTENTION
        for i in lac["kda_layers"]:
            types[int(i) - 1] = LINEAR_ATTENTION
        if None in types:
            raise ValueError(f"linear_attn_config names neither KDA nor full attention for layer(s) "
                             f"{[i + 1 for i, t in enumerate(types) if t is None]} (1-indexed)")
        from_lists = tuple(types)
    types = text.get("layer_types")
    if types is not None:
        types = tuple(types)
        if len(types) != n or set(types) - {LINEAR_ATTENTION, FULL_ATTENTION}:
            raise ValueError(f"layer_types must give {LINEAR_ATTENTION!r} or {FULL_ATTENTION!r} for {n} layers, got {types}")
        if from_lists is not None and from_lists != types:
            raise ValueError(f"layer_types {types} disagrees with linear_attn_config's kda_layers/full_attn_layers {from_lists}")
        return types
    if from_lists is not None:
        return from_lists
    return tuple(FULL_ATTENTION if i and i % 4 == 0 else LINEAR_ATTENTION for i in range(n))


def _mlp_types(text: Mapping[str, Any], n: int, num_experts: int) -> tuple[str, ...]:
    """``mlp_layer_types`` (port: ``"dense"``/``"sparse"``) or DeepSeek's rule: MoE from layer
    ``first_k_dense_replace`` on (every ``moe_layer_freq``-th layer)."""
    types = text.get("mlp_layer_types")
    if types is not None:
        types = tuple(types)
        if len(types) != n or set(types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types must give 'dense' or 'sparse' for {n} layers, got {types}")
        if "sparse" in types and not num_experts:
            raise ValueError("mlp_layer_types has sparse layers but the config has no experts")
        return tuple(MOE if t == "sparse" else DENSE for t in types)
    first_dense = int(_first(text, "first_k_dense_replace", default=1))
    freq = int(_first(text, "moe_layer_freq", default=1))
    return tuple(MOE if num_experts and i >= first_dense and i % freq == 0 else DENSE for i in range(n))


def _rope(text: Mapping[str, Any]) -> float:
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(f"MLA with RoPE type {rope_type!r} is not supported (only default RoPE)")
    return float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))


def config_from_hf(config_json: Mapping[str, Any]) -> KimiLinearConfig:
    """Parses a Kimi-Linear ``config.json`` (released or written by transformers)."""
    model_type = config_json.get("model_type")
    if model_type != KIMI_LINEAR:
        raise ValueError(f"not a Kimi-Linear config: model_type {model_type!r}")
    text = dict(config_json.get("text_config") or config_json)
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (Kimi-Linear uses silu)")
    lac = dict(text.get("linear_attn_config") or {})
    if lac.get("use_full_rank_gate"):
        raise NotImplementedError("linear_attn_config.use_full_rank_gate is not supported")
    n = int(text["num_hidden_layers"])
    kda_heads = int(_first(lac, "num_heads", default=_first(text, "linear_num_heads", default=32)))
    if lac.get("num_v_heads") not in (None, kda_heads):
        raise NotImplementedError("KDA with num_v_heads != num_heads (GVA) is not supported")
    lower = _first(lac, "gate_lower_bound", default=text.get("gate_lower_bound"))
    num_experts = int(_first(text, "num_experts", "num_local_experts", "n_routed_experts", default=0) or 0)
    mla_use_nope = bool(text.get("mla_use_nope", True))  # the port never applies RoPE
    heads = int(text["num_attention_heads"])
    cfg = KimiLinearConfig(
        model_type=model_type,
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        layer_types=_layer_types(text, lac, n),
        mlp_types=_mlp_types(text, n, num_experts),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
        kda_num_heads=kda_heads,
        kda_head_dim=int(_first(lac, "head_dim", default=_first(text, "linear_head_dim", default=128))),
        kda_conv_kernel=int(_first(lac, "short_conv_kernel_size", default=_first(text, "linear_conv_kernel_dim", default=4))),
        gate_lower_bound=None if lower is None else float(lower),
        num_attention_heads=heads,
        q_lora_rank=None if text.get("q_lora_rank") is None else int(text["q_lora_rank"]),
        kv_lora_rank=int(text.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(text.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(text.get("qk_rope_head_dim", 64)),
        v_head_dim=int(text.get("v_head_dim", 128)),
        mla_use_nope=mla_use_nope,
        rope_theta=10000.0 if mla_use_nope else _rope(text),
        rope_interleave=bool(text.get("rope_interleave", True)),
        attention_bias=bool(text.get("attention_bias", False)),
        intermediate_size=int(text.get("intermediate_size") or 0),
        moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
        num_experts=num_experts,
        num_experts_per_tok=int(_first(text, "num_experts_per_token", "num_experts_per_tok", default=0) or 0),
        num_shared_experts=int(_first(text, "num_shared_experts", "n_shared_experts", default=0) or 0),
        routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(_first(text, "moe_renormalize", "norm_topk_prob", default=True)),
        num_expert_group=int(_first(text, "num_expert_group", "n_group", default=1) or 1)
        if text.get("use_grouped_topk", True) else 1,
        topk_group=int(_first(text, "topk_group", default=1) or 1) if text.get("use_grouped_topk", True) else 1,
        router_activation=str(text.get("moe_router_activation_func", "sigmoid")),
        tie_word_embeddings=bool(config_json.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
    )
    if MOE in cfg.mlp_types:
        if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
            raise ValueError(f"num_experts_per_token must be in [1, {cfg.num_experts}], got {cfg.num_experts_per_tok}")
        if cfg.num_experts % cfg.num_expert_group or cfg.topk_group > cfg.num_expert_group:
            raise ValueError("num_experts must split into num_expert_group groups, topk_group <= num_expert_group")
        if cfg.router_activation not in ("sigmoid", "softmax"):
            raise ValueError(f"moe_router_activation_func {cfg.router_activation!r} is not supported")
    return cfg


# ============================================================================= converter


def _kda_layout(tensors: Mapping[str, Any], sa: str, cfg: KimiLinearConfig) -> dict:
    """Which accepted naming one KDA layer uses (decided by the names present)."""
    if sa + "forget_gate.f_a_proj.weight" in tensors or sa + "forget_gate.A_log" in tensors:
        fgate = "port"
    elif sa + "f_proj.0.weight" in tensors:
        fgate = "fla"
    else:
        fgate = "released"
    a_log = sa + ("forget_gate.A_log" if fgate == "port" else "A_log")
    h = cfg.kda_num_heads
    a_log_shape = (h,) if a_log in tensors and tuple(np.shape(tensors[a_log])) == (h,) else (1, 1, h, 1)
    return dict(
        conv="packed" if sa + "conv1d.weight" in tensors else "separate",
        fgate=fgate,
        ogate="fla" if sa + "g_proj.0.weight" in tensors else "released",
        a_log_shape=a_log_shape,
    )


def _kda_names(sa: str, lay: dict) -> dict[str, str]:
    """Our KDA param key -> the file's tensor name (for this layer's naming)."""
    fg = {"released": sa, "port": sa + "forget_gate.", "fla": sa}[lay["fgate"]]
    names = {n: f"{sa}{n}_proj.weight" for n in ("q", "k", "v", "b", "o")}
    if lay["fgate"] == "fla":
        names.update(f_a=sa + "f_proj.0.weight", f_b=sa + "f_proj.1.weight")
    else:
        names.update(f_a=fg + "f_a_proj.weight", f_b=fg + "f_b_proj.weight")
    names.update(dt_bias=fg + "dt_bias", a_log=fg + "A_log", o_norm=sa + "o_norm.weight")
    if lay["ogate"] == "fla":
        names.update(g_a=sa + "g_proj.0.weight", g_b=sa + "g_proj.1.weight", g_b_bias=sa + "g_proj.1.bias")
    else:
        names.update(g_a=sa + "g_a_proj.weight", g_b=sa + "g_b_proj.weight", g_b_bias=sa + "g_b_proj.bias")
    if lay["conv"] == "packed":
        names["conv"] = sa + "conv1d.weight"
    else:
        names.update({f"{n}_conv": f"{sa}{n}_conv1d.weight" for n in ("q", "k", "v")})
    return names


def _kda_specs(cfg: KimiLinearConfig, sa: str, lay: dict) -> tuple[dict, dict]:
    d_model, h, d, p, kc = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_dim, cfg.kda_conv_kernel
    n = _kda_names(sa, lay)
    shapes = dict(q=(p, d_model), k=(p, d_model), v=(p, d_model), b=(h, d_model), o=(d_model, p),
                  f_a=(d, d_model), f_b=(p, d), dt_bias=(p,), a_log=lay["a_log_shape"], o_norm=(d,),
                  g_a=(d, d_model), g_b=(p, d), conv=(3 * p, 1, kc), q_conv=(p, 1, kc), k_conv=(p, 1, kc),
                  v_conv=(p, 1, kc))
    specs = {n[key]: shapes[key] for key in n if key != "g_b_bias"}
    # vLLM declares g_b_proj without a bias (so the release has none); fla's layer has one
    return specs, {n["g_b_bias"]: (p,)}


def _mla_specs(cfg: KimiLinearConfig, sa: str) -> dict:
    d_model, h = cfg.hidden_size, cfg.num_attention_heads
    r, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    specs = {
        sa + "kv_a_proj_with_mqa.weight": (r + dr, d_model),
        sa + "kv_a_layernorm.weight": (r,),
        sa + "kv_b_proj.weight": (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), r),
        sa + "o_proj.weight": (d_model, h * cfg.v_head_dim),
    }
    if cfg.q_lora_rank is None:
        specs[sa + "q_proj.weight"] = (h * cfg.qk_head_dim, d_model)
    else:
        specs[sa + "q_a_proj.weight"] = (cfg.q_lora_rank, d_model)
        specs[sa + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        specs[sa + "q_b_proj.weight"] = (h * cfg.qk_head_dim, cfg.q_lora_rank)
    if cfg.attention_bias:  # HF: kv_a_proj_with_mqa, q_a_proj and o_proj take attention_bias
        specs[sa + "kv_a_proj_with_mqa.bias"] = (r + dr,)
        specs[sa + "o_proj.bias"] = (d_model,)
        if cfg.q_lora_rank is not None:
            specs[sa + "q_a_proj.bias"] = (cfg.q_lora_rank,)
    return specs


def _mlp_layout(tensors: Mapping[str, Any], p: str, kind: str) -> dict:
    """Where one layer's MLP lives. Released files: ``mlp.`` (dense) and ``block_sparse_moe.``
    (MoE); the port's module tree uses ``mlp.`` for both, and ``save_pretrained`` (which reverses
    the port's ``block_sparse_moe -> mlp`` renaming everywhere) writes ``block_sparse_moe.`` for
    both. Experts may be per-expert ``w1/w3/w2`` or the port's fused ``gate_up_proj``/``down_proj``."""
    default = "mlp." if kind == DENSE else "block_sparse_moe."
    other = "block_sparse_moe." if kind == DENSE else "mlp."
    prefix = other if any(n.startswith(p + other) for n in tensors) and not any(
        n.startswith(p + default) for n in tensors) else default
    return dict(prefix=p + prefix, fused=p + prefix + "experts.gate_up_proj" in tensors)


def _mlp_specs(cfg: KimiLinearConfig, p: str, kind: str, mlp_lay: dict) -> dict:
    d = cfg.hidden_size
    m = mlp_lay["prefix"]
    if kind == DENSE:
        return swiglu_specs(m, cfg.intermediate_size, d)
    e, i, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.moe_intermediate_size * cfg.num_shared_experts
    specs = {m + "gate.weight": (e, d), m + "gate.e_score_correction_bias": (e,)}
    specs.update(expert_specs(m, e, i, d, fused=mlp_lay["fused"], names=("w1", "w3", "w2")))
    if s:
        specs.update(swiglu_specs(m + "shared_experts.", s, d))
    return specs


def _layout(cfg: KimiLinearConfig, tensors: Mapping[str, Any]) -> tuple[dict, ...]:
    out = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.append(dict(
            kda=_kda_layout(tensors, p + "self_attn.", cfg) if cfg.layer_types[i] == LINEAR_ATTENTION else None,
            mlp=_mlp_layout(tensors, p, cfg.mlp_types[i]),
        ))
    return tuple(out)


def _specs_for(cfg: KimiLinearConfig, layout: tuple[dict, ...]) -> tuple[dict, dict]:
    d = cfg.hidden_size
    specs = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    optional = {}
    if cfg.tie_word_embeddings:
        optional["lm_head.weight"] = (cfg.vocab_size, d)
    else:
        specs["lm_head.weight"] = (cfg.vocab_size, d)
    for i, lay in enumerate(layout):
        p = f"model.layers.{i}."
        specs[p + "input_layernorm.weight"] = (d,)
        specs[p + "post_attention_layernorm.weight"] = (d,)
        if cfg.layer_types[i] == LINEAR_ATTENTION:
            req, opt = _kda_specs(cfg, p + "self_attn.", lay["kda"])
            specs.update(req)
            optional.update(opt)
        else:
            specs.update(_mla_specs(cfg, p + "self_attn."))
        specs.update(_mlp_specs(cfg, p, cfg.mlp_types[i], lay["mlp"]))
    return specs, optional


def param_specs(config: KimiLinearConfig) -> dict[str, tuple[int, ...]]:
    """Canonical (released, on-disk) HF name -> shape of every tensor the converter reads."""
    return _specs_for(config, _layout(config, {}))[0]


def convert(tensors: Mapping[str, np.ndarray], config: KimiLinearConfig) -> dict:
    """HF tensors (any accepted naming, see the module docstring) -> params pytree.

    Raises ``models.base.ConversionError`` naming every missing, unexpected or mis-shaped tensor (by the
    name the file uses). Layouts fixed here: ``A_log -> [H]``, conv weights ``[P, Kc]``, expert
    weights stacked as ``w1``/``w3 [E, D, I]`` and ``w2 [E, I, D]`` (input-major, the layout
    ``lax.ragged_dot`` takes); every other weight keeps torch's ``[out, in]``.
    """
    layout = _layout(config, tensors)
    specs, optional = _specs_for(config, layout)
    check_shapes(tensors, specs, optional=optional, ignored=IGNORED_PREFIXES, context=config.model_type)
    t = lambda name: np.asarray(tensors[name])  # noqa: E731
    layer_params = tuple(_layer_params(config, tensors, t, i, layout[i]) for i in range(config.num_layers))
    embed = t("model.embed_tokens.weight")
    return {
        "embed": embed,
        "final_norm": t("model.norm.weight"),
        "lm_head": t("lm_head.weight") if "lm_head.weight" in tensors else embed,
        "layers": layer_params,
    }


def _layer_params(cfg: KimiLinearConfig, tensors, t, i: int, lay: dict) -> dict:
    p = f"model.layers.{i}."
    sa = p + "self_attn."
    out = {"input_norm": t(p + "input_layernorm.weight"), "post_norm": t(p + "post_attention_layernorm.weight")}
    if cfg.layer_types[i] == LINEAR_ATTENTION:
        names = _kda_names(sa, lay["kda"])
        kda = {key: t(names[key]) for key in ("q", "k", "v", "b", "o", "f_a", "f_b", "dt_bias", "o_norm", "g_a", "g_b")}
        kda["a_log"] = t(names["a_log"]).reshape(cfg.kda_num_heads)
        kda["g_b_bias"] = t(names["g_b_bias"]) if names["g_b_bias"] in tensors else np.zeros(
            (cfg.kda_dim,), kda["g_b"].dtype)
        if lay["kda"]["conv"] == "packed":  # the port's cat(q_conv1d, k_conv1d, v_conv1d) along channels
            kda["q_conv"], kda["k_conv"], kda["v_conv"] = np.split(t(names["conv"])[:, 0, :], 3, axis=0)
        else:
            for n in ("q", "k", "v"):
                kda[f"{n}_conv"] = t(names[f"{n}_conv"])[:, 0, :]
        out["kda"] = kda
    else:
        mla = {"kv_a": t(sa + "kv_a_proj_with_mqa.weight"), "kv_a_norm": t(sa + "kv_a_layernorm.weight"),
               "kv_b": t(sa + "kv_b_proj.weight"), "o": t(sa + "o_proj.weight")}
        if cfg.q_lora_rank is None:
            mla["q"] = t(sa + "q_proj.weight")
        else:
            mla.update(q_a=t(sa + "q_a_proj.weight"), q_a_norm=t(sa + "q_a_layernorm.weight"), q_b=t(sa + "q_b_proj.weight"))
        if cfg.attention_bias:
            mla.update(kv_a_bias=t(sa + "kv_a_proj_with_mqa.bias"), o_bias=t(sa + "o_proj.bias"))
            if cfg.q_lora_rank is not None:
                mla["q_a_bias"] = t(sa + "q_a_proj.bias")
        out["mla"] = mla
    m = lay["mlp"]["prefix"]
    if cfg.mlp_types[i] == DENSE:
        out["mlp"] = {n: t(f"{m}{n}_proj.weight") for n in ("gate", "up", "down")}
    else:
        if lay["mlp"]["fused"]:
            gate, up = np.split(t(m + "experts.gate_up_proj"), 2, axis=1)  # [E, I, D] each
            down = t(m + "experts.down_proj")  # [E, D, I]
        else:
            stack = lambda n: np.stack([t(f"{m}experts.{j}.{n}.weight") for j in range(cfg.num_experts)])  # noqa: E731
            gate, up, down = stack("w1"), stack("w3"), stack("w2")
        io = lambda w: np.ascontiguousarray(np.swapaxes(w, 1, 2))  # noqa: E731  [E, out, in] -> [E, in, out]
        moe = {"router": t(m + "gate.weight"), "e_bias": t(m + "gate.e_score_correction_bias"),
               "w1": io(gate), "w3": io(up), "w2": io(down)}
        if cfg.num_shared_experts:
            moe["shared"] = {n: t(f"{m}shared_experts.{n}_proj.weight") for n in ("gate", "up", "down")}
        out["moe"] = moe
    return out


# ============================================================================= KDA


def kda_inputs(p: dict, x: Array, cache: dict, cfg: KimiLinearConfig, *, lengths: Optional[Array]):
    """Input side of a KDA layer: projections, the three short convolutions + SiLU, gates, l2norm.

    x ``[B, T, D]``. Returns ``(q, k, v [B, T, H, d], g [B, T, H, d], beta [B, T, H], tails)``
    with ``q`` L2-normalised and scaled by ``d**-0.5``, ``k`` L2-normalised (what the state
    method takes) and ``tails`` the new conv tails ``{"q_conv", "k_conv", "v_conv"}``.
    """
    bsz, t, _ = x.shape
    h, d = cfg.kda_num_heads, cfg.kda_head_dim
    feats, tails = {}, {}
    for n in ("q", "k", "v"):
        y, tails[f"{n}_conv"] = L.causal_conv1d(L.linear(x, p[n], compute=cfg.compute), p[f"{n}_conv"], tail=cache[f"{n}_conv"],
                                                lengths=lengths)
        feats[n] = jax.nn.silu(y).reshape(bsz, t, h, d)
    q = L.l2norm(feats["q"]) * d**-0.5
    k = L.l2norm(feats["k"])
    f = L.linear(L.linear(x, p["f_a"], compute=cfg.compute), p["f_b"], compute=cfg.compute).reshape(bsz, t, h, d)
    dt_bias = p["dt_bias"].reshape(h, d)
    if cfg.gate_lower_bound is None:
        g = kda_log_decay(f, a_log=p["a_log"], dt_bias=dt_bias)
    else:
        g = kda_lower_bound_log_decay(f, a_log=p["a_log"], dt_bias=dt_bias, lower_bound=cfg.gate_lower_bound)
    beta = L.write_strength(L.linear(x, p["b"], compute=cfg.compute))
    return q, k, feats["v"], g, beta, tails


def kda_output(p: dict, o: Array, x: Array, cfg: KimiLinearConfig) -> Array:
    """Sigmoid-gated RMSNorm per head with gate ``g_b(g_a(x))``, then ``o_proj``.
    o ``[B, T, H, d]``, x ``[B, T, D]`` -> ``[B, T, D]``."""
    bsz, t = x.shape[:2]
    gate = L.linear(L.linear(x, p["g_a"], compute=cfg.compute), p["g_b"], p["g_b_bias"], compute=cfg.compute).reshape(bsz, t, cfg.kda_num_heads, cfg.kda_head_dim)
    y = L.gated_rms_norm_sigmoid(o, gate, p["o_norm"], eps=cfg.rms_norm_eps)
    return L.linear(y.reshape(bsz, t, cfg.kda_dim), p["o"], compute=cfg.compute)


def kda_layer(p: dict, x: Array, cache: dict, cfg: KimiLinearConfig, *, method, mode: str,
              lengths: Optional[Array], active: Optional[Array]) -> tuple[Array, dict, dict]:
    """Kimi Delta Attention. x ``[B, T, D]``; cache ``{"q_conv", "k_conv", "v_conv": [B, Kc-1, P],
    "state": method state}``. Returns ``(out [B, T, D], new_cache, trace)``."""
    q, k, v, g, beta, tails = kda_inputs(p, x, cache, cfg, lengths=lengths)
    o, state, tails = run_recurrence(method, cache["state"], tails, {n: cache[n] for n in tails}, q=q, k=k, v=v,
                                     g=g, beta=beta, mode=mode, lengths=lengths, active=active)
    trace = dict(q=q, k=k, v=v, g=g, beta=beta)
    return kda_output(p, o, x, cfg), dict(tails, state=state), trace


# ============================================================================= MLA


def _rope_mla(x: Array, positions: Array, cfg: KimiLinearConfig) -> Array:
    """RoPE on the rope part ``[B, T, h, dr]`` (only when ``mla_use_nope`` is false).

    DeepSeek's checkpoints rotate interleaved pairs ``(2i, 2i+1)``: HF first permutes the
    channels to ``[evens | odds]`` and then applies ``rotate_half``; the same permutation on
    ``q`` and ``k`` leaves their dot product unchanged, so it is applied and kept.
    """
    dr = cfg.qk_rope_head_dim
    if cfg.rope_interleave:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    inv_freq = L.rope_inv_freq(head_dim=dr, partial_rotary_factor=1.0, theta=cfg.rope_theta)
    return L.apply_partial_rope(x, positions, inv_freq)


def mla_inputs(p: dict, x: Array, cfg: KimiLinearConfig, positions: Array):
    """``q_nope [B, T, H, dn]``, ``q_rot [B, T, H, dr]``, latent ``c [B, T, r]`` (after
    ``kv_a_layernorm``) and the shared ``k_rot [B, T, dr]``."""
    bsz, t, _ = x.shape
    h, dn, dr, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank is None:
        q = L.linear(x, p["q"], compute=cfg.compute)
    else:
        q = L.linear(L.rms_norm(L.linear(x, p["q_a"], p.get("q_a_bias"), compute=cfg.compute), p["q_a_norm"], eps=cfg.rms_norm_eps), p["q_b"], compute=cfg.compute)
    q = q.reshape(bsz, t, h, dn + dr)
    q_nope, q_rot = q[..., :dn], q[..., dn:]
    ckv = L.linear(x, p["kv_a"], p.get("kv_a_bias"), compute=cfg.compute)
    c = L.rms_norm(ckv[..., :r], p["kv_a_norm"], eps=cfg.kv_a_norm_eps)
    k_rot = ckv[..., r:]
    if not cfg.mla_use_nope:
        q_rot = _rope_mla(q_rot, positions, cfg)
        k_rot = _rope_mla(k_rot[:, :, None, :], positions, cfg)[:, :, 0, :]
    return q_nope, q_rot, c, k_rot


def mla_layer(p: dict, x: Array, cache: dict, cfg: KimiLinearConfig, *, positions: Array, mode: str,
              active: Optional[Array]) -> tuple[Array, dict]:
    """Multi-head latent attention with a latent KV cache ``{"c": [B, L, r], "k_rot": [B, L, dr]}``.

    Prefill expands keys and values from the latents (as the HF port does) and attends causally
    over positions ``0..T-1``; decode writes each row at its own position and attends in the
    absorbed form: ``q_nope W_uk`` against the cached latents, then ``W_uv`` on the result.
    """
    bsz, t, _ = x.shape
    h, dn, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    scale = cfg.qk_head_dim**-0.5
    q_nope, q_rot, c, k_rot = mla_inputs(p, x, cfg, positions)
    w = p["kv_b"].astype(F32).reshape(h, dn + dv, r)
    w_uk, w_uv = w[:, :dn], w[:, dn:]  # [H, dn, r], [H, dv, r]
    if mode == "prefill":
        cc = jax.lax.dynamic_update_slice(cache["c"], c.astype(cache["c"].dtype), (0, 0, 0))
        kr = jax.lax.dynamic_update_slice(cache["k_rot"], k_rot.astype(cache["k_rot"].dtype), (0, 0, 0))
        k_nope = L.einsum("bsr,hnr->bshn", c, w_uk, compute=cfg.compute)
        v = L.einsum("bsr,hvr->bshv", c, w_uv, compute=cfg.compute)
        keys = jnp.arange(t)

        def attend(xs, positions):  # a block of queries at `positions` [blk]
            qn, qr = xs
            scores = (L.einsum("bthn,bshn->bhts", qn, k_nope, compute=cfg.compute)
                      + L.einsum("bthd,bsd->bhts", qr, k_rot, compute=cfg.compute)) * scale
            # right padding: a valid query only sees earlier tokens of its own row, all valid
            scores = jnp.where((positions[:, None] >= keys[None, :])[None, None], scores, -jnp.inf)
            return L.einsum("bhts,bshv->bthv", jax.nn.softmax(scores, axis=-1), v, compute=cfg.compute)

        out = L.query_blocks(attend, (q_nope, q_rot))
    else:
        pos = positions[:, 0]
        cc, kr = L.set_rows(cache["c"], pos, c[:, 0]), L.set_rows(cache["k_rot"], pos, k_rot[:, 0])
        if active is not None:
            cc = jnp.where(active[:, None, None], cc, cache["c"])
            kr = jnp.where(active[:, None, None], kr, cache["k_rot"])
        q_lat = L.einsum("bthn,hnr->bthr", q_nope, w_uk, compute=cfg.compute)
        scores = (L.einsum("bthr,bsr->bhts", q_lat, cc, compute=cfg.compute)
                  + L.einsum("bthd,bsd->bhts", q_rot, kr, compute=cfg.compute)) * scale
        valid = jnp.arange(cc.shape[1])[None, :] <= pos[:, None]  # [B, L]
        scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
        ctx = L.einsum("bhts,bsr->bthr", jax.nn.softmax(scores, axis=-1), cc, compute=cfg.compute)
        out = L.einsum("bthr,hvr->bthv", ctx, w_uv, compute=cfg.compute)
    return L.linear(out.reshape(bsz, t, h * dv), p["o"], p.get("o_bias"), compute=cfg.compute), {"c": cc, "k_rot": kr}


# ============================================================================= MoE


def moe_mlp(p: dict, x: Array, cfg: KimiLinearConfig) -> Array:
    """Sigmoid-routed experts (``noaux_tc``, ``routed_scaling_factor``) plus the shared experts
    (HF ``KimiLinearMoE``). ``[B, T, D] -> [B, T, D]``."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1]).astype(F32)
    weights, idx = route_sigmoid_grouped(
        L.linear(xf, p["router"], compute=cfg.compute), correction_bias=p["e_bias"], top_k=cfg.num_experts_per_tok,
        num_groups=cfg.num_expert_group, top_k_groups=cfg.topk_group, normalize=cfg.norm_topk_prob,
        scaling=cfg.routed_scaling_factor, activation=cfg.router_activation)
    out = routed_experts(xf, weights, idx, w1=p["w1"], w3=p["w3"], w2=p["w2"], compute=cfg.compute)
    if "shared" in p:
        out = out + L.swiglu_mlp(xf, **p["shared"], compute=cfg.compute)
    return out.reshape(shape)


def tensor_parallel_layout(params: Mapping[str, Any], config: KimiLinearConfig, model: int) -> dict:
    """``params`` in the layout a model axis of ``model`` devices splits without re-layout: the
    routed experts in ``model`` groups (``models.moe.group_experts``; KDA's q, k and v projections
    are separate and split by head as they are). The identity for ``model`` 1."""
    return group_experts(dict(params), model)


# ============================================================================= model


def init_cache(config: KimiLinearConfig, *, batch: int, max_len: int, method) -> dict:
    """Empty cache: ``pos [B]`` int32 and per layer either ``{"q_conv", "k_conv", "v_conv":
    [B, Kc-1, P], "state": method.init(B, H, d, d, per_channel_decay=True)}`` (KDA) or
    ``{"c": [B, max_len, kv_lora_rank], "k_rot": [B, max_len, qk_rope_head_dim]}`` (MLA, in
    ``layers.kv_dtype(config.compute)``); the layers stacked as ``models.base.finish_cache`` says."""
    layer_caches = []
    for i, kind in enumerate(config.layer_types):
        if kind == LINEAR_ATTENTION:
            tail = jnp.zeros((batch, config.kda_conv_kernel - 1, config.kda_dim), F32)
            layer_caches.append({
                "q_conv": tail, "k_conv": tail, "v_conv": tail,
                "state": method.for_layer(i).init(batch, config.kda_num_heads, config.kda_head_dim, config.kda_head_dim,
                                     per_channel_decay=True),
            })
        else:
            kv = L.kv_dtype(config.compute)
            layer_caches.append({
                "c": jnp.zeros((batch, max_len, config.kv_lora_rank), kv),
                "k_rot": jnp.zeros((batch, max_len, config.qk_rope_head_dim), kv),
            })
    return finish_cache(config, layer_caches, batch=batch)


# The shared residual block's architecture-specific pieces (``models.base.decoder_layer``).
PARTS = LayerParts(norm=L.rms_norm, linear_key="kda", linear_mixer=kda_layer, attention_key="mla",
                   attention_mixer=mla_layer, moe_mlp=moe_mlp)


# ``models.base.Architecture`` for Kimi-Linear (KDA + MLA, MoE).
ARCH = DecoderArchitecture(model_types=(KIMI_LINEAR,), parts=PARTS,
                           config_from_hf=config_from_hf, param_specs=param_specs, convert=convert,
                           init_cache=init_cache, tensor_parallel_layout=tensor_parallel_layout)

__all__ = [
    "ARCH",
    "KimiLinearConfig",
    "config_from_hf",
    "convert",
    "PARTS",
    "init_cache",
    "kda_inputs",
    "kda_layer",
    "kda_output",
    "mla_inputs",
    "mla_layer",
    "moe_mlp",
    "param_specs",
    "tensor_parallel_layout",
]
