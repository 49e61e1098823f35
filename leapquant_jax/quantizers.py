"""Pure quantize/dequantize pairs for recurrent states ``[..., dk, dv]``.

Every format quantizes the last two axes of a state (keys index rows, values index
columns) and returns a pytree of separate arrays, so that the bytes a format saves are
saved in memory too. Scaled formats keep one fp32 scale per value column.

Integer codes at 6, 4 and 2 bits are packed along the key axis in a *planar* layout, so a
kernel unpacks them with contiguous slices of the read vector instead of strided ones:

* 4 bits, ``[dk/2, dv]`` uint8: byte row ``i`` holds code rows ``i`` (low nibble) and
  ``i + dk/2`` (high nibble).
* 6 bits, ``[3 dk/4, dv]`` uint8: with ``m = dk/4`` and code rows split into quarters
  ``a, b, c, d``, byte row ``i`` of plane ``p`` (``p`` in 0..2, rows ``p*m + i``) holds
  quarter ``p``'s 6-bit code in its low bits and bits ``2p, 2p+1`` of quarter ``d``'s
  code in its top two bits: 4 codes in 3 bytes.
* 2 bits, ``[dk/4, dv]`` uint8: byte row ``i`` holds code rows ``i + p dk/4`` in bits ``2p, 2p+1``
  (``p`` in 0..3).

Codes are stored with an offset, so they are unsigned: ``u = z + qmax + 1``. At 2 bits the
values are the odd integers ``z = 2u - 3`` in ``{-3, -1, 1, 3}`` (``qmax = 3``): four levels
and no zero, where a symmetric grid would keep three.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

FP8_E4M3_MAX = 448.0
INT_WIDTHS = (8, 6, 4, 2)   # widths of the integer codes
PER_STEP_WIDTHS = (8, 6, 4)  # widths of the per-step integer formats (2 bits is a checkpoint width only)


def qmax_for_bits(bits: int) -> int:
    """Largest code magnitude for ``bits``: 127, 31, 7, 3 for 8, 6, 4, 2."""
    if bits not in INT_WIDTHS:
        raise ValueError(f"integer state formats take 8, 6, 4 or 2 bits, got {bits}")
    return 3 if bits == 2 else 2 ** (bits - 1) - 1


def check_per_step_bits(bits: int) -> None:
    """Raises ``ValueError`` unless ``bits`` is a width of the per-step integer formats."""
    if bits not in PER_STEP_WIDTHS:
        raise ValueError(f"per-step integer formats take 8, 6 or 4 bits, got {bits}")


def signed_codes(unsigned, bits: int):
    """Stored codes ``u`` -> signed values ``z`` in ``[-qmax, qmax]`` (module docstring); any
    integer array type (JAX, NumPy, or a kernel's registers)."""
    return 2 * unsigned - 3 if bits == 2 else unsigned - (qmax_for_bits(bits) + 1)


def unsigned_codes(z, bits: int):
    """Signed values ``z`` -> stored codes ``u`` (inverse of ``signed_codes``)."""
    return (z + 3) // 2 if bits == 2 else z + (qmax_for_bits(bits) + 1)


def round_codes(t, bits: int, xp=jnp):
    """``t = x / scale`` (in ``[-qmax, qmax]`` before clipping) -> the nearest value of the grid:
    the nearest integer (ties to even), at 2 bits the nearest odd integer (ties up). ``xp``: the
    array module (``numpy`` rounds host arrays in their own precision)."""
    qmax = qmax_for_bits(bits)
    z = 2 * xp.floor(t / 2) + 1 if bits == 2 else xp.round(t)
    return xp.clip(z, -qmax, qmax)


def check_state(x: Array, name: str = "state") -> None:
    """Raises unless ``x`` is a floating-point ``[..., dk, dv]`` state (every format's ``quantize`` checks it)."""
    if x.ndim < 2:
        raise ValueError(f"{name} must be [..., dk, dv], got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be floating point, got dtype {x.dtype}")


def column_absmax(x: Array) -> Array:
    """Per-value-column max magnitude: ``[..., dk, dv] -> [..., dv]``."""
    return jnp.max(jnp.abs(x), axis=-2)


def safe_divisor(scale: Array) -> Array:
    """``scale`` with zeros replaced by 1: an all-zero column has scale 0, and dividing by 1 there
    keeps its codes at 0 instead of NaN."""
    return jnp.where(scale > 0, scale, 1.0)


# ----------------------------------------------------------------------------- packing


CODE_PARTS = {8: 1, 4: 2, 6: 4, 2: 4}   # key-row parts of the planar layout (module docstring)


def code_parts(bits: int) -> int:
    """Key-row parts the packed codes split into: 1 (8 bits), 2 (4 bits), 4 (6 and 2 bits)."""
    return CODE_PARTS[bits]


def pack_codes(codes: Array, bits: int) -> Array:
    """Packs unsigned codes ``[..., dk, dv]`` (values < 2**bits) into bytes along ``dk``.

    8 bits: int8 ``[dk, dv]`` (the signed code itself); 6 bits: uint8 ``[3 dk/4, dv]``;
    4 bits: uint8 ``[dk/2, dv]``; 2 bits: uint8 ``[dk/4, dv]`` (layouts in the module docstring).
    """
    dk = codes.shape[-2]
    if bits == 8:
        return (codes.astype(jnp.int32) - 128).astype(jnp.int8)
    c = codes.astype(jnp.uint8)
    if bits == 4:
        if dk % 2:
            raise ValueError(f"4-bit packing needs dk divisible by 2, got dk={dk}")
        h = dk // code_parts(4)
        return c[..., :h, :] | (c[..., h:, :] << 4)
    if bits == 6:
        if dk % 4:
            raise ValueError(f"6-bit packing needs dk divisible by 4, got dk={dk}")
        m = dk // code_parts(6)
        a, b, cc, d = (c[..., i * m:(i + 1) * m, :] for i in range(4))
        planes = [q | (((d >> (2 * p)) & 3) << 6) for p, q in enumerate((a, b, cc))]
        return jnp.concatenate(planes, axis=-2)
    if bits == 2:
        if dk % 4:
            raise ValueError(f"2-bit packing needs dk divisible by 4, got dk={dk}")
        m = dk // code_parts(2)
        out = c[..., :m, :]
        for p in range(1, 4):
            out = out | (c[..., p * m:(p + 1) * m, :] << (2 * p))
        return out
    raise ValueError(f"cannot pack {bits}-bit codes (8, 6, 4 or 2)")


def unpack_codes(packed: Array, bits: int) -> Array:
    """Inverse of ``pack_codes``: bytes -> unsigned codes ``[..., dk, dv]`` as int32."""
    if bits == 8:
        return packed.astype(jnp.int32) + 128
    p = packed.astype(jnp.int32)
    if bits == 4:
        return jnp.concatenate([p & 15, p >> 4], axis=-2)
    if bits == 6:
        m = p.shape[-2] // 3
        planes = [p[..., i * m:(i + 1) * m, :] for i in range(3)]
        d = sum(((q >> 6) & 3) << (2 * i) for i, q in enumerate(planes))
        return jnp.concatenate([q & 63 for q in planes] + [d], axis=-2)
    if bits == 2:
        return jnp.concatenate([(p >> (2 * i)) & 3 for i in range(4)], axis=-2)
    raise ValueError(f"cannot unpack {bits}-bit codes (8, 6, 4 or 2)")


def packed_rows(dk: int, bits: int) -> int:
    """Rows of the packed code array for ``dk`` key rows."""
    n = dk // code_parts(bits)
    return {8: n, 6: 3 * n, 4: n, 2: n}[bits]


# ----------------------------------------------------------------------------- tensors


@flax.struct.dataclass
class FloatTensor:
    """A state stored as plain floats (fp32, bf16 or fp16): ``values [..., dk, dv]``."""

    values: Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


@flax.struct.dataclass
class ScaledFloatTensor:
    """A state in a scaled 8-bit float (fp8 e4m3): ``values [..., dk, dv]``, ``scale [..., dv]``
    (one per value column), or ``[..., 1]`` (one per head, ``fp8-tensor``)."""

    values: Array
    scale: Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


@flax.struct.dataclass
class IntTensor:
    """Symmetric integer codes with one fp32 scale per value column.

    codes: packed bytes ``[..., packed_rows(dk, bits), dv]`` (int8 at 8 bits, uint8 below);
    scale: ``[..., dv]`` (one per value column), or ``[..., 1]`` (one per head, ``int8-tensor``);
    dequantized value = ``(code - offset) * scale``.
    """

    codes: Array
    scale: Array
    bits: int = flax.struct.field(pytree_node=False, default=8)
    dk: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape[:-2] + (self.dk, self.codes.shape[-1])


QTensor = Union[FloatTensor, ScaledFloatTensor, IntTensor]


# ----------------------------------------------------------------------------- formats


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """Plain float storage: ``fp32`` (identity), ``bf16`` or ``fp16`` with round-to-nearest-even."""

    dtype: str = "float32"

    @property
    def name(self) -> str:
        return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[self.dtype]

    def quantize(self, x: Array) -> FloatTensor:
        """``x [..., dk, dv]`` float -> ``FloatTensor``."""
        check_state(x)
        return FloatTensor(values=x.astype(self.dtype))

    def dequantize(self, t: FloatTensor) -> Array:
        """``FloatTensor`` -> fp32 ``[..., dk, dv]``."""
        return t.values.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """fp8 e4m3 with one scale per value column: the column max maps to 448."""

    @property
    def name(self) -> str:
        return "fp8"

    def quantize(self, x: Array) -> ScaledFloatTensor:
        """``x [..., dk, dv]`` -> ``ScaledFloatTensor(values e4m3, scale [..., dv])``."""
        check_state(x)
        x = x.astype(jnp.float32)
        scale = column_absmax(x) / FP8_E4M3_MAX
        y = jnp.clip(x / safe_divisor(scale)[..., None, :], -FP8_E4M3_MAX, FP8_E4M3_MAX)
        return ScaledFloatTensor(values=y.astype(jnp.float8_e4m3fn), scale=scale)

    def dequantize(self, t: ScaledFloatTensor) -> Array:
        return t.values.astype(jnp.float32) * t.scale[..., None, :]


@dataclasses.dataclass(frozen=True)
class IntFormat:
    """Symmetric integer codes at 8, 6, 4 or 2 bits, one scale per value column.

    ``scale_j = max_i |x_ij| / qmax``; codes ``round_codes(x / scale)`` in ``[-qmax, qmax]``;
    6-, 4- and 2-bit codes are packed (0.75, 0.5 and 0.25 bytes per element). The per-step
    formats (``FORMATS``) are 8, 6 and 4 bits; 2 bits is a width of LeapQuant's checkpoint.
    """

    bits: int = 8

    def __post_init__(self):
        qmax_for_bits(self.bits)

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    @property
    def qmax(self) -> int:
        return qmax_for_bits(self.bits)

    def quantize(self, x: Array) -> IntTensor:
        """``x [..., dk, dv]`` -> ``IntTensor`` (packed codes, scale ``[..., dv]``)."""
        check_state(x)
        x = x.astype(jnp.float32)
        scale = column_absmax(x) / self.qmax
        q = round_codes(x / safe_divisor(scale)[..., None, :], self.bits)
        codes = pack_codes(unsigned_codes(q.astype(jnp.int32), self.bits), self.bits)
        return IntTensor(codes=codes, scale=scale, bits=self.bits, dk=x.shape[-2])

    def dequantize(self, t: IntTensor) -> Array:
        return self.integer_values(t).astype(jnp.float32) * t.scale[..., None, :]

    def integer_values(self, t: IntTensor) -> Array:
        """Signed codes ``[..., dk, dv]`` int32 in ``[-qmax, qmax]``."""
        return signed_codes(unpack_codes(t.codes, t.bits), t.bits)


Format = Union[FloatFormat, Fp8Format, IntFormat]

FORMATS = {
    "fp32": lambda: FloatFormat("float32"),
    "bf16": lambda: FloatFormat("bfloat16"),
    "fp16": lambda: FloatFormat("float16"),
    "fp8": Fp8Format,
    "int8": lambda: IntFormat(8),
    "int6": lambda: IntFormat(6),
    "int4": lambda: IntFormat(4),
}

FORMAT_NAMES = tuple(FORMATS)


def get_format(name: str) -> Format:
    """Looks a state format up by name (``fp32``, ``bf16``, ``fp16``, ``fp8``, ``int8``, ``int6``, ``int4``)."""
    try:
        return FORMATS[name]()
    except KeyError:
        raise ValueError(f"unknown state format {name!r}; known: {', '.join(FORMAT_NAMES)}") from None


def tree_bytes(tree) -> int:
    """Bytes held by the array leaves of a pytree (arrays or ``ShapeDtypeStruct``s)."""
    return int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)))


__all__ = [
    "FORMATS",
    "FORMAT_NAMES",
    "FloatFormat",
    "FloatTensor",
    "Format",
    "Fp8Format",
    "INT_WIDTHS",
    "PER_STEP_WIDTHS",
    "IntFormat",
    "IntTensor",
    "QTensor",
    "ScaledFloatTensor",
    "check_per_step_bits",
    "check_state",
    "code_parts",
    "column_absmax",
    "get_format",
    "pack_codes",
    "packed_rows",
    "qmax_for_bits",
    "round_codes",
    "safe_divisor",
    "signed_codes",
    "tree_bytes",
    "unpack_codes",
    "unsigned_codes",
]
