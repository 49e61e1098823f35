"""HF ``model_type`` -> architecture module, imported on first use."""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from models.base import Architecture

# Qwen3.5 checkpoints are VLMs (``qwen3_5``) whose text half may also be saved on its own
# (``qwen3_5_text``, transformers' ``Qwen3_5ForCausalLM``).
MODULES = {
    "qwen3_next": "models.qwen3_next",
    "qwen3_5": "models.qwen3_next",
    "qwen3_5_text": "models.qwen3_next",
    "qwen3_5_moe": "models.qwen3_next",
    "qwen3_5_moe_text": "models.qwen3_next",
    "kimi_linear": "models.kimi_linear",
}


def model_type_of(config_json: Mapping[str, Any]) -> str:
    model_type = config_json.get("model_type")
    if not model_type:
        raise ValueError("config.json has no model_type")
    return model_type


def get_architecture(model_type: str) -> Architecture:
    """The ``ARCH`` object serving ``model_type``; a clear error for unsupported types."""
    if model_type not in MODULES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(MODULES))}")
    arch = importlib.import_module(MODULES[model_type]).ARCH
    if model_type not in arch.model_types:
        raise RuntimeError(f"{MODULES[model_type]}.ARCH does not declare model_type {model_type!r}")
    return arch


def architecture_for_config(config_json: Mapping[str, Any]) -> Architecture:
    return get_architecture(model_type_of(config_json))


__all__ = ["MODULES", "architecture_for_config", "get_architecture", "model_type_of"]
