"""Pallas kernels for the LeapQuant step and flush and the dense per-step baselines (Triton backend;
a Mosaic GPU step, flush and dense step for Hopper).

Modules, each read top to bottom as kernel, wrapper, reference:

* ``leapquant_step``: one in-window decode step (two reads served from one pass over the codes).
* ``mosaic_step``: the same step on the Mosaic GPU backend (Hopper; 8 bits, GDN and KDA; measured
  faster than ``leapquant_step``, so ``auto`` takes it there).
* ``leapquant_flush``: window-end flush (reconstruct, fit Compensator Tokens, smooth, quantize).
* ``mosaic_flush``: the same flush on the Mosaic GPU backend (Hopper; 8 bits; the state held in
  shared memory; measured faster than the split flush, so ``auto`` takes it on Hopper).
* ``dense_step``: the fp32 and bf16 per-step GDN/KDA baselines.
* ``mosaic_dense``: the same on the Mosaic GPU backend (Hopper; dk = 128; faster than
  ``dense_step`` on the H200, so ``auto`` takes it on Hopper).
* ``chunk_scan``: the serial part of the chunkwise-parallel delta rule (prefill).
* ``kda_scores``: KDA's decayed pair scores inside a chunk (prefill).
* ``shared``: helpers of both LeapQuant kernels (the codes' planar layout, the window's decays).
* ``mosaic_shared``: helpers of the Mosaic GPU kernels (register layouts, the interpreter shim,
  launch sizing, the launch inside ``run_state`` and its batching rule).
* ``support``: which configs and states the kernels take (``unsupported_reason``), the token's
  shape checks (``check_token``).

``api`` is the seam ``leapquant_jax.dispatch`` calls. Imports run one way: ``api`` -> the kernel
modules (``leapquant_flush`` -> ``mosaic_flush``, which ``auto`` takes on Hopper) -> ``shared``,
``mosaic_shared``, ``support``, ``_compat``; no kernel module imports ``api``.
"""
