"""The one rule for an integer setting: a Python or NumPy integer, not a bool (``True`` is an
``int`` to Python but never a count), of at least a bound. Every layer checks its integer
arguments and config fields with these, the one-line error naming the setting.
"""

from __future__ import annotations

import numpy as np


def is_integer(value, low: int) -> bool:
    """Whether ``value`` is a Python or NumPy integer (a bool is not one) of at least ``low``."""
    return not isinstance(value, bool) and isinstance(value, (int, np.integer)) and value >= low


def check_integer(name: str, value, low: int = 1) -> int:
    """``int(value)``; ``ValueError("{name} must be an integer >= {low}, got {value!r}")`` unless
    ``is_integer(value, low)``."""
    if not is_integer(value, low):
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def check_positive(name: str, value) -> int:
    """``int(value)``; ``ValueError("{name} must be a positive integer, got {value!r}")`` unless
    ``is_integer(value, 1)``."""
    if not is_integer(value, 1):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


__all__ = ["check_integer", "check_positive", "is_integer"]
