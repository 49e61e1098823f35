"""``bench.kernels`` on the CPU: the load-only kernel (interpret mode against numpy, its bytes
against ``step_bytes``, its lowering to Triton), the sweep variants, the targets and the report.
The GPU timings themselves run in ``bench/``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import kernels as bk
from leapquant_jax import windowed
from leapquant_jax.state import LeapQuantConfig
from pallas_kernels.leapquant_step import step_bytes

# Its tests share compiled programs (the same shapes and configs, op by op and kernel by kernel):
# one xdist worker compiles them once (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("bench_kernels_cpu")


def filled_state(config, bsz, h, dk, dv, kda, pos):
    """A state whose every window slot holds a record (so that dead slots are nonzero and a
    missing mask shows), then ``pos`` set to the given ragged positions."""
    st = windowed.from_dense(config, bk.random_state(jax.random.PRNGKey(3), bsz, h, dk, dv), per_channel_decay=kda)
    seq = bk.random_sequence(jax.random.PRNGKey(4), bsz, config.window, h, dk, dv, kda)
    for i in range(config.window):
        _, st = windowed.step_reference(config, st, bk.token_at(seq, i))
    return st.replace(pos=jnp.asarray(pos, jnp.int32))


def numpy_load_only(config, st, tok):
    """The load-only kernel's reduction (its docstring) and records, in float64 numpy."""
    ck = st.checkpoint
    f = lambda x: np.asarray(x, np.float64)   # noqa: E731
    codes, scale = f(ck.residual.codes), f(ck.residual.scale)
    k, u, g = (np.array(x) for x in (st.buffer.k, st.buffer.u, st.buffer.g))
    pos = np.asarray(st.pos)
    bsz, h, p = k.shape[0], k.shape[1], config.window
    o = np.zeros(codes.shape[:2] + codes.shape[-1:])
    for i in range(bsz):
        live = slice(0, min(pos[i], p))
        for j in range(h):
            s = (np.sum(f(tok.q)[i, j] + f(tok.w)[i, j] + f(tok.b)[i, j]) + np.sum(f(tok.g)[i, j]) + f(tok.beta)[i, j]
                 + np.sum(f(ck.smooth)[i, j]) + np.sum(f(ck.comp_k)[i, j]) + np.sum(f(k[i, j, live]))
                 + np.sum(f(g[i, j, live])))
            col = (codes[i, j].sum(0) * scale[i, j] + f(ck.comp_u)[i, j].sum(0) + f(u[i, j, live]).sum(0)
                   + f(tok.v)[i, j])
            o[i, j] = col + s
        if pos[i] < p:
            k[i, :, pos[i]] = np.asarray(tok.w[i], k.dtype)
            u[i, :, pos[i]] = o[i].astype(u.dtype)
            g[i, :, pos[i]] = np.asarray(tok.g[i], g.dtype)
    return o, k, u, g


@pytest.mark.parametrize("bits, kda, chunk", [(8, False, None), (8, True, 16), (6, True, None), (4, False, 8)])
def test_load_only_kernel_matches_numpy(bits, kda, chunk):
    # bits 6: rank 6 (not a power of two, one Compensator Token row at a time) and three code planes
    config = LeapQuantConfig(bits=bits, window=4)
    bsz, h, dk, dv = 3, 2, 32, 32
    st = filled_state(config, bsz, h, dk, dv, kda, [0, 2, 4])       # pos = p: reads all, writes nothing
    tok = bk.token_at(bk.random_sequence(jax.random.PRNGKey(9), bsz, 1, h, dk, dv, kda), 0)
    want_o, want_k, want_u, want_g = numpy_load_only(config, st, tok)
    o, new = bk.load_only_step(config, jax.tree_util.tree_map(jnp.copy, st), tok, chunk=chunk, interpret=True)
    np.testing.assert_allclose(np.asarray(o), want_o, rtol=1e-5, atol=1e-3)
    np.testing.assert_array_equal(np.asarray(new.pos), [1, 3, 5])
    for got, want in ((new.buffer.k, want_k), (new.buffer.g, want_g)):
        np.testing.assert_array_equal(np.asarray(got), want)
    # u's record is o rounded to fp16: the fp32 and float64 sums may straddle a rounding boundary
    np.testing.assert_allclose(np.asarray(new.buffer.u, np.float64), want_u.astype(np.float64), rtol=2 ** -10, atol=1e-3)


@pytest.mark.parametrize("kda", [False, True])
def test_load_only_kernel_moves_step_bytes(kda):
    # The bytes the kernel's operands give per head (the first pos records read, one record
    # written, the token read as fp32) are step_bytes at every window position.
    config = LeapQuantConfig(bits=8, window=4)
    bsz, h, dk, dv = 2, 2, 32, 32
    st = windowed.from_dense(config, bk.random_state(jax.random.PRNGKey(3), bsz, h, dk, dv), per_channel_decay=kda)
    ck, buf = st.checkpoint, st.buffer

    def per_head(x):
        return x.dtype.itemsize * x.size // (bsz * h)

    fixed = sum(per_head(x) for x in (ck.residual.codes, ck.residual.scale, ck.smooth, ck.comp_k, ck.comp_u))
    record = sum(per_head(x) for x in (buf.k, buf.u, buf.g)) // config.window
    token = 4 * (3 * dk + dv + (dk if kda else 1) + 1)
    for pos in range(config.window):
        assert fixed + pos * record + token + 4 + 4 * dv + record == step_bytes(config, dk, dv, pos, kda)


@pytest.mark.parametrize("bits, kda", [(8, False), (8, True), (6, True), (4, False)])
def test_load_only_kernel_lowers_to_triton(bits, kda):
    disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    config = LeapQuantConfig(bits=bits, window=16)
    st = windowed.init_state(config, 2, 2, 128, 128, kda)
    tok = bk.token_at(bk.random_sequence(jax.random.PRNGKey(0), 2, 1, 2, 128, 128, kda), 0)
    for opts in bk.LOAD_ONLY_VARIANTS:
        f = functools.partial(bk.load_only_step, config, interpret=False, **opts)
        jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=disabled)(st, tok)


def test_sweep_variants():
    dense = bk.dense_variants(128)
    assert [(v["block_v"], v["num_warps"]) for v in dense if v.get("num_stages", 1) == 1] == [
        (64, 4), (64, 2), (32, 4), (32, 2), (128, 4), (128, 8)]
    assert all(("num_stages" in v) == bk.dense_accepts("num_stages") for v in dense)
    steps = bk.step_variants(LeapQuantConfig(bits=8), 128, 128)
    assert [v["num_warps"] for v in steps if v.get("heads_per_program") == 2] == [2, 4]
    assert all("kernel" not in v for v in steps)
    assert bk.step_variants(LeapQuantConfig(bits=8), 128, 128, mosaic=True)[-1] == {"kernel": "mosaic"}
    flush = bk.flush_variants(True, 128)
    assert [v["num_warps"] for v in flush if v["impl"] == "stream"] == [4, 8, 2]
    assert (bk.bytes_impl({}), bk.bytes_impl(dict(impl="auto")), bk.bytes_impl(dict(impl="stream"))) == (
        "split", "split", "stream")
    assert (bk.bytes_impl({}, mosaic=True), bk.bytes_impl(dict(impl="split"), mosaic=True)) == ("mosaic", "split")


def timing(mode, kind, us, *, bsz=512, h=32, nbytes=1.0, fla=None, frac=None, **extra):
    return dict(impl=f"{kind} row", kind=kind, mode=mode, batch=bsz, heads=h, us=us, bytes=nbytes,
                speedup_vs_fla_fp32=fla, frac_copy_bw=frac, **extra)


def test_targets_directions_and_missing_rows():
    rows = [timing("GDN", "lq-window", 10.0, fla=4.4, bits=8, flush_impl="stream"),
            timing("GDN", "lq-window", 10.0, bsz=32, fla=1.0, bits=8),              # not the largest batch
            timing("KDA", "lq-window", 10.0, fla=3.0, bits=8, flush_impl="split"),
            timing("GDN", "lq-steps", 1.0, frac=0.77, bits=8),
            timing("GDN", "lq-flush", 750.0, nbytes=55e3 * 512 * 32, bits=8, flush_impl="stream"),
            timing("KDA", "lq-flush", 500.0, nbytes=66e3 * 512 * 32, bits=8, flush_impl="stream")]
    tg = bk.targets(dict(timings=rows))
    assert len(tg) == len(bk.TARGETS)                      # every target reported, measured or not
    got = tg[0]
    assert got["batch"] == 512 and got["met"] and got["missing_factor"] is None
    assert got["target"] == "GDN: LeapQuant int8 amortised per token-step vs FLA fp32, flush stream"
    kda = tg[1]
    assert not kda["met"] and kda["missing_factor"] == pytest.approx(3.5 / 3.0)
    flush = [t for t in tg if t["key"] == "us"]
    assert [(t["met"], t["missing_factor"]) for t in flush] == [(False, pytest.approx(750 / 600)), (True, None)]
    kb = [t for t in tg if t["key"] == "kb_per_head"]
    assert [t["measured"] for t in kb] == [pytest.approx(55.0), pytest.approx(66.0)]
    assert [(t["met"], t["missing_factor"]) for t in kb] == [(True, None), (False, pytest.approx(1.1))]
    dense = [t for t in tg if t["target"].endswith("Pallas fp32 dense step vs FLA fp32")]
    assert [(t["wanted"], t["met"]) for t in dense] == [(0.95, None), (1.0, None)]   # no dense rows: not measured


def test_markdown_sections():
    env = dict(date="d", jax="j", devices=["cpu"], command="c")
    rows = [timing(m, "lq-window", 10.0, fla=f, bits=8, flush_impl="split", nbytes=2e6, frac=0.5, GBps=1.0)
            for m, f in (("GDN", 4.2), ("KDA", 3.1))]
    for r in rows:
        r.update(speedup_vs_pallas_fp32=2.0)
    lo = [dict(kernel="load-only", mode="GDN", batch=512, heads=32, dk=128, dv=128, options=dict(num_warps=2),
               bytes=1e6, us=1.0, GBps=1e3, frac_copy_bw=0.8, interpret=False),
          dict(kernel="load-only", mode="KDA", batch=512, heads=32, dk=128, dv=128, options=dict(num_warps=4),
               bytes=1e6, us=float("nan"), error="TypeError: x | y", interpret=False)]
    other = [dict(impl=f"LeapQuant int{b} window", batch=512, mode=m, bits=b, us=9.0, speedup_vs_fla_fp32=s)
             for b, m, s in ((6, "GDN", 4.6), (6, "KDA", 3.4), (4, "GDN", 5.0))]
    md = bk.markdown(dict(environment=env, bits=8, correctness=[], timings=rows, sweep=[], notes=[],
                          load_only=lo, other_bits=other))
    assert "## Load-only kernel (the step's bytes)" in md
    assert "| GDN | {'num_warps': 2} | 1.0 | 1.0 | 1000 | 80 |" in md
    assert "error: TypeError: x / y" in md
    assert "| 8 | 10.0 | 4.20 | 10.0 | 3.10 |" in md
    assert "| 6 | 9.0 | 4.60 | 9.0 | 3.40 |" in md
    assert "| 4 | 9.0 | 5.00 | - | - |" in md
    assert "| KDA: LeapQuant int8 amortised per token-step vs FLA fp32, flush split | 3.10× | ≥ 3.50× | no | 1.13× |" in md


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
    assert all(r["error"] == bk.SKIPPED and np.isnan(r["us"]) for r in rows)
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
    st = filled_state(config, 6, 4, 128, 128, False, [0, 3, 7, 5, 1, 6])
    tok = bk.token_at(bk.random_sequence(jax.random.PRNGKey(5), 6, 1, 4, 128, 128, False), 0)
    o, new = mosaic_step.launch(config, st, tok, bm.load_only_head, programs=2, stages=2)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(tok.v))
    for b, pos in enumerate([0, 3, 7, 5, 1, 6]):
        np.testing.assert_array_equal(np.asarray(new.buffer.u[b, :, pos]), np.asarray(tok.v[b].astype(jnp.float16)))
        np.testing.assert_array_equal(np.asarray(new.buffer.k[b, :, pos]), np.asarray(tok.w[b].astype(jnp.float16)))
    # Every record slot is copied in, so the Mosaic GPU step moves more than the Triton step's last position.
    for kda in (False, True):
        assert mosaic_step.mosaic_step_bytes(config, 128, 128, per_channel=kda) > \
            step_bytes(config, 128, 128, config.window - 1, kda)


def test_mosaic_codes_only_head_returns_the_code_sums():
    # bench.mosaic_step's codes-only variant: the pipeline around the code sums alone. Its output
    # row is Z^T (c b) and its value record Z^T (c q), for both ways of summing.
    from bench import mosaic_step as bm
    from pallas_kernels import mosaic_step

    config = LeapQuantConfig(bits=8, window=8)
    st = filled_state(config, 2, 4, 128, 128, False, [2, 5])
    tok = bk.token_at(bk.random_sequence(jax.random.PRNGKey(6), 2, 1, 4, 128, 128, False), 0)
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
    bk.check_single_ops(rows.append, (8,), (True,), flush_impls=({"impl": "mosaic", "programs": 4},),
                        config_options=dict(warm_start=True))
    [row] = rows
    assert "mosaic flush, programs=4" in row["check"] and row["finite"]
    assert row["pallas_flush_err"] <= 1.05 * row["reference_flush_err"]
    config = LeapQuantConfig(bits=8, window=16)
    assert bk.impl_flush_bytes(config, 128, 128, True, "mosaic") < bk.impl_flush_bytes(config, 128, 128, True, "split")
