"""KV-cache quantization methods adapted to a recurrent state (KVQuant, QuaRot, TurboQuant).

``FORMATS`` maps each per-step method name to a zero-argument constructor of its format (``name``,
``quantize(x [..., dk, dv]) -> pytree``, ``dequantize(t) -> fp32``). A per-step method re-quantizes
the whole state after every decode token, so each format is applied to ``S [..., dk, dv]`` once per
token, not to cached key/value vectors written once.

The mapping from a KV cache: the state is ``S = sum_t decay * k_t u_t^T``, so its *rows* are key
channels and its *columns* value channels, and a read ``o = S^T q`` contracts the key axis with the
query, like ``q^T K`` in attention. The key axis of the state plays the role of the cached keys'
head dimension, and each value column ``S[:, j]`` is one vector read against the query:

* ``quarot`` (``QuaRotFormat``): QuaRot's shared Hadamard rotation of queries and keys, here along
  the key axis (``S' = H S``), then per-value-column integers.
* ``kvquant`` (``KVQuantFormat``): KVQuant's per-key-channel scales, here one per key *row* (a key
  channel's outliers make its whole row large), the largest 1% of magnitudes kept in fp16 with
  their indices, a NormalFloat codebook for the rest.
* ``turboquant`` (``TurboQuantFormat``): TurboQuant's random rotation of each vector (here each
  value column), Lloyd–Max levels for the rotated coordinates and a 1-bit QJL sketch of the
  residual, which makes each read unbiased.

Each class says its layout, bits per value and what of the original method has no state analogue.
The formats take any float dtype and return fp32 from ``dequantize``; a zero state round-trips to
exact zeros (every scale is replaced by 1 where it is 0 before dividing). docs/design.md §2 has the
measured choices.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from statistics import NormalDist

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .quantizers import IntFormat, IntTensor, check_per_step_bits, check_state, pack_codes, safe_divisor, unpack_codes

Array = jax.Array

SPARSE_FRACTION = 0.01


# ----------------------------------------------------------------------------- shared pieces


def _check_power_of_two(dk: int, name: str) -> None:
    if dk < 2 or dk & (dk - 1):
        raise ValueError(f"{name} rotates the key axis with a Hadamard matrix: dk must be a power of two >= 2, got dk={dk}")


def hadamard_transform(x: Array) -> Array:
    """Normalized Walsh–Hadamard transform along the key axis: ``[..., dk, dv] -> H x``.

    ``H`` is the Sylvester Hadamard matrix divided by ``sqrt(dk)`` (symmetric, orthogonal, so
    it is its own inverse); ``dk`` must be a power of two. Each butterfly stage divides by
    ``sqrt(2)`` so magnitudes never grow by more than ``sqrt(2)`` per stage (no overflow for large
    finite inputs).
    """
    dk = x.shape[-2]
    _check_power_of_two(dk, "the Hadamard transform")
    lead, dv = x.shape[:-2], x.shape[-1]
    h = 1
    while h < dk:
        y = x.reshape(lead + (dk // (2 * h), 2, h, dv))
        a, b = y[..., 0, :, :], y[..., 1, :, :]
        x = jnp.stack([a + b, a - b], axis=-3).reshape(lead + (dk, dv)) * np.float32(1 / math.sqrt(2))
        h *= 2
    return x


def _nearest_level(y: Array, levels: np.ndarray) -> Array:
    """Index of the nearest of the sorted ``levels`` for every element of ``y`` (int32)."""
    mids = jnp.asarray((levels[1:].astype(np.float64) + levels[:-1]) / 2, jnp.float32)
    return jnp.searchsorted(mids, y.reshape(-1)).reshape(y.shape).astype(jnp.int32)


# ----------------------------------------------------------------------------- QuaRot


@flax.struct.dataclass
class QuaRotTensor:
    """A Hadamard-rotated state ``H S`` stored as an ``IntTensor`` (codes ``[..., packed_rows, dv]``, scale ``[..., dv]``)."""

    rotated: IntTensor

    @property
    def shape(self) -> tuple[int, ...]:
        return self.rotated.shape


@dataclasses.dataclass(frozen=True)
class QuaRotFormat:
    """QuaRot-style: ``H S`` along the key axis, then ``IntFormat(bits)`` (one scale per value column).

    ``H`` is the normalized Sylvester Hadamard matrix along the key axis (``dk`` a power of two);
    QuaRot rotates queries and keys by it (``(H q)^T (H k) = q^T k``) so that outlier channels are
    spread over all of them. Dequantize is ``H deq(S')`` (``H`` symmetric and orthogonal). A kernel
    would not rotate back: it reads ``(H q)^T deq(S')`` and writes ``H k`` (``H S`` after ``k u^T`` is
    ``H S + (H k) u^T``), one ``O(dk log dk)`` transform of ``q`` and ``k`` per token; rotating back
    here is the reference.

    Layout: ``QuaRotTensor(IntTensor)``; ``b + 0.25`` bits per value at ``dk = dv = 128``.
    """

    bits: int = 8

    def __post_init__(self):
        check_per_step_bits(self.bits)

    @property
    def name(self) -> str:
        return "quarot" if self.bits == 8 else f"quarot-b{self.bits}"

    def quantize(self, x: Array) -> QuaRotTensor:
        """``x [..., dk, dv]`` (dk a power of two) -> ``QuaRotTensor``."""
        check_state(x)
        _check_power_of_two(x.shape[-2], self.name)
        return QuaRotTensor(rotated=IntFormat(self.bits).quantize(hadamard_transform(x.astype(jnp.float32))))

    def dequantize(self, t: QuaRotTensor) -> Array:
        """``QuaRotTensor`` -> fp32 ``[..., dk, dv]`` (``H^T deq(H S)``)."""
        return hadamard_transform(IntFormat(self.bits).dequantize(t.rotated))


# ----------------------------------------------------------------------------- KVQuant


def normal_float_levels(bits: int) -> np.ndarray:
    """The ``2^bits - 1`` NormalFloat-style levels of ``kvquant`` as an fp16 codebook, sorted.

    Level ``i`` is the normal quantile at ``(i + 1/2) / n`` (``n = 2^bits - 1``, odd, so the middle
    level is exactly 0), divided by the largest so the levels span ``[-1, 1]``.
    """
    n = 2 ** bits - 1
    q = np.array([NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)])
    q = (q - q[::-1]) / 2                    # exact symmetry despite rounding in inv_cdf
    return (q / q[-1]).astype(np.float16)


@flax.struct.dataclass
class KVQuantTensor:
    """Dense-and-sparse state of ``kvquant``.

    codes: packed codebook indices ``[..., packed_rows(dk, bits), dv]``; scale: fp32 per key row
    ``[..., dk]``; sparse_values: fp16 ``[..., k]`` (relative to ``sparse_scale``);
    sparse_index: uint16 flat indices ``i * dv + j`` ``[..., k]``; sparse_scale: fp32 ``[...]``.
    """

    codes: Array
    scale: Array
    sparse_values: Array
    sparse_index: Array
    sparse_scale: Array
    bits: int = flax.struct.field(pytree_node=False, default=8)
    dk: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape[:-2] + (self.dk, self.codes.shape[-1])


def sparse_count(dk: int, dv: int) -> int:
    """Entries kept exactly per head by ``kvquant``: ``ceil(0.01 dk dv)``."""
    return math.ceil(SPARSE_FRACTION * dk * dv)


@dataclasses.dataclass(frozen=True)
class KVQuantFormat:
    """KVQuant-style: per-key-row NormalFloat codebook at ``bits`` + top-1% sparse fp16 outliers.

    The sparse part has a fixed size ``k = sparse_count(dk, dv) = ceil(0.01 dk dv)`` per head
    (static shapes): the ``k`` largest magnitudes, fp16 relative to one fp32 head scale (the largest
    magnitude, so fp16 cannot overflow), with uint16 flat indices (``dk dv <= 65536``). The rest
    (outlier positions set to zero) is divided by its key row's largest magnitude and rounded to the
    nearest of ``2^b - 1`` NormalFloat-style levels (normal quantiles in ``[-1, 1]``, symmetric with
    an exact zero): an fp16 codebook that is a constant of the format, not in the per-head pytree.
    KVQuant's per-layer sensitivity-weighted k-means codebooks, pre-RoPE keys and attention-sink
    handling have no state analogue and are left out.

    Layout: ``KVQuantTensor``; ``b + (512 + 164 * 4 + 4) * 8 / 16384 = b + 0.572265625`` bits per
    value at ``dk = dv = 128``.
    """

    bits: int = 8

    def __post_init__(self):
        check_per_step_bits(self.bits)

    @property
    def name(self) -> str:
        return "kvquant" if self.bits == 8 else f"kvquant-b{self.bits}"

    @property
    def codebook(self) -> np.ndarray:
        """The fp16 levels ``[2^bits - 1]`` shared by every head."""
        return normal_float_levels(self.bits)

    def quantize(self, x: Array) -> KVQuantTensor:
        """``x [..., dk, dv]`` (``dk dv <= 65536``) -> ``KVQuantTensor``."""
        check_state(x)
        *lead, dk, dv = x.shape
        if dk * dv > 2 ** 16:
            raise ValueError(f"{self.name} stores uint16 flat indices: dk * dv must be <= 65536, got {dk} * {dv}")
        x = x.astype(jnp.float32)
        flat = x.reshape(tuple(lead) + (dk * dv,))
        _, idx = jax.lax.top_k(jnp.abs(flat), sparse_count(dk, dv))
        vals = jnp.take_along_axis(flat, idx, axis=-1)
        head_scale = jnp.max(jnp.abs(vals), axis=-1)
        sparse = (vals / safe_divisor(head_scale)[..., None]).astype(jnp.float16)
        dense = jnp.put_along_axis(flat, idx, 0.0, axis=-1, inplace=False).reshape(x.shape)
        scale = jnp.max(jnp.abs(dense), axis=-1)
        codes = _nearest_level(dense / safe_divisor(scale)[..., None], self.codebook)
        return KVQuantTensor(codes=pack_codes(codes, self.bits), scale=scale, sparse_values=sparse,
                             sparse_index=idx.astype(jnp.uint16), sparse_scale=head_scale, bits=self.bits, dk=dk)

    def dequantize(self, t: KVQuantTensor) -> Array:
        """``KVQuantTensor`` -> fp32 ``[..., dk, dv]``: codebook values times row scales, outliers written back."""
        levels = jnp.asarray(self.codebook, jnp.float32)
        dense = levels[unpack_codes(t.codes, t.bits)] * t.scale[..., None]
        shape = dense.shape
        vals = t.sparse_values.astype(jnp.float32) * t.sparse_scale[..., None]
        flat = jnp.put_along_axis(dense.reshape(shape[:-2] + (-1,)), t.sparse_index.astype(jnp.int32), vals,
                                  axis=-1, inplace=False)
        return flat.reshape(shape)


# ----------------------------------------------------------------------------- TurboQuant


@functools.lru_cache(maxsize=None)
def lloyd_max_levels(bits: int, iterations: int = 5000) -> np.ndarray:
    """The ``2^bits`` Lloyd–Max (MSE-optimal) levels for N(0, 1), sorted, float64 (read-only, cached).

    Alternates the two optimality conditions (boundaries at midpoints of levels, each level at
    the conditional mean of its cell, ``(phi(a) - phi(b)) / (Phi(b) - Phi(a))``) from the
    high-rate optimum, quantiles of N(0, 3) (point density ``p^(1/3)``), which converges far
    faster than quantile initial levels when there are many levels. Stops when no level moves by
    1e-12, or after ``iterations`` (at 8 bits, 5000 iterations leave the outermost levels about
    1e-3 from the fixed point, a fraction of a percent of their spacing).
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"Lloyd–Max levels are computed for 1..8 bits, got {bits}")
    n = 2 ** bits
    nd = NormalDist()
    levels = np.array([math.sqrt(3) * nd.inv_cdf((i + 0.5) / n) for i in range(n)])
    erfc = np.vectorize(math.erfc)
    for _ in range(iterations):
        edges = np.concatenate([[-np.inf], (levels[1:] + levels[:-1]) / 2, [np.inf]])
        pdf = np.exp(-edges ** 2 / 2) / math.sqrt(2 * math.pi)
        upper = 0.5 * erfc(edges / math.sqrt(2))       # P(X > edge), accurate in the tails
        new = (pdf[:-1] - pdf[1:]) / (upper[:-1] - upper[1:])
        new = (new - new[::-1]) / 2                     # keep exact symmetry
        moved = np.max(np.abs(new - levels))
        levels = new
        if moved < 1e-12:
            break
    levels.setflags(write=False)
    return levels


@functools.lru_cache(maxsize=None)
def _turbo_constants(seed: int, dk: int) -> tuple[np.ndarray, np.ndarray]:
    """Random signs ``[dk]`` of the rotation and the QJL projection ``G [dk, dk]`` for ``seed``."""
    rng = np.random.default_rng(seed)
    signs = rng.choice(np.array([-1.0, 1.0], np.float32), size=dk)
    g = rng.standard_normal((dk, dk)).astype(np.float32)
    signs.setflags(write=False)
    g.setflags(write=False)
    return signs, g


def pack_bits(bits: Array) -> Array:
    """Packs booleans ``[..., m, dv]`` (``m % 8 == 0``) into uint8 ``[..., m/8, dv]``.

    Planar like ``pack_codes``: bit ``p`` of byte row ``i`` holds row ``p * m/8 + i``.
    """
    m = bits.shape[-2]
    if m % 8:
        raise ValueError(f"1-bit packing needs a row count divisible by 8, got {m}")
    r = m // 8
    b = bits.astype(jnp.uint8)
    return functools.reduce(jnp.bitwise_or, [b[..., p * r:(p + 1) * r, :] << p for p in range(8)])


def unpack_bits(packed: Array) -> Array:
    """Inverse of ``pack_bits``: uint8 ``[..., m/8, dv]`` -> bool ``[..., m, dv]``."""
    return jnp.concatenate([((packed >> p) & 1).astype(bool) for p in range(8)], axis=-2)


def qjl_sketch(r: Array, g: Array) -> tuple[Array, Array]:
    """1-bit QJL sketch of residual columns ``r [..., dk, dv]`` with projection ``g [m, dk]``.

    Returns ``(signs [..., m, dv] bool, norm [..., dv])`` with ``signs = (g r >= 0)``.
    """
    return jnp.einsum("md,...dv->...mv", g, r) >= 0, jnp.sqrt(jnp.sum(r * r, axis=-2))


def qjl_estimate(signs: Array, norm: Array, g: Array) -> Array:
    """Unbiased residual estimate ``sqrt(pi/2) / m * |r| * g^T (2 signs - 1)``: ``[..., dk, dv]``.

    For Gaussian ``g``, ``E[g_i sign(g_i . r)] = sqrt(2/pi) r / |r|``, so the expectation over
    ``g`` is ``r`` and inner products ``q^T estimate`` are unbiased estimates of ``q^T r``.
    """
    m = g.shape[0]
    pm = signs.astype(jnp.float32) * 2 - 1
    return np.float32(math.sqrt(math.pi / 2) / m) * norm[..., None, :] * jnp.einsum("md,...mv->...dv", g, pm)


@flax.struct.dataclass
class TurboQuantTensor:
    """State of ``turboquant``.

    codes: packed Lloyd–Max indices of the rotated, RMS-normalized columns
    ``[..., packed_rows(dk, bits), dv]``; scale: fp32 column RMS ``[..., dv]``;
    sketch: packed residual signs uint8 ``[..., dk/8, dv]``; residual_norm: fp16 ``[..., dv]``
    (in units of ``scale``).
    """

    codes: Array
    scale: Array
    sketch: Array
    residual_norm: Array
    bits: int = flax.struct.field(pytree_node=False, default=8)
    dk: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape[:-2] + (self.dk, self.codes.shape[-1])


@dataclasses.dataclass(frozen=True)
class TurboQuantFormat:
    """TurboQuant-style: random-sign Hadamard rotation, Lloyd–Max levels per column RMS, 1-bit QJL residual sketch.

    Each value column is the vector: ``y = P S[:, j]`` with ``P = H diag(s)`` (``s`` random signs
    from ``seed``), divided by its RMS (one fp32 scale per value column) and rounded to the
    ``b``-bit Lloyd–Max levels for N(0, 1) (``lloyd_max_levels``). The residual ``r`` (normalized
    units) is sketched as ``sign(G r)`` with a fixed Gaussian ``G [dk, dk]`` (from ``seed``) and
    ``|r|`` in fp16; dequantize adds the unbiased estimate ``sqrt(pi/2) / dk * |r| * G^T sign(G r)``
    before scaling and rotating back. The paper splits ``b`` bits into ``b - 1`` MSE bits and the
    sketch; the project packs 8, 6 and 4 bits, so here the sketch comes on top of ``b`` MSE bits.

    Layout: ``TurboQuantTensor``; ``b + 0.25 + 1 + 0.125 = b + 1.375`` bits per value at ``dk = dv =
    128``; ``dk`` a power of two >= 8. ``sketch=False`` drops the residual estimate at dequantize
    (the stored sketch is then ignored; for ablations).
    """

    bits: int = 8
    seed: int = 0
    sketch: bool = True

    def __post_init__(self):
        check_per_step_bits(self.bits)

    @property
    def name(self) -> str:
        return "turboquant" if self.bits == 8 else f"turboquant-b{self.bits}"

    def quantize(self, x: Array) -> TurboQuantTensor:
        """``x [..., dk, dv]`` -> ``TurboQuantTensor``."""
        check_state(x)
        dk = x.shape[-2]
        _check_power_of_two(dk, self.name)
        if dk < 8:
            raise ValueError(f"{self.name} packs 8 sketch bits per byte along dk: dk must be >= 8, got {dk}")
        signs, g = _turbo_constants(self.seed, dk)
        y = hadamard_transform(x.astype(jnp.float32) * signs[:, None])
        # RMS through the column max so that squaring cannot overflow for huge finite inputs.
        amax = jnp.max(jnp.abs(y), axis=-2)
        scale = amax * jnp.sqrt(jnp.mean(jnp.square(y / safe_divisor(amax)[..., None, :]), axis=-2))
        z = y / safe_divisor(scale)[..., None, :]
        levels = lloyd_max_levels(self.bits).astype(np.float32)
        codes = _nearest_level(z, levels)
        bits, norm = qjl_sketch(z - jnp.asarray(levels)[codes], jnp.asarray(g))
        return TurboQuantTensor(codes=pack_codes(codes, self.bits), scale=scale, sketch=pack_bits(bits),
                                residual_norm=norm.astype(jnp.float16), bits=self.bits, dk=dk)

    def dequantize(self, t: TurboQuantTensor) -> Array:
        """``TurboQuantTensor`` -> fp32 ``[..., dk, dv]``: levels (+ residual estimate), times RMS, rotated back."""
        signs, g = _turbo_constants(self.seed, t.dk)
        z = jnp.asarray(lloyd_max_levels(t.bits), jnp.float32)[unpack_codes(t.codes, t.bits)]
        if self.sketch:
            z = z + qjl_estimate(unpack_bits(t.sketch), t.residual_norm.astype(jnp.float32), jnp.asarray(g))
        return hadamard_transform(z * t.scale[..., None, :]) * signs[:, None]


FORMATS: dict = {
    **{("quarot" if b == 8 else f"quarot-b{b}"): functools.partial(QuaRotFormat, b) for b in (8, 6, 4)},
    **{("kvquant" if b == 8 else f"kvquant-b{b}"): functools.partial(KVQuantFormat, b) for b in (8, 6, 4)},
    **{("turboquant" if b == 8 else f"turboquant-b{b}"): functools.partial(TurboQuantFormat, b) for b in (8, 6, 4)},
}

__all__ = [
    "FORMATS",
    "KVQuantFormat",
    "KVQuantTensor",
    "QuaRotFormat",
    "QuaRotTensor",
    "SPARSE_FRACTION",
    "TurboQuantFormat",
    "TurboQuantTensor",
    "hadamard_transform",
    "lloyd_max_levels",
    "normal_float_levels",
    "pack_bits",
    "qjl_estimate",
    "qjl_sketch",
    "sparse_count",
    "unpack_bits",
]
