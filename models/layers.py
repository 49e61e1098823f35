"""Small pieces the hybrid models share, each matched to the checkpoint's own code.

Element-wise work (norms, gates, softmax, RoPE) is float32 whatever the dtype of the weights
(bf16 checkpoints stay bf16 in memory). Matmuls follow the model's ``compute`` setting:

* ``"exact"``: fp32 operands at ``Precision.HIGHEST``. A TF32 or bf16-pass matmul on the GPU
  would add an error of its own to the state-format comparisons (``score``, ``eval``), where
  only the recurrent state may differ.
* ``"fast"``: bf16 operands with fp32 accumulation, what serving engines run (``generate``,
  ``bench.decode``); attention KV caches are then held in bf16. The recurrence and its state
  stay in fp32 or the state method's format either way.

Shapes: ``B`` batch, ``T`` tokens, ``H`` heads, ``D`` hidden size.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array
F32 = jnp.float32
EXACT, FAST = "exact", "fast"
COMPUTE_MODES = (EXACT, FAST)
L2NORM_EPS = 1e-6


def kv_dtype(compute: str):
    """The dtype attention caches are held in: fp32 (``exact``) or bf16 (``fast``)."""
    return F32 if compute == EXACT else jnp.bfloat16


# ----------------------------------------------------------------------------- projections


def fast_operands(*xs: Array) -> tuple[Array, ...]:
    """Operands of a ``fast`` matmul: rounded to bf16; on the CPU, whose XLA dot has no bf16 x bf16
    -> fp32 form for every shape, widened back to fp32 (a product of two bf16 values is exact in
    fp32, so the result is the same bf16-operand, fp32-accumulated matmul)."""
    xs = tuple(x.astype(jnp.bfloat16) for x in xs)
    return tuple(x.astype(F32) for x in xs) if jax.default_backend() == "cpu" else xs


def einsum(spec: str, a: Array, b: Array, *, compute: str = EXACT) -> Array:
    """``jnp.einsum(spec, a, b)`` under ``compute`` (module docstring); the result is float32."""
    if compute == EXACT:
        return jnp.einsum(spec, a.astype(F32), b.astype(F32), precision=jax.lax.Precision.HIGHEST)
    if compute != FAST:
        raise ValueError(f"compute must be one of {COMPUTE_MODES}, got {compute!r}")
    return jnp.einsum(spec, *fast_operands(a, b), preferred_element_type=F32, precision=jax.lax.Precision.HIGHEST)


def linear(x: Array, weight: Array, bias: Optional[Array] = None, *, compute: str = EXACT) -> Array:
    """``x @ weight.T (+ bias)`` with a torch-layout weight ``[out, in]``: ``[..., in] -> [..., out]``."""
    y = einsum("...i,oi->...o", x, weight, compute=compute)
    return y if bias is None else y + bias.astype(F32)


def swiglu_mlp(x: Array, *, gate: Array, up: Array, down: Array, compute: str = EXACT) -> Array:
    """``down(silu(gate x) * up x)``: the Qwen/Llama MLP. ``[..., D] -> [..., D]``."""
    hid = jax.nn.silu(linear(x, gate, compute=compute)) * linear(x, up, compute=compute)
    return linear(hid, down, compute=compute)


# ----------------------------------------------------------------------------- norms


def _rms_normalize(x: Array, eps: float) -> Array:
    x = x.astype(F32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def rms_norm_zero_centred(x: Array, weight: Array, *, eps: float) -> Array:
    """Qwen's RMSNorm: ``rmsnorm(x) * (1 + w)`` (weights stored zero-centred, initialised 0).

    Used by Qwen3-Next/Qwen3.5 ``input_layernorm``, ``post_attention_layernorm``, ``model.norm``
    and attention ``q_norm``/``k_norm``. ``x [..., n]``, ``weight [n]``.
    """
    return _rms_normalize(x, eps) * (1.0 + weight.astype(F32))


def rms_norm(x: Array, weight: Array, *, eps: float) -> Array:
    """Plain (Llama-style) RMSNorm ``rmsnorm(x) * w``: Kimi-Linear's layer norms. ``x [..., n]``."""
    return _rms_normalize(x, eps) * weight.astype(F32)


def gated_rms_norm_silu(x: Array, gate: Array, weight: Array, *, eps: float) -> Array:
    """GDN output norm (HF ``Qwen3NextRMSNormGated``): ``w * rmsnorm(x) * silu(gate)``.

    Plain ``w`` (initialised to ones), normalised per head: ``x``, ``gate`` ``[..., dv]``.
    """
    return weight.astype(F32) * _rms_normalize(x, eps) * jax.nn.silu(gate.astype(F32))


def gated_rms_norm_sigmoid(x: Array, gate: Array, weight: Array, *, eps: float) -> Array:
    """KDA output norm (fla ``FusedRMSNormGated`` with ``activation="sigmoid"``):
    ``w * rmsnorm(x) * sigmoid(gate)``, per head: ``x``, ``gate`` ``[..., dv]``."""
    return weight.astype(F32) * _rms_normalize(x, eps) * jax.nn.sigmoid(gate.astype(F32))


def l2norm(x: Array, *, eps: float = L2NORM_EPS) -> Array:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis: HF ``l2norm`` and fla's in-kernel
    ``use_qk_l2norm_in_kernel`` (eps 1e-6, fp32)."""
    x = x.astype(F32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


# ----------------------------------------------------------------------------- gates


def gdn_log_decay(a: Array, *, a_log: Array, dt_bias: Array) -> Array:
    """Gated DeltaNet log-decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32; decay ``exp(g)``).

    ``a [..., H]``, ``a_log``, ``dt_bias`` ``[H]``. HF computes this in fp32 too, because a
    bf16 ``exp(A_log)`` may overflow.
    """
    return -jnp.exp(a_log.astype(F32)) * jax.nn.softplus(a.astype(F32) + dt_bias.astype(F32))


def write_strength(b: Array) -> Array:
    """``beta = sigmoid(b)``, the delta rule's write strength, ``[..., H]``."""
    return jax.nn.sigmoid(b.astype(F32))


# ----------------------------------------------------------------------------- short convolution


def causal_conv1d(x: Array, weight: Array, *, tail: Array, lengths: Optional[Array] = None) -> tuple[Array, Array]:
    """Depthwise causal convolution over time with a carried tail (no activation, no bias).

    Args:
      x: ``[B, T, C]`` new inputs.
      weight: ``[C, Kc]`` (HF ``conv1d.weight`` ``[C, 1, Kc]`` squeezed); tap ``Kc-1`` multiplies
        the current token, as in ``F.conv1d`` with left padding ``Kc-1``.
      tail: ``[B, Kc-1, C]`` the inputs preceding ``x`` (zeros for a fresh sequence).
      lengths: ``[B]`` valid tokens per row when ``x`` is right-padded; ``None`` means ``T``.

    Returns ``(y [B, T, C], new_tail [B, Kc-1, C])``, the new tail being the last ``Kc-1``
    valid inputs of each row, so padding never enters a later step.
    """
    kc = weight.shape[-1]
    bsz, t, _ = x.shape
    full = jnp.concatenate([tail.astype(F32), x.astype(F32)], axis=1)  # [B, Kc-1+T, C]
    w = weight.astype(F32)
    y = sum(full[:, j : j + t, :] * w[:, j] for j in range(kc))
    if lengths is None:
        new_tail = full[:, t:, :]
    else:
        idx = lengths[:, None] + jnp.arange(kc - 1)[None, :]  # [B, Kc-1]
        new_tail = jnp.take_along_axis(full, idx[..., None], axis=1)
    return y, new_tail


# ----------------------------------------------------------------------------- rotary embedding


def rope_inv_freq(*, head_dim: int, partial_rotary_factor: float, theta: float) -> Array:
    """Inverse frequencies ``[rotary_dim / 2]`` of (partial) RoPE; ``rotary_dim = int(hd * factor)``."""
    dim = int(head_dim * partial_rotary_factor)
    return 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=F32) / dim))


def apply_partial_rope(x: Array, positions: Array, inv_freq: Array) -> Array:
    """Rotates the first ``rotary_dim`` channels of every head (``rotate_half`` convention).

    x: ``[B, T, H, hd]``; positions: ``[B, T]`` int; inv_freq ``[rotary_dim / 2]``.
    """
    freqs = positions.astype(F32)[..., None] * inv_freq  # [B, T, rd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, rd]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    rd = emb.shape[-1]
    x = x.astype(F32)
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1)


# ----------------------------------------------------------------------------- attention


# Prefill attends ``ATTENTION_QUERY_BLOCK`` queries at a time: a block's scores are
# ``[B, H, block, T]``, so a long prompt never holds the ``[B, H, T, T]`` matrix (at T = 16K and
# batch 3, four heads of it are 12 GB in fp32, and XLA keeps several such temporaries).
ATTENTION_QUERY_BLOCK = 1024


def query_blocks(fn, xs: tuple, *, block: int = ATTENTION_QUERY_BLOCK) -> Array:
    """``fn`` over blocks of ``block`` queries, one block at a time (``lax.map``).

    xs: arrays ``[B, T, ...]`` cut along ``T``; ``fn(xs_block, positions [block])`` returns
    ``[B, block, ...]`` for the queries at ``positions``. Returns ``[B, T, ...]``. ``T`` need not be
    a multiple of ``block``: the last block is padded and its padding rows dropped.
    """
    t = xs[0].shape[1]
    if t <= block:
        return fn(xs, jnp.arange(t))
    n = -(-t // block)
    pad = n * block - t

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((x.shape[0], n, block) + x.shape[2:]), 1, 0)

    out = jax.lax.map(lambda a: fn(a[0], a[1]), (tuple(split(x) for x in xs), jnp.arange(n * block).reshape(n, block)))
    out = jnp.moveaxis(out, 0, 1)
    return out.reshape((out.shape[0], n * block) + out.shape[3:])[:, :t]


def causal_attention(q: Array, k: Array, v: Array, *, scale: float, block: int = ATTENTION_QUERY_BLOCK,
                     compute: str = EXACT) -> Array:
    """Causal grouped attention over a prompt: query ``t`` attends to keys ``0..t``.

    q: ``[B, T, H, hd]``; k, v: ``[B, T, Hkv, hd]``. Returns ``[B, T, H, hd]``, computed
    ``block`` queries at a time (``query_blocks``), so memory grows as ``block x T``, not ``T^2``.
    """
    keys = jnp.arange(k.shape[1])

    def one(xs, positions):
        (qb,) = xs
        mask = jnp.broadcast_to(positions[:, None] >= keys[None, :], (qb.shape[0], qb.shape[1], keys.shape[0]))
        return grouped_attention(qb, k, v, mask=mask, scale=scale, compute=compute)

    return query_blocks(one, (q,), block=block)


def grouped_attention(q: Array, k: Array, v: Array, *, mask: Array, scale: float, compute: str = EXACT) -> Array:
    """Softmax attention with grouped KV heads.

    q: ``[B, T, H, hd]``; k, v: ``[B, S, Hkv, hd]`` with ``H % Hkv == 0`` (query head ``h``
    reads KV head ``h // (H // Hkv)``, HF ``repeat_kv``); mask: ``[B, T, S]`` bool (True =
    may attend). Returns ``[B, T, H, hd]``.
    """
    bsz, t, h, hd = q.shape
    hkv = k.shape[2]
    qg = q.reshape(bsz, t, hkv, h // hkv, hd)
    scores = einsum("btgrd,bsgd->bgrts", qg, k, compute=compute) * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = einsum("bgrts,bsgd->btgrd", probs, v, compute=compute)
    return out.reshape(bsz, t, h, hd)


# ----------------------------------------------------------------------------- sampling


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is picked. ``temperature == 0`` is greedy (argmax, lowest id on ties).

    ``top_k = 0`` and ``top_p = 1`` disable those filters. Frozen and hashable: static under jit.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def set_rows(x: Array, index: Array, values: Array) -> Array:
    """``x [B, ...]`` with ``x[b, index[b]] = values[b]`` for every row ``b`` (``index [B]`` or
    ``[B, k]``; out-of-range entries dropped, as ``.at[].set`` does). One scatter batched over the
    rows: on a mesh that splits the batch each device writes its own rows, where an indexed
    ``x.at[arange(B), index]`` first gathers every device's indices and values."""
    return jax.vmap(lambda row, i, v: row.at[i].set(v.astype(row.dtype)))(x, index, values)


def top_k(x: Array, k: int) -> tuple[Array, Array]:
    """``jax.lax.top_k`` over the last axis, ``(values, int32 indices)``, ties to the lower index,
    as a stable sort: split over a mesh's batch like any sort, where XLA's TopK gathers the whole
    batch on every device first."""
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    neg, idx = jax.lax.sort((-x, iota), dimension=x.ndim - 1, num_keys=1, is_stable=True)
    return -neg[..., :k], idx[..., :k]


def filter_top_k(logits: Array, k: int) -> Array:
    """Keeps the ``k`` largest logits of each row ``[B, V]`` (ties at the threshold survive)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = top_k(logits, k)[0][..., -1:]
    return jnp.where(logits >= kth, logits, -jnp.inf)


def filter_top_p(logits: Array, p: float) -> Array:
    """Nucleus filter: keeps the smallest set of top tokens whose probability reaches ``p``.

    The most likely token always survives. ``logits [B, V]``.
    """
    if p >= 1.0:
        return logits
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # a token is kept when the mass strictly before it is still below p
    before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = before < p
    keep = set_rows(jnp.zeros_like(keep_sorted), order, keep_sorted)
    return jnp.where(keep, logits, -jnp.inf)


def sample_next(logits: Array, key: Array, sampling: Sampling) -> Array:
    """Next token ids ``[B]`` int32 from logits ``[B, V]``."""
    logits = logits.astype(F32)
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = filter_top_k(logits / sampling.temperature, sampling.top_k)
    logits = filter_top_p(logits, sampling.top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


__all__ = [
    "COMPUTE_MODES",
    "EXACT",
    "FAST",
    "L2NORM_EPS",
    "Sampling",
    "apply_partial_rope",
    "causal_conv1d",
    "einsum",
    "fast_operands",
    "kv_dtype",
    "filter_top_k",
    "filter_top_p",
    "gated_rms_norm_sigmoid",
    "gated_rms_norm_silu",
    "gdn_log_decay",
    "ATTENTION_QUERY_BLOCK",
    "causal_attention",
    "grouped_attention",
    "query_blocks",
    "l2norm",
    "linear",
    "rms_norm",
    "rms_norm_zero_centred",
    "rope_inv_freq",
    "sample_next",
    "set_rows",
    "swiglu_mlp",
    "top_k",
    "write_strength",
]
