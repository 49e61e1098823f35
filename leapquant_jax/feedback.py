"""Per-step methods whose state carries more than the rounded values: error feedback (the last
rounding residual, added back before the next rounding) and stochastic rounding (a step counter
that seeds the rounding noise), as serving engines use for recurrent states.

``METHODS`` maps each method name to a zero-argument constructor of its method (a ``runner.Runner``
subclass like ``methods.PerStepMethod``).
"""

from __future__ import annotations

METHODS: dict = {}

__all__ = ["METHODS"]
