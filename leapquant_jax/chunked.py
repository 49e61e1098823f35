"""The chunkwise-parallel form of the gated delta rule (GDN and KDA), for training and prefill.

Contract: ``recurrence.recurrent_scan``'s result up to fp32 round-off, differentiable and jit-able
(``chunk_delta_rule``: ``[B, T, H, ...]`` in, ``(o [B, T, H, dv], S [B, H, dk, dv])`` out).

The sequence is cut into chunks of ``C`` tokens. With ``G_i`` the cumulative log-decay from the
chunk start to token ``i`` (scalar for GDN, per key channel for KDA) and ``S0`` the chunk's initial
state, the corrections ``u_i = beta_i (v_i - S_{i-1}^T (alpha_i k_i))`` solve a unit
lower-triangular system ``(I + A) U = diag(beta) (V - Ktil S0)``, ``A_ij = beta_i k_i^T (e^{G_i -
G_j} k_j)`` (``j < i``), ``Ktil_i = e^{G_i} k_i``. Its inverse ``T = (I + A)^{-1}`` gives the WY
representation ``W = T diag(beta) Ktil``, ``Uv = T diag(beta) V``, ``U = Uv - W S0``, computed for
every chunk at once with matmuls (``_chunk_terms``); so are the outputs ``o_i = S0^T (e^{G_i} q_i) +
sum_{j<=i} u_j (k_j^T (e^{G_i - G_j} q_i))`` and the chunk's map ``S_C = Diag(e^{G_C}) S0 + Khat^T U``.
Crossing chunks is the only serial part (``inter``): a scan over the chunks, four small matmuls
each (``chunk_ops.scan_chunks``, or its kernel where ``impl`` resolves to one: the default on a
GPU), or a parallel prefix over the chunks' affine maps (log-depth, ``dk x dk`` products). Long
sequences run ``group`` chunks at a time (bounded memory).

Numerics: every exponent is a difference ``G_i - G_j <= 0`` (or a decay from the chunk start),
masked *before* ``exp`` where its sign is wrong (neither value nor gradient can overflow), and no
product of decays is divided by. KDA's pair terms are not plain matmuls: pairs within a sub-chunk
of ``chunk_ops.SUB_CHUNK`` tokens are reduced from ``e^{G_i - G_j}`` directly, pairs across
sub-chunks factor into two factors ``<= 1`` (``chunk_ops.pair_scores_kda``; FLA's ``chunk_kda``
splits the same way). Log-decays are clamped at ``LOG_DECAY_FLOOR``, below which ``exp`` is 0 in
fp32; pair decays are differences of cumulative sums within a chunk, so after a token of
log-decay ``-x`` they carry an absolute error of about ``x * 2^-24``.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import dispatch
from .impls import AUTO, Impl, check_request
from .chunk_ops import HI, SUB_CHUNK, kda_cumulative, masked_exp, pair_scores_kda, scan_chunks
from .recurrence import check_lengths, check_sequence, expand_heads

Array = jax.Array

# exp(x) rounds to 0 in fp32 (subnormals included) for x < -103.97: clamping log-decays here
# leaves every decay of the recurrence unchanged and keeps a chunk's cumulative sums small.
LOG_DECAY_FLOOR = -104.0

# ``chunk_delta_rule(group=None)``: chunks x rows (batch x heads) whose intra-chunk terms are
# formed at once: 128 chunks of a batch of 8 x 32 heads (about 5 GB of fp32 terms at 128 x 128
# heads), or a whole 64K-token prompt of 32 heads in one group (faster than two; docs/performance.md).
GROUP_CHUNK_ROWS = 32768

# How the state crosses chunks (``chunk_delta_rule(inter=...)``): the serial scan (a kernel runs it
# where ``impl`` resolves to one) or the parallel prefix (reference only).
INTER_CHUNK = ("serial", "associative")


def unit_lower_inverse(a: Array, *, precision=HI) -> Array:
    """``(I + a)^{-1}`` for strictly lower-triangular ``a [..., n, n]``, ``n`` a power of two.

    Recursive 2x2 block inversion, ``[[L11, 0], [L21, L22]]^{-1} =
    [[L11^-1, 0], [-L22^-1 L21 L11^-1, L22^-1]]``, from 1x1 blocks up: only matmuls, and every
    intermediate is a block of the final inverse (no Neumann-series powers that can grow).
    """
    n = a.shape[-1]
    lead = a.shape[:-2]
    inv = jnp.ones(lead + (n, 1, 1), a.dtype)                     # inverses of the 1x1 diagonal blocks
    b = 1
    while b < n:
        m = n // (2 * b)
        blocks = a.reshape(lead + (m, 2 * b, m, 2 * b))
        diag = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)   # [..., m, 2b, 2b]
        low = diag[..., b:, :b]                                                # L21 [..., m, b, b]
        pair = inv.reshape(lead + (m, 2, b, b))
        i11, i22 = pair[..., 0, :, :], pair[..., 1, :, :]
        off = -jnp.matmul(jnp.matmul(i22, low, precision=precision), i11, precision=precision)
        zero = jnp.zeros_like(i11)
        inv = jnp.concatenate([jnp.concatenate([i11, zero], -1), jnp.concatenate([off, i22], -1)], -2)
        b *= 2
    return inv.reshape(lead + (n, n))


def _pair_scores_gdn(q: Array, k: Array, G: Array, precision) -> Array:
    """GDN: ``[k_i . k_j, q_i . k_j] * e^{G_i - G_j}`` for ``j <= i``, 0 above.

    q, k ``[..., C, dk]``; G ``[..., C]``. Returns ``[..., 2, C, C]`` (``k k^T`` then ``q k^T``).
    """
    c = G.shape[-1]
    causal = jnp.tril(jnp.ones((c, c), bool))
    decay = masked_exp(G[..., :, None] - G[..., None, :], causal)
    scores = jnp.einsum("...xic,...jc->...xij", jnp.stack([k, q], axis=-3), k, precision=precision)
    return scores * decay[..., None, :, :]


def _chunk_terms(q: Array, k: Array, v: Array, g: Array, beta: Array, precision, kda_scores=None):
    """Everything about a chunk that does not depend on its initial state ``S0``.

    q, k ``[..., C, dk]``; v ``[..., C, dv]``; g ``[..., C]`` (GDN) or ``[..., C, dk]`` (KDA);
    beta ``[..., C]``; kda_scores: computes ``pair_scores_kda`` (KDA; ``None``: that function).
    Returns ``(w, uv, k_end, decay, q_start, p)``: the corrections
    ``U = uv - w S0`` (``w [..., C, dk]``, ``uv [..., C, dv]``), the final state
    ``S_C = Diag(decay) S0 + k_end^T U`` (``k_end_j = e^{G_C - G_j} * k_j`` ``[..., C, dk]``,
    ``decay = e^{G_C}`` ``[..., dk]``) and the outputs ``o = q_start S0 + p U``
    (``q_start [..., C, dk]``, ``p [..., C, C]``).
    """
    c, dk = k.shape[-2:]
    if g.ndim == k.ndim:
        G = kda_cumulative(g)
        scores = (kda_scores or pair_scores_kda)(q, k, G, precision)
        G_end = G[..., -1:, :]
    else:
        G = jnp.cumsum(g, axis=-1)
        scores = _pair_scores_gdn(q, k, G, precision)
        G, G_end = G[..., None], G[..., -1:, None]
    kk, p = scores[..., 0, :, :], scores[..., 1, :, :]
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    t = unit_lower_inverse(jnp.where(strict, beta[..., :, None] * kk, 0.0), precision=precision)
    w = jnp.matmul(t, (beta[..., None] * jnp.exp(G)) * k, precision=precision)
    uv = jnp.matmul(t, beta[..., None] * v, precision=precision)
    k_end = k * jnp.exp(G_end - G)
    decay = jnp.broadcast_to(jnp.exp(G_end[..., 0, :]), k.shape[:-2] + (dk,))
    return w, uv, k_end, decay, q * jnp.exp(G), p


def _affine_maps(w: Array, uv: Array, k_end: Array, decay: Array, precision) -> tuple[Array, Array]:
    """A chunk as an affine map of its initial state, ``S_C = trans S0 + drive``:
    ``trans = Diag(decay) - k_end^T w`` ``[..., dk, dk]``, ``drive = k_end^T uv`` ``[..., dk, dv]``."""
    dk = w.shape[-1]
    trans = decay[..., :, None] * jnp.eye(dk, dtype=w.dtype) - jnp.einsum("...ck,...cj->...kj", k_end, w,
                                                                          precision=precision)
    drive = jnp.einsum("...ck,...cv->...kv", k_end, uv, precision=precision)
    return trans, drive


def _scan_associative(state: Array, w, uv, k_end, decay, q_start, p, *, precision=HI):
    """``scan_chunks``'s contract by a parallel prefix over the chunks' affine maps
    ``S -> trans S + drive`` (``jax.lax.associative_scan``): log-depth instead of one dependent
    step per chunk, at the cost of ``dk x dk`` products. The form for few heads and rows (a
    single long prompt) where no kernel runs."""
    trans, drive = _affine_maps(w, uv, k_end, decay, precision)

    def compose(first, then):          # apply `first`, then `then`
        (a1, b1), (a2, b2) = first, then
        return jnp.matmul(a2, a1, precision=precision), jnp.matmul(a2, b1, precision=precision) + b2

    a, b = jax.lax.associative_scan(compose, (trans, drive), axis=0)
    ends = jnp.matmul(a, state, precision=precision) + b                      # state after each chunk
    starts = jnp.concatenate([state[None], ends[:-1]], axis=0)
    u = uv - jnp.matmul(w, starts, precision=precision)
    o = jnp.matmul(q_start, starts, precision=precision) + jnp.matmul(p, u, precision=precision)
    return o, ends[-1]


def _scan_kernel(chunk_scan, precision):
    """``scan_chunks`` on the kernel ``chunk_scan`` (``pallas_kernels.chunk_scan``), differentiable:
    a ``jax.custom_jvp`` whose derivative is ``scan_chunks``'s (the kernel has no derivative of its own)."""

    def flat(state, *terms):
        # kernel layout: rows x heads flattened, [N, R, ...]
        lead = state.shape[:-2]
        rows = int(np.prod(lead)) if lead else 1
        n = terms[0].shape[0]
        o, s = chunk_scan(state.reshape((rows,) + state.shape[-2:]),
                          *(x.reshape((n, rows) + x.shape[1 + len(lead):]) for x in terms), precision=precision)
        return o.reshape((n,) + lead + o.shape[2:]), s.reshape(state.shape)

    @jax.custom_jvp
    def run(state, w, uv, k_end, decay, q_start, p):
        return flat(state, w, uv, k_end, decay, q_start, p)

    @run.defjvp
    def _jvp(primals, tangents):
        return jax.jvp(functools.partial(scan_chunks, precision=precision), primals, tangents)

    return run


def _kda_scores_kernel(kda_pair_scores, q: Array, k: Array, G: Array, precision) -> Array:
    """``pair_scores_kda`` on the kernel ``kda_pair_scores`` (``pallas_kernels.kda_scores``; inputs
    ``[R, C, dk]``), differentiable: a ``jax.custom_jvp`` whose derivative is ``pair_scores_kda``'s."""

    @jax.custom_jvp
    def run(q, k, G):
        return kda_pair_scores(q, k, G, precision=precision)

    @run.defjvp
    def _jvp(primals, tangents):
        return jax.jvp(lambda q, k, G: pair_scores_kda(q, k, G, precision), primals, tangents)

    return run(q, k, G)


def _resolve(impl: str, inter: str, kda: bool, dk: int, dv: int, chunk: int) -> tuple[Impl, Impl]:
    """The implementations of the chunk scan and of KDA's pair scores (``dispatch.resolve``); the
    parallel prefix (``inter="associative"``) has no kernel, so it takes the reference or fails
    for a request that must run one."""
    check_request(impl, ("chunk_scan", "kda_scores"))
    if inter == "associative":
        if impl not in (AUTO, Impl.REFERENCE):
            raise ValueError(f"impl={impl!r} cannot run inter='associative' (no kernel runs the parallel prefix); "
                             "pass inter='serial' or impl='reference'")
        return Impl.REFERENCE, Impl.REFERENCE
    scan = dispatch.resolve("chunk_scan", impl, dk, dv, chunk)
    scores = dispatch.resolve("kda_scores", impl, dk, chunk) if kda else Impl.REFERENCE
    return scan, scores


def _chunk_layout(x: Array, groups: int, per_group: int, chunk: int) -> Array:
    """``[B, T', H, ...] -> [groups, per_group, B, H, C, ...]`` (``T' = groups * per_group * C``)."""
    b, _, h = x.shape[:3]
    rest = x.shape[3:]
    x = x.reshape((b, groups, per_group, chunk, h) + rest)
    return jnp.moveaxis(x, (1, 2, 4), (0, 1, 3))


def chunk_delta_rule(
    *,
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    initial_state: Optional[Array] = None,
    lengths: Optional[Array] = None,
    chunk: int = 64,
    group: Optional[int] = None,
    precision=HI,
    inter: str = "serial",
    impl: str = AUTO,
) -> tuple[Array, Array]:
    """The GDN/KDA delta rule over a sequence in chunkwise-parallel form (same result as
    ``recurrent_scan`` up to fp32 round-off), differentiable and jit-able.

    Args (keyword-only):
      q, k: ``[B, T, Hk, dk]``, L2-normalised, ``q`` carrying its scale; GVA when ``Hk < H``
        (value head ``j`` reads key head ``j // (H // Hk)``).
      v: ``[B, T, H, dv]``; g: ``[B, T, H]`` (GDN) or ``[B, T, H, dk]`` (KDA) log-decays ``<= 0``;
        beta: ``[B, T, H]``.
      initial_state: ``[B, H, dk, dv]`` or ``None`` (zeros).
      lengths: ``[B]`` integers in ``[0, T]`` or ``None`` (all ``T``): valid tokens of right-padded
        rows. Row ``b``'s final state is the state after its first ``lengths[b]`` tokens; its
        outputs past ``lengths[b]`` are unspecified (finite for finite inputs).
      chunk: tokens per chunk, a power of two (``T`` need not be a multiple: it is padded).
      group: chunks whose intra-chunk work runs in parallel at a time (bounds the memory of
        long sequences; the state is carried from group to group). ``None`` (default):
        ``GROUP_CHUNK_ROWS // (B * H)`` chunks, at least one.
      precision: of the matmuls. ``HIGHEST`` (default) is fp32; ``DEFAULT`` lets a GPU use TF32
        (faster, about 1e-3 relative error).
      inter: how the state crosses chunks. ``"serial"`` (default): one dependent step per chunk
        (``chunk_ops.scan_chunks``, or the kernel ``impl`` resolves to); ``"associative"``: a
        parallel prefix over the chunks' affine maps, log-depth in the number of chunks but with
        ``dk x dk`` products, reference only.
      impl: which implementation runs the serial scan and KDA's pair scores (``impls``: ``"auto"``,
        the Triton kernels on a GPU where they take the sizes, ``dk``, ``dv`` and ``chunk`` powers
        of two >= 16; ``"reference"``; ``"triton"``; ``"pallas"``). A kernel's derivative is its
        reference's. ``python -m bench.prefill`` times them.
    Returns ``(o [B, T, H, dv] fp32, final_state [B, H, dk, dv] fp32)``.
    """
    bsz, t, h = check_sequence(q=q, k=k, v=v, g=g, beta=beta)
    dk, dv = q.shape[-1], v.shape[-1]
    if not isinstance(chunk, int) or chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk!r}")
    if group is None:
        group = max(1, GROUP_CHUNK_ROWS // (bsz * h))
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be a positive number of chunks or None, got {group!r}")
    if inter not in INTER_CHUNK:
        raise ValueError(f"inter must be one of {INTER_CHUNK}, got {inter!r}")
    scan_impl, scores_impl = _resolve(impl, inter, g.ndim == 4, dk, dv, chunk)
    if initial_state is None:
        initial_state = jnp.zeros((bsz, h, dk, dv), jnp.float32)
    elif initial_state.shape != (bsz, h, dk, dv):
        raise ValueError(f"initial_state must be [B, H, dk, dv] = {(bsz, h, dk, dv)}, got {initial_state.shape}")
    f32 = jnp.float32
    q = expand_heads(q, h, axis=2, name="q").astype(f32)
    k = expand_heads(k, h, axis=2, name="k").astype(f32)
    v, beta = v.astype(f32), beta.astype(f32)
    g = jnp.maximum(g.astype(f32), LOG_DECAY_FLOOR)
    if lengths is not None:
        check_lengths(lengths, bsz, t)
        lengths = jnp.asarray(lengths)
        # A padded token with beta = 0 and g = 0 leaves the state exactly unchanged; k and v are
        # zeroed too so that non-finite padding cannot reach the state through 0 * inf.
        valid = jnp.arange(t)[None, :] < lengths[:, None]                                   # [B, T]
        k, v = (jnp.where(valid[:, :, None, None], x, 0.0) for x in (k, v))
        beta = jnp.where(valid[:, :, None], beta, 0.0)
        g = jnp.where(valid.reshape(valid.shape + (1,) * (g.ndim - 2)), g, 0.0)

    n_chunks = max(1, -(-t // chunk))
    groups = -(-n_chunks // group)
    per_group = -(-n_chunks // groups)
    padded = groups * per_group * chunk
    if padded != t:                      # zero tokens (beta = 0, g = 0) leave the state unchanged
        pad = lambda x: jnp.pad(x, [(0, 0), (0, padded - t)] + [(0, 0)] * (x.ndim - 2))   # noqa: E731
        q, k, v, g, beta = (pad(x) for x in (q, k, v, g, beta))
    xs = tuple(_chunk_layout(x, groups, per_group, chunk) for x in (q, k, v, g, beta))   # [Ng, Npg, B, H, C, ...]

    if inter == "associative":
        scan_of = functools.partial(_scan_associative, precision=precision)
    elif scan_impl is Impl.REFERENCE:
        scan_of = functools.partial(scan_chunks, precision=precision)
    else:
        scan_of = _scan_kernel(dispatch.kernel("chunk_scan", scan_impl), precision)
    kda_scores = (None if scores_impl is Impl.REFERENCE
                  else functools.partial(_kda_scores_kernel, dispatch.kernel("kda_scores", scores_impl)))

    def run_group(state, xs):
        # Leading axes flattened: fewer dimensions compile faster (and XLA:CPU in JAX 0.10 crashes
        # on the gradient of the KDA pair reduction with six leading dimensions).
        lead = xs[0].shape[:3]                                                             # [Npg, B, H]
        flat = tuple(x.reshape((-1,) + x.shape[3:]) for x in xs)
        terms = _chunk_terms(*flat, precision, kda_scores=kda_scores)
        w, uv, k_end, decay, q_start, p = (x.reshape(lead + x.shape[1:]) for x in terms)
        o, state = scan_of(state, w, uv, k_end, decay, q_start, p)                          # o [Npg, B, H, C, dv]
        return state, o

    state, o = jax.lax.scan(run_group, initial_state.astype(f32), xs)
    o = jnp.moveaxis(o, (0, 1, 3), (1, 2, 4)).reshape(bsz, padded, h, dv)
    return o[:, :t], state


__all__ = ["GROUP_CHUNK_ROWS", "INTER_CHUNK", "LOG_DECAY_FLOOR", "SUB_CHUNK", "chunk_delta_rule", "kda_cumulative",
           "pair_scores_kda", "scan_chunks", "unit_lower_inverse"]
