"""The per-step baselines (eq. 2): the state lives in one format and is re-quantized after every token.

``PerStepMethod(format_name)`` runs any format of ``formats`` (``fp32``, ``bf16``, ``fp16``,
``int8``, ``fp8``, ``int6``, ``int4`` and the direct, block, adapted and per-tile formats): each
step dequantizes the state to fp32, applies the dense update (``recurrence.recurrent_step_general``)
and rounds the new state back into the format once; the output is read from the unrounded fp32
state. The ``fp32`` and ``bf16`` states may run the dense step on a kernel (``impl``, resolved by
``dispatch``); every other format runs the reference.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax

from . import dispatch, windowed
from .formats import STATE_FORMAT_NAMES, get_state_format
from .quantizers import FloatTensor, QTensor
from .recurrence import Token, recurrent_step_general
from .runner import PerStepRunner, check_dense, check_token
from .impls import AUTO, check_request

Array = jax.Array

# Every per-step format, the base ones first.
PER_STEP_METHODS = STATE_FORMAT_NAMES
# Per-step formats whose step may run on a dense-step kernel (``PerStepMethod.impl``).
DENSE_KERNEL_FORMATS = ("fp32", "bf16")


@dataclasses.dataclass(frozen=True)
class PerStepMethod(PerStepRunner):
    """Per-step baseline (eq. 2): the state lives in ``format`` and is re-quantized after every token."""

    format_name: str = "fp32"
    # fp32 and bf16 states: which implementation runs the dense step (impls, dispatch.resolve)
    impl: str = AUTO

    def __post_init__(self):
        if self.format_name not in PER_STEP_METHODS:
            raise ValueError(f"per-step formats are {PER_STEP_METHODS}, got {self.format_name!r}")
        check_request(self.impl, ("dense_step",))
        if self.impl not in (AUTO, "reference") and self.format_name not in DENSE_KERNEL_FORMATS:
            raise ValueError(f"impl={self.impl!r}: the dense-step kernels run the fp32 and bf16 states only, "
                             f"not {self.format_name!r}")

    @property
    def name(self) -> str:
        return self.format_name

    def from_dense(self, state: Array, *, per_channel_decay: bool = False, key_heads: Optional[int] = None) -> QTensor:
        """Rounds ``[B, H, dk, dv]`` fp32 into the format."""
        check_dense(state)
        return get_state_format(self.format_name).quantize(state)

    def to_dense(self, state: QTensor) -> Array:
        """``[B, H, dk, dv]`` fp32."""
        return get_state_format(self.format_name).dequantize(state)

    def step_token(self, state: QTensor, token: Token, *, active: Optional[Array] = None):
        """General-form step: dequantize, dense fp32 update, re-quantize. Returns ``(o, state)``."""
        check_token(state.shape, token, active)
        if self.format_name in DENSE_KERNEL_FORMATS:
            o, values = dispatch.dense_step(state.values, token, impl=self.impl)
            new = FloatTensor(values=values)
        else:
            fmt = get_state_format(self.format_name)
            o, dense = recurrent_step_general(fmt.dequantize(state), token)
            new = fmt.quantize(dense)
        if active is not None:
            new = windowed.select_batch(active, new, state)
        return o, new


__all__ = ["DENSE_KERNEL_FORMATS", "PER_STEP_METHODS", "PerStepMethod"]
