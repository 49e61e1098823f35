"""Trace files: one linear-attention layer's decode inputs, saved as ``.npz`` (docs/design.md §5).

Keys (all float32): ``q``, ``k`` ``[T, Hk, dk]``, ``v`` ``[T, H, dv]``, ``beta`` ``[T, H]``,
``g`` ``[T, H]`` (GDN) or ``[T, H, dk]`` (KDA); optional ``s0`` ``[H, dk, dv]`` initial state.
Models record these from real decoding; studies replay them.
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
from typing import Optional

import numpy as np

REQUIRED_KEYS = ("q", "k", "v", "beta", "g")


class TraceError(ValueError):
    """A trace file that is missing a key or holds tensors of the wrong shape or dtype."""


@dataclasses.dataclass(frozen=True)
class Trace:
    """One layer's inputs for one sequence. Shapes as in the module docstring."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    beta: np.ndarray
    g: np.ndarray
    s0: Optional[np.ndarray] = None

    @property
    def num_tokens(self) -> int:
        return self.v.shape[0]

    @property
    def num_heads(self) -> int:
        return self.v.shape[1]

    @property
    def per_channel_decay(self) -> bool:
        return self.g.ndim == 3

    def batched(self) -> dict:
        """The inputs with a leading batch axis of 1: ``[1, T, H, ...]``, for ``method.decode``."""
        return {name: getattr(self, name)[None] for name in REQUIRED_KEYS}


def validate_trace(arrays: dict, source: str = "trace") -> Trace:
    """Checks keys, dtypes and shapes of trace arrays; raises ``TraceError`` naming the problem."""
    missing = [k for k in REQUIRED_KEYS if k not in arrays]
    if missing:
        raise TraceError(f"{source} is missing key(s) {missing}; a trace needs {list(REQUIRED_KEYS)} (and optionally 's0')")
    out = {}
    for name in REQUIRED_KEYS + (("s0",) if "s0" in arrays else ()):
        x = np.asarray(arrays[name])
        if not np.issubdtype(x.dtype, np.floating):
            raise TraceError(f"{source}: '{name}' must be floating point, got dtype {x.dtype}")
        if not np.all(np.isfinite(x)):
            raise TraceError(f"{source}: '{name}' holds non-finite values")
        out[name] = x.astype(np.float32)
    q, k, v, beta, g = (out[n] for n in REQUIRED_KEYS)
    shapes = ", ".join(f"{n} {out[n].shape}" for n in REQUIRED_KEYS)
    for name, ndims, layout in (("q", (3,), "[T, Hk, dk]"), ("k", (3,), "[T, Hk, dk]"), ("v", (3,), "[T, H, dv]"),
                                ("beta", (2,), "[T, H]"), ("g", (2, 3), "[T, H] or [T, H, dk]")):
        if out[name].ndim not in ndims:
            raise TraceError(f"{source}: '{name}' must be {layout}, got shape {out[name].shape} ({shapes})")
    lengths = {n: out[n].shape[0] for n in REQUIRED_KEYS}
    common = max(set(lengths.values()), key=list(lengths.values()).count)
    odd = [n for n, t_n in lengths.items() if t_n != common]
    if odd:
        blamed = " and ".join(f"'{n}'" for n in odd)
        raise TraceError(f"{source}: {blamed} {'has' if len(odd) == 1 else 'have'} a different number of tokens T "
                         f"than the other tensors ({shapes})")
    t, h, dv = v.shape
    if t == 0:
        raise TraceError(f"{source} holds no tokens ({shapes})")
    if h == 0 or dv == 0:
        raise TraceError(f"{source}: 'v' must have at least one head and dv >= 1, got shape {v.shape}")
    if q.shape != k.shape:
        raise TraceError(f"{source}: 'q' and 'k' must have the same shape [T, Hk, dk], got {q.shape} and {k.shape}")
    hk, dk = q.shape[1:]
    if dk == 0:
        raise TraceError(f"{source}: 'q' and 'k' must have dk >= 1, got shape {q.shape}")
    if hk == 0 or h % hk:
        raise TraceError(f"{source}: 'q'/'k' have {hk} heads, which does not divide the {h} value heads of 'v'")
    if beta.shape != (t, h):
        raise TraceError(f"{source}: 'beta' must be [T, H] = {(t, h)}, got {beta.shape}")
    if g.shape not in ((t, h), (t, h, dk)):
        raise TraceError(f"{source}: 'g' must be [T, H] = {(t, h)} (GDN) or [T, H, dk] = {(t, h, dk)} (KDA), got {g.shape}")
    if "s0" in out and out["s0"].shape != (h, dk, dv):
        raise TraceError(f"{source}: 's0' must be [H, dk, dv] = {(h, dk, dv)}, got {out['s0'].shape}")
    if g.max() > 0:
        raise TraceError(f"{source}: 'g' holds log-decays up to {g.max():.3g}; they must be <= 0 (decays exp(g) in (0, 1])")
    return Trace(**out)


def load_trace(path: str | os.PathLike) -> Trace:
    """Reads and validates a trace ``.npz``."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"trace file not found: {path}")
    if os.path.isdir(path):
        raise TraceError(f"{path} is a folder, not a trace .npz file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic not in (b"PK\x03\x04", b"PK\x05\x06"):   # .npz files are zip archives (the second: empty)
        raise TraceError(f"{path} is not a trace .npz file (write one with numpy.savez or save_trace)")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
        raise TraceError(f"{path}: unreadable .npz file ({err})") from None
    return validate_trace(arrays, source=path)


def save_trace(path: str | os.PathLike, trace: Trace) -> None:
    """Writes a trace ``.npz`` (validated first, so a bad trace is never written)."""
    arrays = {n: getattr(trace, n) for n in REQUIRED_KEYS}
    if trace.s0 is not None:
        arrays["s0"] = trace.s0
    validate_trace(arrays, source=os.fspath(path))
    np.savez(path, **arrays)


__all__ = ["REQUIRED_KEYS", "Trace", "TraceError", "load_trace", "save_trace", "validate_trace"]
