"""Why per-step 16-bit states stop decaying: ``round(alpha * x) == x`` for most stored ``x``.

For every representable positive bf16 or fp16 value ``x`` in ``[0.01, 10]``, multiply by the
decay ``alpha`` in fp32 (as a per-step update does on the dequantized state) and round back
to the storage format with round-to-nearest-even. A value that comes back unchanged never
decays: the state *freezes*.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

DEFAULT_DECAYS = (0.997, 0.998, 0.999, 0.9995, 0.9999)
FORMATS = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16}


def representable_values(fmt: str, low: float = 0.01, high: float = 10.0) -> np.ndarray:
    """Every finite positive value of ``fmt`` in ``[low, high]``, as that dtype."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    bits = np.arange(0, 0x8000, dtype=np.uint16)            # sign bit clear: positives
    values = bits.view(FORMATS[fmt])
    as32 = values.astype(np.float32)
    keep = np.isfinite(as32) & (as32 >= low) & (as32 <= high)
    return values[keep]


def frozen_fraction(fmt: str, alpha: float, low: float = 0.01, high: float = 10.0) -> float:
    """Fraction of ``fmt`` values in ``[low, high]`` with ``round_fmt(fp32(alpha) * x) == x``."""
    x = representable_values(fmt, low, high)
    decayed = (x.astype(np.float32) * np.float32(alpha)).astype(FORMATS[fmt])
    return float(np.mean(decayed == x))


def run_freeze_study(decays=DEFAULT_DECAYS, formats=tuple(FORMATS)) -> dict[str, dict[str, float]]:
    """``{format: {str(alpha): fraction}}`` for every format and decay ``alpha`` in ``(0, 1]``."""
    if len(decays) == 0:
        raise ValueError("decays: give at least one decay")
    bad = [a for a in decays if not 0.0 < a <= 1.0]
    if bad:
        raise ValueError(f"decays must lie in (0, 1], got {', '.join(map(repr, bad))}")
    return {fmt: {str(a): frozen_fraction(fmt, a) for a in decays} for fmt in formats}


def format_freeze_table(result: dict[str, dict[str, float]]) -> str:
    """The study as a printed table: one row per format, one column per decay ``alpha``."""
    decays = list(next(iter(result.values())))
    width = max(len(d) for d in decays) + len("alpha = ") + 3
    rows = [
        "fraction of the stored values x in [0.01, 10] with round(alpha * x) == x: the share of the",
        "state that stops decaying when re-rounded after every token (0 = all decay, 1 = all frozen)",
        f"{'':<8}" + "".join(f"{'alpha = ' + d:>{width}}" for d in decays),
    ]
    for fmt, fractions in result.items():
        rows.append(f"{fmt:<8}" + "".join(f"{v:>{width}.3f}" for v in fractions.values()))
    return "\n".join(rows)


__all__ = ["DEFAULT_DECAYS", "format_freeze_table", "frozen_fraction", "representable_values", "run_freeze_study"]
