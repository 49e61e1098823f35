"""The Mosaic GPU dense step (``pallas_kernels.mosaic_dense``) against the Triton dense step and
FLA's fp32 ``fused_recurrent`` kernels, in one process: compiled correctness against the
reference over a few tokens, then µs per token-step at one batch, for each mode and state dtype.

    python -m bench.mosaic_dense [--batch 512] [--heads 32] [--modes gdn kda] [--dtypes float32 bfloat16]
        [--variants JSON] [--triton-variants JSON] [--out DIR]
    python -m bench.mosaic_dense ... --copy-only   # also the pipeline without the arithmetic
    python -m bench.mosaic_dense --ncu JSON [--modes ...]   # that variant and FLA, 3 launches each (Nsight Compute)

``--variants``: JSON list of option dicts for ``mosaic_dense.dense_step`` (``block_v``, ``stages``,
``inplace``, ``interleave``, and ``per_sm``, programs per SM, turned into ``programs``); ``--triton-variants`` the same for
``dense_step.dense_step`` (``block_v``, ``num_warps``). Variants a dtype cannot take (shared
memory) are reported and skipped. 128 x 128 heads, 8 tokens per timed call, the state donated.
Writes ``mosaic-dense-<UTC time>.json``, ``.log`` and ``.md`` under ``--out`` (default
``bench/results``). Bytes per step: ``dense_step_bytes``; FLA's kernel moves the same.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp

from bench.fla import fla_fns, time_copy, time_fla
from bench.harness import git_commit, results_log, time_jax
from bench.inputs import random_sequence, random_state, rel, token_at
from bench.kernel_timing import step_timer
from pallas_kernels import dense_step as triton_dense
from pallas_kernels import mosaic_dense
from pallas_kernels.mosaic_shared import rows_layout, sm_count

TOKENS = 8
DEFAULT_VARIANTS = '[{}, {"stages": 4, "per_sm": 1}, {"interleave": false}, {"inplace": false, "per_sm": 1}]'
DEFAULT_TRITON = ('[{}, {"block_v": 16, "num_warps": 1}, {"block_v": 8, "num_warps": 1},'
                  ' {"block_v": 32, "num_warps": 2}]')


def mosaic_options(opts: dict) -> dict:
    """``opts`` with ``per_sm`` turned into ``programs``."""
    opts = dict(opts)
    if "per_sm" in opts:
        opts["programs"] = opts.pop("per_sm") * sm_count()
    return opts


def copy_only_tile(meta_all, i, t, *, per_channel, bv, lay):
    """A tile's 'arithmetic' that returns its state block unchanged and its ``v`` block as the
    output: the pipeline's own cost on the same bytes."""
    tile = rows_layout(mosaic_dense.DK, bv)
    return lay.load(t["v"], tile.reduce(0)), lay.load(t["s"], tile).astype(jnp.float32)


def copy_only_step(state, token, **opts):
    return mosaic_dense.launch(state, token, copy_only_tile, **opts)


def label(kind: str, opts: dict) -> str:
    return f"{kind} " + (" ".join(f"{k}={v}" for k, v in opts.items()) or "defaults")


def profile_launches(a, opts) -> int:
    """Three launches of the Mosaic dense step with ``opts`` (fp32) and of FLA's kernel per mode."""
    bsz, h, dk, dv = a.batch, a.heads, 128, 128
    fla = fla_fns() if jax.default_backend() == "gpu" else None
    for mode in a.modes:
        kda = mode == "kda"
        tok = token_at(random_sequence(jax.random.PRNGKey(7), bsz, 1, h, dk, dv, kda), 0)
        fn = jax.jit(lambda s, t: mosaic_dense.dense_step(s, t, **mosaic_options(opts)), donate_argnums=(0,))
        state = random_state(jax.random.PRNGKey(3), bsz, h, dk, dv)
        for _ in range(3):
            _, state = jax.block_until_ready(fn(state, tok))
        state = None
        if fla is not None:
            time_fla(fla[kda], bsz, h, dk, dv, kda)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--modes", nargs="+", default=["gdn", "kda"], choices=["gdn", "kda"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(triton_dense.STATE_DTYPES))
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="JSON list of mosaic_dense.dense_step options")
    ap.add_argument("--triton-variants", default=DEFAULT_TRITON, help="JSON list of dense_step.dense_step options")
    ap.add_argument("--copy-only", action="store_true",
                    help="also time each Mosaic variant's pipeline with the arithmetic left out (state unchanged)")
    ap.add_argument("--ncu", default=None, help="JSON options: only launch that variant (fp32) and FLA 3 times each")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    bsz, h, dk, dv = a.batch, a.heads, 128, 128
    if a.ncu:
        return profile_launches(a, json.loads(a.ncu))
    base, say = results_log(a.out, "mosaic-dense")
    rows, checks = [], []

    say("jax", jax.__version__, jax.devices(), "commit", git_commit(), "command", " ".join(sys.argv))
    gpu = jax.default_backend() == "gpu"
    copy_bw = time_copy() if gpu else float("nan")
    say(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s")
    fla = fla_fns() if gpu else None
    for mode in a.modes:
        kda = mode == "kda"
        seq = random_sequence(jax.random.PRNGKey(7), bsz, TOKENS, h, dk, dv, kda)
        toks = [token_at(seq, i) for i in range(TOKENS)]
        s0 = random_state(jax.random.PRNGKey(3), bsz, h, dk, dv)
        fla_us = None
        if fla is not None:
            fla_us = time_fla(fla[kda], bsz, h, dk, dv, kda)
        for dtype in a.dtypes:
            nbytes = triton_dense.dense_step_bytes(dk, dv, jnp.dtype(dtype).itemsize, kda) * bsz * h
            state = s0.astype(dtype)
            ref = step_timer(triton_dense.dense_step_reference)
            s_r, o_r = ref(jnp.copy(state), toks)
            entries = [("fla", {}, None)] if dtype == "float32" and fla_us is not None else []
            entries += [("triton", o, triton_dense.dense_step) for o in json.loads(a.triton_variants)]
            entries += [("mosaic", o, mosaic_dense.dense_step) for o in json.loads(a.variants)]
            if a.copy_only:
                entries += [("copy-only", o, copy_only_step) for o in json.loads(a.variants)]
            for kind, opts, step in entries:
                name = label(kind, opts)
                if kind == "fla":
                    us = fla_us
                else:
                    fn_opts = opts if kind == "triton" else mosaic_options(opts)
                    try:
                        t0 = time.time()
                        fn = step_timer(step, **fn_opts)
                        s_k, o_k = fn(jnp.copy(state), toks)
                        if kind == "copy-only":   # the state comes back as it went in, o is the last v
                            err = dict(o=rel(o_k, toks[-1].v), state=rel(s_k.astype(jnp.float32),
                                                                         state.astype(jnp.float32)))
                        else:
                            err = dict(o=rel(o_k, o_r), state=rel(s_k.astype(jnp.float32), s_r.astype(jnp.float32)))
                        err["finite"] = bool(jnp.all(jnp.isfinite(o_k)) & jnp.all(jnp.isfinite(s_k)))
                        s_k = o_k = None
                        say(mode, dtype, name, f"compile + run {time.time() - t0:.1f} s;",
                            f"{TOKENS} tokens against the "
                            + ("input (copy only):" if kind == "copy-only" else "reference:"), err)
                        checks.append(dict(mode=mode, dtype=dtype, name=name, **err))
                        us = time_jax(fn, jnp.copy(state), toks, TOKENS) if gpu else None
                    except Exception:
                        say(mode, dtype, name, "FAILED\n" + traceback.format_exc()[-2500:])
                        continue
                if us is None:
                    continue
                bw = nbytes / (us * 1e-6)
                row = dict(mode=mode, dtype=dtype, name=name, kind=kind, opts=opts, us=us, bytes=nbytes,
                           GBps=bw / 1e9, frac_copy_bw=bw / copy_bw, vs_fla=(fla_us / us) if fla_us else None)
                rows.append(row)
                say(f"{mode} {dtype} {name}: {us:.1f} us per step, {bw / 1e9:.0f} GB/s ({bw / copy_bw:.0%} of copy)"
                    + (f", {fla_us / us:.2f}x FLA fp32" if fla_us else ""))
            state = s_r = o_r = None
    json.dump(dict(jax=jax.__version__, commit=git_commit(), copy_bw=copy_bw, batch=bsz, heads=h, checks=checks,
                   rows=rows, command=" ".join(sys.argv)), open(base + ".json", "w"), indent=1)
    with open(base + ".md", "w") as md:
        md.write(f"# Dense steps at batch {bsz}, {h} heads of 128 x 128 (`{' '.join(sys.argv)}`)\n\n"
                 f"JAX {jax.__version__}, commit {git_commit()}, copy {copy_bw / 1e9:.0f} GB/s.\n\n"
                 "| mode | state | kernel | µs/step | GB/s | % copy | × FLA fp32 |\n| --- | --- | --- | --- | --- | --- | --- |\n")
        for r in rows:
            fx = f"{r['vs_fla']:.2f}" if r["vs_fla"] else "-"
            md.write(f"| {r['mode']} | {r['dtype']} | {r['name']} | {r['us']:.1f} | {r['GBps']:.0f} | "
                     f"{100 * r['frac_copy_bw']:.0f} | {fx} |\n")
        md.write("\n| mode | state | kernel | o error | state error | finite |\n| --- | --- | --- | --- | --- | --- |\n")
        for c in checks:
            md.write(f"| {c['mode']} | {c['dtype']} | {c['name']} | {c['o']:.2e} | {c['state']:.2e} | "
                     f"{c['finite']} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
