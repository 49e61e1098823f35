"""The implementations each kernel-backed op can run on, and the requests that choose among them.

An op is a computation of the core that has Pallas kernels beside its pure-JAX reference:

    op           implementations (the kernels in the order ``auto`` tries them)
    step         reference, mosaic, triton        LeapQuant's in-window decode step
    flush        reference, mosaic, split, fused  LeapQuant's window flush
    dense_step   reference, mosaic, triton        the fp32/bf16 per-step methods' step
    chunk_scan   reference, triton                the chunked form's serial scan over chunks
    kda_scores   reference, triton                the chunked form's KDA pair scores

``triton`` is the op's Pallas Triton kernel (every CUDA GPU); ``mosaic`` its Pallas Mosaic GPU
kernel (Hopper); the flush has two Triton kernels, ``split`` (three stages, the fp32 state through
device memory) and ``fused`` (one program per head, which skips heads whose window is not full).

A request (``LeapQuantConfig.impl``, ``PerStepMethod.impl``, ``chunk_delta_rule(impl=)``) is an
implementation's name or one of:

* ``"auto"`` (every default): on a GPU the first kernel that takes the inputs, else the reference;
  off a GPU the reference. Why: the kernels are the fast path on a GPU, and off one they only run
  interpreted, far slower than XLA.
* ``"pallas"``: the first kernel that takes the inputs on this device (interpreted off a GPU), an
  error naming why when none does. Why: checks and benchmarks that must run a kernel.

``"triton"`` asked of the flush means its split flush. ``leapquant_jax.dispatch.resolve`` turns a
request into an ``Impl``. A leaf module: it imports nothing of the package.
"""

from __future__ import annotations

import enum


class Impl(enum.StrEnum):
    """An implementation of an op (compares equal to its name)."""

    REFERENCE = "reference"
    TRITON = "triton"
    MOSAIC = "mosaic"
    SPLIT = "split"
    FUSED = "fused"


AUTO = "auto"
PALLAS = "pallas"

# op -> its implementations, the reference first, then the kernels in the order auto tries them:
# Mosaic GPU first where it exists (faster on Hopper, docs/performance.md), the fused flush never
# (auto takes it, beside the split flush, for few full windows: dispatch.MIN_FULL_FRACTION).
OPS: dict[str, tuple[Impl, ...]] = {
    "step": (Impl.REFERENCE, Impl.MOSAIC, Impl.TRITON),
    "flush": (Impl.REFERENCE, Impl.MOSAIC, Impl.SPLIT, Impl.FUSED),
    "dense_step": (Impl.REFERENCE, Impl.MOSAIC, Impl.TRITON),
    "chunk_scan": (Impl.REFERENCE, Impl.TRITON),
    "kda_scores": (Impl.REFERENCE, Impl.TRITON),
}
AUTO_ORDER: dict[str, tuple[Impl, ...]] = {op: tuple(i for i in impls if i not in (Impl.REFERENCE, Impl.FUSED))
                                           for op, impls in OPS.items()}
# Names an op takes for one of its implementations.
ALIASES: dict[tuple[str, str], Impl] = {("flush", "triton"): Impl.SPLIT}
REQUESTS = (AUTO, PALLAS) + tuple(Impl)


def request_for(op: str, impl: str) -> Impl | str:
    """``impl`` checked as a request for ``op``: ``"auto"``, ``"pallas"`` or the ``Impl`` it names.
    Raises ``ValueError`` naming the op's implementations otherwise."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")
    if impl in (AUTO, PALLAS):
        return impl
    if (op, impl) in ALIASES:
        return ALIASES[op, impl]
    if impl in OPS[op]:
        return Impl(impl)
    names = ", ".join((AUTO, PALLAS) + tuple(OPS[op]) + tuple(a for o, a in ALIASES if o == op))
    raise ValueError(f"impl={impl!r} is not an implementation of the {op}; it takes {names}")


def check_request(impl: str, ops: tuple[str, ...]) -> None:
    """Raises ``ValueError`` unless ``impl`` is a request every op of ``ops`` takes."""
    if not isinstance(impl, str):
        raise ValueError(f"impl must be a string, one of {REQUESTS}, got {impl!r}")
    for op in ops:
        request_for(op, impl)


__all__ = ["ALIASES", "AUTO", "AUTO_ORDER", "Impl", "OPS", "PALLAS", "REQUESTS", "check_request", "request_for"]
