"""Version shims for the Pallas Triton backend.

``CompilerParams`` lives in ``jax.experimental.pallas.triton`` in JAX 0.10.2 and 0.11.2 (the
versions these kernels were tested on: 0.10.2 in interpret mode on the CPU, 0.11.2 compiled on
an H200); older releases named it ``TritonCompilerParams``. The backend is deprecated from JAX
0.11, which warns on import; the test configuration filters that one warning.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl  # noqa: F401  (re-exported for the kernels)
from jax.experimental.pallas import triton as plgpu

_PARAMS = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")


def compiler_params(num_warps: int, num_stages: int = 1):
    """Triton ``CompilerParams(num_warps, num_stages)`` for this JAX version."""
    return _PARAMS(num_warps=num_warps, num_stages=num_stages)


def default_interpret() -> bool:
    """Interpret mode (the kernel body run by XLA) everywhere but on a GPU."""
    return jax.default_backend() != "gpu"


def tensor_core_precision(precision, interpret: bool):
    """The dot precision a kernel uses for a caller's ``precision``: ``HIGHEST`` is three TF32
    passes on the GPU (about fp32 round-off), anything else one; interpret mode computes in fp32."""
    if interpret:
        return jax.lax.Precision.HIGHEST
    if precision == jax.lax.Precision.HIGHEST:
        return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return jax.lax.DotAlgorithmPreset.TF32_TF32_F32


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def round_half_even(x: jax.Array) -> jax.Array:
    """Round to nearest, ties to even (``jnp.round``), from ``floor`` alone.

    The Pallas Triton lowering has no ``round``; this is exact for ``|x| < 2**22``, the range
    of quantization codes.
    """
    f = jnp.floor(x)
    d = x - f
    odd = (f - 2.0 * jnp.floor(0.5 * f)) == 1.0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return f + up.astype(x.dtype)


load = plgpu.load
store = plgpu.store

__all__ = ["compiler_params", "default_interpret", "is_pow2", "load", "pl", "plgpu", "round_half_even", "store",
           "tensor_core_precision"]
