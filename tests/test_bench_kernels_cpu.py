"""The benchmark modules on the CPU (``bench.kernel_timing``, ``bench.kernel_report``,
``bench.kernels``, ``bench.mosaic_step``, ``bench.mosaic_dense``, ``bench.registers``): the sweep
variants, the targets and the report, a whole run's shape, the Mosaic GPU pipelines' bench
variants. The GPU timings themselves run in ``bench/``; the compiled checks in ``test_gpu_checks``."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import kernels as bk
from bench import kernel_report, kernel_timing
from bench.inputs import random_state, window_tokens
from bench.kernel_checks import check_single_ops, ragged_failures, single_op_failures, tf32_fit
from leapquant_jax import windowed
from leapquant_jax.state import LeapQuantConfig
from pallas_kernels.leapquant_step import step_bytes

from helpers import copy_tree, live_state, random_sequence, token_at

# Its tests share compiled programs (the same shapes and configs, op by op and kernel by kernel):
# one xdist worker compiles them once (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("bench_kernels_cpu")


def test_sweep_variants():
    dense = kernel_timing.dense_variants(128)
    assert [(v["block_v"], v["num_warps"]) for v in dense if v.get("num_stages", 1) == 1] == [
        (64, 4), (64, 2), (32, 4), (32, 2), (128, 4), (128, 8)]
    assert all(("num_stages" in v) == kernel_timing.dense_accepts("num_stages") for v in dense)
    steps = kernel_timing.step_variants(LeapQuantConfig(bits=8), 128, 128)
    assert [v["num_warps"] for v in steps if v.get("heads_per_program") == 2] == [2, 4]
    assert all("kernel" not in v for v in steps)
    assert kernel_timing.step_variants(LeapQuantConfig(bits=8), 128, 128, mosaic=True)[-1] == {"kernel": "mosaic"}
    flush = kernel_timing.flush_variants(True, 128)
    assert [v["impl"] for v in flush] == ["fused", "split", "split", "auto"]
    assert (kernel_timing.bytes_impl({}), kernel_timing.bytes_impl(dict(impl="auto")),
            kernel_timing.bytes_impl(dict(impl="fused"))) == ("split", "split", "fused")
    assert (kernel_timing.bytes_impl({}, mosaic=True), kernel_timing.bytes_impl(dict(impl="split"), mosaic=True)) == ("mosaic", "split")


def timing(mode, kind, us, *, bsz=512, h=32, nbytes=1.0, fla=None, frac=None, **extra):
    return dict(impl=f"{kind} row", kind=kind, mode=mode, batch=bsz, heads=h, us=us, bytes=nbytes,
                speedup_vs_fla_fp32=fla, frac_copy_bw=frac, **extra)


def test_targets_directions_and_missing_rows():
    rows = [timing("GDN", "lq-window", 10.0, fla=4.4, bits=8, flush_impl="fused"),
            timing("GDN", "lq-window", 10.0, bsz=32, fla=1.0, bits=8),              # not the largest batch
            timing("KDA", "lq-window", 10.0, fla=2.0, bits=8, flush_impl="split"),
            timing("GDN", "lq-steps", 1.0, frac=0.77, bits=8),
            timing("GDN", "lq-flush", 750.0, nbytes=55e3 * 512 * 32, bits=8, flush_impl="fused"),
            timing("KDA", "lq-flush", 500.0, nbytes=66e3 * 512 * 32, bits=8, flush_impl="fused")]
    tg = kernel_report.targets(dict(timings=rows))
    # every target reported, measured or not: the bit widths' per mode
    assert len(tg) == len(kernel_report.TARGETS) + 2 * len(kernel_report.BITS_TARGETS)
    got = tg[0]
    assert got["batch"] == 512 and got["met"] and got["missing_factor"] is None
    assert got["target"] == "GDN: LeapQuant int8 amortised per token-step vs FLA fp32, flush fused"
    kda = tg[1]
    assert not kda["met"] and kda["missing_factor"] == pytest.approx(2.5 / 2.0)
    flush = [t for t in tg if t["key"] == "us"]
    assert [(t["met"], t["missing_factor"]) for t in flush] == [(False, pytest.approx(750 / 600)), (True, None)]
    kb = [t for t in tg if t["key"] == "kb_per_head"]
    assert [t["measured"] for t in kb] == [pytest.approx(55.0), pytest.approx(66.0)]
    assert [(t["met"], t["missing_factor"]) for t in kb] == [(True, None), (False, pytest.approx(1.1))]
    other = [dict(impl="LeapQuant int4 window", batch=512, mode="GDN", bits=4, speedup_vs_fla_fp32=3.3),
             dict(impl="LeapQuant int6 window", batch=32, mode="GDN", bits=6, speedup_vs_fla_fp32=9.9)]
    widths = {t["target"]: t for t in kernel_report.targets(dict(timings=rows, other_bits=other))
              if t["key"] == "of_int8"}
    int4, int6 = (widths[f"GDN: LeapQuant int{b} amortised ratio to FLA / int8's"] for b in (4, 6))
    assert int4["measured"] == pytest.approx(3.3 / 4.4) and int4["missing_factor"] == pytest.approx(4.4 / 3.3)
    assert int6["measured"] is None and int6["met"] is None            # only timed at another batch
    dense = [t for t in tg if t["target"].endswith("Pallas fp32 dense step vs FLA fp32")]
    assert [(t["wanted"], t["met"]) for t in dense] == [(0.95, None), (1.0, None)]   # no dense rows: not measured


def test_targets_take_the_8_bit_rows_of_a_run_at_another_width():
    """A run with 4 bits as its main width and 8 beside it: the 8-bit targets judge the 8-bit rows
    of ``other_bits``, never the 4-bit ones, and int4's ratio is taken over that int8 window."""
    rows = [timing("GDN", "lq-window", 10.0, fla=3.1, bits=4, flush_impl="mosaic"),
            timing("GDN", "lq-steps", 1.0, frac=0.5, bits=4),
            timing("GDN", "lq-flush", 500.0, nbytes=30e3 * 512 * 32, bits=4, flush_impl="mosaic")]
    other = [dict(impl="LeapQuant int8 window", batch=512, mode="GDN", bits=8, us=9.0, speedup_vs_fla_fp32=3.2),
             dict(impl="LeapQuant int8 steps", batch=512, mode="GDN", bits=8, us=1.0),
             dict(impl="LeapQuant int8 flush", batch=512, mode="GDN", bits=8, us=700.0)]
    tg = {t["target"]: t for t in kernel_report.targets(dict(timings=rows, other_bits=other, bits=4))}
    assert tg["GDN: LeapQuant int8 amortised per token-step vs FLA fp32"]["measured"] == pytest.approx(3.2)
    assert tg["GDN: LeapQuant int8 flush of full windows, µs per window"]["measured"] == pytest.approx(700.0)
    # measures the other widths' rows do not carry stay unmeasured, not taken from the 4-bit rows
    assert tg["GDN: LeapQuant int8 step alone: bandwidth on its bytes / copy bandwidth"]["measured"] is None
    assert tg["GDN: LeapQuant int8 flush, KB (10^3 B) moved per head"]["measured"] is None
    int4 = tg["GDN: LeapQuant int4 amortised ratio to FLA / int8's"]
    assert int4["measured"] == pytest.approx(3.1 / 3.2) and not int4["met"]
    assert tg["KDA: LeapQuant int4 amortised ratio to FLA / int8's"]["measured"] is None


def test_markdown_sections():
    env = dict(date="d", jax="j", devices=["cpu"], command="c")
    rows = [timing(m, "lq-window", 10.0, fla=f, bits=8, flush_impl="split", nbytes=2e6, frac=0.5, GBps=1.0)
            for m, f in (("GDN", 4.2), ("KDA", 2.2))]
    rows[0].update(speedup_vs_pallas_fp32=2.0)      # KDA's: a run with --no-dense has no Pallas fp32 row
    lo = [dict(kernel="load-only", mode="GDN", batch=512, heads=32, dk=128, dv=128, options=dict(num_warps=2),
               bytes=1e6, us=1.0, GBps=1e3, frac_copy_bw=0.8, interpret=False),
          dict(kernel="load-only", mode="KDA", batch=512, heads=32, dk=128, dv=128, options=dict(num_warps=4),
               bytes=1e6, us=float("nan"), error="TypeError: x | y", interpret=False)]
    other = [dict(impl=f"LeapQuant int{b} window", batch=512, mode=m, bits=b, us=9.0, speedup_vs_fla_fp32=s)
             for b, m, s in ((6, "GDN", 4.6), (6, "KDA", 3.4), (4, "GDN", 5.0))]
    md = kernel_report.markdown(dict(environment=env, bits=8, correctness=[], timings=rows, sweep=[], notes=[],
                          load_only=lo, other_bits=other))
    assert "## Load-only kernel (the step's bytes)" in md
    assert "| GDN | {'num_warps': 2} | 1.0 | 1.0 | 1000 | 80 |" in md
    assert "error: TypeError: x / y" in md
    assert "| 512 | 8 | 10.0 | 4.20 | 10.0 | 2.20 |" in md
    assert "| 512 | GDN | lq-window row | 10.0 | 2.0 | 1 | 50 | 4.20 | 2.00 |" in md
    assert "| 512 | KDA | lq-window row | 10.0 | 2.0 | 1 | 50 | 2.20 | - |" in md
    assert "| 512 | 6 | 9.0 | 4.60 | 9.0 | 3.40 |" in md
    assert "| 512 | 4 | 9.0 | 5.00 | - | - |" in md
    assert "| GDN: LeapQuant int4 amortised ratio to FLA / int8's | 1.19 of int8 | ≥ 1.00 of int8 | yes | - |" in md
    assert "| KDA: LeapQuant int4 amortised ratio to FLA / int8's | - | ≥ 1.00 of int8 | not measured | - |" in md
    assert "| KDA: LeapQuant int8 amortised per token-step vs FLA fp32, flush split | 2.20× | ≥ 2.50× | no | 1.14× |" in md


def test_modes_and_time_budget_shape_the_run(tmp_path):
    # --modes keeps one recurrence; a spent --time-budget lists the optional parts as skipped
    out = bk.main(["--batches", "2", "--heads", "2", "--dim", "64", "--window", "4", "--correctness", "none",
                   "--load-only", "--modes", "kda", "--out", str(tmp_path)])
    rows = out["load_only"]
    assert rows and {r["mode"] for r in rows} == {"KDA"} and all(np.isfinite(r["us"]) for r in rows)
    out = bk.main(["--batches", "2", "--heads", "2", "--dim", "64", "--window", "4", "--correctness", "none",
                   "--load-only", "--modes", "gdn", "--time-budget", "1e-9", "--out", str(tmp_path)])
    rows = out["load_only"]
    assert rows and {r["mode"] for r in rows} == {"GDN"}
    assert all(r["error"] == kernel_timing.SKIPPED and np.isnan(r["us"]) for r in rows)
    assert (tmp_path / next(p.name for p in tmp_path.glob("kernels-*.md"))).read_text()


def test_registers_captures_each_kernels_triton_ir():
    """``bench.registers`` takes the Triton IR of every ``pallas_call`` out of a CUDA lowering
    (no GPU, no triton package needed for this part): a flush at ``impl="auto"`` holds the fused
    flush and the split flush's two kernels (chosen at run time), named as on the GPU, and their
    IR reads back as MLIR text."""
    from bench.registers import _text, capture, kernel_calls

    (_, fn, args), = kernel_calls("flush", 8, False, {}, batch=1, heads=2, dim=64, window=8)
    kernels = capture(fn, *args)
    assert sorted(k.name for k in kernels) == [f"leapquant_flush_{s}_gdn_int8" for s in ("fused", "quantize",
                                                                                           "reconstruct")]
    assert all(k.num_warps >= 1 and k.num_stages >= 1 for k in kernels)
    assert "tt.func" in _text(kernels[0].bytecode)


def test_mosaic_load_only_pipeline_delivers_every_head():
    # bench.mosaic_step's load-only variant: the Mosaic GPU step's pipeline around a head that
    # returns its v and w. Each head's output row must be its own v (index maps of every program,
    # the last one's heads past B H included), and its records appended where the step puts them.
    from bench import mosaic_step as bm
    from pallas_kernels import mosaic_step

    config = LeapQuantConfig(bits=8, window=8)
    st, _ = live_state(config, jax.random.PRNGKey(3), 6, 4, 128, 128, False, [0, 3, 7, 5, 1, 6], steps=config.window)
    tok = token_at(random_sequence(jax.random.PRNGKey(5), 6, 1, 4, 128, 128, False), 0)
    o, new = mosaic_step.launch(config, st, tok, bm.load_only_head, programs=2, stages=2)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(tok.v))
    for b, pos in enumerate([0, 3, 7, 5, 1, 6]):
        np.testing.assert_array_equal(np.asarray(new.buffer.u[b, :, pos]), np.asarray(tok.v[b].astype(jnp.float16)))
        np.testing.assert_array_equal(np.asarray(new.buffer.k[b, :, pos]), np.asarray(tok.w[b].astype(jnp.float16)))
    # Record slots come in parts of slot_copy: at least the live ones, the first part always.
    p = config.window
    assert [mosaic_step.copied_slots(p, pos, 4) for pos in range(p + 1)] == [4] * 5 + [8] * 4
    assert [mosaic_step.copied_slots(p, pos, p) for pos in range(p + 1)] == [p] * (p + 1)
    for kda in (False, True):
        whole = mosaic_step.mosaic_step_bytes(config, 128, 128, per_channel=kda, slot_copy=p)
        for pos in range(p):
            parts = mosaic_step.mosaic_step_bytes(config, 128, 128, per_channel=kda, pos=pos, slot_copy=4)
            assert step_bytes(config, 128, 128, pos, kda) < parts <= whole
            # the default: GDN's records in parts of DEFAULT_SLOT_COPY where it divides the window, KDA's whole
            gdn_parts = mosaic_step.mosaic_step_bytes(config, 128, 128, per_channel=kda, pos=pos,
                                                      slot_copy=mosaic_step.DEFAULT_SLOT_COPY)
            want = whole if kda or p % mosaic_step.DEFAULT_SLOT_COPY else gdn_parts
            assert mosaic_step.mosaic_step_bytes(config, 128, 128, per_channel=kda, pos=pos) == want
            assert mosaic_step.mosaic_step_bytes(config, 128, 128, per_channel=kda, pos=pos, slot_copy=p) == whole
        assert mosaic_step.mosaic_step_bytes(config, 128, 128, per_channel=kda) == pytest.approx(
            np.mean([mosaic_step.mosaic_step_bytes(config, 128, 128, per_channel=kda, pos=j) for j in range(p)]))


def test_mosaic_codes_only_head_returns_the_code_sums():
    # bench.mosaic_step's codes-only variant: the pipeline around the code sums alone. Its output
    # row is Z^T (c b) and its value record Z^T (c q), for both ways of summing.
    from bench import mosaic_step as bm
    from pallas_kernels import mosaic_step

    config = LeapQuantConfig(bits=8, window=8)
    st, _ = live_state(config, jax.random.PRNGKey(3), 2, 4, 128, 128, False, [2, 5], steps=config.window)
    tok = token_at(random_sequence(jax.random.PRNGKey(6), 2, 1, 4, 128, 128, False), 0)
    z = np.asarray(st.checkpoint.residual.codes, np.float64)
    c = np.asarray(st.checkpoint.smooth, np.float64)
    want_b = np.einsum("bhkv,bhk->bhv", z, c * np.asarray(tok.b, np.float64))
    want_q = np.einsum("bhkv,bhk->bhv", z, c * np.asarray(tok.q, np.float64))
    for dot in mosaic_step.DOTS:
        o, new = mosaic_step.launch(config, st, tok, bm.codes_only_head, programs=1, dot=dot)
        o = np.asarray(o, np.float64)
        assert np.linalg.norm(o - want_b) <= 1e-6 * np.linalg.norm(want_b), dot
        u = np.stack([np.asarray(new.buffer.u[b, :, pos], np.float64) for b, pos in enumerate([2, 5])])
        assert np.all(np.abs(u - want_q) <= 2.0 ** -10 * np.abs(want_q) + 1e-6), dot


def test_mosaic_dense_bench_checks_and_writes_its_tables(tmp_path):
    # bench.mosaic_dense on the CPU: the compiled-correctness rows (interpreter, Triton interpret
    # mode) land in the JSON and the Markdown, with no timing rows (no GPU to time on); the
    # copy-only pipeline gives the state back unchanged and each head's v block as its output.
    import json

    from bench import mosaic_dense as bd

    assert bd.main(["--batch", "2", "--heads", "2", "--modes", "kda", "--dtypes", "float32", "--out", str(tmp_path),
                    "--variants", '[{"block_v": 32, "per_sm": 1}]', "--triton-variants", '[{"block_v": 32}]',
                    "--copy-only"]) == 0
    out = json.loads(next(tmp_path.glob("mosaic-dense-*.json")).read_text())
    checks = {c["name"]: c for c in out["checks"]}
    assert list(checks) == ["triton block_v=32", "mosaic block_v=32 per_sm=1", "copy-only block_v=32 per_sm=1"]
    assert all(c["o"] < 1e-5 and c["state"] < 1e-6 and c["finite"] for c in out["checks"]), out["checks"]
    assert checks["copy-only block_v=32 per_sm=1"]["o"] == 0.0 == checks["copy-only block_v=32 per_sm=1"]["state"]
    assert out["rows"] == []
    assert "mosaic block_v=32 per_sm=1" in next(tmp_path.glob("mosaic-dense-*.md")).read_text()


def test_flush_checks_take_the_mosaic_flush_with_options_and_configs():
    # bench.flush_time's compiled checks: impl "mosaic" with its options (a JSON object on the
    # command line) and further config fields, here in the Mosaic GPU interpreter; the flushed
    # state as close to the exact one as the reference's, and its byte count in the window rows.
    rows = []
    check_single_ops(rows.append, (8,), (True,), flush_impls=({"impl": "mosaic", "programs": 4},),
                        config_options=dict(warm_start=True))
    [row] = rows
    assert "mosaic flush, programs=4" in row["check"] and row["finite"]
    assert row["pallas_flush_err"] <= 1.05 * row["reference_flush_err"]
    assert row["tf32_fit"] and not single_op_failures(row)
    config = LeapQuantConfig(bits=8, window=16)
    mosaic, split = (kernel_timing.impl_flush_bytes(config, 128, 128, True, impl) for impl in ("mosaic", "split"))
    assert mosaic < split


def test_a_tf32_fit_is_judged_by_the_criterion_not_code_by_code():
    # tf32_fit names the flushes whose fit runs Y = S Z in TF32 (the Mosaic GPU flush's default from
    # 4 bits up); only for them the checks waive the clauses that compare codes with the reference's.
    config, two = LeapQuantConfig(bits=8, window=16), LeapQuantConfig(bits=2, window=16)
    s0 = random_state(jax.random.PRNGKey(0), 1, 2, 128, 128)
    st = windowed.from_dense(config, s0)
    assert tf32_fit(config, st, "mosaic", {}) and not tf32_fit(two, windowed.from_dense(two, s0), "mosaic", {})
    assert not tf32_fit(config, st, "mosaic", {"fit": "fma"}) and not tf32_fit(config, st, "split", {})
    assert not tf32_fit(config, st, "mosaic", {"recon": "fma"})
    op = dict(finite=True, o_rel_err=1e-7, buffer_rel_err=0.0, reference_flush_err=5.4e-3, pallas_flush_err=5.4e-3,
              state_rel_err=1.5e-3)
    assert single_op_failures(op) and not single_op_failures(dict(op, tf32_fit=True))
    assert single_op_failures(dict(op, tf32_fit=True, pallas_flush_err=5.6e-3))
    ragged = dict(finite=True, reference_o_err_vs_fp32=3.89e-3, pallas_o_err_vs_fp32=3.89e-3, o_rel_err=1.3e-3)
    assert ragged_failures(ragged) and not ragged_failures(dict(ragged, tf32_fit=True))
    assert ragged_failures(dict(ragged, tf32_fit=True, pallas_o_err_vs_fp32=3.95e-3))


@pytest.mark.parametrize("swept, mosaic, want", [(False, True, "mosaic"), (False, False, "triton"),
                                                 (True, True, "triton")])
def test_other_bit_widths_time_the_step_auto_runs(monkeypatch, swept, mosaic, want):
    # --extra-bits: without a sweep the steps are the kernel dispatch runs at that width (the
    # Mosaic GPU step where it takes the state), as the main width's rows; with a sweep, the
    # sweep's fastest options (here the Triton step's defaults). Each row names its step kernel.
    seen = []
    monkeypatch.setattr(kernel_timing, "takes_mosaic", lambda op, *a: mosaic and op == "step")
    monkeypatch.setattr(kernel_timing, "leapquant_window_timer",
                        lambda cfg, what, opts, flush: seen.append((cfg.bits, what, dict(opts))) or what)
    monkeypatch.setattr(kernel_timing, "time_jax", lambda timer, state, toks, steps: 2.0)
    results = dict(timings=[])
    run = kernel_timing.Run(results=results, log=lambda row: None, save=lambda: None, over=lambda: False,
                            config=LeapQuantConfig(bits=8, window=4), heads=2, dim=16)
    best = {kda: dict(step={}, flush={}) for kda in (False, True)}
    kernel_timing.time_other_bits(run, best, 6, 2, (False,), swept=swept)
    assert [(bits, what) for bits, what, _ in seen] == [(6, "window"), (6, "steps"), (6, "flush")]
    for _, what, opts in seen:
        assert opts == (dict(kernel="mosaic") if want == "mosaic" else {})
    rows = results["other_bits"]
    assert [r.get("step_kernel") for r in rows] == [want, want, None]
    env = dict(date="d", jax="j", devices=["cpu"], command="c")
    md = kernel_report.markdown(dict(environment=env, bits=8, correctness=[], timings=[], sweep=[], notes=[],
                                     other_bits=rows))
    assert f"| 2 | 6 | GDN | LeapQuant int6 window | {want} | 2.0 |" in md


def test_the_methods_window_flushes_after_every_step_to_the_same_state():
    # "window-checked" runs a flush of the full windows after each step, as WindowedMethod does:
    # the steps before the last fill no window, so it ends where "window" (one flush at the end) does.
    config = LeapQuantConfig(bits=8, window=4, impl="pallas")
    toks = window_tokens(2, 2, 32, 32, False, 4)
    start = windowed.from_dense(config, random_state(jax.random.PRNGKey(3), 2, 2, 32, 32))
    out = {mode: kernel_timing.leapquant_window_timer(config, mode)(copy_tree(start), toks)
           for mode in ("window", "window-checked")}
    chex.assert_trees_all_close(out["window"], out["window-checked"], rtol=0, atol=0)
    assert int(out["window"][0].pos.max()) == 0
