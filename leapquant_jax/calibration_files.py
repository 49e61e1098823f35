"""Calibration files (DAMP's, the lifetime calibration's): one JSON object naming its ``"format"``
and ``"version"``, written atomically (a temporary file renamed over the path, so that a reader
never sees half a file) and read back with both checked before anything else is read; and what
makes a calibration fit a model (``model_mismatches``).
"""

from __future__ import annotations

import json
import os


def write_json(path: str, content: dict) -> None:
    """Writes ``content`` as the JSON file at ``path`` (indent 1) atomically."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(content, f, indent=1)
    os.replace(tmp, path)


def read_json(path: str, *, what: str, fmt: str, version: int, error: type[Exception], hint: str = "") -> dict:
    """The JSON object of the calibration file at ``path``. Raises ``error("{what} {path}: ...")``
    when there is no such file, it is not readable JSON, its ``"format"`` is not ``fmt`` (``hint``
    ends that message: how to make one) or its ``"version"`` is not ``version``."""
    where = f"{what} {path}"
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise error(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise error(f"{where}: not a readable JSON file ({err})") from None
    if not isinstance(d, dict) or d.get("format") != fmt:
        raise error(f"{where}: not a {what} file (no \"format\": \"{fmt}\"{hint})")
    if d.get("version") != version:
        raise error(f"{where}: version {d.get('version')!r}, this library reads version {version}")
    return d


def model_mismatches(cal, *, fingerprint: str, layers, heads: int, dk: int, dv: int) -> list[str]:
    """What differs between the model a calibration ``cal`` (its ``model`` fingerprint, ``layers``,
    ``heads``, ``dk``, ``dv``) was made for and the model described, in words; ``[]`` when it fits.
    A fingerprint is compared only where both are known (not ``""``)."""
    problems = []
    if cal.model and fingerprint and cal.model != fingerprint:
        problems.append("it was made on another model (its configuration or weights differ)")
    if tuple(layers) != tuple(cal.layers):
        problems.append(f"linear-attention layers {list(cal.layers)} vs the model's {list(layers)}")
    if (cal.heads, cal.dk, cal.dv) != (heads, dk, dv):
        problems.append(f"heads x dk x dv {cal.heads} x {cal.dk} x {cal.dv} vs the model's {heads} x {dk} x {dv}")
    return problems


__all__ = ["model_mismatches", "read_json", "write_json"]
