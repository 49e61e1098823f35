"""Direct per-step state formats beyond the base ones: per-tensor and per-channel fp8/int8, int16,
and the block floats (OCP MX, NVFP).

``FORMATS`` maps each per-step method name to a zero-argument constructor of its format (an
object with ``name``, ``quantize(x [..., dk, dv]) -> pytree`` and ``dequantize(t) -> fp32``).
"""

from __future__ import annotations

FORMATS: dict = {}

__all__ = ["FORMATS"]
