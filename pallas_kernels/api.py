"""The seam ``leapquant_jax.dispatch`` calls: which configs and states the kernels take, and the two ops.

* ``unsupported_reason(config, state) -> str | None`` (from ``support``): why the kernels cannot
  run (``None`` if they can). Checked before any launch, so an explicit ``impl="pallas"`` fails
  with this reason.
* ``leapquant_step(config, state, token) -> (o [B, H, dv] fp32, state)``: the contract of
  ``windowed.step_reference`` (read ``u`` at ``l = pos``, append the record, output read at
  ``l = pos + 1``; no flush, no checkpoint write); on Hopper the Mosaic GPU step where it takes
  the state (``takes_mosaic_step``), else the Triton one.
* ``leapquant_flush(config, state) -> state``: the contract of ``windowed.flush_reference``
  (every sequence flushes), but for the buffer: the kernels leave its records, all past the
  reset ``pos`` and so never read, where the reference zeroes them. ``leapquant_flush_full`` flushes only the sequences whose window is
  full and leaves the others as they are (``windowed.maybe_flush``'s result without its
  select); which flush kernel runs depends on how many windows are full
  (``leapquant_flush.SPLIT_MIN_FULL_FRACTION``; on Hopper ``MOSAIC_MIN_FULL_FRACTION``, the
  Mosaic GPU flush in place of the split one where it takes the state).

* ``dense_step(values, token) -> (o [B, H, dv] fp32, values)``: the per-step ``fp32``/``bf16``
  methods' step (``recurrent_step_general``, the new state rounded to the state's dtype), on
  the Mosaic GPU dense step on Hopper where it takes the state (``takes_mosaic_dense``);
  ``dense_unsupported_reason(values, token)`` says when it cannot run.

What the LeapQuant kernels take: integer residuals at 8, 6 or 4 bits (no ``residual_format`` override),
``fit="subspace"`` (the exact SVD fit stays in the reference), ``dk`` and ``dv`` in
{16, 32, 64, 128} (``dk`` a multiple of 64 at 6 bits and of 32 at 4 bits: code planes of at least 16 rows), a power-of-two window from 2 to 32 and
``r <= 8`` Compensator Tokens. The window buffer may keep its key records per key head
(GVA: ``k [B, Hk, p, dk]`` with ``Hk`` dividing ``H``); the step then takes ``token.w`` at ``Hk``
heads, or at a number dividing ``Hk`` (``windowed.match_key_heads``).
"""

from __future__ import annotations

from leapquant_jax.recurrence import Token
from leapquant_jax.state import LeapQuantConfig, LeapQuantState

from . import leapquant_flush as _flush
from . import leapquant_step as _step
from . import dense_step as _dense
from . import mosaic_dense as _mosaic_dense
from . import mosaic_step as _mosaic_step
from ._compat import default_interpret
from .chunk_scan import chunk_scan
from .kda_scores import kda_pair_scores
from .mosaic_shared import on_hopper
from .support import unsupported_reason


def takes_mosaic_step(config: LeapQuantConfig, state: LeapQuantState) -> bool:
    """Whether ``leapquant_step`` runs the Mosaic GPU step (``mosaic_step``): compiled on a Hopper
    GPU, for the states it takes (GDN and KDA, 8 bits, 128 x 128 heads); measured faster than the
    Triton step there (``mosaic_step``'s docstring)."""
    return not default_interpret() and on_hopper() and _mosaic_step.unsupported_reason(config, state) is None


def leapquant_step(config: LeapQuantConfig, state: LeapQuantState, token: Token):
    """One in-window step on the kernels: ``(o [B, H, dv] fp32, state with pos + 1)``."""
    if takes_mosaic_step(config, state):
        return _mosaic_step.leapquant_step(config, state, token)
    return _step.leapquant_step(config, state, token)


def leapquant_flush(config: LeapQuantConfig, state: LeapQuantState) -> LeapQuantState:
    """Flush of every sequence on the kernels (``windowed.flush_reference``'s contract)."""
    return _flush.leapquant_flush(config, state, only_full=False)


def leapquant_flush_full(config: LeapQuantConfig, state: LeapQuantState) -> LeapQuantState:
    """Flush of the sequences whose window is full (``pos >= p``); the others are untouched."""
    return _flush.leapquant_flush(config, state, only_full=True)


def _dense_block(values) -> int:
    return min(_dense.DEFAULT_BLOCK_V, values.shape[-1]) if values.ndim == 4 else _dense.DEFAULT_BLOCK_V


def dense_unsupported_reason(values, token: Token) -> str | None:
    """Why ``dense_step`` cannot take a ``[B, H, dk, dv]`` state and ``token``; ``None`` when it can."""
    try:
        _dense.check_dense_inputs(values, token, _dense_block(values))
    except (ValueError, TypeError) as err:
        return str(err)
    return None


def takes_mosaic_dense(values, token: Token) -> bool:
    """Whether ``dense_step`` runs the Mosaic GPU dense step (``mosaic_dense``): compiled on a Hopper
    GPU, for the states it takes (``dk = 128``); measured faster than the Triton one there
    (``mosaic_dense``'s docstring)."""
    return not default_interpret() and on_hopper() and _mosaic_dense.unsupported_reason(values, token) is None


def dense_step(values, token: Token):
    """One per-step dense update on the kernel: ``(o [B, H, dv] fp32, new values [B, H, dk, dv])``."""
    if takes_mosaic_dense(values, token):
        return _mosaic_dense.dense_step(values, token)
    return _dense.dense_step(values, token, block_v=_dense_block(values))


__all__ = ["chunk_scan", "dense_step", "dense_unsupported_reason", "kda_pair_scores", "leapquant_flush", "leapquant_flush_full", "leapquant_step",
           "takes_mosaic_dense", "takes_mosaic_step", "unsupported_reason"]
