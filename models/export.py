"""The inverse of the converters: our params pytree -> Hugging Face tensor names and layouts.

``to_hf_tensors(config, params)`` undoes what ``ARCH.convert`` did, writing the canonical
on-disk naming of the config's model type, the naming ``ARCH.param_specs(config)`` lists:

* Qwen3.5 (``qwen3_5_text``, ``qwen3_5``, MoE variants): flat ``in_proj_qkv``/``z``/``b``/``a``;
  Qwen3-Next (``qwen3_next``): the per-key-head-group interleaved ``in_proj_qkvz``/``in_proj_ba``;
  routed experts per expert (``experts.{e}.gate_proj``, ...);
* Kimi-Linear: the released naming (``q_conv1d``, ``f_a_proj``, ``A_log [1, 1, H, 1]``,
  ``block_sparse_moe.experts.{e}.w1``), which transformers' port renames on load.

The converter's spec table stays the one list of names: every export is checked against
``param_specs`` (same names, same shapes), so a converter change the inverse misses fails
loudly instead of writing a file nobody can read. ``convert(to_hf_tensors(c, p), c)`` gives
back ``p`` exactly (tests check the round trip both ways).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from models.base import LINEAR_ATTENTION, ConversionError, check_shapes
from models.kimi_linear import DENSE, KimiLinearConfig
from models.qwen3_next import QWEN3_NEXT, QwenHybridConfig
from models.registry import get_architecture


def _np(x) -> np.ndarray:
    return np.asarray(x)


def _linear_weights(prefix: str, tree: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, np.ndarray]:
    """``{prefix + hf_name: tree[key]}`` for ``names = {key: hf_name}``."""
    return {prefix + hf: _np(tree[key]) for key, hf in names.items()}


def _join_interleaved_qkvz(gdn: Mapping[str, Any], config) -> tuple[np.ndarray, np.ndarray]:
    """Flat ``qkv``, ``z``, ``b``, ``a`` -> Qwen3-Next's ``in_proj_qkvz``, ``in_proj_ba`` (the
    inverse of ``qwen3_next.split_interleaved_qkvz``)."""
    hk, dk, dv, r = (config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim,
                     config.gva_ratio)
    qkv, z = _np(gdn["qkv"]), _np(gdn["z"])
    d = qkv.shape[-1]
    q = qkv[: hk * dk].reshape(hk, dk, d)
    k = qkv[hk * dk: 2 * hk * dk].reshape(hk, dk, d)
    v = qkv[2 * hk * dk:].reshape(hk, r * dv, d)
    qkvz = np.concatenate([q, k, v, z.reshape(hk, r * dv, d)], axis=1).reshape(-1, d)
    ba = np.concatenate([_np(gdn["b"]).reshape(hk, r, d), _np(gdn["a"]).reshape(hk, r, d)], axis=1).reshape(-1, d)
    return qkvz, ba


def _qwen_to_hf(config, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    pre = "model.language_model." if config.model_type in ("qwen3_5", "qwen3_5_moe") else "model."
    out = {pre + "embed_tokens.weight": _np(params["embed"]), pre + "norm.weight": _np(params["final_norm"])}
    _head(out, config, params, pre + "embed_tokens.weight")
    for i, lp in enumerate(params["layers"]):
        p = f"{pre}layers.{i}."
        out[p + "input_layernorm.weight"] = _np(lp["input_norm"])
        out[p + "post_attention_layernorm.weight"] = _np(lp["post_norm"])
        if config.layer_types[i] == LINEAR_ATTENTION:
            g, la = lp["gdn"], p + "linear_attn."
            if config.model_type == QWEN3_NEXT:
                out[la + "in_proj_qkvz.weight"], out[la + "in_proj_ba.weight"] = _join_interleaved_qkvz(g, config)
            else:
                out.update(_linear_weights(la, g, {n: f"in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")}))
            out[la + "conv1d.weight"] = _np(g["conv"])[:, None, :]
            out.update(_linear_weights(la, g, {"a_log": "A_log", "dt_bias": "dt_bias", "norm": "norm.weight",
                                               "out": "out_proj.weight"}))
        else:
            a, sa = lp["attn"], p + "self_attn."
            out.update(_linear_weights(sa, a, {n: f"{n}_proj.weight" for n in ("q", "k", "v", "o")}))
            out.update(_linear_weights(sa, a, {"q_norm": "q_norm.weight", "k_norm": "k_norm.weight"}))
            if config.attention_bias:
                out.update(_linear_weights(sa, a, {f"{n}_bias": f"{n}_proj.bias" for n in ("q", "k", "v", "o")}))
        m = p + "mlp."
        if config.mlp_types[i] == "dense":
            out.update(_linear_weights(m, lp["mlp"], {n: f"{n}_proj.weight" for n in ("gate", "up", "down")}))
        else:
            moe = lp["moe"]
            out[m + "gate.weight"] = _np(moe["router"])
            for n, ours in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                stacked = np.swapaxes(_np(moe[ours]), 1, 2)  # our [E, in, out] -> torch [E, out, in]
                for j in range(config.num_experts):
                    out[f"{m}experts.{j}.{n}_proj.weight"] = stacked[j]
            if "shared" in moe:
                out.update(_linear_weights(m, moe["shared"], {n: f"shared_expert.{n}_proj.weight"
                                                              for n in ("gate", "up", "down")}))
                out[m + "shared_expert_gate.weight"] = _np(moe["shared_gate"])
    return out


def _kimi_to_hf(config, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    out = {"model.embed_tokens.weight": _np(params["embed"]), "model.norm.weight": _np(params["final_norm"])}
    _head(out, config, params, "model.embed_tokens.weight")
    h = config.kda_num_heads
    for i, lp in enumerate(params["layers"]):
        p = f"model.layers.{i}."
        sa = p + "self_attn."
        out[p + "input_layernorm.weight"] = _np(lp["input_norm"])
        out[p + "post_attention_layernorm.weight"] = _np(lp["post_norm"])
        if config.layer_types[i] == LINEAR_ATTENTION:
            kda = lp["kda"]
            out.update(_linear_weights(sa, kda, {n: f"{n}_proj.weight" for n in ("q", "k", "v", "b", "o")}))
            out.update(_linear_weights(sa, kda, {"f_a": "f_a_proj.weight", "f_b": "f_b_proj.weight",
                                                 "g_a": "g_a_proj.weight", "g_b": "g_b_proj.weight",
                                                 "dt_bias": "dt_bias", "o_norm": "o_norm.weight"}))
            out[sa + "A_log"] = _np(kda["a_log"]).reshape(1, 1, h, 1)
            for n in ("q", "k", "v"):
                out[f"{sa}{n}_conv1d.weight"] = _np(kda[f"{n}_conv"])[:, None, :]
            # the released layer has no g_b_proj bias (the converter reads a missing one as zeros);
            # a non-zero one is kept under fla's optional name so nothing trained is dropped
            if np.any(_np(kda["g_b_bias"]) != 0):
                out[sa + "g_b_proj.bias"] = _np(kda["g_b_bias"])
        else:
            mla = lp["mla"]
            names = {"kv_a": "kv_a_proj_with_mqa.weight", "kv_a_norm": "kv_a_layernorm.weight",
                     "kv_b": "kv_b_proj.weight", "o": "o_proj.weight"}
            if config.q_lora_rank is None:
                names["q"] = "q_proj.weight"
            else:
                names.update(q_a="q_a_proj.weight", q_a_norm="q_a_layernorm.weight", q_b="q_b_proj.weight")
            if config.attention_bias:
                names.update(kv_a_bias="kv_a_proj_with_mqa.bias", o_bias="o_proj.bias")
                if config.q_lora_rank is not None:
                    names["q_a_bias"] = "q_a_proj.bias"
            out.update(_linear_weights(sa, mla, names))
        if config.mlp_types[i] == DENSE:
            out.update(_linear_weights(p + "mlp.", lp["mlp"], {n: f"{n}_proj.weight" for n in ("gate", "up", "down")}))
        else:
            moe, m = lp["moe"], p + "block_sparse_moe."
            out[m + "gate.weight"] = _np(moe["router"])
            out[m + "gate.e_score_correction_bias"] = _np(moe["e_bias"])
            for n in ("w1", "w3", "w2"):
                stacked = np.swapaxes(_np(moe[n]), 1, 2)  # our [E, in, out] -> torch [E, out, in]
                for j in range(config.num_experts):
                    out[f"{m}experts.{j}.{n}.weight"] = np.ascontiguousarray(stacked[j])
            if "shared" in moe:
                out.update(_linear_weights(m, moe["shared"], {n: f"shared_experts.{n}_proj.weight"
                                                              for n in ("gate", "up", "down")}))
    return out


def _head(out: dict, config, params: Mapping[str, Any], embed_name: str) -> None:
    head = _np(params["lm_head"])
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = head
    elif not np.array_equal(head, _np(params["embed"])):
        raise ValueError("config ties the word embeddings but params['lm_head'] differs from params['embed']")


def to_hf_tensors(config, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Our params pytree (the converter's output, numpy or jax leaves) -> ``{HF name: array}``.

    The names and shapes are those of ``ARCH.param_specs(config)`` (plus a Kimi ``g_b_proj.bias``
    when it is non-zero); leaves keep their dtype. Raises ``ConversionError`` when the params do
    not fit the config, naming every offending tensor.
    """
    if len(params["layers"]) != config.num_layers:
        raise ValueError(f"params have {len(params['layers'])} layers, the config {config.num_layers}")
    if isinstance(config, QwenHybridConfig):
        tensors = _qwen_to_hf(config, params)
    elif isinstance(config, KimiLinearConfig):
        tensors = _kimi_to_hf(config, params)
    else:
        raise TypeError(f"no export for config type {type(config).__name__}")
    specs = get_architecture(config.model_type).param_specs(config)
    optional = {n: x.shape for n, x in tensors.items() if n.endswith("g_b_proj.bias")}
    try:
        check_shapes(tensors, specs, optional=optional, context=f"export {config.model_type}")
    except ConversionError as err:  # a params tree that does not fit its config
        raise ConversionError(missing=err.missing, unexpected=err.unexpected, mis_shaped=err.mis_shaped,
                              context=f"export {config.model_type}: params do not fit the config") from None
    return tensors


__all__ = ["to_hf_tensors"]
