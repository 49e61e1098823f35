"""What the model commands read besides the weights, checked before anything runs: a checkpoint
folder (loaded onto the device), its tokenizer, its training-file list, token-id files.

A checkpoint folder is our converted checkpoint (``models.checkpoint.META_FILE``) or a Hugging
Face directory (``config.json`` and safetensors). ``DATA_FILES.txt``, shipped with a checkpoint
that ``leapquant train`` made, lists every file of its training corpus as ``split sha256
relative/path`` (split ``train`` or ``heldout``). Every problem raises a ``ValueError`` or
``OSError`` whose message names the file and the flag it came from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
from tokenizers import Tokenizer

from models.checkpoint import META_FILE, is_converted, load_model
from models.decode import to_device
from models.training.data import file_sha256

DATA_FILES = "DATA_FILES.txt"
SPLITS = ("train", "heldout")


def check_checkpoint(path, *, what: str = "checkpoint") -> Path:
    """Refuses a ``path`` that is not a checkpoint folder: missing, a file, or a folder with
    neither ``config.json`` nor ``META_FILE``. Returns it as a ``Path``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {path}: no such directory")
    if not path.is_dir():
        raise NotADirectoryError(f"{what} {path} is a file; give the checkpoint's folder (a converted checkpoint "
                                 "or an HF directory)")
    if not is_converted(path) and not (path / "config.json").is_file():
        raise FileNotFoundError(f"{what} {path} has no config.json (nor {META_FILE}): not an HF directory or a "
                                "converted checkpoint")
    return path


def load_checkpoint(path) -> tuple[Any, Any, Any, dict]:
    """``models.checkpoint.load_model`` of a checked folder, the params moved onto the default
    device (dtypes kept): ``(arch, config, params, hf_config_json)``."""
    arch, config, params, config_json = load_model(check_checkpoint(path))
    return arch, config, to_device(params), config_json


def load_tokenizer(path) -> Optional[Tokenizer]:
    """The checkpoint folder's ``tokenizer.json``, or ``None`` when it has none."""
    tok = Path(path) / "tokenizer.json"
    if not tok.exists():
        return None
    try:
        return Tokenizer.from_file(str(tok))
    except Exception as err:  # the tokenizers library raises plain Exception for a malformed file
        raise ValueError(f"{tok} is not a readable tokenizer file ({err})") from None


def load_token_ids(path, flag: str = "--ids-file") -> np.ndarray:
    """A ``.npy`` integer array ``[B, T]`` (or ``[T]``, one row) read without pickle, as
    ``[B, T]``; every problem is reported against ``flag``."""
    try:
        with open(path, "rb") as f:
            is_npy = f.read(6) == b"\x93NUMPY"
            f.seek(0)
            if is_npy:
                version = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, dtype = read_header(f)
    except OSError as err:
        raise type(err)(f"{flag} {path}: {err.strerror or err}") from None
    except ValueError as err:
        raise ValueError(f"{flag} {path}: unreadable .npy header ({err})") from None
    if not is_npy:
        raise ValueError(f"{flag} {path} is not a .npy file (save the ids with numpy.save)")
    # Checked on the header, before loading: an object array would need pickle.
    if len(shape) not in (1, 2) or not np.issubdtype(dtype, np.integer):
        raise ValueError(f"{flag} {path} must hold integer ids [B, T] or [T], got {dtype} {shape}")
    try:
        ids = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"{flag} {path}: unreadable .npy file ({err})") from None
    if ids.ndim == 1:
        ids = ids[None]
    if ids.size == 0:
        raise ValueError(f"{flag} {path} holds no tokens (shape {ids.shape})")
    return ids


def read_file_list(path) -> list[tuple[str, str, str]]:
    """``DATA_FILES.txt``: one ``split sha256 relative/path`` line per corpus file.

    Returns ``[(split, sha256, path)]`` in file order. Raises ``ValueError`` naming the line of a
    malformed entry (unknown split, a sha256 that is not 64 hex digits, an absolute path or one
    leaving the directory) and ``OSError`` naming the file when it cannot be read.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise type(err)(f"{path}: {err.strerror or err}") from None
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        parts = line.split(" ", 2)
        if len(parts) != 3:
            raise ValueError(f"{path} line {number}: expected 'split sha256 relative/path', got {line!r}")
        split, digest, rel = parts
        if split not in SPLITS:
            raise ValueError(f"{path} line {number}: split must be one of {SPLITS}, got {split!r}")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"{path} line {number}: sha256 must be 64 lowercase hex digits, got {digest!r}")
        # A listed path only ever names a file inside the standard-library directory.
        if not rel or rel.startswith("/") or ".." in rel.split("/"):
            raise ValueError(f"{path} line {number}: expected a relative path inside the directory, got {rel!r}")
        entries.append((split, digest, rel))
    if not entries:
        raise ValueError(f"{path} lists no files")
    return entries


def training_file(checkpoint, data) -> Optional[str]:
    """The entry of ``checkpoint``'s ``DATA_FILES.txt`` in the ``train`` split whose sha256 is
    that of the file ``data``, or ``None`` (no list, or the file is not training data)."""
    listed = Path(checkpoint) / DATA_FILES
    data = Path(data)
    if not listed.is_file() or not data.is_file():
        return None
    digest = file_sha256(data)
    return next((rel for split, sha, rel in read_file_list(listed) if split == "train" and sha == digest), None)


__all__ = ["DATA_FILES", "SPLITS", "check_checkpoint", "load_checkpoint", "load_token_ids", "load_tokenizer",
           "read_file_list", "training_file"]
