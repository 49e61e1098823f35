"""The one dispatch: which implementation runs each kernel-backed op, and the core's one seam to the
kernels (``pallas_kernels``, imported here and nowhere else in the core, lazily: it is optional).

``resolve(op, impl, *operands)`` turns a request (``impls``: ``"auto"``, ``"pallas"`` or an
implementation's name) into the ``Impl`` that runs ``op`` on ``operands`` (the arguments of the op's
``unsupported_reason``: ``(config, state)`` for the step and the flush, ``(values, token)`` for the
dense step, ``(dk, dv, chunk)`` for the chunk scan, ``(dk, chunk)`` for KDA's pair scores):

* ``"reference"`` is always the reference;
* an explicit kernel runs, or raises ``ValueError`` with the kernel's reason (never a silent fallback);
* ``"auto"`` takes the first kernel of ``impls.AUTO_ORDER[op]`` whose reason is ``None`` on a GPU,
  the reference otherwise; ``"pallas"`` the same on any device, and raises when none runs. Mosaic
  GPU kernels are candidates only on a GPU (interpreted, the Triton kernels are the ones checked);
* on a GPU, ``"auto"`` with a kernels package that fails to import is an error, not a quiet
  switch to the much slower reference.

The ops below run what ``resolve`` chose, with the reference's signatures. A flush of the full
windows only on a kernel in ``SELF_SKIPPING`` (the Mosaic GPU and fused flushes read nothing for
a sequence they do not flush) runs on every step with no decision on the host. The split flush,
which copies every head, runs in a loop of at most one turn (``_at_most_once``); under ``"auto"``
or ``"pallas"`` only where at least ``MIN_FULL_FRACTION`` of the batch's windows are full, the
fused flush taking them otherwise. A kernel's
``custom_jvp`` and its reference derivative are wired by the core module that calls it
(``chunked``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import windowed
from .impls import AUTO, AUTO_ORDER, PALLAS, Impl, request_for
from .recurrence import Token, recurrent_step_general
from .state import LeapQuantConfig, LeapQuantState

# The split flush of full windows under auto or pallas runs where at least this fraction of the
# batch's windows is full, the fused one otherwise. Why: the measured break-even of the two on the
# H200 at batch 512, per decay kind (False: GDN, True: KDA; docs/performance.md, "Which
# implementation auto takes").
MIN_FULL_FRACTION = {False: 0.22, True: 0.13}
# Flush kernels that, with ``only_full``, read nothing for a sequence whose window is not full and
# next to nothing when no window is: they run on every step without a decision on the host.
SELF_SKIPPING = (Impl.FUSED, Impl.MOSAIC)


def load_kernels():
    """``(pallas_kernels.api, None)``, or ``(None, why)`` when the kernels package fails to import."""
    try:
        from pallas_kernels import api
    except ImportError as err:
        return None, f"pallas_kernels is not importable ({err})"
    return api, None


def resolve(op: str, impl: str, *operands) -> Impl:
    """The ``Impl`` that runs ``op`` for the request ``impl`` on ``operands`` (module docstring).

    Raises ``ValueError`` for an unknown request or one that cannot run here (naming why), and
    ``RuntimeError`` for ``"auto"`` on a GPU whose kernels package fails to import.
    """
    choice = request_for(op, impl)
    if choice is Impl.REFERENCE:
        return choice
    api, broken = load_kernels()
    on_gpu = jax.default_backend() == "gpu"
    if isinstance(choice, Impl):
        why = broken or api.unsupported_reason(op, choice, *operands)
        if why is not None:
            raise ValueError(f"impl={impl!r} cannot run the {op} here: {why}")
        return choice
    if broken is not None:
        if choice == AUTO and not on_gpu:
            return Impl.REFERENCE
        if choice == AUTO:
            raise RuntimeError(f"impl='auto' on a GPU, but {broken}; fix the installation or pass impl='reference'")
        raise ValueError(f"impl={impl!r} cannot run the {op} here: {broken}")
    if choice == AUTO and not on_gpu:
        return Impl.REFERENCE
    why = None
    for candidate in AUTO_ORDER[op]:
        if candidate is Impl.MOSAIC and not on_gpu:
            continue
        why = api.unsupported_reason(op, candidate, *operands)
        if why is None:
            return candidate
    if choice == PALLAS:
        raise ValueError(f"impl={impl!r} cannot run the {op} here: {why}")
    return Impl.REFERENCE


def takes(op: str, impl: Impl, *operands) -> bool:
    """Whether the kernel of ``op`` on ``impl`` takes ``operands`` (its reason is ``None``)."""
    api, broken = load_kernels()
    return broken is None and api.unsupported_reason(op, impl, *operands) is None


def kernel(op: str, impl: Impl):
    """The kernel entry point of ``op`` on ``impl`` (not the reference), from ``pallas_kernels.api``."""
    api, broken = load_kernels()
    if broken is not None:
        raise ValueError(f"impl={str(impl)!r} cannot run the {op} here: {broken}")
    return api.entry_point(op, impl)


def leapquant_step(config: LeapQuantConfig, state: LeapQuantState, token: Token, *, impl: str | None = None):
    """One in-window step ``(o [B, H, dv] fp32, state with pos + 1)`` (``windowed.step_reference``'s
    contract) on ``impl`` (``None``: ``config.impl``)."""
    chosen = resolve("step", config.impl if impl is None else impl, config, state)
    if chosen is Impl.REFERENCE:
        return windowed.step_reference(config, state, token)
    return kernel("step", chosen)(config, state, token)


def leapquant_flush(config: LeapQuantConfig, state: LeapQuantState, *, only_full: bool = False,
                    impl: str | None = None) -> LeapQuantState:
    """The window flush on ``impl`` (``None``: ``config.impl``): every sequence
    (``windowed.flush_reference``'s contract), or with ``only_full`` the sequences whose window is
    full (``pos >= p``; ``windowed.maybe_flush``'s), the others untouched. The kernels leave the
    buffer's records, all past the reset ``pos`` and so never read, where the reference zeroes them.
    """
    request = config.impl if impl is None else impl
    chosen = resolve("flush", request, config, state)
    if chosen is Impl.REFERENCE:
        return windowed.maybe_flush(config, state) if only_full else windowed.flush_reference(config, state)
    run = kernel("flush", chosen)
    if not only_full:
        return run(config, state, only_full=False)
    if chosen in SELF_SKIPPING:
        return run(config, state, only_full=True)
    full = state.pos >= config.window
    if not (request in (AUTO, PALLAS) and takes("flush", Impl.FUSED, config, state)):
        return _at_most_once(jnp.any(full), lambda s: run(config, s, only_full=True), state)
    many = jnp.mean(full.astype(jnp.float32)) >= MIN_FULL_FRACTION[state.per_channel_decay]
    state = _at_most_once(many, lambda s: run(config, s, only_full=True), state)
    return kernel("flush", Impl.FUSED)(config, state, only_full=True)


def _at_most_once(pred: jax.Array, fn, operand):
    """``fn(operand)`` where ``pred`` (a scalar bool), else ``operand``: a loop of at most one turn,
    for a flush that costs the same whatever the positions (the split flush's fit runs in XLA).
    Why not ``lax.cond``: XLA gives a conditional's result a buffer of its own when its branches
    yield different values, so the branch that does nothing copies the state into it, on every
    step that flushes nothing; a loop updates its carried state in place. Either waits on the
    device for its predicate; the kernels in ``SELF_SKIPPING`` need no decision (docs/performance.md)."""
    def body(carry):
        _, x = carry
        return jnp.zeros((), bool), fn(x)

    return jax.lax.while_loop(lambda carry: carry[0], body, (pred, operand))[1]


def dense_step(values: jax.Array, token: Token, *, impl: str = AUTO) -> tuple[jax.Array, jax.Array]:
    """One per-step dense update of ``values [B, H, dk, dv]`` (fp32 or bf16) on ``impl``:
    ``(o [B, H, dv] fp32, new values in values.dtype)``, the new state computed in fp32 and rounded
    to nearest even once, ``o`` read from the unrounded state."""
    chosen = resolve("dense_step", impl, values, token)
    if chosen is not Impl.REFERENCE:
        return kernel("dense_step", chosen)(values, token)
    o, new = recurrent_step_general(values.astype(jnp.float32), token)
    return o, new.astype(values.dtype)


__all__ = ["MIN_FULL_FRACTION", "SELF_SKIPPING", "dense_step", "kernel", "leapquant_flush", "leapquant_step",
           "load_kernels", "resolve", "takes"]
