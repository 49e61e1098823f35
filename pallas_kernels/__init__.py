"""Pallas kernels for LeapQuant's step and flush, the dense per-step baselines and the chunked
form's serial parts: Triton everywhere, Mosaic GPU on Hopper. Each kernel has the pure-JAX
reference's contract (``leapquant_jax``) and is checked against it in interpret mode on the CPU.

Modules, each read top to bottom as kernel, wrapper, reference:

* ``leapquant_step`` / ``mosaic_step``: one in-window decode step (Triton; Mosaic GPU at 8, 6, 4 and 2 bits).
* ``leapquant_flush`` / ``mosaic_flush``: the window flush (Triton's split and fused flushes;
  Mosaic GPU at 8, 6, 4 and 2 bits).
* ``dense_step`` / ``mosaic_dense``: the fp32 and bf16 per-step baselines' step.
* ``chunk_scan``, ``kda_scores``: the chunked form's serial scan and KDA's pair scores (prefill).
* ``shared``, ``mosaic_shared``: helpers of the Triton and the Mosaic GPU kernels; ``support``:
  which configs and states the LeapQuant kernels take; ``_compat``: version shims.
* ``api``: the registry ``leapquant_jax.dispatch`` (the core's one seam) reads: each op's kernels
  and their ``unsupported_reason``. It chooses nothing.

Imports run one way: ``api`` -> the kernel modules -> ``shared``, ``mosaic_shared``, ``support``,
``_compat`` -> the core's leaf modules (``state``, ``quantizers``, ``recurrence``, ``compensators``,
``windowed``, ``chunk_ops``, ``impls``); no kernel module imports ``api``. Why each kernel exists,
and what it measured: docs/performance.md.
"""
