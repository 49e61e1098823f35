"""Which configs and states the LeapQuant kernels take: ``unsupported_reason`` (every step and
flush kernel's first condition: ``api`` gives it to ``leapquant_jax.dispatch``, and the kernels
check it themselves before a launch) and ``check_token``, the token's shapes against the state.

The kernels take integer residuals at 8, 6, 4 or 2 bits (``INT_WIDTHS``), or ``fp32-w``'s
checkpoint: an fp32 residual (``residual_format="fp32"``, a ``FloatTensor``) without Compensator
Tokens or smoothing, read as it is and only rebuilt by the flush (no other ``residual_format``);
the subspace fit (the exact SVD fit stays in the reference), ``dk`` and ``dv`` in ``HEAD_SIZES``
(``dk`` a multiple of 64 at 6 and 2 bits and of 32 at 4 bits: code parts of at least
``MIN_PART_ROWS`` rows, a Triton dot's least size), a power-of-two window up to ``MAX_WINDOW``
and at most ``MAX_RANK`` Compensator Tokens (the fit's Cholesky factor is unrolled up to there).
The buffer may keep its key records per key head (GVA: ``k [B, Hk, p, dk]``, ``Hk`` dividing
``H``). Which kernels take the fp32 checkpoint: the Triton step and split flush
(``leapquant_step``, ``leapquant_flush``), each saying so itself."""

from __future__ import annotations

from leapquant_jax.quantizers import INT_WIDTHS, FloatTensor, IntTensor, code_parts
from leapquant_jax.recurrence import Token
from leapquant_jax.state import LeapQuantConfig, LeapQuantState

from ._compat import is_pow2

HEAD_SIZES = (16, 32, 64, 128)
MIN_PART_ROWS = 16    # key rows of a code part, at least: a Triton dot's least size
MAX_WINDOW = 32
MAX_RANK = 8


def unsupported_reason(config: LeapQuantConfig, state: LeapQuantState) -> str | None:
    """Why the Pallas kernels cannot take ``config`` and ``state``; ``None`` when they can."""
    fp32 = config.residual_format == "fp32"
    if config.residual_format is not None and not fp32:
        return (f"residual_format={config.residual_format!r}: the kernels read integer residuals or an fp32 "
                "checkpoint (fp32-w) only")
    if fp32 and (config.effective_rank or config.smoothing):
        return ("an fp32 residual with Compensator Tokens or smoothing: the kernels take an fp32 checkpoint as "
                "fp32-w keeps it, without them (its flush only rebuilds the state)")
    if not fp32 and config.bits not in INT_WIDTHS:
        return f"bits={config.bits}: the kernels take 8, 6, 4 or 2"
    if config.fit != "subspace":
        return f"fit={config.fit!r}: the kernels fit Compensator Tokens by subspace iteration only"
    if not is_pow2(config.window) or not 2 <= config.window <= MAX_WINDOW:
        return f"window={config.window}: the kernels take a power of two from 2 to {MAX_WINDOW}"
    if config.effective_rank > MAX_RANK:
        return f"rank={config.effective_rank}: the kernels take at most {MAX_RANK} Compensator Tokens"
    ckpt, buf = state.checkpoint, state.buffer
    if fp32:
        if not isinstance(ckpt.residual, FloatTensor) or ckpt.residual.values.dtype != "float32":
            return "the state's residual is not an fp32 tensor (residual_format='fp32')"
    elif not isinstance(ckpt.residual, IntTensor) or ckpt.residual.bits != config.bits:
        return "the state's residual is not an integer tensor of the config's bits"
    if buf.k.ndim != 4 or buf.u.ndim != 4:
        return f"the window buffer must be [B, Hk, p, dk] / [B, H, p, dv], got {buf.k.shape} / {buf.u.shape}"
    b, hk, p, dk = buf.k.shape
    h, dv = buf.u.shape[1], buf.u.shape[-1]
    if buf.u.shape[:3] != (b, h, p) or hk < 1 or h % hk:
        return (f"the window buffer's key records {buf.k.shape} and values {buf.u.shape} must be [B, Hk, p, dk] and "
                "[B, H, p, dv] with Hk dividing H")
    if p != config.window:
        return f"the buffer holds {p} slots but window={config.window}"
    if dk not in HEAD_SIZES or dv not in HEAD_SIZES:
        return f"head sizes dk={dk}, dv={dv}: the kernels take {HEAD_SIZES}"
    if fp32 and ckpt.residual.values.shape != (b, h, dk, dv):
        return f"the fp32 checkpoint must be [B, H, dk, dv] = {(b, h, dk, dv)}, got {ckpt.residual.values.shape}"
    if not fp32 and dk % (MIN_PART_ROWS * code_parts(config.bits)):
        return (f"dk={dk} at {config.bits} bits: each of the {code_parts(config.bits)} code parts must be at least "
                f"{MIN_PART_ROWS} rows (dk a multiple of {MIN_PART_ROWS * code_parts(config.bits)})")
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


def check_token(state: LeapQuantState, token: Token) -> None:
    """Raises ``ValueError`` when the token does not match the state (``token.w`` at the state's
    ``Hk`` key heads: ``windowed.match_key_heads`` brings it there)."""
    bsz, h, dk, dv = state.shape
    hk = state.key_heads
    for name, x, shape in (("q", token.q, (bsz, h, dk)), ("w", token.w, (bsz, hk, dk)), ("b", token.b, (bsz, h, dk)),
                           ("v", token.v, (bsz, h, dv)), ("beta", token.beta, (bsz, h))):
        if x.shape != shape:
            raise ValueError(f"token.{name} must be {shape} to match the state, got {x.shape}")
    gshape = (bsz, h, dk) if state.per_channel_decay else (bsz, h)
    if token.g.shape != gshape:
        kind = "per-channel (KDA)" if state.per_channel_decay else "scalar (GDN)"
        raise ValueError(f"token.g must be {gshape}: the state holds {kind} decays; got {token.g.shape}")


__all__ = ["HEAD_SIZES", "MAX_RANK", "MAX_WINDOW", "MIN_PART_ROWS", "check_token", "unsupported_reason"]
