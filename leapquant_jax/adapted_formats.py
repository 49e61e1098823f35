"""KV-cache quantization methods adapted to a recurrent state (KVQuant, QuaRot, TurboQuant).

``FORMATS`` maps each per-step method name to a zero-argument constructor of its format (an
object with ``name``, ``quantize(x [..., dk, dv]) -> pytree`` and ``dequantize(t) -> fp32``).
"""

from __future__ import annotations

FORMATS: dict = {}

__all__ = ["FORMATS"]
