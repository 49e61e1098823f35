"""The kernels' registry: for each op and implementation (``leapquant_jax.impls``), the kernel's entry
point and why it cannot take given inputs. ``leapquant_jax.dispatch`` (the core's one seam) reads it
and chooses; nothing here chooses.

    op          impl    entry point                    unsupported_reason's arguments
    step        triton  leapquant_step.leapquant_step  (config, state)
    step        mosaic  mosaic_step.leapquant_step     (config, state)
    flush       split   leapquant_flush.flush_split    (config, state)
    flush       fused   leapquant_flush.flush_fused    (config, state)
    flush       mosaic  mosaic_flush.leapquant_flush   (config, state)
    dense_step  triton  dense_step.dense_step          (values, token)
    dense_step  mosaic  mosaic_dense.dense_step        (values, token)
    chunk_scan  triton  chunk_scan.chunk_scan          (dk, dv, chunk)
    kda_scores  triton  kda_scores.kda_pair_scores     (dk, chunk)

Entry points take the reference's arguments: the step ``(config, state, token) -> (o, state)``,
the flush ``(config, state, *, only_full) -> state``, the dense step ``(values, token) -> (o,
values)``, the chunk kernels their references' (``leapquant_jax.chunk_ops``) with ``precision=``.
The LeapQuant kernels' reasons start with ``support.unsupported_reason`` (what every LeapQuant kernel
needs), so the step and the flush leave the reference together; an fp32 checkpoint (``fp32-w``)
runs on the Triton step and split flush, the others refuse it by name. A Mosaic GPU kernel compiled needs a
Hopper GPU; interpreted (no GPU) it runs anywhere.
"""

from __future__ import annotations

from leapquant_jax.impls import Impl

from . import chunk_scan, dense_step, kda_scores, leapquant_flush, leapquant_step, mosaic_dense, mosaic_flush
from . import mosaic_step, support
from ._compat import default_interpret
from .mosaic_shared import on_hopper


def _mosaic_device() -> str | None:
    if not default_interpret() and not on_hopper():
        return "the Mosaic GPU kernels run compiled on Hopper GPUs (sm_90) only"
    return None


def _leapquant_mosaic(reason):
    def why(config, state):
        return support.unsupported_reason(config, state) or _mosaic_device() or reason(config, state)
    return why


KERNELS = {
    ("step", Impl.TRITON): (leapquant_step.leapquant_step, support.unsupported_reason),
    ("step", Impl.MOSAIC): (mosaic_step.leapquant_step, _leapquant_mosaic(mosaic_step.unsupported_reason)),
    ("flush", Impl.SPLIT): (leapquant_flush.flush_split, support.unsupported_reason),
    ("flush", Impl.FUSED): (leapquant_flush.flush_fused, leapquant_flush.fused_unsupported_reason),
    ("flush", Impl.MOSAIC): (mosaic_flush.leapquant_flush, _leapquant_mosaic(mosaic_flush.unsupported_reason)),
    ("dense_step", Impl.TRITON): (dense_step.dense_step, dense_step.unsupported_reason),
    ("dense_step", Impl.MOSAIC): (mosaic_dense.dense_step,
                                  lambda values, token: _mosaic_device() or mosaic_dense.unsupported_reason(values, token)),
    ("chunk_scan", Impl.TRITON): (chunk_scan.chunk_scan, chunk_scan.unsupported_reason),
    ("kda_scores", Impl.TRITON): (kda_scores.kda_pair_scores, kda_scores.unsupported_reason),
}


def _entry(op: str, impl: Impl):
    try:
        return KERNELS[op, Impl(impl)]
    except (KeyError, ValueError):
        raise ValueError(f"no kernel runs the {op} as {impl!r}") from None


def entry_point(op: str, impl: Impl):
    """The kernel that runs ``op`` as ``impl``."""
    return _entry(op, impl)[0]


def unsupported_reason(op: str, impl: Impl, *operands) -> str | None:
    """Why the kernel of ``op`` on ``impl`` cannot take ``operands`` (``None`` when it can)."""
    return _entry(op, impl)[1](*operands)


__all__ = ["KERNELS", "entry_point", "unsupported_reason"]
