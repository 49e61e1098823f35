"""The kernel benchmark's report: the targets it is held to and the Markdown written beside its
JSON (``bench.kernels``). Reads result dicts only, so ``bench.ceilings`` and the tests use it on
saved runs without JAX kernels or a GPU."""

from __future__ import annotations

from leapquant_jax.synthetic import EXTREME_DECAYS

TARGETS = (  # (what, mode, timing row kind, measure, sense, wanted) at the largest batch, FLA from the same run
    ("amortised per token-step vs FLA fp32", "GDN", "lq-window", "speedup_vs_fla_fp32", ">=", 3.6),
    ("amortised per token-step vs FLA fp32", "KDA", "lq-window", "speedup_vs_fla_fp32", ">=", 2.5),
    ("step alone: bandwidth on its bytes / copy bandwidth", "GDN", "lq-steps", "frac_copy_bw", ">=", 0.70),
    ("step alone: bandwidth on its bytes / copy bandwidth", "KDA", "lq-steps", "frac_copy_bw", ">=", 0.75),
    ("flush of full windows, µs per window", "GDN", "lq-flush", "us", "<=", 600.0),
    ("flush of full windows, µs per window", "KDA", "lq-flush", "us", "<=", 600.0),
    ("flush, KB (10^3 B) moved per head", "GDN", "lq-flush", "kb_per_head", "<=", 60.0),
    ("flush, KB (10^3 B) moved per head", "KDA", "lq-flush", "kb_per_head", "<=", 60.0),
    ("Pallas fp32 dense step vs FLA fp32", "GDN", "dense-float32", "speedup_vs_fla_fp32", ">=", 0.95),
    ("Pallas fp32 dense step vs FLA fp32", "KDA", "dense-float32", "speedup_vs_fla_fp32", ">=", 1.0),
)
BITS_TARGETS = ((6, 0.9), (4, 1.0))  # (bits, wanted): the amortised ratio to FLA at least this share of int8's


def row_kind(row) -> str:
    """The kind of a timing row (``fla``, ``dense-float32``, ``dense-bfloat16``, ``lq-window``,
    ``lq-steps``, ``lq-flush``), from its name for results written before rows carried one."""
    if row.get("kind"):
        return row["kind"]
    name = row["impl"]
    for prefix, kind in (("FLA", "fla"), ("Pallas float32", "dense-float32"), ("Pallas bfloat16", "dense-bfloat16")):
        if name.startswith(prefix):
            return kind
    for part, kind in (("steps + flush", "lq-window"), ("step only", "lq-steps"), ("flush (per flush)", "lq-flush")):
        if part in name:
            return kind
    return "other"


def _measure(row, key):
    if key == "kb_per_head":
        return row["bytes"] / (row["batch"] * row["heads"]) / 1e3 if "bytes" in row else None
    return row.get(key)


WIDTH_ROW_SUFFIX = {"lq-window": " window", "lq-steps": " steps", "lq-flush": " flush"}   # ``other_bits`` rows


def width_row(results, bsz, mode, bits, kind):
    """The LeapQuant row of ``kind`` at ``bits`` and batch ``bsz``: from the main timings (at the
    run's ``bits``, 8 where a run predates the key) or from ``other_bits``; None where not timed."""
    main_bits = results.get("bits") or 8
    for r in results.get("timings") or []:
        if r["batch"] == bsz and r["mode"] == mode and row_kind(r) == kind and (r.get("bits") or main_bits) == bits:
            return r
    return next((r for r in results.get("other_bits") or [] if r["batch"] == bsz and r["mode"] == mode
                 and r["bits"] == bits and r["impl"].endswith(WIDTH_ROW_SUFFIX[kind]) and not r.get("error")), None)


def _judged(target, mode, bsz, key, value, sense, wanted):
    met = missing = None
    if value is not None and value == value:   # not NaN
        met = value >= wanted if sense == ">=" else value <= wanted
        if not met:
            missing = (wanted / value if value else float("inf")) if sense == ">=" else value / wanted
    return dict(target=f"{mode}: {target}", mode=mode, batch=bsz, key=key, measured=value, wanted=wanted,
                sense=sense, met=met, missing_factor=missing)


def targets(results):
    """Each of ``TARGETS`` at the largest batch (the LeapQuant ones on the 8-bit rows, wherever the
    run timed them: ``width_row``), then each of ``BITS_TARGETS`` per mode (the amortised window's
    ratio to FLA at that width over int8's): ``dict(target, mode, batch, key, measured, wanted,
    sense, met, missing_factor)``; ``measured``/``met`` are None where the run has no such row (FLA
    absent, the width not timed, a measure its row lacks). ``missing_factor``: ``wanted / measured``
    for a ``>=`` target, ``measured / wanted`` for ``<=``."""
    rows = results.get("timings") or []
    if not rows:
        return []
    bsz = max(r["batch"] for r in rows)
    out = []
    for what, mode, kind, key, sense, wanted in TARGETS:
        if kind.startswith("lq"):
            hit = width_row(results, bsz, mode, 8, kind)
            named = hit is not None and hit.get("flush_impl") and kind != "lq-steps"
            fl = f", flush {hit['flush_impl']}" if named else ""
            label = f"LeapQuant int8 {what}{fl}"
        else:
            hit = next((r for r in rows if r["batch"] == bsz and r["mode"] == mode and row_kind(r) == kind), None)
            label = what
        value = _measure(hit, key) if hit is not None else None
        out.append(_judged(label, mode, bsz, key, value, sense, wanted))
    for mode in ("GDN", "KDA"):
        base = width_row(results, bsz, mode, 8, "lq-window")
        base = base.get("speedup_vs_fla_fp32") if base is not None else None
        for bits, wanted in BITS_TARGETS:
            hit = width_row(results, bsz, mode, bits, "lq-window")
            hit = hit.get("speedup_vs_fla_fp32") if hit is not None else None
            value = hit / base if hit and base else None
            out.append(_judged(f"LeapQuant int{bits} amortised ratio to FLA / int8's", mode, bsz, "of_int8",
                               value, ">=", wanted))
    return out


def _fmt_target(key, x):
    if x is None:
        return "-"
    if key == "frac_copy_bw":
        return f"{100 * x:.0f}%"
    if key == "us":
        return f"{x:.0f} µs"
    if key == "kb_per_head":
        return f"{x:.1f} KB"
    if key == "of_int8":
        return f"{x:.2f} of int8"
    return f"{x:.2f}×"


def _cell(text, n=160):
    return str(text)[:n].replace("|", "/").replace("\n", " ")


def _table(*columns: str) -> list[str]:
    """A Markdown table's header row and separator row for ``columns``."""
    return ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]


def decoded_state_markdown(rows) -> list[str]:
    """The decoded-state criterion's table (``bench.kernel_checks.decoded_state_row`` rows): per head
    kind the worst error ratio to the reference's, or ``cap`` and the error over the cap where the
    reference's error is below the floor; ``ref`` the reference's error / mean |S|."""
    out = ["## Decoded-state criterion (the flush)", "",
           "Per head: err = mean |decode(checkpoint) - S| over the batch and the head's elements, S rebuilt in "
           "fp64; pass: err <= 1.01 x the reference flush's where that is >= 1e-4 mean |S|, else <= 1e-3 mean |S|; "
           "every output finite, codes in range.", "",
           *_table("mode", "bits", "flush", "inputs", "batch", "pass", "worst ratio",
                   "per head kind: ratio (ref err) or cap")]
    for r in rows:
        if r.get("skipped"):
            out.append(f"| {r['mode']} | {r['bits']} | {r['impl']} | - | - | skipped | - | {_cell(r['skipped'])} |")
            continue
        kinds = ", ".join(f"{k} {v['ratio']:.4f} ({v['ref_err']:.1e})" if v["ratio"] is not None
                          else f"{k} cap {v['cap']:.2f}" for k, v in r["kinds"].items())
        worst = f"{r['worst_ratio']:.4f}" if r["worst_ratio"] is not None else "-"
        out.append(f"| {r['mode']} | {r['bits']} | {r['impl']} | {r['inputs']} | {r['batch']} | "
                   f"{'yes' if r['passed'] else 'no'} | {worst} | {kinds} |")
    return out + [""]


def markdown(results) -> str:
    env = results["environment"]
    out = [f"# Kernel benchmark ({env.get('gpu') or env['devices']})", "",
           f"date {env['date']}; jax {env['jax']}; torch {env.get('torch')}; triton {env.get('triton')}; "
           f"fla-core {env.get('fla')}; commit {env.get('commit')}; command `{env['command']}`", ""]
    if "copy_bandwidth_Bps" in results:
        out += [f"Device-to-device copy: {results['copy_bandwidth_Bps'] / 1e12:.2f} TB/s (read + write).", ""]
    if results["correctness"]:
        out += ["## Correctness (compiled kernels)", "", *_table("check", "mode", "o rel err", "state rel err", "other")]
        for r in results["correctness"]:
            extra = {k: v for k, v in r.items() if k not in ("check", "mode", "o_rel_err", "state_rel_err", "tokens")}
            ex = ", ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items())
            out.append(f"| {r['check']} | {r['mode']} | {r['o_rel_err']:.2e} | {r['state_rel_err']:.2e} | {ex} |")
        out.append("")
    if results.get("decoded_state"):
        out += decoded_state_markdown(results["decoded_state"])
    if results.get("long_decode"):
        r0 = results["long_decode"][0]
        out += [f"## Long decodes of extreme-decay heads ({r0['tokens']} tokens, batch {r0['batch']}, "
                f"{r0['dk']}x{r0['dv']}, LeapQuant int8 against exact fp32)", "",
                "Per head (alpha): final state relative error / output relative error over all tokens; "
                "NaN marks a head with a non-finite output or state.", "",
                *_table("mode", "impl", "all finite", "s", *(f"a={a:.8g}" for a in EXTREME_DECAYS))]
        for r in results["long_decode"]:
            cells = [f"{h['state_rel_error']:.1e} / {h['output_rel_error']:.1e}" if h["finite"] else "NaN"
                     for h in r["heads"]]
            out.append(f"| {r['mode']} | {r['impl']} | {'yes' if r['all_finite'] else 'no'} | {r['seconds']:.0f} | "
                       + " | ".join(cells) + " |")
        out.append("")
    if results["timings"]:
        out += ["## Timings (µs per token-step, medians)", "",
                *_table("batch", "mode", "impl", "µs/step", "MB moved/step", "GB/s", "% copy BW", "× vs FLA fp32",
                        "× vs Pallas fp32")]
        for r in results["timings"]:
            if r.get("error"):
                out.append(f"| {r['batch']} | {r['mode']} | {r['impl']} | error: {_cell(r['error'])} | | | | | |")
                continue
            fla = f"{r['speedup_vs_fla_fp32']:.2f}" if r.get("speedup_vs_fla_fp32") else "-"
            pallas = f"{r['speedup_vs_pallas_fp32']:.2f}" if r.get("speedup_vs_pallas_fp32") else "-"
            out.append(f"| {r['batch']} | {r['mode']} | {r['impl']} | {r['us']:.1f} | {r['bytes'] / 1e6:.1f} | "
                       f"{r['GBps']:.0f} | {100 * r['frac_copy_bw']:.0f} | {fla} | {pallas} |")
        out.append("")
    if results.get("load_only"):
        lo = results["load_only"]
        steps = {(r["batch"], r["mode"]): r["us"] for r in results["timings"] if row_kind(r) == "lq-steps"}
        out += ["## Load-only kernel (the step's bytes)", "",
                f"A Pallas Triton kernel, one program per (sequence, head), reading exactly what the LeapQuant "
                f"step reads (codes, scales, smoothing, Compensator Tokens, the live records, the token) with a "
                f"trivial reduction of each, and writing the output and one record: `step_bytes` per head. "
                f"µs per step, mean over window positions 0..p-1, batch {lo[0]['batch']}, {lo[0]['heads']} heads, "
                f"{lo[0]['dk']}x{lo[0]['dv']}"
                + (" (interpret mode: not a timing)." if lo[0].get("interpret") else "."), "",
                *_table("mode", "options", "µs/step", "MB/step", "GB/s", "% copy BW", "step µs (same batch)",
                        "step / load-only")]
        for r in lo:
            if r.get("error"):
                out.append(f"| {r['mode']} | {r['options']} | error: {_cell(r['error'])} | | | | | |")
                continue
            st = steps.get((r["batch"], r["mode"]))
            bw = f"{100 * r['frac_copy_bw']:.0f}" if r.get("frac_copy_bw") else "-"
            out.append(f"| {r['mode']} | {r['options']} | {r['us']:.1f} | {r['bytes'] / 1e6:.1f} | {r['GBps']:.0f} | {bw} | "
                       + (f"{st:.1f} | {st / r['us']:.2f} |" if st else "- | - |"))
        out.append("")
    if results.get("split_flush_stages"):
        out += ["## Split flush stages (largest batch, µs per flush, every window full)", "",
                *_table("mode", "stage 1: reconstruct + S S^T Q0", "stage 2: fit in XLA",
                        "stage 3: residual, quantize, write")]
        for mode, st in results["split_flush_stages"].items():
            if "error" in st:
                out.append(f"| {mode} | {st['error']} | | |")
            else:
                out.append(f"| {mode} | {st['reconstruct']:.0f} | {st['fit_xla']:.0f} | {st['quantize']:.0f} |")
        out.append("")
    if results.get("other_bits"):
        out += ["## Other bit widths (µs per token-step; flush: per flush)", "",
                *_table("batch", "bits", "mode", "what", "step kernel", "µs", "× vs FLA fp32")]
        for r in results["other_bits"]:
            sp = f"{r['speedup_vs_fla_fp32']:.2f}" if r.get("speedup_vs_fla_fp32") else "-"
            us = f"error: {_cell(r['error'])}" if r.get("error") else f"{r['us']:.1f}"
            out.append(f"| {r['batch']} | {r['bits']} | {r['mode']} | {r['impl']} | {r.get('step_kernel', '-')} | {us} "
                       f"| {sp} |")
        out.append("")
        # the amortised window (p steps + flush, per step) of every bit width timed, against FLA fp32
        main_bits = results.get("bits") or 8
        timed = {(r["batch"], r.get("bits") or main_bits) for r in results["timings"] if row_kind(r) == "lq-window"}
        timed |= {(r["batch"], r["bits"]) for r in results["other_bits"]
                  if r["impl"].endswith(WIDTH_ROW_SUFFIX["lq-window"]) and not r.get("error")}
        batches = sorted({b for b, _ in timed} & {r["batch"] for r in results["other_bits"]})
        if batches:
            out += ["### Amortised per token-step vs FLA fp32 by bit width (p steps + flush)", "",
                    *_table("batch", "bits", "GDN µs", "GDN × vs FLA fp32", "KDA µs", "KDA × vs FLA fp32")]
            for bsz in batches:
                for bits in sorted({b for n, b in timed if n == bsz}, reverse=True):
                    cells = []
                    for mode in ("GDN", "KDA"):
                        r = width_row(results, bsz, mode, bits, "lq-window")
                        sp = r.get("speedup_vs_fla_fp32") if r else None
                        cells += [f"{r['us']:.1f}" if r else "-", f"{sp:.2f}" if sp else "-"]
                    out.append(f"| {bsz} | {bits} | " + " | ".join(cells) + " |")
            out.append("")
    if results["sweep"]:
        out += [f"## Variant sweep (batch {results['sweep'][0]['batch']}; the timings above use the fastest)", "",
                *_table("kernel", "mode", "options", "µs", "error")]
        for r in results["sweep"]:
            out.append(f"| {r['kernel']} | {r['mode']} | {r['options']} | {r['us']:.1f} | {_cell(r.get('error', ''))} |")
        out.append("")
    tg = targets(results)
    if tg:
        out += [f"## Targets (batch {tg[0]['batch']}, FLA fp32 timed in the same run)", "",
                *_table("target", "measured", "wanted", "met", "short by")]
        for t in tg:
            met = {True: "yes", False: "no", None: "not measured"}[t["met"]]
            short = f"{t['missing_factor']:.2f}×" if t["missing_factor"] else "-"
            wanted = ("≥ " if t["sense"] == ">=" else "≤ ") + _fmt_target(t["key"], t["wanted"])
            out.append(f"| {t['target']} | {_fmt_target(t['key'], t['measured'])} | {wanted} | {met} | {short} |")
        out.append("")
    for n in results.get("notes", []):
        out.append(f"- {n}")
    return "\n".join(out) + "\n"

