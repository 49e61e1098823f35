"""Per-step methods whose state carries more than the rounded values: error feedback (the last
rounding residual, added back before the next rounding) and stochastic rounding (a step counter
that seeds the rounding noise), as serving engines use for recurrent states.

``METHODS`` maps each method name to a zero-argument constructor of its method (a
``runner.PerStepRunner`` like ``methods.PerStepMethod``, whose ``requantize`` carries the extra
state from step to step):

* ``int8+ef``, ``int8+ef4``: INT8 codes (one scale per value column) with error feedback
  (sigma-delta). Reads (the output and the delta-rule correction) use ``deq(Q)`` only; at
  re-quantization ``x = update(deq(Q)) + e``, ``Q' = quant(x)``, ``e' = x - deq(Q')``. The
  residual ``e`` is stored in fp16 (``int8+ef``) or as int4 codes with one scale per value column
  (``int8+ef4``). This is the scheme serving engines' INT8 + error-feedback GDN state kernels
  describe: the residual is not decayed by the token, it is added back as it was, and the rounding
  itself stays deterministic (round to nearest).
* ``int8+sr``, ``bf16+sr``, ``fp8-tile+sr``: stochastic rounding at every re-quantization
  (unbiased: up with probability equal to the fractional position between the two neighbouring
  representable values). int8: ``floor(x / scale + u)``; bf16: uniform bits added to the low 16 bits
  of the fp32 pattern, then truncated (what the hardware ``cvt.rs.bf16x2.f32`` does); fp8-tile:
  the same on the e4m3 grid (``tile_formats.e4m3_stochastic_round``, as ``cvt.rs`` to e4m3).
  The noise is ``fold_in(PRNGKey(seed), counter)`` with a uint32 step counter per sequence kept in
  the state, so a decode is reproducible and jit-safe; the counter advances on active rows only.

Every state is a pytree of separate arrays at their stored width, so ``quantizers.tree_bytes``
counts the residual and the counter too. Bits per state value at ``dk = dv = 128`` (one head,
one sequence): ``int8+ef`` 24.25, ``int8+ef4`` 12.5, ``int8+sr`` 8.25, ``bf16+sr`` 16.0,
``fp8-tile+sr`` 8.008 (plus 32 bits per sequence for the counter).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .quantizers import FloatFormat, FloatTensor, IntFormat, IntTensor, column_absmax, pack_codes
from .runner import PerStepRunner, check_dense
from .tile_formats import Fp8TileFormat, TileFp8Tensor

Array = jax.Array

FP16_MAX = 65504.0


# ----------------------------------------------------------------------------- states


@flax.struct.dataclass
class FeedbackState:
    """An error-feedback state: INT8 ``codes`` (``IntTensor``, ``[B, H, dk, dv]`` with scales
    ``[B, H, dv]``) and the last rounding residual: fp16 ``FloatTensor [B, H, dk, dv]`` or int4
    ``IntTensor`` (packed ``[B, H, dk/2, dv]`` with scales ``[B, H, dv]``)."""

    codes: IntTensor
    residual: Union[FloatTensor, IntTensor]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape


@flax.struct.dataclass
class StochasticState:
    """A stochastically rounded state: the format's tensor ``values`` (``[B, H, dk, dv]``) and
    ``counter`` uint32 ``[B]``, the number of re-quantizations of each sequence (seeds its noise)."""

    values: Union[IntTensor, FloatTensor, TileFp8Tensor]
    counter: Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


# ----------------------------------------------------------------------------- rounding


def int_stochastic(fmt: IntFormat, x: Array, u: Array) -> IntTensor:
    """``fmt``'s symmetric integer codes (one scale per value column) with stochastic rounding:
    ``clip(floor(x / scale + u), -qmax, qmax)``. x ``[..., dk, dv]`` fp32, u uniform ``[0, 1)``
    of the same shape."""
    scale = column_absmax(x) / fmt.qmax
    div = jnp.where(scale > 0, scale, 1.0)[..., None, :]
    q = jnp.clip(jnp.floor(x / div + u), -fmt.qmax, fmt.qmax)
    codes = pack_codes((q + fmt.qmax + 1).astype(jnp.int32), fmt.bits)
    return IntTensor(codes=codes, scale=scale, bits=fmt.bits, dk=x.shape[-2])


def bf16_stochastic(x: Array, bits: Array) -> FloatTensor:
    """bf16 with stochastic rounding: ``x`` fp32 ``[...]``; ``bits`` uint32 random, same shape.

    The low 16 bits of the fp32 pattern are what bf16 drops; adding a uniform 16-bit number and
    truncating carries into the kept bits with probability (dropped bits) / 2**16, i.e. rounds the
    magnitude up with probability equal to its fractional position between its neighbours (a
    carry out of the mantissa steps the exponent, to the next bf16 value). Finite values beyond
    bf16's largest may round to infinity, as round-to-nearest does.
    """
    pattern = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    pattern = (pattern + (bits >> 16)) & jnp.uint32(0xFFFF0000)
    return FloatTensor(values=jax.lax.bitcast_convert_type(pattern, jnp.float32).astype(jnp.bfloat16))


def uniform_from_bits(bits: Array) -> Array:
    """uint32 random bits -> fp32 uniform in ``[0, 1)`` (the top 24 bits, exact in fp32)."""
    return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)


def sequence_bits(seed: int, counter: Array, shape: tuple[int, ...]) -> Array:
    """uint32 random bits ``[B, *shape]``: sequence ``b`` draws from ``fold_in(PRNGKey(seed), counter[b])``."""
    key = jax.random.PRNGKey(seed)
    size = int(np.prod(shape, dtype=np.int64))
    # Drawn flat and reshaped: a multi-dimensional draw compiles several times slower on CPU.
    return jax.vmap(lambda c: jax.random.bits(jax.random.fold_in(key, c), (size,), jnp.uint32).reshape(shape))(counter)


# ----------------------------------------------------------------------------- methods


_RESIDUAL_FORMATS = {"fp16": lambda: FloatFormat("float16"), "int4": lambda: IntFormat(4)}


@dataclasses.dataclass(frozen=True)
class ErrorFeedbackMethod(PerStepRunner):
    """INT8 state (one scale per value column) with error feedback; the residual in
    ``residual_format`` (``fp16`` -> ``int8+ef``, ``int4`` -> ``int8+ef4``)."""

    residual_format: str = "fp16"

    def __post_init__(self):
        if self.residual_format not in _RESIDUAL_FORMATS:
            raise ValueError(f"residual_format must be one of {sorted(_RESIDUAL_FORMATS)}, got {self.residual_format!r}")

    @property
    def name(self) -> str:
        return {"fp16": "int8+ef", "int4": "int8+ef4"}[self.residual_format]

    def _encode(self, x: Array) -> FeedbackState:
        # Q' = quant(x); e' = x - deq(Q'). fp16 saturates instead of overflowing to inf (a state
        # column beyond ~1.6e7 in magnitude), so a residual never turns the next x into inf/NaN.
        fmt = IntFormat(8)
        codes = fmt.quantize(x)
        e = x - fmt.dequantize(codes)
        if self.residual_format == "fp16":
            e = jnp.clip(e, -FP16_MAX, FP16_MAX)
        return FeedbackState(codes=codes, residual=_RESIDUAL_FORMATS[self.residual_format]().quantize(e))

    def from_dense(self, state: Array, *, per_channel_decay: bool = False,
                   key_heads: Optional[int] = None) -> FeedbackState:
        """Rounds ``[B, H, dk, dv]`` fp32 to INT8, keeping that rounding's residual."""
        check_dense(state)
        return self._encode(state.astype(jnp.float32))

    def to_dense(self, state: FeedbackState) -> Array:
        """``deq(Q)`` ``[B, H, dk, dv]`` fp32: what the reads see (the residual is not read)."""
        return IntFormat(8).dequantize(state.codes)

    def residual(self, state: FeedbackState) -> Array:
        """The carried residual ``e`` as fp32 ``[B, H, dk, dv]``."""
        return _RESIDUAL_FORMATS[self.residual_format]().dequantize(state.residual)

    def requantize(self, state: FeedbackState, dense: Array) -> FeedbackState:
        """``x = dense + e``, then ``Q' = quant(x)``, ``e' = x - deq(Q')``."""
        return self._encode(dense + self.residual(state))


_SR_FORMATS = {"int8": lambda: IntFormat(8), "bf16": lambda: FloatFormat("bfloat16"), "fp8-tile": Fp8TileFormat}


@dataclasses.dataclass(frozen=True)
class StochasticRoundingMethod(PerStepRunner):
    """A per-step format (``int8``, ``bf16`` or ``fp8-tile``) re-quantized with stochastic
    rounding after every token; ``seed`` (static) seeds the noise.

    The noise of a step depends on the sequence's counter alone, not on its batch row, so a
    sequence decodes the same in any batch (and sequences at the same step share noise).
    ``from_dense`` (and so ``prefill``'s one rounding) rounds to nearest and restarts the counter at 0.
    """

    format_name: str = "int8"
    seed: int = 0

    def __post_init__(self):
        if self.format_name not in _SR_FORMATS:
            raise ValueError(f"stochastic rounding takes formats {sorted(_SR_FORMATS)}, got {self.format_name!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")

    @property
    def name(self) -> str:
        return f"{self.format_name}+sr"

    @property
    def format(self):
        return _SR_FORMATS[self.format_name]()

    def from_dense(self, state: Array, *, per_channel_decay: bool = False,
                   key_heads: Optional[int] = None) -> StochasticState:
        """Rounds ``[B, H, dk, dv]`` fp32 to nearest into the format; counters 0."""
        check_dense(state)
        return StochasticState(values=self.format.quantize(state.astype(jnp.float32)),
                               counter=jnp.zeros((state.shape[0],), jnp.uint32))

    def to_dense(self, state: StochasticState) -> Array:
        """``[B, H, dk, dv]`` fp32."""
        return self.format.dequantize(state.values)

    def round(self, x: Array, counter: Array):
        """Stochastic rounding of ``x [B, H, dk, dv]`` fp32 with the noise of step ``counter [B]``."""
        bits = sequence_bits(self.seed, counter, x.shape[1:])
        if self.format_name == "bf16":
            return bf16_stochastic(x, bits)
        if self.format_name == "int8":
            return int_stochastic(self.format, x, uniform_from_bits(bits))
        return self.format.quantize(x, uniform_from_bits(bits))

    def requantize(self, state: StochasticState, dense: Array) -> StochasticState:
        """Rounds with the noise of the current step, then advances the counter."""
        return StochasticState(values=self.round(dense, state.counter), counter=state.counter + jnp.uint32(1))


METHODS: dict = {
    "int8+ef": lambda: ErrorFeedbackMethod("fp16"),
    "int8+ef4": lambda: ErrorFeedbackMethod("int4"),
    "int8+sr": lambda: StochasticRoundingMethod("int8"),
    "bf16+sr": lambda: StochasticRoundingMethod("bf16"),
    "fp8-tile+sr": lambda: StochasticRoundingMethod("fp8-tile"),
}

__all__ = [
    "ErrorFeedbackMethod",
    "FeedbackState",
    "METHODS",
    "StochasticRoundingMethod",
    "StochasticState",
    "bf16_stochastic",
    "int_stochastic",
    "sequence_bits",
    "uniform_from_bits",
]
