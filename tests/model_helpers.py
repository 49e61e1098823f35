"""Shared helpers for the model tests: tiny random transformers models as golden references.

Tests that use these call ``require_reference()`` first, so they skip cleanly where torch or
transformers is not installed. Nothing here imports torch at module import time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest


def require_reference():
    """``(torch, transformers)``, or skips the calling test."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    return torch, transformers


def perturb_small_params(model, *, seed: int, scale: float = 0.1) -> None:
    """Adds noise to every 1-D parameter (norm weights start at 0 or 1, ``dt_bias`` at 1) so
    that the tests see per-channel norm weights and per-head gates, not the init constants."""
    torch, _ = require_reference()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(scale * torch.randn(p.shape, generator=gen))


def build_tiny(config_cls, model_cls, *, seed: int = 0, **config_kwargs):
    """A float32 random tiny model in eval mode."""
    torch, _ = require_reference()
    torch.manual_seed(seed)
    model = model_cls(config_cls(**config_kwargs)).float().eval()
    perturb_small_params(model, seed=seed + 1)
    return model


def save_tiny(model, path: Path, **kwargs) -> Path:
    """``save_pretrained`` as safetensors; returns the directory."""
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    return Path(path)


def reference_logits(model, ids: np.ndarray) -> np.ndarray:
    """transformers full forward over ``ids [B, T]`` -> logits ``[B, T, V]`` float32."""
    torch, _ = require_reference()
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


def reference_greedy(model, prompt, max_new_tokens: int) -> list[int]:
    """transformers ``generate`` (greedy, no stop token) for one prompt; returns the new ids."""
    torch, _ = require_reference()
    ids = torch.as_tensor([list(prompt)], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def relative_logit_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """``max |ours - ref| / max |ref|``: the error relative to the logit scale."""
    return float(np.max(np.abs(np.asarray(ours, np.float64) - ref)) / np.max(np.abs(ref)))


def rewrite_checkpoint(src: Path, dst: Path, *, edit=None, config_edit=None) -> Path:
    """Copies an HF directory's single safetensors file into ``dst`` after ``edit(tensors)``
    (a dict of numpy arrays, changed in place) and ``config_edit(config_json)``."""
    from safetensors.numpy import save_file

    from models.checkpoint import read_safetensors, safetensors_files

    tensors = read_safetensors(safetensors_files(src))
    if edit is not None:
        edit(tensors)
    config = json.loads((Path(src) / "config.json").read_text())
    if config_edit is not None:
        config_edit(config)
    dst = Path(dst)
    dst.mkdir(parents=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def convert_damaged(hf_dir: Path, tmp_path: Path, edit) -> str:
    """Converts a copy of ``hf_dir`` damaged by ``edit(tensors)``; requires a ``ConversionError``
    and that nothing (not even a temporary directory) was written. Returns the error text."""
    from models.base import ConversionError
    from models.checkpoint import convert_checkpoint

    src = rewrite_checkpoint(hf_dir, tmp_path / "hf", edit=edit)
    out = tmp_path / "out"
    with pytest.raises(ConversionError) as info:
        convert_checkpoint(src, out)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    return str(info.value)
