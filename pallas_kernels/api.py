"""The seam ``leapquant_jax.dispatch`` calls: which configs and states the kernels take, and the two ops.

* ``unsupported_reason(config, state) -> str | None``: why the kernels cannot run (``None`` if
  they can). Checked before any launch, so an explicit ``impl="pallas"`` fails with this reason.
* ``leapquant_step(config, state, token) -> (o [B, H, dv] fp32, state)``: the contract of
  ``windowed.step_reference`` (read ``u`` at ``l = pos``, append the record, output read at
  ``l = pos + 1``; no flush, no checkpoint write).
* ``leapquant_flush(config, state) -> state``: the contract of ``windowed.flush_reference``
  (every sequence flushes). ``leapquant_flush_full`` flushes only the sequences whose window is
  full and leaves the others as they are (``windowed.maybe_flush``'s result without its
  select); which flush kernel runs depends on how many windows are full
  (``leapquant_flush.SPLIT_MIN_FULL_FRACTION``).

What the kernels take: integer residuals at 8, 6 or 4 bits (no ``residual_format`` override),
``fit="subspace"`` (the exact SVD fit stays in the reference), ``dk`` and ``dv`` in
{16, 32, 64, 128} (``dk`` a multiple of 64 at 6 bits and of 32 at 4 bits: code planes of at least 16 rows), a power-of-two window from 2 to 32 and
``r <= 8`` Compensator Tokens.
"""

from __future__ import annotations

from leapquant_jax.quantizers import IntTensor
from leapquant_jax.recurrence import Token
from leapquant_jax.state import LeapQuantConfig, LeapQuantState

from . import leapquant_flush as _flush
from . import leapquant_step as _step
from ._compat import is_pow2

HEAD_SIZES = (16, 32, 64, 128)
MAX_WINDOW = 32
MAX_RANK = 8


def unsupported_reason(config: LeapQuantConfig, state: LeapQuantState) -> str | None:
    """Why the Pallas kernels cannot take ``config`` and ``state``; ``None`` when they can."""
    if config.residual_format is not None:
        return f"residual_format={config.residual_format!r}: the kernels read integer residuals only"
    if config.bits not in (8, 6, 4):
        return f"bits={config.bits}: the kernels take 8, 6 or 4"
    if config.fit != "subspace":
        return f"fit={config.fit!r}: the kernels fit Compensator Tokens by subspace iteration only"
    if not is_pow2(config.window) or not 2 <= config.window <= MAX_WINDOW:
        return f"window={config.window}: the kernels take a power of two from 2 to {MAX_WINDOW}"
    if config.effective_rank > MAX_RANK:
        return f"rank={config.effective_rank}: the kernels take at most {MAX_RANK} Compensator Tokens"
    ckpt, buf = state.checkpoint, state.buffer
    if not isinstance(ckpt.residual, IntTensor) or ckpt.residual.bits != config.bits:
        return "the state's residual is not an integer tensor of the config's bits"
    if buf.k.ndim != 4 or buf.u.ndim != 4:
        return f"the window buffer must be [B, H, p, dk] / [B, H, p, dv], got {buf.k.shape} / {buf.u.shape}"
    b, h, p, dk = buf.k.shape
    dv = buf.u.shape[-1]
    if p != config.window:
        return f"the buffer holds {p} slots but window={config.window}"
    if dk not in HEAD_SIZES or dv not in HEAD_SIZES:
        return f"head sizes dk={dk}, dv={dv}: the kernels take {HEAD_SIZES}"
    if config.bits == 6 and dk % 64:
        return f"dk={dk} at 6 bits: each of the four code planes must be at least 16 rows"
    if config.bits == 4 and dk % 32:
        return f"dk={dk} at 4 bits: each code plane must be at least 16 rows"
    if buf.g.shape not in ((b, h, p), (b, h, p, dk)):
        return f"buffer log-decays must be [B, H, p] or [B, H, p, dk], got {buf.g.shape}"
    if str(buf.k.dtype) != config.record_dtype:
        return f"the buffer holds {buf.k.dtype} records but record_dtype={config.record_dtype!r}"
    if config.smoothing and ckpt.smooth is None:
        return "smoothing is on but the checkpoint has no smoothing scales"
    r = config.effective_rank
    if ckpt.comp_k.shape[-2] != r or ckpt.comp_u.shape[-2] != r:
        return f"the checkpoint holds {ckpt.comp_k.shape[-2]} Compensator Tokens, the config {r}"
    if state.pos.shape != (b,):
        return f"pos must be [B] = ({b},), got {state.pos.shape}"
    return None


def leapquant_step(config: LeapQuantConfig, state: LeapQuantState, token: Token):
    """One in-window step on the kernels: ``(o [B, H, dv] fp32, state with pos + 1)``."""
    return _step.leapquant_step(config, state, token)


def leapquant_flush(config: LeapQuantConfig, state: LeapQuantState) -> LeapQuantState:
    """Flush of every sequence on the kernels (``windowed.flush_reference``'s contract)."""
    return _flush.leapquant_flush(config, state, only_full=False)


def leapquant_flush_full(config: LeapQuantConfig, state: LeapQuantState) -> LeapQuantState:
    """Flush of the sequences whose window is full (``pos >= p``); the others are untouched."""
    return _flush.leapquant_flush(config, state, only_full=True)


__all__ = ["leapquant_flush", "leapquant_flush_full", "leapquant_step", "unsupported_reason"]
