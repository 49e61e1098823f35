"""The leapquant command line: replay, studies and memory, on small inputs."""

import json

import numpy as np
import pytest

from leapquant_cli import main
from leapquant_jax.recurrence import recurrent_scan
from leapquant_jax.traces import TraceError, load_trace
from helpers import random_inputs, rel


def _write_trace(path, kda=False, s0=True, **drop):
    x = {k: np.asarray(v[0]) for k, v in random_inputs(3, batch=1, tokens=40, heads=2, dk=8, dv=8, kda=kda).items()}
    if s0:
        x["s0"] = np.random.default_rng(0).normal(size=(2, 8, 8)).astype(np.float32)
    for k in drop:
        x.pop(k)
    np.savez(path, **x)
    return x


def _json(capsys):
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("kda", [False, True])
def test_replay_fp32_matches_the_dense_recurrence(tmp_path, capsys, kda):
    x = _write_trace(tmp_path / "t.npz", kda=kda)
    out = tmp_path / "o.npz"
    assert main(["replay", str(tmp_path / "t.npz"), "--method", "fp32", "--out", str(out), "--json", "--chunk", "16"]) == 0
    assert _json(capsys)["tokens"] == 40
    res = np.load(out)
    o_ref, s_ref = recurrent_scan(np.asarray(x["s0"])[None], **{k: v[None] for k, v in x.items() if k != "s0"})
    assert res["o"].shape == (40, 2, 8) and res["state"].shape == (2, 8, 8)
    assert rel(res["o"], o_ref[0]) < 1e-5 and rel(res["state"], s_ref[0]) < 1e-5


def test_replay_leapquant_options(tmp_path, capsys):
    _write_trace(tmp_path / "t.npz")
    out = tmp_path / "sub" / "o.npz"
    args = ["replay", str(tmp_path / "t.npz"), "--method", "leapquant", "--bits", "4", "--window", "8", "--rank", "2",
            "--no-smoothing", "--out", str(out), "--json"]
    assert main(args) == 0
    assert np.all(np.isfinite(np.load(out)["o"]))


def test_replay_takes_the_labels_every_command_takes(tmp_path, capsys):
    # leapquant-b4 (the label eval and demo know) is LeapQuant with --bits 4
    _write_trace(tmp_path / "t.npz")
    outs = []
    for flags in (["--method", "leapquant-b4"], ["--method", "leapquant", "--bits", "4"]):
        out = tmp_path / f"o{len(outs)}.npz"
        assert main(["replay", str(tmp_path / "t.npz"), *flags, "--window", "8", "--out", str(out), "--json"]) == 0
        assert _json(capsys)["tokens"] == 40
        outs.append(np.load(out))
    np.testing.assert_array_equal(outs[0]["o"], outs[1]["o"])
    np.testing.assert_array_equal(outs[0]["state"], outs[1]["state"])


def test_replay_reports_a_missing_key_and_writes_nothing(tmp_path, capsys):
    _write_trace(tmp_path / "t.npz", beta=True)
    out = tmp_path / "o.npz"
    assert main(["replay", str(tmp_path / "t.npz"), "--method", "fp32", "--out", str(out)]) == 2
    assert "missing key(s) ['beta']" in capsys.readouterr().err
    assert not out.exists()


def test_trace_validation_names_the_problem(tmp_path):
    x = _write_trace(tmp_path / "t.npz")
    x["beta"] = x["beta"].astype(np.int32)
    np.savez(tmp_path / "bad.npz", **x)
    with pytest.raises(TraceError, match="'beta' must be floating point"):
        load_trace(tmp_path / "bad.npz")
    x["beta"] = np.ones((40, 3), np.float32)
    np.savez(tmp_path / "bad.npz", **x)
    with pytest.raises(TraceError, match="'beta' must be"):
        load_trace(tmp_path / "bad.npz")


def test_unknown_method_and_per_step_options_are_errors(tmp_path, capsys):
    _write_trace(tmp_path / "t.npz")
    assert main(["replay", str(tmp_path / "t.npz"), "--method", "int7", "--out", str(tmp_path / "o.npz")]) == 2
    assert "argument --method: invalid choice: 'int7'" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "t.npz"), "--method", "int8", "--window", "8", "--out", str(tmp_path / "o.npz")]) == 2
    assert "per-step" in capsys.readouterr().err


def test_study_errors_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "e.png"
    args = ["study", "errors", "--tokens", "128", "--every", "64", "--heads", "2", "--seeds", "1", "--dk", "16", "--dv", "16",
            "--methods", "fp32,int8,int8-w,int8-w+ct,leapquant-b4", "--plot", str(plot), "--json"]
    assert main(args) == 0
    r = _json(capsys)
    assert set(r["methods"]) == {"fp32", "int8", "int8-w", "int8-w+ct", "leapquant-b4"}
    for v in r["methods"].values():
        assert set(v) >= {"final_rel_state_error", "rel_output_error"}
    assert r["methods"]["fp32"]["final_rel_state_error"] == 0.0
    assert r["methods"]["int8"]["final_rel_state_error"] > 0
    assert plot.stat().st_size > 0


def test_study_freeze_fractions(capsys):
    assert main(["study", "freeze", "--json"]) == 0
    r = _json(capsys)
    assert set(r) == {"bf16", "fp16"} and set(r["bf16"]) == {"0.997", "0.998", "0.999", "0.9995", "0.9999"}
    # bf16 keeps 8 significant bits: alpha = 0.9999 is below half an ulp for every value.
    assert r["bf16"]["0.9999"] == 1.0
    assert r["fp16"]["0.997"] < r["fp16"]["0.9999"] <= 1.0
    assert r["bf16"]["0.997"] > r["fp16"]["0.997"]


def test_study_outliers_on_a_trace(tmp_path, capsys):
    _write_trace(tmp_path / "t.npz")
    plot = tmp_path / "o.png"
    assert main(["study", "outliers", "--trace", str(tmp_path / "t.npz"), "--rank", "2", "--plot", str(plot), "--json"]) == 0
    r = _json(capsys)
    assert set(r["peak_over_median"]) == {"state", "residual", "smoothed"}
    assert plot.stat().st_size > 0


def test_memory_matches_the_design_table(capsys):
    assert main(["memory", "--json", "--layers", "2", "--heads", "4"]) == 0
    r = _json(capsys)
    assert r["checkpoint_bytes_per_element"] == pytest.approx(19456 / 16384)
    assert r["bytes_per_element"]["fp32"] == 4.0 and r["bytes_per_element"]["bf16"] == 2.0
    # The live GDN stream adds 16 fp16 records of k and u and a log-decay each, and its position.
    assert r["bytes_per_head"]["live_gdn"] == pytest.approx(19456 + 16 * (128 + 128 + 1) * 2 + 4 / 4)
    assert r["live_kda_bytes_per_element"] > r["live_gdn_bytes_per_element"]
    assert r["model_bytes"]["fp32"] == 2 * 4 * 4 * 128 * 128
    assert main(["memory", "--json", "--bits", "4"]) == 0
    # 4-bit codes, fp32 column and smoothing scales, six fp16 Compensator Tokens.
    assert _json(capsys)["checkpoint_bytes_per_element"] == pytest.approx(0.5 + 2 * 512 / 16384 + 6 * 256 * 2 / 16384)


def test_memory_lists_every_method_label_with_checkpoint_and_live_bytes(capsys):
    from leapquant_jax.method_names import METHOD_LABELS

    assert main(["memory", "--json", "--heads", "4", "--methods", "all"]) == 0
    methods = _json(capsys)["methods"]
    # the one name table of every command: LeapQuant at 6 and 4 bits and the partial fixes included
    assert list(methods) == list(METHOD_LABELS) and {"leapquant-b6", "leapquant-b4", "int8-w+ct"} <= set(methods)
    keys = {f"{part}_{unit}" for part in ("checkpoint", "live_gdn", "live_kda") for unit in ("bytes_per_head",
                                                                                          "bits_per_value")}
    assert all(set(m) == keys for m in methods.values())
    # int8 and int4: codes plus one fp32 scale per value column of 128 rows, the same in every stream
    assert methods["int8"]["checkpoint_bits_per_value"] == methods["int8"]["live_kda_bits_per_value"] == 8 + 32 / 128
    assert methods["int4"]["live_gdn_bytes_per_head"] == 128 * 128 / 2 + 4 * 128
    lq = methods["leapquant"]
    assert lq["checkpoint_bytes_per_head"] == 19456
    assert lq["live_gdn_bytes_per_head"] == pytest.approx(19456 + 16 * (128 + 128 + 1) * 2 + 4 / 4)
    assert lq["live_kda_bytes_per_head"] > lq["live_gdn_bytes_per_head"]
    # 4-bit codes, fp32 column and smoothing scales, six fp16 Compensator Tokens
    assert methods["leapquant-b4"]["checkpoint_bits_per_value"] == pytest.approx(
        8 * (0.5 + 2 * 512 / 16384 + 6 * 256 * 2 / 16384))
    assert main(["memory", "--methods", "int8,nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err


def test_study_errors_says_when_a_per_step_format_diverges(tmp_path, capsys):
    """TurboQuant's 4-bit per-step state (its residual sketch adds noise that grows with the
    state) overflows fp32 within 2,048 tokens here: the study names the token, keeps the JSON
    free of NaN and still draws the plot; int8 stays finite."""
    argv = ["study", "errors", "--tokens", "2048", "--heads", "2", "--seeds", "1", "--dk", "64", "--dv", "64",
            "--every", "256", "--methods", "int8,turboquant-b4", "--out-dir", str(tmp_path), "--plot", "d.png"]
    assert main(argv + ["--json"]) == 0
    text = capsys.readouterr().out
    assert "NaN" not in text and "Infinity" not in text
    methods = json.loads(text)["methods"]
    assert methods["int8"]["diverged_by_token"] is None and methods["int8"]["final_rel_state_error"] < 0.2
    diverged = methods["turboquant-b4"]
    assert diverged["diverged_by_token"] in range(256, 2049, 256) and diverged["final_rel_state_error"] is None
    assert (tmp_path / "d.png").stat().st_size > 0
    assert main(argv) == 0
    assert f"diverged: the state overflowed fp32 by token {diverged['diverged_by_token']}" in capsys.readouterr().out


# ----------------------------------------------------------------------------- model commands


def test_score_and_generate_take_compute_and_scan_layers(tmp_path, capsys):
    """``score --compute fast`` (bf16 matmul operands) differs from the default exact run, by
    round-off only; ``--scan-layers`` runs the same model in the scanned layout (``score`` and
    ``generate``)."""
    from models.checkpoint import save_converted
    from models.training.model import hf_config, init_params

    cj = hf_config("gdn", vocab_size=64, eos_token_id=0, size="tiny")  # three GDN layers, then attention
    ckpt = save_converted(tmp_path / "ckpt", config_json=cj, params=init_params(cj, seed=0))
    np.save(tmp_path / "ids.npy", np.random.default_rng(5).integers(0, 64, (2, 12)))

    def score(*flags):
        out = tmp_path / "logits.npy"
        argv = ["score", str(ckpt), "--ids-file", str(tmp_path / "ids.npy"), "--out", str(out), "--json", *flags]
        assert main(argv) == 0
        return np.load(out), _json(capsys)

    exact, r = score()
    assert r["compute"] == "exact" and r["scan_layers"] is False
    fast, r = score("--compute", "fast")
    assert r["compute"] == "fast" and 0 < rel(fast, exact) < 2e-2
    scanned, r = score("--scan-layers")
    assert r["scan_layers"] is True and rel(scanned, exact) < 1e-5

    def generate(*flags):
        argv = ["generate", str(ckpt), "--prompt-ids", "3,1,4,1,5,9,2,6", "--max-new-tokens", "6", "--stop-ids", "",
                "--json", *flags]
        assert main(argv) == 0
        return _json(capsys)

    unrolled, scanned = generate(), generate("--scan-layers")
    assert unrolled["compute"] == "fast" and scanned["scan_layers"] is True
    assert scanned["generated_ids"] == unrolled["generated_ids"]
