"""Every per-step state format, by the name ``make_method`` takes.

The base formats (``fp32``, ``bf16``, ``fp16``, ``fp8``, ``int8``, ``int6``, ``int4``) live in
``quantizers``, where the windowed method's residual formats come from too; the direct and block
formats in ``block_formats``; the adapted KV-cache methods in ``adapted_formats``; the per-tile
formats of serving engines in ``tile_formats``. A format is
stateless: ``quantize(x [..., dk, dv]) -> pytree of arrays``, ``dequantize(t) -> fp32 [..., dk, dv]``.
"""

from __future__ import annotations

from . import adapted_formats, block_formats, quantizers, tile_formats

_BASE = ("fp32", "bf16", "fp16", "int8", "fp8", "int6", "int4")
_REGISTRY = {**{n: quantizers.FORMATS[n] for n in _BASE}, **block_formats.FORMATS, **adapted_formats.FORMATS,
             **tile_formats.FORMATS}

STATE_FORMAT_NAMES = tuple(_REGISTRY)


def get_state_format(name: str):
    """The per-step state format called ``name`` (one of ``STATE_FORMAT_NAMES``)."""
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown per-step state format {name!r}; known: {', '.join(STATE_FORMAT_NAMES)}") from None


__all__ = ["STATE_FORMAT_NAMES", "get_state_format"]
