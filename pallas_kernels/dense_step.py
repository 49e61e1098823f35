"""Dense per-step GDN/KDA decode step, state in fp32 or bf16: the baselines (docs/design.md §2, §6).

Why: the per-step baselines must run as Pallas kernels too, so the LeapQuant kernels are
compared Pallas against Pallas as well as against FLA's fp32 ``fused_recurrent`` kernels.

One program per (sequence, head, value block ``BV``). It loads the state tile
``S [dk, BV]`` once, computes in fp32

    u = beta (v - S^T b),  S' = Diag(exp(g)) S + w u^T,  o = S'^T q

and stores ``S'`` in place (the state input is aliased to the state output: in place when the
caller's ``jit`` donates the state, otherwise XLA copies it first). Rounding: only the store of
``S'`` rounds, to bf16 by round-to-nearest-even for a bf16 state (the per-step ``bf16`` method, eq. 2); ``o`` is read from the
unrounded fp32 ``S'``, as in ``PerStepMethod``.

Bytes moved per step and head (the count ``bench/kernels.py`` uses):
``2 * dk * dv * itemsize`` (state read + write) ``+ 4 * (3 dk + dv + 2)`` (q, w, b, v, g, beta;
KDA adds ``4 * (dk - 1)`` for its per-channel g) ``+ 4 * dv`` (o).

Tested with JAX 0.10.2 (interpret mode, CPU) and 0.11.2 (compiled, H200).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from leapquant_jax.recurrence import Token, recurrent_step_general

from ._compat import compiler_params, default_interpret, is_pow2, pl

STATE_DTYPES = ("float32", "bfloat16")
# Value columns per program (at most dv): the block ``bench.kernels`` times the dense steps with.
DEFAULT_BLOCK_V = 64


# ----------------------------------------------------------------------------- kernel


def _dense_step_kernel(q_ref, w_ref, b_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *, per_channel: bool):
    # q, w, b: [dk]; v: [BV]; g: [] or [dk]; beta: []; s: [dk, BV]
    s = s_ref[...].astype(jnp.float32)
    b = b_ref[...]
    u = beta_ref[...] * (v_ref[...] - jnp.sum(s * b[:, None], axis=0))        # [BV]
    alpha = jnp.exp(g_ref[...])
    s = (alpha[:, None] if per_channel else alpha) * s + w_ref[...][:, None] * u[None, :]
    o_ref[...] = jnp.sum(s * q_ref[...][:, None], axis=0)
    s_out_ref[...] = s.astype(s_out_ref.dtype)


# ----------------------------------------------------------------------------- wrapper


def check_dense_inputs(state: jax.Array, token: Token, block_v: int) -> None:
    """Raises ``ValueError``/``TypeError`` with a clear message for inputs the kernel cannot take."""
    if state.ndim != 4:
        raise ValueError(f"state must be [B, H, dk, dv], got shape {state.shape}")
    if str(state.dtype) not in STATE_DTYPES:
        raise TypeError(f"dense step kernel takes {STATE_DTYPES} states, got {state.dtype}")
    bsz, h, dk, dv = state.shape
    for name, x, shape in (("q", token.q, (bsz, h, dk)), ("w", token.w, (bsz, h, dk)), ("b", token.b, (bsz, h, dk)),
                           ("v", token.v, (bsz, h, dv)), ("beta", token.beta, (bsz, h))):
        if x.shape != shape:
            raise ValueError(f"token.{name} must be {shape} to match the state, got {x.shape}")
    if token.g.shape not in ((bsz, h), (bsz, h, dk)):
        raise ValueError(f"token.g must be {(bsz, h)} or {(bsz, h, dk)}, got {token.g.shape}")
    if not (is_pow2(dk) and is_pow2(dv) and dk >= 16 and dv >= 16):
        raise ValueError(f"dk and dv must be powers of two >= 16 (Triton tiles), got dk={dk}, dv={dv}")
    if not (is_pow2(block_v) and dv % block_v == 0):
        raise ValueError(f"block_v={block_v} must be a power of two dividing dv={dv}")


def default_block_v(state: jax.Array) -> int:
    """``DEFAULT_BLOCK_V`` value columns per program, at most ``dv``."""
    return min(DEFAULT_BLOCK_V, state.shape[-1]) if state.ndim == 4 else DEFAULT_BLOCK_V


def unsupported_reason(state: jax.Array, token: Token) -> str | None:
    """Why ``dense_step`` cannot take ``state [B, H, dk, dv]`` and ``token`` at its default block
    (``None`` when it can)."""
    try:
        check_dense_inputs(state, token, default_block_v(state))
    except (ValueError, TypeError) as err:
        return str(err)
    return None


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "interpret"))
def dense_step(state: jax.Array, token: Token, *, block_v: int | None = None, num_warps: int = 4,
               interpret: bool | None = None):
    """One dense step on a ``[B, H, dk, dv]`` fp32 or bf16 state.

    token: general-form ``Token`` with ``H`` value heads. Returns ``(o [B, H, dv] fp32, state)``.
    ``block_v``: value columns per program (``default_block_v``).
    """
    block_v = default_block_v(state) if block_v is None else block_v
    check_dense_inputs(state, token, block_v)
    interpret = default_interpret() if interpret is None else interpret
    bsz, h, dk, dv = state.shape
    per_channel = token.g.ndim == 3
    f32 = jnp.float32
    vec_k = pl.BlockSpec((None, None, dk), lambda i, j, c: (i, j, 0))
    vec_v = pl.BlockSpec((None, None, block_v), lambda i, j, c: (i, j, c))
    scalar = pl.BlockSpec((None, None), lambda i, j, c: (i, j))
    tile = pl.BlockSpec((None, None, dk, block_v), lambda i, j, c: (i, j, 0, c))
    kernel = functools.partial(_dense_step_kernel, per_channel=per_channel)
    o, new = pl.pallas_call(
        kernel,
        grid=(bsz, h, dv // block_v),
        in_specs=[vec_k, vec_k, vec_k, vec_v, vec_k if per_channel else scalar, scalar, tile],
        out_specs=[vec_v, tile],
        out_shape=[jax.ShapeDtypeStruct((bsz, h, dv), f32), jax.ShapeDtypeStruct(state.shape, state.dtype)],
        input_output_aliases={6: 1},
        compiler_params=compiler_params(num_warps=num_warps),
        interpret=interpret,
        name=f"dense_step_{'kda' if per_channel else 'gdn'}_{state.dtype}",
    )(token.q.astype(f32), token.w.astype(f32), token.b.astype(f32), token.v.astype(f32),
      token.g.astype(f32), token.beta.astype(f32), state)
    return o, new


def dense_step_bytes(dk: int, dv: int, itemsize: int, per_channel: bool) -> int:
    """Bytes one head moves per step (the docstring's count)."""
    return 2 * dk * dv * itemsize + 4 * (3 * dk + dv + 2) + (4 * (dk - 1) if per_channel else 0) + 4 * dv


# ----------------------------------------------------------------------------- reference


def dense_step_reference(state: jax.Array, token: Token, **_unused):
    """The per-step ``fp32``/``bf16`` method: dense fp32 update of the upcast state, stored back in its dtype."""
    o, new = recurrent_step_general(state.astype(jnp.float32), token)
    return o, new.astype(state.dtype)


__all__ = ["DEFAULT_BLOCK_V", "STATE_DTYPES", "check_dense_inputs", "default_block_v", "dense_step", "dense_step_bytes",
           "dense_step_reference", "unsupported_reason"]
