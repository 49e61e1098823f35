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

from models import decode
from models.checkpoint import convert_checkpoint, load_model

# The model tests' sizes: prompts of 12 tokens then 32 decoded, greedy continuations of 24.
PROMPT_LEN = 12
DECODE_STEPS = 32
GREEDY_TOKENS = 24
PROMPTS = ([5, 17, 3, 88, 41], [9, 2, 64, 33, 70, 21, 8, 99, 14, 56, 27, 3, 40, 61, 12, 7, 93, 30])


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


class TinyModel:
    """A tiny reference model ``hf``, its HF directory and our converted checkpoint, loaded, with
    ``ids [2, PROMPT_LEN + DECODE_STEPS]`` (random, seeded) and transformers' logits on them."""

    def __init__(self, hf, root: Path, vocab_size: int):
        self.hf = hf
        self.hf_dir = save_tiny(hf, root / "hf")
        self.ckpt = convert_checkpoint(self.hf_dir, root / "ckpt")
        self.arch, self.config, params, _ = load_model(self.ckpt)
        self.params = decode.to_device(params)
        rng = np.random.RandomState(1)
        self.ids = rng.randint(0, vocab_size, (2, PROMPT_LEN + DECODE_STEPS)).astype(np.int32)
        self.ref_logits = reference_logits(hf, self.ids)

    def score(self, method_name: str, record: bool = False, **options):
        """``decode.score`` of ``ids`` (``PROMPT_LEN`` prefilled) with a state method by name."""
        method = decode.make_state_method(method_name, **options)
        return decode.score(self.arch, self.params, self.config, self.ids, method=method, prefill_len=PROMPT_LEN,
                            record=record)


def check_greedy_matches_reference(tiny: TinyModel) -> None:
    """Our greedy decoding of the uneven ``PROMPTS`` in one batch (fp32 state) gives transformers'
    ``generate`` continuation of each prompt alone, ``GREEDY_TOKENS`` long."""
    gen = decode.generate(tiny.arch, tiny.params, tiny.config, PROMPTS, method=decode.make_state_method("fp32"),
                          max_new_tokens=GREEDY_TOKENS)
    for prompt, tokens in zip(PROMPTS, gen.tokens):
        assert tokens == reference_greedy(tiny.hf, prompt, GREEDY_TOKENS)


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


def check_converter_names_damage(hf_dir: Path, tmp_path: Path, *, missing: str, unexpected: str, reshape: dict,
                                 shown: str) -> None:
    """Converting a copy of ``hf_dir`` without tensor ``missing``, then one with an extra tensor
    ``unexpected``, fails naming each; converting one whose tensors ``reshape`` maps by name to a
    new array (``reshape[name](old)``) fails naming every one of them, the message showing
    ``shown``. Nothing is written (``convert_damaged``)."""
    for kind, name, edit in (("missing", missing, lambda t: t.pop(missing)),
                             ("unexpected", unexpected, lambda t: t.__setitem__(unexpected, np.zeros((3,), np.float32))),
                             ("mis-shaped", None, lambda t: t.update({n: f(t[n]) for n, f in reshape.items()}))):
        folder = tmp_path / kind
        folder.mkdir()
        msg = convert_damaged(hf_dir, folder, edit)
        if name is None:
            assert all(n in msg for n in reshape) and shown in msg, msg
        else:
            assert kind in msg and name in msg, msg


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
