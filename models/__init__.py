"""Hybrid linear-attention language models (Qwen3-Next, Qwen3.5, Kimi-Linear) in JAX, decoding
with a pluggable recurrent-state format (``leapquant_jax.make_method``). See ``models/base.py``."""
