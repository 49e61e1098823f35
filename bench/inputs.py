"""Decode and flush inputs for the kernel benchmarks and the kernel tests alike, and their error measure.

Needs only JAX and the core (no torch, triton or GPU), so the CPU test suite imports it too.
Shapes: sequences ``[B, T, H, ...]``, dense states ``[B, H, dk, dv]``, tokens ``[B, H, ...]``;
the flush inputs (``structured_flush_state``, ``random_flush_state``, ``next_window``) are
LeapQuant streams, one head kind per head (``FLUSH_HEAD_KINDS``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from leapquant_jax import windowed
from leapquant_jax.quantizers import IntTensor, pack_codes, qmax_for_bits, round_codes, signed_codes, unsigned_codes
from leapquant_jax.recurrence import delta_rule_token
from leapquant_jax.state import Checkpoint, LeapQuantConfig, LeapQuantState, WindowBuffer


def random_sequence(key, bsz, t, h, dk, dv, kda, *, log_decay=None):
    """Realistic decode inputs ``[B, T, H, ...]``: L2-normalised keys with three outlier channels
    (x6 before normalising), queries likewise carrying ``1/sqrt(dk)``, values standard normal,
    log-decays ``-softplus(N(0, 1) - 4)`` (about -0.02, so alpha near 1) or all ``log_decay``
    where given, ``beta = sigmoid(N(0, 1))``. KDA (``kda``) takes ``g [B, T, H, dk]``."""
    ks = jax.random.split(key, 6)
    chan = jnp.ones((dk,)).at[jnp.array([3, 17, dk - 5])].set(6.0)               # outlier channels
    k = jax.random.normal(ks[0], (bsz, t, h, dk)) * chan
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    q = jax.random.normal(ks[1], (bsz, t, h, dk)) * chan
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True) / np.sqrt(dk)
    v = jax.random.normal(ks[2], (bsz, t, h, dv))
    gshape = (bsz, t, h, dk) if kda else (bsz, t, h)
    if log_decay is None:
        g = -jax.nn.softplus(jax.random.normal(ks[3], gshape) - 4.0)
    else:
        g = jnp.full(gshape, log_decay, jnp.float32)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (bsz, t, h)))
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def random_state(key, bsz, h, dk, dv):
    """A dense fp32 state ``[B, H, dk, dv]`` with the scale of a decoded one (0.3 N(0, 1)) and
    three outlier value columns (x5)."""
    s = jax.random.normal(key, (bsz, h, dk, dv)) * 0.3
    return s.at[..., :3].multiply(5.0)


def token_at(seq, t, key_heads=None):
    """Token ``t`` of ``seq`` as a ``Token`` of ``[B, H, ...]`` fields; with ``key_heads`` (GVA),
    q and k cut to that many heads and the key kept per key head, as a stream storing its key
    records once per key head takes it."""
    x = {n: v[:, t] for n, v in seq.items()}
    if key_heads is not None:
        x["q"], x["k"] = x["q"][:, :key_heads], x["k"][:, :key_heads]
    return delta_rule_token(**x, key_heads=key_heads)


def window_tokens(bsz, h, dk, dv, kda, p, seed=0):
    """The ``p`` tokens of one window of ``random_sequence``, for the timed loops."""
    seq = random_sequence(jax.random.PRNGKey(seed), bsz, p, h, dk, dv, kda)
    return [token_at(seq, i) for i in range(p)]


# The heads of ``structured_flush_state``, one head each, in this order: the edge cases of the
# NVlabs/kda LeapQuant flush requests (docs/performance.md, "The flush's decoded-state criterion").
FLUSH_HEAD_KINDS = ("hot_column", "rank1", "zero", "rank2", "tiny", "huge", "rank1_noise", "decayed", "never_decays")
HOT_COLUMN = 5   # the value column whose scale is 30x the others' in every structured head


def _check_flush_shapes(config, dk, dv):
    if config.residual_format is not None:
        raise ValueError(f"flush inputs hold integer residuals; residual_format={config.residual_format!r} has none")
    if dk < 8 or dv < 8:
        raise ValueError(f"flush inputs need dk, dv >= 8 (a hot value column, a quarter of the key channels), "
                         f"got dk={dk}, dv={dv}")
    config.check_head_size(dk, dv)


def _window_records(config, rng, bsz, h, dk, dv, kda, *, spread, alpha_low):
    """A window of ``p`` records in float64 NumPy (the caller edits, then ``_stream`` rounds them):
    keys ``spread N(0, 1)``, values ``spread N(0, 1)`` times a weight ``U(0, 1)`` (beta),
    log-decays ``log U(alpha_low, 1)``, per key channel for KDA."""
    p = config.window
    k = spread * rng.standard_normal((bsz, h, p, dk))
    u = spread * rng.standard_normal((bsz, h, p, dv)) * rng.uniform(size=(bsz, h, p, 1))
    alpha = rng.uniform(alpha_low, 1.0, (bsz, h, p, dk) if kda else (bsz, h, p))
    return k, u, np.log(alpha)


def _uniform_codes(rng, bits, shape):
    """Code values uniform over the grid of ``[-qmax, qmax]`` (its stored codes drawn, then signed)."""
    qmax = qmax_for_bits(bits)
    return signed_codes(rng.integers(unsigned_codes(-qmax, bits), unsigned_codes(qmax, bits) + 1, shape), bits)


def _stream(config, codes, scale, smooth, comp_k, comp_u, records, pos):
    """A ``LeapQuantState`` from code values ``[B, H, dk, dv]`` (integers of the grid of
    ``config.bits``; packed here), scales and smoothing in fp32 (the smoothing dropped when
    ``config.smoothing`` is off), Compensator Tokens in fp16 and records in the record dtype
    (log-decays clamped as ``windowed.append_record`` stores them)."""
    dt = jnp.dtype(config.record_dtype)
    k, u, g = records
    stored = unsigned_codes(np.asarray(codes).astype(np.int32), config.bits)
    residual = IntTensor(codes=pack_codes(jnp.asarray(stored, jnp.int32), config.bits),
                         scale=jnp.asarray(scale, jnp.float32), bits=config.bits, dk=codes.shape[-2])
    ckpt = Checkpoint(residual=residual, smooth=jnp.asarray(smooth, jnp.float32) if config.smoothing else None,
                      comp_k=jnp.asarray(comp_k, jnp.float16), comp_u=jnp.asarray(comp_u, jnp.float16))
    g = np.maximum(g, windowed.RECORD_LOG_DECAY_MIN)
    buf = WindowBuffer(k=jnp.asarray(k, dt), u=jnp.asarray(u, dt), g=jnp.asarray(g, dt))
    return LeapQuantState(checkpoint=ckpt, buffer=buf, pos=jnp.asarray(pos, jnp.int32))


def structured_flush_state(config: LeapQuantConfig, seed: int, bsz: int, dk: int, dv: int, kda: bool) -> LeapQuantState:
    """A stream of ``len(FLUSH_HEAD_KINDS)`` heads (head ``i`` of kind ``FLUSH_HEAD_KINDS[i]``),
    every window full: the inputs of a flush on the edge cases of the NVlabs/kda flush requests.

    Every head starts from the base: codes ``0.315 qmax N(0, 1)`` rounded to the grid (clipped;
    ``quantizers.round_codes``), smoothing ``U(0.05, 0.25)``, scales ``U(0.1, 0.6) / qmax`` with value column
    ``HOT_COLUMN`` 30x hotter (the requests' hot row: the state is ``[dk, dv]`` here), Compensator
    Tokens ``0.5 N(0, 1)``, and a window of records 0.3 N(0, 1) decaying by alpha in
    ``[0.96, 1]`` (GDN) or ``[0.6, 1]`` per key channel (KDA). Then: ``hot_column`` the base;
    ``rank1``, ``rank2`` an empty checkpoint (zero codes and scales: 2-bit codes, which have no
    zero, decode to zero by their scales) and one or two live records; ``zero`` all zero;
    ``tiny`` / ``huge`` scaled by about 1e-4 / 3e2; ``rank1_noise`` one record over codes scaled
    by 1e-6; ``decayed`` the checkpoint decayed by ``e^-200`` (the first record's log-decay, which
    no record sees); ``never_decays`` a quarter of the key channels (KDA) or the whole head (GDN)
    at alpha 1.
    Drawn with NumPy's generator seeded by ``seed`` (no JAX compile per shape).
    """
    _check_flush_shapes(config, dk, dv)
    h, r, p = len(FLUSH_HEAD_KINDS), config.effective_rank, config.window
    qmax = qmax_for_bits(config.bits)
    at = {name: i for i, name in enumerate(FLUSH_HEAD_KINDS)}
    rng = np.random.default_rng(seed)
    codes = rng.standard_normal((bsz, h, dk, dv)) * 0.315 * qmax      # rounded to the grid below
    smooth = rng.uniform(0.05, 0.25, (bsz, h, dk))
    scale = rng.uniform(0.1, 0.6, (bsz, h, dv)) / qmax
    scale[..., HOT_COLUMN] *= 30.0
    comp_k = 0.5 * rng.standard_normal((bsz, h, r, dk))
    comp_u = 0.5 * rng.standard_normal((bsz, h, r, dv))
    k, u, g = _window_records(config, rng, bsz, h, dk, dv, kda, spread=0.3, alpha_low=0.6 if kda else 0.96)
    for name, live in (("rank1", 1), ("zero", 0), ("rank2", 2), ("rank1_noise", 1)):
        i = at[name]
        comp_k[:, i] = comp_u[:, i] = u[:, i, live:] = 0.0
        if name != "rank1_noise":
            codes[:, i] = scale[:, i] = 0.0
    smooth[:, at["rank1_noise"]] *= 1e-6
    for name, factor, comp, rec in (("tiny", 1e-4, 1e-2, 1e-4), ("huge", 3e2, 17.0, 3e2)):
        smooth[:, at[name]] *= factor
        comp_u[:, at[name]] *= comp
        u[:, at[name]] *= rec
    g[:, at["decayed"], 0] -= 200.0
    if kda:
        g[:, at["never_decays"], :, :dk // 4] = 0.0
    else:
        g[:, at["never_decays"]] = 0.0
    return _stream(config, round_codes(codes, config.bits, xp=np), scale, smooth, comp_k, comp_u, (k, u, g),
                   np.full((bsz,), p))


def random_flush_state(config: LeapQuantConfig, seed: int, bsz: int, h: int, dk: int, dv: int,
                       kda: bool) -> LeapQuantState:
    """Unstructured flush inputs of ``h`` heads inside the deployment domain (the requests' random
    tensors): codes uniform over the grid of ``[-qmax, qmax]``, smoothing ``0.05 e^{0.7 N(0, 1)}``,
    scales ``0.3 e^{0.7 N(0, 1)} / qmax``, Compensator Tokens N(0, 1), records N(0, 1) (values
    times a weight ``U(0, 1)``) decaying by alpha in ``[0.65, 1]`` (GDN) or ``[0.001, 1]`` per key
    channel (KDA), windows holding ``U{0..p}`` records. Drawn with NumPy's generator seeded by ``seed``."""
    _check_flush_shapes(config, dk, dv)
    r, p = config.effective_rank, config.window
    qmax = qmax_for_bits(config.bits)
    rng = np.random.default_rng(seed)
    codes = _uniform_codes(rng, config.bits, (bsz, h, dk, dv))
    smooth = 0.05 * np.exp(0.7 * rng.standard_normal((bsz, h, dk)))
    scale = 0.3 * np.exp(0.7 * rng.standard_normal((bsz, h, dv))) / qmax
    comp_k = rng.standard_normal((bsz, h, r, dk))
    comp_u = rng.standard_normal((bsz, h, r, dv))
    records = _window_records(config, rng, bsz, h, dk, dv, kda, spread=1.0, alpha_low=0.001 if kda else 0.65)
    return _stream(config, codes, scale, smooth, comp_k, comp_u, records, rng.integers(0, p + 1, (bsz,)))


def next_window(config: LeapQuantConfig, seed: int, flushed: LeapQuantState) -> LeapQuantState:
    """``flushed`` (a flush's output) with a full window of fresh records, drawn as
    ``structured_flush_state``'s base window: the requests' second window."""
    bsz, h, dk, dv = flushed.shape
    kda = flushed.per_channel_decay
    k, u, g = _window_records(config, np.random.default_rng(seed), bsz, h, dk, dv, kda, spread=0.3,
                              alpha_low=0.6 if kda else 0.96)
    dt = jnp.dtype(config.record_dtype)
    return flushed.replace(buffer=WindowBuffer(k=jnp.asarray(k, dt), u=jnp.asarray(u, dt), g=jnp.asarray(g, dt)),
                           pos=jnp.full((bsz,), config.window, jnp.int32))


def copy_tree(tree):
    """A copy of every leaf (the kernels donate their state)."""
    return jax.tree_util.tree_map(jnp.copy, tree)


def rel(a, b) -> float:
    """``||a - b|| / ||b||`` in float64 (the error every check reports; 0-safe)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
