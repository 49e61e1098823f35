"""``fp32-w``: the lossless windowed state (ReplaySSM's scheme) on LeapQuant's window machinery.

The state is a ``LeapQuantState`` whose checkpoint keeps ``S0 [B, H, dk, dv]`` in fp32 as it is:
a ``FloatTensor`` residual in the identity format (``residual_format="fp32"``), no Compensator
Tokens (``comp_k [B, H, 0, dk]``, ``comp_u [B, H, 0, dv]``, zero bytes) and no smoothing scales
(``None``). Its window buffer is LeapQuant's (``WindowBuffer``: ``p`` records, one key record per
key head with GVA, per-sequence ``pos``), in fp32.

A step reads ``u`` and ``o`` from the checkpoint and the records (eq. 10 with an fp32 ``S0``) and
appends its record, writing no state. After ``p`` records the flush rebuilds ``S_p``
(``windowed.reconstruct_reference``) and keeps it as the next checkpoint: the identity format
stores it unchanged, with no fit and no rounding. The read, the record append and the
reconstruction are ``windowed``'s, the same code as LeapQuant's; every output is the dense fp32
recurrence's up to the order of its sums.

Records default to fp32: a record's ``u`` depends on the state, so rounding it to 16 bits would
make the method lossy (pass ``record_dtype`` to study that). Per head of ``128 x 128`` and
``p = 16``: a 64 KiB checkpoint and 8 KiB of record values per value head, 8 KiB of record keys per
key head, against the fp32 state's 64 KiB. A step reads the checkpoint and the records and writes
one record; a flush reads them once more and writes the checkpoint.

Kernels (``impl``, through ``dispatch`` as LeapQuant's): ``"auto"`` (default; the kernels on a
GPU, the reference elsewhere), ``"reference"``, ``"pallas"`` or ``"triton"`` (the kernels, an
error naming why where they cannot run). The step is LeapQuant's Triton step reading the fp32
``S0`` tile in place of codes, scales and Compensator Tokens; the flush is the split flush's
first stage alone, ``S_p`` written over the checkpoint (``pallas_kernels.leapquant_flush``). The
Mosaic GPU kernels read integer codes only: ``"mosaic"`` is refused, and ``auto`` takes Triton on
Hopper too. ``pallas_kernels.support.unsupported_reason`` says which states the kernels take.
"""

from __future__ import annotations

from .impls import AUTO, PALLAS, Impl
from .state import LeapQuantConfig

NAME = "fp32-w"
# What makes a LeapQuant config this method: the identity residual format, nothing fitted.
FIXED = dict(residual_format="fp32", compensators=False, smoothing=False)
# The options it takes (``make_method("fp32-w", ...)``); the rest of ``LeapQuantConfig`` is fixed.
OPTIONS = ("window", "record_dtype", "impl")
# The requests it takes: its kernels are the Triton step and split flush (``"triton"`` names both).
IMPLS = (AUTO, PALLAS, Impl.REFERENCE, Impl.TRITON)


def fp32w_config(**options) -> LeapQuantConfig:
    """The ``LeapQuantConfig`` of ``fp32-w``: ``window`` (records per window ``p``, default 16),
    ``record_dtype`` (default ``float32``) and ``impl`` (one of ``IMPLS``, default ``auto``);
    ``None`` keeps a default. Raises ``ValueError`` naming any other option or request."""
    given = {k: v for k, v in options.items() if v is not None}
    others = sorted(set(given) - set(OPTIONS))
    if others:
        raise ValueError(f"method {NAME!r} keeps its checkpoint in fp32 as it is and takes only {list(OPTIONS)}, "
                         f"got {others}")
    impl = given.get("impl", AUTO)
    if impl not in IMPLS:
        raise ValueError(f"method {NAME!r} runs on the reference or the Triton step and split flush: impl={impl!r} "
                         f"cannot run it; pass one of {[str(i) for i in IMPLS]}")
    return LeapQuantConfig(**{**FIXED, "record_dtype": "float32", **given})


__all__ = ["FIXED", "IMPLS", "NAME", "OPTIONS", "fp32w_config"]
