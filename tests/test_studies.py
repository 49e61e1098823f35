"""The studies: error study bytes and configuration, output folders, table labels (tiny configurations)."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from leapquant_cli import main
from leapquant_jax.methods import WINDOWED_METHODS
from leapquant_jax.studies.errors import (
    STUDY_METHODS,
    ErrorStudyConfig,
    build_method,
    format_error_table,
    run_error_study,
    state_bytes_per_element,
)
from leapquant_jax.studies.freeze import format_freeze_table, run_freeze_study
from leapquant_jax.studies.memory import MemoryQuery, measure_memory

# The module's fixtures serve all its tests: one xdist worker runs them (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("studies")

# dk != dv and three heads, so a transposed shape or a position not shared by the heads shows.
# Every method compiles once; the sequence is as short as the measurement allows.
TINY = ErrorStudyConfig(tokens=32, heads=3, seeds=1, dk=16, dv=24, every=16, window=8)


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def _pytree_bytes_per_element(label: str, cfg: ErrorStudyConfig) -> tuple[float, float]:
    """(live, checkpoint) bytes per element, from the leaves of the method's initial state."""
    method = build_method(label, cfg.window)
    state = jax.eval_shape(lambda: method.init(1, cfg.heads, cfg.dk, cfg.dv, per_channel_decay=cfg.kda))
    elems = cfg.heads * cfg.dk * cfg.dv
    ckpt = state.checkpoint if hasattr(state, "checkpoint") else state
    return _nbytes(state) / elems, _nbytes(ckpt) / elems


@pytest.fixture(scope="module")
def gdn_result():
    return run_error_study(TINY)


def test_error_study_bytes_per_element_match_each_state_pytree(gdn_result):
    assert set(gdn_result["methods"]) == set(STUDY_METHODS)
    for label, r in gdn_result["methods"].items():
        live, ckpt = _pytree_bytes_per_element(label, TINY)
        assert r["bytes_per_element"] == pytest.approx(live), label
        assert r["checkpoint_bytes_per_element"] == pytest.approx(ckpt), label
        assert r["windowed"] == (r["bytes_per_element"] > r["checkpoint_bytes_per_element"]), label
    m = gdn_result["methods"]
    assert m["fp32"]["bytes_per_element"] == 4.0 and m["bf16"]["bytes_per_element"] == 2.0
    # 8-bit codes, fp32 smoothing and column scales, four fp16 Compensator Tokens.
    dk, dv = TINY.dk, TINY.dv
    assert m["leapquant"]["checkpoint_bytes_per_element"] == pytest.approx((dk * dv + 4 * dk + 4 * dv + 2 * 4 * (dk + dv)) / (dk * dv))
    # The same residual format packed: 6-bit codes take 3/4 of the 8-bit codes' bytes.
    assert m["int8-w"]["checkpoint_bytes_per_element"] - m["leapquant-b6"]["checkpoint_bytes_per_element"] == pytest.approx(
        0.25 - (4 * dk + 2 * 6 * (dk + dv)) / (dk * dv))


def test_error_study_bytes_agree_with_the_memory_command(gdn_result):
    mem = measure_memory(MemoryQuery(dk=TINY.dk, dv=TINY.dv, bits=8, window=TINY.window, heads=TINY.heads, layers=1))
    lq = gdn_result["methods"]["leapquant"]
    assert lq["checkpoint_bytes_per_element"] == pytest.approx(mem["checkpoint_bytes_per_element"])
    assert lq["bytes_per_element"] == pytest.approx(mem["live_gdn_bytes_per_element"])


def test_error_study_json_states_its_configuration(gdn_result):
    cfg = gdn_result["config"]
    assert cfg == dict(tokens=32, heads=3, seeds=1, dk=16, dv=24, every=16, window=8, kda=False, mode="GDN")
    for part in ("GDN", "tokens=32", "heads=3", "seeds=1", "dk=16", "dv=24", "window=8"):
        assert part in gdn_result["description"]
    assert gdn_result["reference"] == "fp32" and gdn_result["methods"]["fp32"]["final_rel_state_error"] == 0.0
    assert gdn_result["tokens"] == [16, 32]
    json.dumps(gdn_result)


def test_study_errors_cli_writes_its_plot_into_out_dir(tmp_path, monkeypatch, capsys):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    out_dir = tmp_path / "results" / "nested"
    # TINY's shapes: the compiled trajectories of the module's fixture are reused.
    args = ["study", "errors", "--tokens", "32", "--every", "16", "--window", "8", "--heads", "3", "--seeds", "1",
            "--dk", "16", "--dv", "24", "--methods", "fp16,int8-w", "--out-dir", str(out_dir), "--json"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)                 # the whole stdout is one JSON object
    assert r["plot"] == str(out_dir / "study_errors.png")
    assert (out_dir / "study_errors.png").stat().st_size > 0
    assert list(cwd.iterdir()) == []
    assert set(r["methods"]) == {"fp16", "int8-w"} and r["config"]["heads"] == 3
    for label, m in r["methods"].items():
        assert (m["bytes_per_element"], m["checkpoint_bytes_per_element"]) == pytest.approx(_pytree_bytes_per_element(label, TINY))


@pytest.mark.parametrize("label", list(STUDY_METHODS))
def test_kda_bytes_per_element_match_the_kda_pytree(label):
    kda = dataclasses.replace(TINY, kda=True)
    nbytes = state_bytes_per_element(build_method(label, kda.window), kda.heads, kda.dk, kda.dv, kda=True)
    assert (nbytes["live"], nbytes["checkpoint"]) == pytest.approx(_pytree_bytes_per_element(label, kda))
    gdn = _pytree_bytes_per_element(label, TINY)
    if STUDY_METHODS[label][0] in WINDOWED_METHODS:
        # KDA records carry a log-decay per key channel, GDN's one scalar.
        assert nbytes["live"] > gdn[0] and nbytes["checkpoint"] == pytest.approx(gdn[1])
    else:
        assert nbytes["live"] == pytest.approx(gdn[0])
    assert kda.describe().startswith("KDA")


def test_error_study_table_shows_configuration_and_bytes(gdn_result):
    text = format_error_table(gdn_result)
    assert "tokens=32, heads=3, seeds=1, dk=16, dv=24, window=8" in text
    assert "B/el ckpt" in text and "B/el live" in text and "reference: fp32" in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[3:3 + len(STUDY_METHODS)]}
    assert set(rows) == set(STUDY_METHODS)
    for label, (ckpt, live, state_err, out_err) in rows.items():
        r = gdn_result["methods"][label]
        assert float(ckpt) == pytest.approx(r["checkpoint_bytes_per_element"], abs=5e-4)
        assert float(live) == pytest.approx(r["bytes_per_element"], abs=5e-4)
        assert float(state_err) == pytest.approx(r["final_rel_state_error"], rel=1e-3)


def _write_trace(path, tokens=24, heads=2, dk=8, dv=8):
    rng = np.random.default_rng(1)
    q, k = (rng.normal(size=(tokens, heads, dk)).astype(np.float32) for _ in range(2))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dk)
    np.savez(path, q=q, k=k, v=rng.normal(size=(tokens, heads, dv)).astype(np.float32),
             g=np.log(rng.uniform(0.9, 1.0, size=(tokens, heads))).astype(np.float32),
             beta=rng.uniform(0.1, 0.9, size=(tokens, heads)).astype(np.float32))


def test_study_outliers_default_plot_goes_to_out_under_the_cwd(tmp_path, monkeypatch, capsys):
    _write_trace(tmp_path / "trace.npz")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    args = ["study", "outliers", "--trace", str(tmp_path / "trace.npz"), "--rank", "2", "--json"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["plot"] == os.path.join("out", "study_outliers.png")
    assert (cwd / "out" / "study_outliers.png").stat().st_size > 0
    assert [p.name for p in cwd.iterdir()] == ["out"]
    assert main(args + ["--out-dir", "elsewhere", "--plot", ""]) == 0
    assert "plot" not in json.loads(capsys.readouterr().out)
    assert [p.name for p in cwd.iterdir()] == ["out"]       # --plot '' writes nothing


def test_study_plot_options_refused_by_name_before_running(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    assert main(["study", "errors", "--out-dir", str(tmp_path / "a_file" / "x")]) == 2
    assert "--out-dir" in capsys.readouterr().err
    assert main(["study", "outliers", "--out-dir", str(tmp_path), "--plot", "plot.nope"]) == 2
    assert "--plot" in capsys.readouterr().err
    assert main(["study", "errors", "--methods", "fp32,int9", "--out-dir", str(tmp_path)]) == 2
    assert "int9" in capsys.readouterr().err
    assert main(["study", "errors", "--heads", "0", "--out-dir", str(tmp_path)]) == 2
    assert "heads" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_freeze_table_labels_its_columns_as_decays(capsys):
    result = run_freeze_study((0.99, 0.9999))
    lines = format_freeze_table(result).splitlines()
    header = next(line for line in lines if "alpha" in line and "=" in line and "0.99" in line)
    assert [c.strip() for c in header.split("alpha = ")[1:]] == ["0.99", "0.9999"]
    bf16 = next(line for line in lines if line.startswith("bf16"))
    assert [float(x) for x in bf16.split()[1:]] == pytest.approx([result["bf16"]["0.99"], result["bf16"]["0.9999"]], abs=5e-4)
    assert "fraction" in lines[0]
    assert main(["study", "freeze", "--decays", "0.99,1.5"]) == 2
    assert "decays" in capsys.readouterr().err
    assert main(["study", "freeze", "--decays", "0.99,abc"]) == 2
    assert "--decays" in capsys.readouterr().err
