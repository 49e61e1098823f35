"""Chooses between the Pallas kernels and the pure-JAX reference for the LeapQuant step and flush,
and for the per-step ``fp32``/``bf16`` methods' dense step.

``LeapQuantConfig.impl`` decides: ``"reference"`` always runs ``windowed``'s reference;
``"pallas"`` runs the kernels and fails with the kernels' reason where they cannot run
(never a silent fallback); ``"auto"`` runs the kernels on a GPU when they support the
shapes and the reference everywhere else. On a GPU, ``"auto"`` with a kernels package that
fails to import is an error, not a quiet switch to the (much slower) reference. Both paths
have the same signatures.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import windowed
from .recurrence import Token, recurrent_step_general
from .state import LeapQuantConfig, LeapQuantState


def load_kernels():
    """``(pallas_kernels.api, None)``, or ``(None, why)`` when the kernels package fails to import:
    the one place the core loads the kernels (they are optional at run time)."""
    try:
        from pallas_kernels import api
    except ImportError as err:
        return None, f"pallas_kernels is not importable ({err})"
    return api, None


def _resolve(impl: str, reason) -> str:
    # reason(api) -> why the kernels cannot take the inputs, or None
    if impl not in ("auto", "reference", "pallas"):
        raise ValueError(f"impl must be 'auto', 'reference' or 'pallas', got {impl!r}")
    if impl == "reference":
        return "reference"
    api, why = load_kernels()
    if why is None:
        why = reason(api)
    if impl == "pallas":
        if why is not None:
            raise ValueError(f"impl='pallas' cannot run here: {why}")
        return "pallas"
    on_gpu = jax.default_backend() == "gpu"
    if api is None and on_gpu:
        raise RuntimeError(f"impl='auto' on a GPU, but {why}; fix the installation or pass impl='reference'")
    return "pallas" if why is None and on_gpu else "reference"


def resolve_impl(config: LeapQuantConfig, state: LeapQuantState) -> str:
    """``"pallas"`` or ``"reference"`` for this config and state; raises if ``"pallas"`` cannot run."""
    return _resolve(config.impl, lambda api: api.unsupported_reason(config, state))


def resolve_dense_impl(impl: str, values: jax.Array, token: Token) -> str:
    """``"pallas"`` or ``"reference"`` for a per-step dense state ``values [B, H, dk, dv]`` (fp32 or
    bf16), by the same rule as ``resolve_impl``."""
    return _resolve(impl, lambda api: api.dense_unsupported_reason(values, token))


def dense_step(impl: str, values: jax.Array, token: Token) -> tuple[jax.Array, jax.Array]:
    """One per-step dense update ``(o [B, H, dv] fp32, new values in values.dtype)``: the new state is
    computed in fp32 and rounded to nearest even once; ``o`` is read from the unrounded state."""
    if resolve_dense_impl(impl, values, token) == "pallas":
        api, _ = load_kernels()
        return api.dense_step(values, token)
    o, new = recurrent_step_general(values.astype(jnp.float32), token)
    return o, new.astype(values.dtype)


def leapquant_step(config: LeapQuantConfig, state: LeapQuantState, token: Token):
    """One in-window step ``(o [B, H, dv], state)`` on the chosen implementation."""
    if resolve_impl(config, state) == "pallas":
        api, _ = load_kernels()
        return api.leapquant_step(config, state, token)
    return windowed.step_reference(config, state, token)


def leapquant_maybe_flush(config: LeapQuantConfig, state: LeapQuantState) -> LeapQuantState:
    """Flushes the sequences whose window is full (``pos == p``) on the chosen implementation.

    The kernel skips the other sequences itself (reading and writing nothing for them); the
    reference flushes every sequence and keeps the full ones (``windowed.maybe_flush``).
    """
    if resolve_impl(config, state) == "pallas":
        api, _ = load_kernels()
        full = state.pos >= config.window
        return jax.lax.cond(jnp.any(full), lambda s: api.leapquant_flush_full(config, s), lambda s: s, state)
    return windowed.maybe_flush(config, state)
