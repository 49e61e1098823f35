"""Which tensor-core operands the flush's fit tolerates, judged by the decoded-state criterion.

    python -m bench.fit_precision [--fits fp16 tf32 bf16 bf16_x3:fp32 ...] [--bits 8 6 4]
                                  [--modes gdn kda] [--seeds 0 1 2] [--batch 16] [--out DIR]

The subspace fit's three products (``compensators.fit_subspace``: ``Z = S^T Q``, ``Y = S Z``,
``U = S^T K^T``) are emulated with the operands a tensor-core kernel would feed them, fp32 sums
throughout; everything else is the reference flush (``windowed.encode_checkpoint`` with that
``product``). Each candidate is judged against the fp32 reference on the criterion's inputs
(``kernel_checks.criterion_cases``: structured heads, a second window, random heads, 128 x 128)
by ``kernel_checks.decoded_state_row``: per head, mean decoded-state error at most 1.01 times the
reference's. A fit ``A`` uses operands ``A`` in all three products; ``A:B`` uses ``A`` for ``Z``
and ``Y`` and ``B`` for ``U``.

Operands (``OPERANDS``): ``fp32`` (the reference's products); ``tf32`` (each operand rounded to
10 mantissa bits); ``fp16`` (each operand scaled per head so that its largest magnitude is
``MM_SCALE``, as the Mosaic GPU flush scales its fp16 keys, then rounded); ``fp16_bound`` (as
``fp16``, but ``S`` scaled by ``state_bound``, a bound on ``|S|`` from the factors it is built
from: what a flush that never holds ``S`` whole can know); ``bf16``; ``bf16_x3``
(two bf16 pieces, three products: hi hi + hi lo + lo hi); ``bf16_x6`` (three pieces, six
products); ``tf32_x3`` (TF32 with a correction term: two TF32 pieces, three products).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import environment, git_commit, results_log
from bench.kernel_checks import CRITERION_BATCH, criterion_cases, decoded_state_failures, decoded_state_row
from leapquant_jax import windowed
from leapquant_jax.compensators import NORMAL_TINY, Product, hi_product
from leapquant_jax.state import LeapQuantConfig
from pallas_kernels.mosaic_flush import MM_SCALE

f32 = jnp.float32
HI = jax.lax.Precision.HIGHEST
OPERANDS = ("fp32", "tf32", "fp16", "fp16_bound", "bf16", "bf16_x3", "bf16_x6", "tf32_x3")


def _tf32(x):
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=10)


def _pieces(x, n, rounding):
    """``x`` as ``n`` pieces rounded by ``rounding`` whose fp32 sum approximates it, largest first."""
    out = []
    for _ in range(n):
        piece = rounding(x)
        out.append(piece)
        x = x - piece.astype(f32)
    return out


def _per_head_scale(x):
    """``MM_SCALE / max |x|`` over the last two axes, keepdims; 1 where ``x`` is zero to
    ``NORMAL_TINY`` (as ``compensators.scale_to_unit_max`` leaves such a ``y``)."""
    m = jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True)
    return jnp.where(m > NORMAL_TINY, MM_SCALE / jnp.where(m > NORMAL_TINY, m, 1.0), 1.0)


def state_bound(config: LeapQuantConfig, state) -> jax.Array:
    """A bound ``[B, H, 1, 1]`` on ``max |S|`` of the state a flush rebuilds, from its factors:
    per key row ``i``, ``D0_i (c_i max_j scale_j qmax + sum_m |K_mi| max |U_m|) + sum_j |w_ji k_ji|
    max |u_j|``, then the largest row (``windowed.reconstruct_reference``'s terms, each by its
    magnitude; ``c = 1`` without smoothing)."""
    ck, buf = state.checkpoint, state.buffer
    G_l, w = windowed.window_decays(buf, state.pos, buf.k.shape[-1])
    vmax = lambda x: jnp.max(jnp.abs(x.astype(f32)), axis=-1)                         # over value columns
    smooth = jnp.ones_like(G_l) if ck.smooth is None else ck.smooth.astype(f32)
    codes = smooth * (vmax(ck.residual.scale) * config.format.qmax)[..., None]         # [B, H, dk]
    comps = jnp.einsum("bhrk,bhr->bhk", jnp.abs(ck.comp_k.astype(f32)), vmax(ck.comp_u), precision=HI)
    records = jnp.einsum("bhpk,bhp->bhk", jnp.abs(w * windowed.record_keys(buf)), vmax(buf.u), precision=HI)
    rows = jnp.exp(G_l) * (codes + comps) + records
    return jnp.max(rows, axis=-1)[..., None, None]


def operand_product(operands: str, s_scale=None) -> Product:
    """The fit's ``product(eq, a, b)`` with ``operands`` (one of ``OPERANDS``) and fp32 sums;
    ``s_scale [B, H, 1, 1]``: ``fp16_bound``'s scale of ``S`` (every product's first operand)."""
    if operands not in OPERANDS:
        raise ValueError(f"operands must be one of {OPERANDS}, got {operands!r}")
    if (operands == "fp16_bound") != (s_scale is not None):
        raise ValueError("operands='fp16_bound' takes s_scale (the scale of S from state_bound), the others none")
    if operands == "fp32":
        return hi_product

    def dot(eq, a, b):
        return jnp.einsum(eq, a, b, preferred_element_type=f32, precision=HI)

    def product(eq, a, b):
        a, b = a.astype(f32), b.astype(f32)
        if operands in ("fp16", "fp16_bound"):
            sa, sb = (s_scale if operands == "fp16_bound" else _per_head_scale(a)), _per_head_scale(b)
            out = dot(eq, (a * sa).astype(jnp.float16), (b * sb).astype(jnp.float16))
            # the factors' scales, in the output's layout: per head, so broadcast over the last two axes
            return out / (sa * sb)
        if operands in ("bf16", "tf32"):
            rnd = (lambda x: x.astype(jnp.bfloat16)) if operands == "bf16" else _tf32
            return dot(eq, rnd(a), rnd(b))
        n, rnd = {"bf16_x3": (2, lambda x: x.astype(jnp.bfloat16)), "bf16_x6": (3, lambda x: x.astype(jnp.bfloat16)),
                  "tf32_x3": (2, _tf32)}[operands]
        pa, pb = _pieces(a, n, rnd), _pieces(b, n, rnd)
        terms = [(i, j) for i in range(n) for j in range(n) if i + j < n]     # the pieces' leading products
        terms.sort(key=lambda t: -(t[0] + t[1]))                             # smallest first
        out = None
        for i, j in terms:
            t = dot(eq, pa[i], pb[j])
            out = t if out is None else out + t
        return out

    return product


def parse_fit(fit: str) -> tuple[str, str]:
    """``"A"`` or ``"A:B"`` -> ``(operands of Z and Y, operands of U)``, each one of ``OPERANDS``."""
    parts = fit.split(":")
    if len(parts) not in (1, 2) or any(p not in OPERANDS for p in parts):
        raise ValueError(f"a fit is OPERANDS or OPERANDS:OPERANDS with OPERANDS one of {OPERANDS}, got {fit!r}")
    return parts[0], parts[-1]


# compensators.fit_subspace's products by their einsum: Z = S^T Q, Y = S Z, U = S^T K^T
Z_EQ, Y_EQ, U_EQ = "...kv,...kr->...vr", "...kv,...vr->...kr", "...kv,...rk->...rv"


def fit_product(fit: str, s_scale=None) -> Product:
    """One ``product`` for ``encode_checkpoint``: ``fit``'s ``Z`` / ``Y`` operands, and its ``U``
    operands for ``U``; a product it does not know is refused (the fit changed its products).
    ``s_scale``: ``fp16_bound``'s scale of ``S``."""
    zy, u = (operand_product(o, s_scale if o == "fp16_bound" else None) for o in parse_fit(fit))
    by_eq = {Z_EQ: zy, Y_EQ: zy, U_EQ: u}

    def product(eq, a, b):
        if eq not in by_eq:
            raise ValueError(f"bench.fit_precision knows the fit's products {tuple(by_eq)}, not {eq!r}")
        return by_eq[eq](eq, a, b)

    return product


def flush_with(config: LeapQuantConfig, state, fit: str):
    """``windowed.flush_reference``'s checkpoint with ``fit``'s products (the state's buffer kept:
    the criterion reads the checkpoint only)."""
    dense = windowed.reconstruct_reference(config, state)
    s_scale = None
    if "fp16_bound" in parse_fit(fit):
        bound = state_bound(config, state)
        s_scale = jnp.where(bound > NORMAL_TINY, MM_SCALE / jnp.where(bound > NORMAL_TINY, bound, 1.0), 1.0)
    ckpt = windowed.encode_checkpoint(config, dense, state.checkpoint.comp_k, product=fit_product(fit, s_scale))
    return state.replace(checkpoint=ckpt)


def criterion_rows(config: LeapQuantConfig, kda: bool, fits, *, seed=0, batch=CRITERION_BATCH, dim=128) -> list[dict]:
    """``decoded_state_row`` of each fit in ``fits`` on the three inputs of ``criterion_cases``."""
    cases = criterion_cases(config, kda, batch=batch, dk=dim, dv=dim, seed=seed)
    rows = []
    for fit in fits:
        parse_fit(fit)
        flush = jax.jit(lambda c, s, fit=fit: flush_with(c, s, fit), static_argnums=0)
        for case in cases:
            row = decoded_state_row(config, case, flush(config, case["state"]), mode="KDA" if kda else "GDN", impl=fit)
            row = dict(row, seed=seed, failures=decoded_state_failures(row))
            if "fp16_bound" in parse_fit(fit):     # how far above max |S| the bound lies, per head
                peak = np.abs(case["exact"]).max(axis=(-2, -1))
                over = np.asarray(state_bound(config, case["state"]))[..., 0, 0] / np.where(peak > 0, peak, np.nan)
                row["bound_over_max"] = [float(np.nanmin(over)), float(np.nanmedian(over)), float(np.nanmax(over))]
            rows.append(row)
    return rows


def markdown(rows, env) -> str:
    """The worst ratio to the reference's decoded-state error per fit, width and mode, over every
    seed and input (``FAIL`` where a head misses the criterion)."""
    keys = list(dict.fromkeys((r["bits"], r["mode"]) for r in rows))
    fits = list(dict.fromkeys(r["impl"] for r in rows))
    out = ["# The fit's tensor-core operands under the decoded-state criterion", "",
           f"date {env['date']}; jax {env['jax']}; commit {env.get('commit')}; command `{env['command']}`", "",
           "Worst per-head ratio of mean decoded-state error to the fp32 reference's (criterion: at most 1.01), "
           "over the criterion's three inputs and every seed. `Z, Y : U` operands.", "",
           "| fit | " + " | ".join(f"{m} {b} bits" for b, m in keys) + " |",
           "| --- |" + " --- |" * len(keys)]
    for fit in fits:
        cells = []
        for b, m in keys:
            sel = [r for r in rows if r["impl"] == fit and r["bits"] == b and r["mode"] == m]
            worst = max((r["worst_ratio"] for r in sel if r["worst_ratio"] is not None), default=float("nan"))
            cells.append(f"{worst:.4f}" + ("" if all(r["passed"] for r in sel) else " FAIL"))
        out.append(f"| `{fit}` | " + " | ".join(cells) + " |")
    bounded = [r for r in rows if "bound_over_max" in r]
    if bounded:
        out += ["", "`state_bound` over the rebuilt state's max |S|, per head (smallest, median of the inputs' "
                "medians, largest):", ""]
        for b, m in keys:
            sel = [r["bound_over_max"] for r in bounded if r["bits"] == b and r["mode"] == m]
            if sel:
                low, mid, high = min(x[0] for x in sel), float(np.median([x[1] for x in sel])), max(x[2] for x in sel)
                out.append(f"- {m} {b} bits: {low:.3g}, {mid:.3g}, {high:.3g}")
    fails = [f"- `{r['impl']}` {r['mode']} {r['bits']} bits, seed {r['seed']}: {x}"
             for r in rows for x in r["failures"]]
    if fails:
        out += ["", "Failures:", ""] + fails
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fits", nargs="+", default=["fp32", "fp16", "fp16:fp32", "tf32", "bf16", "bf16_x3", "bf16_x6",
                                                  "tf32_x3"])
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 6, 4])
    ap.add_argument("--modes", nargs="+", choices=("gdn", "kda"), default=["gdn", "kda"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--batch", type=int, default=CRITERION_BATCH)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    try:
        for fit in args.fits:
            parse_fit(fit)
        configs = [LeapQuantConfig(bits=b, window=16) for b in args.bits]
    except ValueError as err:
        sys.exit(f"bench.fit_precision: {err}")
    env = environment(git_commit(), module="bench.fit_precision")
    base, say = results_log(args.out, "fit-precision")
    rows = []
    for config in configs:
        for kda in (m == "kda" for m in dict.fromkeys(args.modes)):
            for seed in args.seeds:
                for row in criterion_rows(config, kda, args.fits, seed=seed, batch=args.batch):
                    say(json.dumps({k: row[k] for k in ("impl", "mode", "bits", "inputs", "seed", "worst_ratio",
                                                        "passed", "failures")}))
                    rows.append(row)
    with open(base + ".json", "w") as f:
        json.dump(dict(environment=env, rows=rows), f, indent=1, default=float)
    with open(base + ".md", "w") as f:
        f.write(markdown(rows, env))
    say(open(base + ".md").read())
    return rows


if __name__ == "__main__":
    main()
