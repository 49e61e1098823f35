"""Per-tile state formats of serving engines: fp8 e4m3 with one dynamic scale per tile of value rows.

``FORMATS`` maps each per-step method name to a zero-argument constructor of its format (an
object with ``name``, ``quantize(x [..., dk, dv]) -> pytree`` and ``dequantize(t) -> fp32``).

``fp8-tile`` follows the fp8 state pool of serving engines for GDN hybrids: the pool stores a
head's state value-major, ``[dv, dk]``, and keeps one fp32 scale per tile of 32 value rows by all
key columns. In this project's layout ``[dk, dv]`` (keys index rows, values index columns) such a
tile is 32 value *columns* by all ``dk`` key rows, so the tiles are cut along ``dv`` (see
``Fp8TileFormat`` for why this axis).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from .quantizers import FP8_E4M3_MAX, check_state

Array = jax.Array

# e4m3: 3 mantissa bits; normal exponents down to -6, below that the subnormal spacing 2**-9.
_E4M3_MANTISSA_BITS = 3
_E4M3_MIN_EXPONENT = -6


@flax.struct.dataclass
class TileFp8Tensor:
    """fp8 e4m3 values ``[..., dk, dv]`` and one fp32 scale per tile of ``tile`` value columns,
    ``scale [..., ceil(dv / tile)]`` (the last tile is partial when ``tile`` does not divide ``dv``)."""

    values: Array
    scale: Array
    tile: int = flax.struct.field(pytree_node=False, default=32)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


def e4m3_stochastic_round(y: Array, u: Array) -> Array:
    """Rounds ``y`` (fp32, ``|y| <= 448``) to a neighbouring fp8 e4m3 value, up with probability
    equal to ``y``'s fractional position between its two neighbours (unbiased: ``E[r] = y``).

    ``u`` is uniform in ``[0, 1)``, same shape as ``y``. Within one binade the e4m3 grid is
    uniform with spacing ``2**(e - 3)`` (``2**-9`` among subnormals), so the rounding is
    ``floor(y / step + u) * step``; a result on the binade's upper edge is the power of two,
    which is representable too. Returns fp32 values that are exact e4m3 values.
    """
    _, e = jnp.frexp(jnp.abs(y))                     # |y| = m 2**e, m in [0.5, 1)
    step = jnp.ldexp(jnp.float32(1.0), jnp.maximum(e - 1, _E4M3_MIN_EXPONENT) - _E4M3_MANTISSA_BITS)
    return jnp.clip(jnp.floor(y / step + u) * step, -FP8_E4M3_MAX, FP8_E4M3_MAX)


@dataclasses.dataclass(frozen=True)
class Fp8TileFormat:
    """fp8 e4m3 with one dynamic fp32 scale per tile of ``tile`` value columns (``fp8-tile``).

    Layout of one head ``[dk, dv]``: ``values`` e4m3 ``[dk, dv]`` (1 byte each) and
    ``scale`` fp32 ``[ceil(dv / tile)]``; tile ``j`` is columns ``tile*j .. tile*(j+1)-1`` by
    all ``dk`` rows, its absmax maps to 448. Bits per state value at ``dk = dv = 128``:
    ``8 + 32 * 4 / (128 * 128) = 8.0078``.

    Why tiles along ``dv``: the engines' pool is ``[dv, dk]`` and its "32-row value tile" is 32
    value indices by all keys. Their decode kernel gives each program a block of value indices
    and the whole key axis (the read ``S^T b`` reduces over keys), so the tile's absmax is
    found inside one program, with no reduction across programs. It is also the per-value-column
    scaling of ``fp8`` coarsened to 32 columns (fp8's error is its 3-bit mantissa's, so sharing
    a scale costs little).
    """

    tile: int = 32

    def __post_init__(self):
        if isinstance(self.tile, bool) or not isinstance(self.tile, int) or self.tile < 1:
            raise ValueError(f"tile must be a positive integer, got {self.tile!r}")

    @property
    def name(self) -> str:
        return "fp8-tile"

    def tile_absmax(self, x: Array) -> Array:
        """Max magnitude per tile of value columns: ``[..., dk, dv] -> [..., ceil(dv / tile)]``."""
        dv = x.shape[-1]
        n = -(-dv // self.tile)
        pad = [(0, 0)] * (x.ndim - 1) + [(0, n * self.tile - dv)]
        t = jnp.pad(jnp.abs(x), pad).reshape(x.shape[:-1] + (n, self.tile))
        return jnp.max(t, axis=(-3, -1))

    def column_scale(self, scale: Array, dv: int) -> Array:
        """Per-tile scales ``[..., ceil(dv / tile)]`` repeated onto the value columns: ``[..., dv]``."""
        return jnp.repeat(scale, self.tile, axis=-1)[..., :dv]

    def quantize(self, x: Array, u: Optional[Array] = None) -> TileFp8Tensor:
        """``x [..., dk, dv]`` float -> ``TileFp8Tensor``.

        u: ``None`` rounds to nearest (even); uniform ``[0, 1)`` noise of ``x``'s shape rounds
        stochastically (``e4m3_stochastic_round``) instead.
        """
        check_state(x)
        x = x.astype(jnp.float32)
        scale = self.tile_absmax(x) / FP8_E4M3_MAX
        # An all-zero tile has scale 0; dividing by 1 there keeps its values at 0 instead of NaN.
        div = self.column_scale(jnp.where(scale > 0, scale, 1.0), x.shape[-1])
        y = jnp.clip(x / div[..., None, :], -FP8_E4M3_MAX, FP8_E4M3_MAX)
        if u is not None:
            if u.shape != x.shape:
                raise ValueError(f"rounding noise must have the state's shape {x.shape}, got {u.shape}")
            y = e4m3_stochastic_round(y, u)
        return TileFp8Tensor(values=y.astype(jnp.float8_e4m3fn), scale=scale, tile=self.tile)

    def dequantize(self, t: TileFp8Tensor) -> Array:
        """``TileFp8Tensor`` -> fp32 ``[..., dk, dv]``."""
        if t.tile != self.tile:
            raise ValueError(f"a tensor of {t.tile}-column tiles given to the {self.tile}-column format")
        return t.values.astype(jnp.float32) * self.column_scale(t.scale, t.values.shape[-1])[..., None, :]


FORMATS: dict = {"fp8-tile": Fp8TileFormat}

__all__ = ["FORMATS", "Fp8TileFormat", "TileFp8Tensor", "e4m3_stochastic_round"]
