"""Shared test inputs and checks, defined once for every test module.

* ``random_inputs``: synthetic heads of ``leapquant_jax.synthetic`` (long memory, outlier channels).
* ``numpy_inputs``: random heads drawn in NumPy (nothing to compile), with a fully decayed head, a
  head at alpha = 0.99999 and strong tokens.
* ``random_sequence``, ``random_state``, ``token_at``, ``copy_tree``, ``rel``: the kernel benchmarks'
  decode inputs and error measure (``bench.inputs``), so a test and a benchmark draw alike; the
  two generators draw at one pool shape and are cut to the shape asked (``POOL``).
* ``live_state``, ``expanded_state``, ``check_flush``: LeapQuant streams at ragged window
  positions and a flush kernel checked against the reference.
* ``numpy_reference``: the dense delta rule in float64 NumPy, an oracle independent of JAX.
* ``lower_to_triton``: a kernel lowered for CUDA on the CPU (Triton IR, no GPU).
* ``heldout_ids``, ``heldout_ids_file``: a shipped checkpoint's held-out snippet, as ids or an ``.npy``.
* ``run_cli``, ``calibrate_then_eval``, ``check_refused_by_name``: ``leapquant`` run in-process,
  its output captured.
* ``CHILD_XLA_OPTIONS``, ``child_xla_flags``: the suite's fast compile, also for the child processes
  some tests start; ``jit_as_served``, ``run_cli_served``: XLA's own compile, where a test needs it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np

from bench import inputs
from bench.inputs import copy_tree, rel, token_at
from leapquant_jax import windowed
from leapquant_jax.quantizers import unpack_codes
from leapquant_jax.synthetic import SyntheticSpec, synthetic_batch
from leapquant_jax import dispatch
from pallas_kernels.leapquant_flush import flush_fused, flush_split, leapquant_flush_reference

ROOT = Path(__file__).resolve().parents[1]
GDN_CHECKPOINT = ROOT / "models" / "checkpoints" / "stdlib-gdn"


def random_inputs(seed, *, batch=2, tokens=64, heads=2, dk=16, dv=16, kda=False, key_heads=None, decay=(0.9, 0.999)):
    """``[B, T, H, ...]`` inputs; ``key_heads`` < heads gives GVA."""
    spec = SyntheticSpec(tokens=tokens, heads=heads, dk=dk, dv=dv, per_channel_decay=kda, decay_range=decay,
                         beta_range=(0.1, 0.9), outlier_keys=min(2, dk), outlier_values=min(2, dv))
    x = synthetic_batch(seed, batch, spec)
    if key_heads is not None:
        x["q"] = x["q"][:, :, :key_heads]
        x["k"] = x["k"][:, :, :key_heads]
    return x


# The most sequences, tokens and heads the tests draw. ``random_sequence`` and ``random_state`` draw
# with ``bench.inputs``' generators at this size (larger where asked) and cut the draw in NumPy:
# their generators compile once per head size instead of once per shape, and the cut has the
# statistics of a draw at its own shape (entries are independent across sequences, tokens and heads).
POOL = (8, 33, 8)


def _cut(x, *sizes):
    """The leading ``sizes`` of ``x``: cut in NumPy (nothing to compile), or in JAX while traced."""
    index = tuple(slice(n) for n in sizes)
    try:
        return jnp.asarray(np.asarray(x)[index])
    except jax.errors.TracerArrayConversionError:       # under jax.eval_shape or jit
        return x[index]


def random_sequence(key, bsz, t, h, dk, dv, kda, *, log_decay=None):
    """``bench.inputs.random_sequence``'s inputs ``[B, T, H, ...]``, drawn at the ``POOL`` size."""
    size = [max(n, m) for n, m in zip((bsz, t, h), POOL)]
    seq = {n: _cut(x, bsz, t, h) for n, x in inputs.random_sequence(key, *size, dk, dv, kda).items()}
    if log_decay is not None:
        seq["g"] = jnp.asarray(np.full(seq["g"].shape, log_decay, np.float32))
    return seq


def random_state(key, bsz, h, dk, dv):
    """``bench.inputs.random_state``'s dense state ``[B, H, dk, dv]``, drawn at the ``POOL`` size."""
    size = [max(n, m) for n, m in zip((bsz, h), POOL[::2])]
    return _cut(inputs.random_state(key, *size, dk, dv), bsz, h)


def numpy_inputs(seed, *, batch, tokens, heads, dk, dv, kda, key_heads=None):
    """Fresh ``[B, T, H, ...]`` inputs (NumPy, so no compile): L2-normalised keys and queries
    (``q`` scaled by ``dk**-0.5``), decays in (0.9, 0.999), beta in (0.05, 0.95); head 0 fully
    decayed (log-decay -1e4), head 1 at alpha = 0.99999, and scattered strong tokens
    (log-decay -30) elsewhere; ``key_heads`` < heads gives GVA."""
    rng = np.random.default_rng(seed)
    hk = key_heads or heads

    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    g = np.log(rng.uniform(0.9, 0.999, (batch, tokens, heads) + ((dk,) if kda else ())))
    g[:, :, 0] = -1.0e4
    g[:, :, 1] = np.log(0.99999)
    strong = rng.random(g.shape[:3]) < 0.05
    strong[:, :, :2] = False
    g[strong] = -30.0
    x = dict(q=unit((batch, tokens, hk, dk)) * dk ** -0.5, k=unit((batch, tokens, hk, dk)),
             v=rng.standard_normal((batch, tokens, heads, dv)), g=g,
             beta=rng.uniform(0.05, 0.95, (batch, tokens, heads)))
    return {n: jnp.asarray(a, jnp.float32) for n, a in x.items()}


def numpy_reference(q, k, v, g, beta, s0=None):
    """The dense delta rule written out token by token in float64 NumPy (an independent oracle).

    q, k [B, T, Hk, dk]; v [B, T, H, dv]; g [B, T, H] or [B, T, H, dk]; beta [B, T, H].
    """
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    b, t, h, dv = v.shape
    dk = q.shape[-1]
    rep = h // q.shape[2]
    s = np.zeros((b, h, dk, dv)) if s0 is None else np.array(s0, np.float64)
    o = np.zeros((b, t, h, dv))
    for bi in range(b):
        for hi in range(h):
            S = s[bi, hi]
            for ti in range(t):
                kk = k[bi, ti, hi // rep]
                qq = q[bi, ti, hi // rep]
                alpha = np.exp(g[bi, ti, hi])
                S = (alpha[:, None] if np.ndim(alpha) else alpha) * S
                u = beta[bi, ti, hi] * (v[bi, ti, hi] - S.T @ kk)
                S = S + np.outer(kk, u)
                o[bi, ti, hi] = S.T @ qq
            s[bi, hi] = S
    return o, s


def live_state(config, key, bsz, h, dk, dv, kda, pos, *, log_decay=None, zero=False, key_heads=None, steps=None):
    """``(state, token)``: a stream after ``steps`` (default ``p - 1``) reference steps on
    ``random_sequence`` inputs from ``random_state`` (or zero), then set to the ragged positions
    ``pos``, and the sequence's next token; with ``key_heads`` (GVA), its key records kept per key
    head."""
    steps = config.window - 1 if steps is None else steps
    k1, k2 = jax.random.split(key)
    s0 = jnp.asarray(np.zeros((bsz, h, dk, dv), np.float32)) if zero else random_state(k1, bsz, h, dk, dv)
    st = windowed.from_dense(config, s0, per_channel_decay=kda, key_heads=key_heads)
    seq = random_sequence(k2, bsz, steps + 1, h, dk, dv, kda, log_decay=log_decay)
    for i in range(steps):
        _, st = windowed.step_reference(config, st, token_at(seq, i, key_heads))
    return st.replace(pos=jnp.asarray(pos, jnp.int32)), token_at(seq, steps, key_heads)


def expanded_state(st):
    """``st`` with its key records repeated to the value heads: the layout without GVA."""
    n = st.shape[1] // st.key_heads
    return st.replace(buffer=st.buffer.replace(k=jnp.repeat(st.buffer.k, n, axis=1)))


# The flush kernels by name, interpreted; "auto": what dispatch runs on the kernels (interpreted:
# the split flush, or with only_full the fused one below dispatch.MIN_FULL_FRACTION of full windows).
FLUSHES = {"split": functools.partial(flush_split, interpret=True),
           "fused": functools.partial(flush_fused, interpret=True),
           "auto": functools.partial(dispatch.leapquant_flush, impl="pallas")}


def check_flush(config, st, *, only_full=False, codes_agree=True, impl="auto", flush=None):
    """A flush kernel (``FLUSHES[impl]``, or ``flush(config, state, only_full=...)``) against the
    reference; returns both flushed states."""
    ref = leapquant_flush_reference(config, st, only_full=only_full)
    ker = (flush or FLUSHES[impl])(config, copy_tree(st), only_full=only_full)
    np.testing.assert_array_equal(ker.pos, ref.pos)
    # The kernels leave the buffer as it was (every slot is then past pos = 0, never read), where
    # the reference zeroes it.
    chex.assert_trees_all_equal(ker.buffer, st.buffer)
    dense = windowed.reconstruct_reference(config, st)
    d_k = windowed.decode_checkpoint(config, ker.checkpoint)
    d_r = windowed.decode_checkpoint(config, ref.checkpoint)
    assert np.all(np.isfinite(d_k))
    # Same fit and quantizer in fp32: codes agree except where a value sits on a rounding
    # boundary, where they differ by one step of the grid; the error against the exact state is
    # the same. Compared as stored (unsigned) codes, whose step is 1 at every width (the values'
    # step is 2 at 2 bits, the odd integers).
    z_k, z_r = (np.asarray(unpack_codes(c.checkpoint.residual.codes, config.bits)) for c in (ker, ref))
    if codes_agree:
        assert np.abs(z_k - z_r).max() <= 1
        assert np.mean(z_k != z_r) < 0.01
    step = 2 * np.abs(np.asarray(d_r - dense)).max() + 1e-6 * np.abs(np.asarray(dense)).max() + 1e-30
    assert np.abs(np.asarray(d_k - d_r)).max() <= step
    assert rel(d_k, dense) <= 1.05 * rel(d_r, dense) + 1e-6
    return ker, ref


def lifetime_traces(kda, seed=0, layers=(0, 2), *, heads=4, dk=32, dv=32) -> dict:
    """Calibration traces ``{layer: {"q", "k", "v", "g", "beta": [2, 64, ...]}}`` of ``random_inputs``
    with two long-lived heads (0, 1: decay 0.999) and short-lived others (decay 0.5)."""
    out = {}
    for i, layer in enumerate(layers):
        x = {k: np.array(v) for k, v in random_inputs(seed + i, batch=2, tokens=64, heads=heads, dk=dk, dv=dv,
                                                       kda=kda).items()}
        x["g"][:, :, :2] = np.log(0.999)
        x["g"][:, :, 2:] = np.log(0.5)
        out[layer] = x
    return out


def lower_to_triton(fn, *args) -> None:
    """Lowers ``jax.jit(fn)(*args)`` for CUDA (no GPU needed): every ``pallas_call`` in it must
    lower to Triton IR. ``fn``'s kernels take ``interpret=False``."""
    disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled)(*args)


def heldout_ids(checkpoint: Path = GDN_CHECKPOINT) -> np.ndarray:
    """The token ids ``[T]`` int32 of a shipped checkpoint's ``heldout_snippet.json``."""
    return np.asarray(json.loads((Path(checkpoint) / "heldout_snippet.json").read_text())["ids"], np.int32)


def heldout_ids_file(folder: Path, checkpoint: Path = GDN_CHECKPOINT) -> Path:
    """``folder/heldout.npy``: ``heldout_ids(checkpoint)`` saved for ``--data``."""
    path = Path(folder) / "heldout.npy"
    np.save(path, heldout_ids(checkpoint))
    return path


def run_cli(argv) -> tuple[int, str, str]:
    """``leapquant argv`` (each item as a string) in this process: ``(exit code, stdout, stderr)``."""
    from leapquant_cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def run_cli_served(argv) -> tuple[int, str, str]:
    """``leapquant argv`` in a child process compiled as users' programs are: ``XLA_FLAGS`` without
    ``CHILD_XLA_OPTIONS``. For a command that runs long on few programs (the fast compile's code
    runs several times slower). Returns ``(exit code, stdout, stderr)``."""
    flags = os.environ.get("XLA_FLAGS", "").replace(xla_flags_text(CHILD_XLA_OPTIONS), "").strip()
    env = dict(os.environ, XLA_FLAGS=flags)
    proc = subprocess.run([sys.executable, "-m", "leapquant_cli", *[str(a) for a in argv]], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    return proc.returncode, proc.stdout, proc.stderr


def calibrate_then_eval(command, checkpoint, data, out: Path, calibrate_options, eval_options) -> tuple[dict, dict]:
    """``leapquant command checkpoint --data data --out out *calibrate_options --json``, then
    ``leapquant eval checkpoint --data data *eval_options --json``: both must exit 0. Returns the
    calibration's report and the evaluation's ``methods``."""
    code, text, err = run_cli([command, checkpoint, "--data", data, "--out", out, *calibrate_options, "--json"])
    assert code == 0, err
    report = json.loads(text)
    code, text, err = run_cli(["eval", checkpoint, "--data", data, *eval_options, "--json"])
    assert code == 0, err
    return report, json.loads(text)["methods"]


def check_refused_by_name(argv, names: dict, words, *, eval_data, unwritten: Path) -> None:
    """``leapquant argv``, each ``"{name}"`` item filled from ``names`` (an ``eval`` given ``--data
    eval_data --context 32`` too), is refused: exit code 2, nothing on stdout, each of ``words`` on
    stderr, and ``unwritten`` not written."""
    argv = [a.format(**names) if a.startswith("{") else a for a in argv]
    if argv[0] == "eval":
        argv += ["--data", eval_data, "--context", "32"]
    code, out, err = run_cli(argv)
    assert code == 2 and out == "", err
    for w in words:
        assert w in err, err
    assert not unwritten.exists()


# XLA options for a run that compiles many small programs and runs each briefly: the backend's
# lowest optimisation level, and XLA:CPU's elemental emitters in place of its fusion emitters
# (about half the compile time on such programs). The conftest sets them for the whole suite on a
# CPU-only JAX; a child process some tests start takes them too, so every program a test compares
# is compiled alike.
CHILD_XLA_OPTIONS = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
# XLA's own values of the same options, those a user's program is compiled with. Two programs that
# a test compares bit for bit are compiled so (``jit_as_served``, ``run_cli_served``): such an
# equality is a property of the optimised compile, which the fast one need not keep.
SERVED_XLA_OPTIONS = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}


def xla_flags_text(options: dict) -> str:
    """``options`` as ``XLA_FLAGS`` text: ``--name=value`` each."""
    return " ".join(f"--{name}={str(value).lower()}" for name, value in options.items())


@functools.lru_cache(maxsize=None)
def _known(items: tuple) -> tuple:
    known = []
    for name, value in items:
        try:
            jax.jit(lambda x: x + 1).lower(np.float32(0)).compile(compiler_options={name: value})
        except jax.errors.JaxRuntimeError:      # "No such compile option"
            continue
        known.append((name, value))
    return tuple(known)


def known_xla_options(options: dict) -> dict:
    """The items of ``options`` this JAX's XLA knows, each tried on a trivial compile first (an
    unknown option fails a compile, and an unknown flag in ``XLA_FLAGS`` aborts a process)."""
    return dict(_known(tuple(options.items())))


def child_xla_flags() -> str:
    """``XLA_FLAGS`` text of the ``CHILD_XLA_OPTIONS`` this JAX's XLA knows."""
    return xla_flags_text(known_xla_options(CHILD_XLA_OPTIONS))


def jit_as_served(fn):
    """``jax.jit(fn)``, each input signature compiled with the ``SERVED_XLA_OPTIONS`` this XLA
    knows, whatever ``XLA_FLAGS`` the run has."""
    jitted, compiled = jax.jit(fn), {}

    def call(*args):
        leaves, tree = jax.tree_util.tree_flatten(args)
        key = (tree, tuple((np.shape(x), getattr(x, "dtype", type(x))) for x in leaves))
        if key not in compiled:
            compiled[key] = jitted.lower(*args).compile(compiler_options=known_xla_options(SERVED_XLA_OPTIONS))
        return compiled[key](*args)

    return call


__all__ = ["CHILD_XLA_OPTIONS", "GDN_CHECKPOINT", "ROOT", "SERVED_XLA_OPTIONS", "calibrate_then_eval", "check_flush",
           "check_refused_by_name", "child_xla_flags", "copy_tree", "expanded_state", "heldout_ids", "heldout_ids_file",
           "jax", "jit_as_served", "jnp", "known_xla_options", "lifetime_traces", "live_state", "lower_to_triton",
           "numpy_inputs", "numpy_reference", "random_inputs", "random_sequence", "random_state", "rel", "run_cli", "run_cli_served",
           "token_at", "xla_flags_text"]
