"""Per-tile state formats of serving engines: fp8 e4m3 with one dynamic scale per tile of value rows.

``FORMATS`` maps each per-step method name to a zero-argument constructor of its format (an
object with ``name``, ``quantize(x [..., dk, dv]) -> pytree`` and ``dequantize(t) -> fp32``).
"""

from __future__ import annotations

FORMATS: dict = {}

__all__ = ["FORMATS"]
