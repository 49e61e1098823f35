"""Reading HF safetensors directories, writing and reading our converted checkpoints.

An HF directory holds ``config.json`` and one ``*.safetensors`` file or several shards with a
``model.safetensors.index.json``; tensors may be fp32, bf16 (read as ``ml_dtypes.bfloat16``
numpy arrays) or fp16. Our checkpoint is a directory with

* ``leapquant_model.json``: ``{"format": FORMAT, "version": 1, "model_type", "hf_config"}``,
  the original HF config kept whole so the architecture re-parses it on load;
* ``model.safetensors``: the converted params pytree, flattened to dotted names
  (``layers.3.gdn.qkv``), in their stored dtypes;
* the tokenizer and generation files copied from the HF directory when present.

A conversion either writes the whole directory or nothing: everything is checked and
written into a temporary sibling directory that is renamed into place at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from models.base import Architecture
from models.registry import architecture_for_config

FORMAT = "leapquant-jax-model"
VERSION = 1
META_FILE = "leapquant_model.json"
PARAMS_FILE = "model.safetensors"
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


# ----------------------------------------------------------------------------- HF directories


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; a file that holds none is a ``ValueError`` naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def safetensors_files(hf_dir: Path) -> list[Path]:
    """The weight files of an HF directory: the shards its index names, else every
    ``*.safetensors`` file."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
            raise ValueError(f"{index} has no weight_map of tensor name -> file name")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (hf_dir / n).exists()]
        if missing:
            raise FileNotFoundError(f"{index} names shard(s) that are not there: {', '.join(missing)}")
        return [hf_dir / n for n in names]
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {hf_dir}")
    return files


def read_safetensors(files) -> dict[str, np.ndarray]:
    """name -> numpy array over all files; a name found twice is an error."""
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="np") as f:
                for name in f.keys():
                    if name in tensors:
                        raise ValueError(f"tensor {name} appears in more than one file (second: {path})")
                    tensors[name] = f.get_tensor(name)
        except SafetensorError as err:
            # A truncated or corrupt file: the library's message does not say which file.
            raise ValueError(f"{path} is not a readable safetensors file ({err})") from None
    return tensors


def parse_config(arch: Architecture, config_json: Mapping[str, Any], source) -> Any:
    """``arch.config_from_hf(config_json)``; a missing or malformed field is a ``ValueError``
    naming ``source`` (the file the config came from)."""
    try:
        return arch.config_from_hf(config_json)
    except KeyError as err:
        raise ValueError(f"{source} lacks the field {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: malformed config ({err})") from None


def _architecture(config_json: Mapping[str, Any], source) -> Architecture:
    try:
        return architecture_for_config(config_json)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None


def is_converted(path) -> bool:
    return (Path(path) / META_FILE).exists()


# ----------------------------------------------------------------------------- params pytrees


def flatten_params(tree, prefix: str = "") -> dict[str, np.ndarray]:
    """Dotted names for a pytree of dicts (string keys) and tuples/lists (indices)."""
    if isinstance(tree, Mapping):
        items = tree.items()
    elif isinstance(tree, (tuple, list)):
        items = ((str(i), x) for i, x in enumerate(tree))
    else:
        return {prefix[:-1]: np.asarray(tree)}
    out = {}
    for key, value in items:
        if "." in str(key):
            raise ValueError(f"param key {key!r} contains a dot")
        out.update(flatten_params(value, f"{prefix}{key}."))
    return out


def unflatten_params(flat: Mapping[str, Any]):
    """Inverse of ``flatten_params``: nodes whose keys are all integers become tuples."""
    root: dict = {}
    for name, value in flat.items():
        node = root
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    def rebuild(node):
        if not isinstance(node, dict):
            return node
        if node and all(k.isdigit() for k in node):
            return tuple(rebuild(node[str(i)]) for i in range(len(node)))
        return {k: rebuild(v) for k, v in node.items()}

    return rebuild(root)


# ----------------------------------------------------------------------------- conversion


def convert_hf(hf_dir) -> tuple[Architecture, Any, dict, dict]:
    """Reads and converts an HF directory in memory: ``(arch, config, params, hf_config_json)``."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").exists():
        raise FileNotFoundError(f"{hf_dir} has no config.json")
    config_json = read_json(hf_dir / "config.json")
    arch = _architecture(config_json, hf_dir / "config.json")
    config = parse_config(arch, config_json, hf_dir / "config.json")
    params = arch.convert(read_safetensors(safetensors_files(hf_dir)), config)
    return arch, config, params, config_json


def _check_output_dir(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not an empty directory; not overwriting it")


@contextlib.contextmanager
def _atomic_dir(out_dir):
    """Yields a temporary sibling of ``out_dir`` to fill; renames it into place on success and
    removes it on any failure, so an existing ``out_dir`` (which must be empty) is never half-written."""
    out_dir = Path(out_dir)
    _check_output_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        yield tmp
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_converted(out_dir, *, config_json: Mapping[str, Any], params, copy_from=None) -> Path:
    """Writes our checkpoint atomically: a temporary sibling directory renamed into place."""
    with _atomic_dir(out_dir) as tmp:
        flat = {k: np.ascontiguousarray(v) for k, v in flatten_params(params).items()}
        save_file(flat, str(tmp / PARAMS_FILE))
        meta = {"format": FORMAT, "version": VERSION, "model_type": config_json["model_type"], "hf_config": dict(config_json)}
        with open(tmp / META_FILE, "w") as f:
            json.dump(meta, f, indent=1)
        if copy_from is not None:
            for name in COPIED_FILES:
                if (Path(copy_from) / name).exists():
                    shutil.copyfile(Path(copy_from) / name, tmp / name)
    return Path(out_dir)


def save_hf(out_dir, *, config_json: Mapping[str, Any], tensors: Mapping[str, np.ndarray],
            files: Mapping[str, Any] = ()) -> Path:
    """Writes a Hugging Face directory atomically (a temporary sibling renamed into place):
    ``config.json``, ``model.safetensors`` with ``tensors`` (HF names, e.g. from
    ``models.export.to_hf_tensors``) in their own dtypes, and ``files`` (file name -> source
    path to copy). Refuses a non-empty ``out_dir``."""
    with _atomic_dir(out_dir) as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        with open(tmp / "config.json", "w") as f:
            json.dump(dict(config_json), f, indent=2)
        for name, src in dict(files).items():
            shutil.copyfile(src, tmp / name)
    return Path(out_dir)


def convert_checkpoint(hf_dir, out_dir) -> Path:
    """``leapquant convert``: HF directory -> our checkpoint. Nothing is written when the
    checkpoint does not match its config (the error names every offending tensor)."""
    _check_output_dir(Path(out_dir))
    _, _, params, config_json = convert_hf(hf_dir)
    return save_converted(out_dir, config_json=config_json, params=params, copy_from=hf_dir)


def load_model(path) -> tuple[Architecture, Any, dict, dict]:
    """Our checkpoint or an HF directory (converted on the fly) -> ``(arch, config, params,
    hf_config_json)``; params are numpy arrays in their stored dtypes."""
    path = Path(path)
    if not is_converted(path):
        return convert_hf(path)
    meta = read_json(path / META_FILE)
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{path / META_FILE} is not a {FORMAT} v{VERSION} checkpoint")
    config_json = meta.get("hf_config")
    if not isinstance(config_json, dict):
        raise ValueError(f"{path / META_FILE} has no hf_config object")
    arch = _architecture(config_json, path / META_FILE)
    config = parse_config(arch, config_json, path / META_FILE)
    params = unflatten_params(read_safetensors([path / PARAMS_FILE]))
    return arch, config, params, config_json


def eos_token_ids(path, config_json: Mapping[str, Any]) -> tuple[int, ...]:
    """End-of-sequence ids from ``generation_config.json`` or the config (possibly none)."""
    gen = Path(path) / "generation_config.json"
    for source in ((read_json(gen) if gen.exists() else {}), config_json, config_json.get("text_config") or {}):
        eos = source.get("eos_token_id")
        if eos is not None:
            return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return ()


__all__ = [
    "FORMAT",
    "convert_checkpoint",
    "convert_hf",
    "eos_token_ids",
    "flatten_params",
    "is_converted",
    "load_model",
    "parse_config",
    "read_safetensors",
    "safetensors_files",
    "save_converted",
    "save_hf",
    "unflatten_params",
]
