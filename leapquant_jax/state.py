"""LeapQuant state types and configuration (docs/design.md §4).

The state is a pytree of separate arrays, batch and head axes leading:

* ``Checkpoint``, the window-boundary state: the quantized residual (codes and one scale per
  value column), the smoothing scales ``c [B, H, dk]`` (``None`` when smoothing is off) and
  the Compensator Tokens ``comp_k [B, H, r, dk]``, ``comp_u [B, H, r, dv]`` in fp16.
* ``WindowBuffer``, the live window: ``p`` records ``k [B, Hk, p, dk]``, ``u [B, H, p, dv]``
  and log-decays ``g [B, H, p]`` (GDN) or ``[B, H, p, dk]`` (KDA), all in the record dtype.
  Keys are stored once per key head: with GVA (``H = n Hk`` value heads) value head ``j``
  reads the records of key head ``j // n``. A record holds the raw key (its decay is in
  ``g``), so sharing it loses nothing; ``Hk = H`` is the layout without GVA.
* ``pos [B]`` int32, records held per sequence (sequences may sit at different positions).

A checkpoint is what prefix caching keeps; a live stream is all three.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .impls import check_request
from .quantizers import INT_WIDTHS, Format, IntFormat, QTensor, get_format

Array = jax.Array

RECORD_DTYPES = ("float16", "bfloat16", "float32")
FITS = ("subspace", "svd")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class LeapQuantConfig:
    """Static configuration of the windowed recurrence (hashable: a static jit argument).

    bits: 8, 6, 4 or 2 (integer residual codes; 6, 4 and 2 are packed; 2 bits are the levels +-1, +-3).
    window: records per window ``p`` before a flush.
    rank: Compensator Tokens ``r``; ``None`` means 4 at 8 bits and 6 below.
    compensators, smoothing: switch the two error reducers (both off gives ``int8-w``).
    record_dtype: dtype of buffered records (``float16``, ``bfloat16`` or ``float32``).
    fit: ``"subspace"`` (iteration + CholeskyQR2) or ``"svd"`` (exact reference fit).
    fit_iters: subspace iterations per flush.
    warm_start: start the subspace iteration from the previous window's ``K`` instead of
      the fixed seeded Gaussian.
    seed: seed of the Gaussian start.
    residual_format: overrides the residual's storage (``bf16``, ``fp16``, ``fp8``, ``fp32``
      = identity); ``None`` means ``int{bits}``.
    impl: which implementation runs the step and the flush (``impls``): ``"auto"`` (the kernels
      on a GPU where they take the state, the reference elsewhere), ``"reference"``, ``"pallas"``
      (the kernels or an error naming why), ``"triton"`` or ``"mosaic"``.
    """

    bits: int = 8
    window: int = 16
    rank: Optional[int] = None
    compensators: bool = True
    smoothing: bool = True
    record_dtype: str = "float16"
    fit: str = "subspace"
    fit_iters: int = 1
    warm_start: bool = False
    seed: int = 0
    residual_format: Optional[str] = None
    impl: str = "auto"

    def __post_init__(self):
        if not _is_int(self.bits) or (self.residual_format is None and self.bits not in INT_WIDTHS):
            raise ValueError(f"bits must be 8, 6, 4 or 2, got {self.bits!r}")
        if self.residual_format is not None:
            get_format(self.residual_format)
        if not _is_int(self.window) or self.window < 1:
            raise ValueError(f"window must be a positive integer, got {self.window!r}")
        if self.rank is not None and (not _is_int(self.rank) or self.rank < 0):
            raise ValueError(f"rank must be a non-negative integer, got {self.rank!r}")
        for name in ("compensators", "smoothing", "warm_start"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.record_dtype not in RECORD_DTYPES:
            raise ValueError(f"record_dtype must be one of {RECORD_DTYPES}, got {self.record_dtype!r}")
        if self.fit not in FITS:
            raise ValueError(f"fit must be one of {FITS}, got {self.fit!r}")
        if not _is_int(self.fit_iters) or self.fit_iters < 1:
            raise ValueError(f"fit_iters must be an integer >= 1, got {self.fit_iters!r}")
        check_request(self.impl, ("step", "flush"))

    @property
    def effective_rank(self) -> int:
        """Compensator Tokens actually kept (0 when they are switched off)."""
        if not self.compensators:
            return 0
        if self.rank is not None:
            return self.rank
        return 4 if self.bits == 8 else 6

    def check_head_size(self, dk: int, dv: int) -> None:
        """Raises ``ValueError`` when heads of ``dk x dv`` cannot hold ``effective_rank``
        Compensator Tokens: a rank-``r`` part of a ``[dk, dv]`` state needs ``r <= min(dk, dv)``."""
        r = self.effective_rank
        if r > min(dk, dv):
            hint = "" if self.rank is not None else f" (the default at {self.bits} bits; pass a smaller rank)"
            raise ValueError(f"rank {r}{hint} exceeds min(dk, dv) = {min(dk, dv)} of the [dk, dv] = [{dk}, {dv}] "
                             "state: Compensator Tokens are a rank-r part of it")

    @property
    def format_name(self) -> str:
        return self.residual_format or f"int{self.bits}"

    @property
    def format(self) -> Format:
        return IntFormat(self.bits) if self.residual_format is None else get_format(self.residual_format)


@flax.struct.dataclass
class Checkpoint:
    """A window-boundary state. residual ``[B, H, ...]``; smooth ``[B, H, dk]`` or ``None``;
    comp_k ``[B, H, r, dk]`` fp16; comp_u ``[B, H, r, dv]`` fp16."""

    residual: QTensor
    smooth: Optional[Array]
    comp_k: Array
    comp_u: Array


@flax.struct.dataclass
class WindowBuffer:
    """The records of the live window: k ``[B, Hk, p, dk]`` (one per key head, ``Hk`` dividing
    ``H``), u ``[B, H, p, dv]``, g ``[B, H, p]`` or ``[B, H, p, dk]`` (log-decays), in the
    record dtype."""

    k: Array
    u: Array
    g: Array


@flax.struct.dataclass
class LeapQuantState:
    """A live LeapQuant stream: checkpoint, window buffer and ``pos [B]`` (records held)."""

    checkpoint: Checkpoint
    buffer: WindowBuffer
    pos: Array

    @property
    def per_channel_decay(self) -> bool:
        return self.buffer.g.ndim == 4

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, H, dk, dv)`` of the state it represents (``H`` value heads)."""
        b, h, _, dv = self.buffer.u.shape
        return b, h, self.buffer.k.shape[-1], dv

    @property
    def key_heads(self) -> int:
        """``Hk``, the key heads whose records the buffer stores (``H`` without GVA)."""
        return self.buffer.k.shape[1]


def resolve_key_heads(heads: int, key_heads: Optional[int]) -> int:
    """``key_heads`` checked against ``heads`` value heads (``None`` means ``heads``).

    Raises ``ValueError`` unless it is a positive integer dividing ``heads`` (GVA: value head
    ``j`` reads key head ``j // (heads // key_heads)``).
    """
    if key_heads is None:
        return heads
    if isinstance(key_heads, bool) or not isinstance(key_heads, (int, np.integer)) or key_heads < 1:
        raise ValueError(f"key_heads must be a positive integer, got {key_heads!r}")
    if heads % key_heads:
        raise ValueError(f"key_heads={key_heads} does not divide the {heads} value heads "
                         "(GVA needs H % Hk == 0: value head j reads key head j // (H // Hk))")
    return int(key_heads)


def empty_buffer(config: LeapQuantConfig, batch: int, heads: int, dk: int, dv: int, per_channel_decay: bool,
                 key_heads: Optional[int] = None) -> WindowBuffer:
    """A zeroed window buffer for ``[batch, heads]`` streams: k ``[batch, key_heads, p, dk]``
    (``key_heads`` dividing ``heads``; ``None`` means ``heads``), u and g per value head."""
    hk = resolve_key_heads(heads, key_heads)
    dt = jnp.dtype(config.record_dtype)
    p = config.window
    gshape = (batch, heads, p, dk) if per_channel_decay else (batch, heads, p)
    return WindowBuffer(
        k=jnp.zeros((batch, hk, p, dk), dt),
        u=jnp.zeros((batch, heads, p, dv), dt),
        g=jnp.zeros(gshape, dt),
    )


__all__ = [
    "Checkpoint",
    "LeapQuantConfig",
    "LeapQuantState",
    "WindowBuffer",
    "empty_buffer",
    "resolve_key_heads",
]
