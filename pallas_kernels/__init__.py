"""Pallas (Triton backend) kernels for the LeapQuant step and flush and the dense per-step baselines.

Modules, each read top to bottom as kernel, wrapper, reference:

* ``leapquant_step``: one in-window decode step (two reads served from one pass over the codes).
* ``leapquant_flush``: window-end flush (reconstruct, fit Compensator Tokens, smooth, quantize).
* ``dense_step``: the fp32 and bf16 per-step GDN/KDA baselines.

``api`` is the seam ``leapquant_jax.dispatch`` calls.
"""
