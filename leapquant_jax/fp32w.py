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

Kernels: none yet, so ``impl`` ``"auto"`` and ``"reference"`` both give ``impl="reference"`` (the
dispatch then runs ``windowed``'s reference without asking the kernels), and ``"pallas"`` is
refused by name. A step kernel is LeapQuant's step reading an fp32 ``S0`` tile instead of codes,
scales and Compensator Tokens; its flush is the split flush's reconstruct stage alone.
"""

from __future__ import annotations

from .impls import AUTO, REQUESTS, Impl
from .state import LeapQuantConfig

NAME = "fp32-w"
# What makes a LeapQuant config this method: the identity residual format, nothing fitted.
FIXED = dict(residual_format="fp32", compensators=False, smoothing=False)
# The options it takes (``make_method("fp32-w", ...)``); the rest of ``LeapQuantConfig`` is fixed.
OPTIONS = ("window", "record_dtype", "impl")


def fp32w_config(**options) -> LeapQuantConfig:
    """The ``LeapQuantConfig`` of ``fp32-w``: ``window`` (records per window ``p``, default 16),
    ``record_dtype`` (default ``float32``) and ``impl`` (``auto`` or ``reference``); ``None`` keeps
    a default. Raises ``ValueError`` naming any other option, or a kernel request."""
    given = {k: v for k, v in options.items() if v is not None}
    others = sorted(set(given) - set(OPTIONS))
    if others:
        raise ValueError(f"method {NAME!r} keeps its checkpoint in fp32 as it is and takes only {list(OPTIONS)}, "
                         f"got {others}")
    impl = given.pop("impl", AUTO)
    if impl not in REQUESTS:
        raise ValueError(f"impl must be one of {REQUESTS}, got {impl!r}")
    if impl not in (AUTO, Impl.REFERENCE):
        raise ValueError(f"method {NAME!r} has no Pallas kernels yet: impl={impl!r} cannot run it; "
                         "pass impl='auto' or 'reference'")
    return LeapQuantConfig(**{**FIXED, "record_dtype": "float32", **given, "impl": "reference"})


__all__ = ["FIXED", "NAME", "OPTIONS", "fp32w_config"]
