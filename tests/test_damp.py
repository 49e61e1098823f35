"""DAMP: the INT8 + Hadamard rows against a NumPy oracle, the layout's bits, persistence and channel
selection, calibration on traces, the method through decode, the calibration file and the
refusals (a calibration of another model, a missing or damaged file, damp without one)."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from leapquant_jax import make_method
from leapquant_jax.damp import (DampCalibration, DampCalibrationError, DampMethod, bits_per_value, calibrate,
                                dequantize_rows, persistence, quantize_rows, select_channels)
from leapquant_jax.quantizers import tree_bytes
from leapquant_jax.recurrence import delta_rule_token, recurrent_step_general
from helpers import (calibrate_then_eval, check_refused_by_name, heldout_ids_file, numpy_reference, random_inputs,
                     rel, run_cli)

# The module's fixtures serve all its tests: one xdist worker runs them (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("damp")

CKPTS = Path(__file__).resolve().parents[1] / "models" / "checkpoints"


def _sylvester(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def _oracle(x, group):
    """INT8 + Hadamard written out in float64 NumPy (scale and zero rounded to fp16 first)."""
    h = _sylvester(group)
    lead, dv = x.shape[:-1], x.shape[-1]
    y = x.astype(np.float64).reshape(lead + (dv // group, group)) @ h.T
    lo, hi = y.min(-1), y.max(-1)
    zero = lo.astype(np.float16).astype(np.float64)
    scale = ((hi - lo) / 255).astype(np.float16).astype(np.float64)
    codes = np.clip(np.round((y - zero[..., None]) / np.where(scale > 0, scale, 1)[..., None]), 0, 255)
    back = (codes * scale[..., None] + zero[..., None]) @ h
    return codes.reshape(x.shape), back.reshape(x.shape)


@pytest.mark.parametrize("dv", [128, 16])
def test_int8_hadamard_rows_match_a_numpy_oracle(dv):
    rng = np.random.default_rng(dv)
    x = (rng.standard_normal((2, 3, 8, dv)) * np.exp(rng.uniform(-4, 4, (2, 3, 8, 1)))).astype(np.float32)
    x[0, 0, 0] = 0.0                                    # an all-zero row round-trips to zeros
    t = quantize_rows(jnp.asarray(x))
    group = min(32, dv)
    assert t.codes.dtype == jnp.uint8 and t.codes.shape == x.shape
    assert t.scale.dtype == t.zero.dtype == jnp.float16 and t.scale.shape == (2, 3, 8, dv // group)
    codes, back = _oracle(x, group)
    # codes agree except where fp32 rounding puts a value on the other side of a half-code
    assert np.mean(np.asarray(t.codes) == codes) > 0.999
    np.testing.assert_allclose(np.asarray(dequantize_rows(t)), back, rtol=0, atol=1e-5 * np.abs(x).max())
    np.testing.assert_array_equal(np.asarray(dequantize_rows(t))[0, 0, 0], 0.0)
    assert rel(dequantize_rows(t), x) < 5e-3


def test_layout_bits_are_those_of_the_pytree():
    assert bits_per_value(128, 128) == 9.875                      # DAMP's 9.9 at dk = dv = 128, K_hi = 16
    for dk, dv, k in ((128, 128, 16), (128, 128, 32), (16, 16, 2)):
        state = DampMethod(layout_k_hi=k).init(2, 3, dk, dv)
        assert tree_bytes(state) * 8 / (2 * 3 * dk * dv) == pytest.approx(bits_per_value(dk, dv, k))
    assert make_method("damp").init(1, 1, 128, 128).hi.dtype == jnp.float16
    with pytest.raises(ValueError, match="dk > 16"):
        make_method("damp").init(1, 1, 16, 16)
    with pytest.raises(ValueError, match="power of two"):
        DampMethod(layout_k_hi=2).init(1, 1, 16, 24)


def test_persistence_sums_the_retained_energy_and_stays_finite():
    tau = 50
    for a in (0.0, 0.5, 0.9, 0.999):
        m = np.log(a) if a > 0 else -1e4
        assert persistence(np.array([m]), tau)[0] == pytest.approx(sum(a ** (2 * j) for j in range(tau)), rel=1e-9)
    assert persistence(np.array([0.0, -1e-300]), tau).tolist() == [tau, tau]
    assert np.all(np.isfinite(persistence(np.array([-1e4, -1e-8]), 10 ** 6)))


def test_channels_are_the_largest_risks_of_each_head():
    risk = np.array([[1.0, 5.0, 3.0, 5.0], [0.0, 0.0, 2.0, 1.0]])
    assert select_channels(risk, 2) == ((1, 3), (2, 3))


@pytest.mark.parametrize("kda", [False, True])
def test_calibration_on_traces_protects_the_risky_channels(kda):
    x = random_inputs(0, batch=2, tokens=64, heads=2, dk=16, dv=16, kda=kda)
    x = {k: np.array(v) for k, v in x.items()}
    # key channel 5 of every head: large keys (energy; unit key norms kept, so the rule stays
    # stable) and, for KDA, no decay (persistence)
    x["k"][..., 5] *= 8.0
    x["k"] /= np.linalg.norm(x["k"], axis=-1, keepdims=True)
    if kda:
        x["g"][..., 5] = 0.0
    cal, scores = calibrate({3: x}, k_hi=2, tau=256, every=8)
    assert cal.layers == (3,) and (cal.heads, cal.dk, cal.dv, cal.k_hi) == (2, 16, 16, 2)
    assert all(5 in head for head in cal.table(3))
    risk = np.asarray(scores["3"]["risk"])
    np.testing.assert_allclose(risk, np.asarray(scores["3"]["energy"]) * np.asarray(scores["3"]["persistence"]),
                               rtol=1e-6)
    p = np.asarray(scores["3"]["persistence"])
    if not kda:  # GDN's decay is one per head: so is the persistence
        assert np.all(p == p[:, :1])
    with pytest.raises(ValueError, match=r"\[1, 15\]"):
        calibrate({3: x}, k_hi=16)


def _calibration(layers=(0,), heads=2, dk=16, dv=16, k=2, seed=0):
    rng = np.random.default_rng(seed)
    table = tuple(tuple(tuple(sorted(rng.choice(dk, k, replace=False).tolist())) for _ in range(heads))
                  for _ in layers)
    return DampCalibration(layers=tuple(layers), channels=table, heads=heads, dk=dk, dv=dv, k_hi=k, tau=64)


def test_the_state_keeps_protected_rows_in_fp16_and_decodes_like_its_reference():
    cal = _calibration()
    method = make_method("damp", calibration=cal).for_layer(0)
    rng = np.random.default_rng(1)
    s = rng.standard_normal((2, 2, 16, 16)).astype(np.float32)
    s[1, 0, cal.table(0)[0][0], 3] = 1e6                      # beyond fp16: saturates, never inf
    state = method.from_dense(jnp.asarray(s))
    dense = np.asarray(method.to_dense(state))
    for h, idx in enumerate(cal.table(0)):
        want = np.clip(s[:, h, list(idx)], -65504, 65504).astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(dense[:, h, list(idx)], want)
        others = [i for i in range(16) if i not in idx]
        np.testing.assert_allclose(dense[:, h, others], _oracle(s[:, h, others], 16)[1], atol=1e-5)
    assert np.isfinite(dense).all() and dense[1, 0, cal.table(0)[0][0], 3] == 65504.0
    # a step = dequantize, fp32 update, re-quantize
    x = random_inputs(2, batch=2, tokens=48, heads=2, dk=16, dv=16)
    tok = delta_rule_token(**{k: v[:, 0] for k, v in x.items()})
    o1, s1 = jax.jit(lambda st: method.step_token(st, tok))(state)
    o_ref, d = jax.jit(lambda st: recurrent_step_general(method.to_dense(st), tok))(state)
    np.testing.assert_allclose(np.asarray(o1), np.asarray(o_ref), rtol=1e-6, atol=1e-6)
    assert rel(method.to_dense(s1), method.to_dense(method.from_dense(d))) < 1e-4
    # decoding stays close to the exact fp32 recurrence (re-quantized 48 times)
    o, final = jax.jit(lambda st, x: method.decode(st, **x))(method.init(2, 2, 16, 16), x)
    o_fp32, s_fp32 = numpy_reference(**x)
    assert np.isfinite(np.asarray(o)).all() and rel(o, o_fp32) < 2e-2 and rel(method.to_dense(final), s_fp32) < 2e-2


def test_damp_refuses_what_it_cannot_round():
    with pytest.raises(DampCalibrationError, match="needs a calibration file"):
        make_method("damp").for_layer(0).from_dense(jnp.zeros((1, 2, 16, 16)))
    with pytest.raises(DampCalibrationError, match="for_layer"):
        make_method("damp", calibration=_calibration()).from_dense(jnp.zeros((1, 2, 16, 16)))
    with pytest.raises(DampCalibrationError, match="no layer 4"):
        make_method("damp", calibration=_calibration()).for_layer(4).from_dense(jnp.zeros((1, 2, 16, 16)))
    with pytest.raises(DampCalibrationError, match="2 x 16 x 16, but layer 0's state is 3 x 16 x 16"):
        make_method("damp", calibration=_calibration()).for_layer(0).from_dense(jnp.zeros((1, 3, 16, 16)))
    with pytest.raises(ValueError, match="takes only a calibration"):
        make_method("damp", bits=8)
    with pytest.raises(ValueError, match="only method 'damp' takes a calibration"):
        make_method("int8", calibration=_calibration())


def test_calibration_file_round_trips_and_damaged_ones_are_refused(tmp_path):
    cal = _calibration(layers=(0, 2), seed=3)
    path = tmp_path / "cal.json"
    cal.save(str(path), extra={"note": "x"})
    assert DampCalibration.load(str(path)) == cal
    assert make_method("damp", calibration=str(path)).calibration == cal
    d = json.loads(path.read_text())
    cases = {"missing.json": (None, "no such file"),
             "text.json": ("not json", "not a readable JSON file"),
             "other.json": (dict(d, format="something"), "not a DAMP calibration file"),
             "version.json": (dict(d, version=7), "version 7"),
             "short.json": (dict(d, layers={"0": [[1, 2]]}), "1 heads of channels, expected 2"),
             "repeat.json": (dict(d, layers={"0": [[1, 1], [2, 3]]}), "distinct indices"),
             "nokey.json": ({k: v for k, v in d.items() if k != "dk"}, "malformed")}
    for name, (content, message) in cases.items():
        if content is not None:
            (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(DampCalibrationError, match=message) as err:
            DampCalibration.load(str(tmp_path / name))
        assert name in str(err.value)
    made_on = dataclasses.replace(cal, model="xyz")
    made_on.check_model(fingerprint="xyz", layers=(0, 2), heads=2, dk=16, dv=16)
    with pytest.raises(DampCalibrationError, match="another model"):
        made_on.check_model(fingerprint="abc", layers=(0, 2), heads=2, dk=16, dv=16)
    with pytest.raises(DampCalibrationError, match=r"linear-attention layers \[0, 2\] vs the model's \[0, 1\]"):
        cal.check_model(fingerprint="", layers=(0, 1), heads=2, dk=16, dv=16)


@pytest.mark.parametrize("name", ["stdlib-gdn", "stdlib-kda"])
def test_shipped_calibrations_belong_to_their_checkpoints(name):
    from models.calibrate import check_state_method, linear_state_layout
    from models.checkpoint import load_model

    arch, config, params, _ = load_model(CKPTS / name)
    cal = DampCalibration.load(str(CKPTS / name / "damp-calibration.json"))
    layers, heads, dk, dv = linear_state_layout(arch, config)
    assert (cal.layers, cal.heads, cal.dk, cal.dv, cal.k_hi) == (layers, heads, dk, dv, 16)
    check_state_method(make_method("damp", calibration=cal), arch, config, params)
    other = "stdlib-kda" if name == "stdlib-gdn" else "stdlib-gdn"
    wrong = make_method("damp", calibration=str(CKPTS / other / "damp-calibration.json"))
    with pytest.raises(DampCalibrationError, match="another model"):
        check_state_method(wrong, arch, config, params)


# ----------------------------------------------------------------------------- the commands


@pytest.fixture(scope="module")
def snippet_npy(tmp_path_factory):
    return heldout_ids_file(tmp_path_factory.mktemp("damp"), CKPTS / "stdlib-gdn")


def test_calibrate_then_eval_on_a_shipped_checkpoint(tmp_path, snippet_npy):
    cal = tmp_path / "cal.json"
    report, m = calibrate_then_eval("calibrate-damp", CKPTS / "stdlib-gdn", snippet_npy, cal,
                                    ["--rows", 2, "--tokens", 48, "--channels", 8],
                                    ["--context", 48, "--states", "int8,damp", "--damp-calibration", cal])
    assert report["bits_per_value"] == bits_per_value(128, 128, 8) and report["layers"] == [0, 1, 2, 4, 5, 6]
    loaded = DampCalibration.load(str(cal))
    assert loaded.k_hi == 8 and json.loads(cal.read_text())["calibration"]["rows"] == 2
    # fp16 rows and a Hadamard-rotated INT8 rest: closer to fp32 than per-step INT8 on its state
    mean_err = {k: np.mean(list(m[k]["state_rel_error"].values())) for k in ("damp", "int8")}
    assert 0 < mean_err["damp"] < mean_err["int8"]
    assert np.isfinite(m["damp"]["perplexity"])


@pytest.mark.parametrize("argv, words", [
    (["eval", "{gdn}", "--states", "damp"], ["--states damp needs its calibration file"]),
    (["eval", "{gdn}", "--states", "int8", "--damp-calibration", "{kda_cal}"], ["--states does not name"]),
    (["eval", "{gdn}", "--states", "damp", "--damp-calibration", "{kda_cal}"], ["does not match this model"]),
    (["eval", "{gdn}", "--states", "damp", "--damp-calibration", "{missing}"], ["no such file"]),
    (["score", "{gdn}", "--ids-file", "{ids}", "--out", "{out}", "--state", "damp"],
     ["method damp needs its calibration file"]),
    (["calibrate-damp", "{gdn}", "--data", "{ids}", "--out", "{tmp}", "--rows", "1", "--tokens", "16"], ["is a folder"]),
    (["calibrate-damp", "{gdn}", "--data", "{ids}", "--out", "{out}", "--rows", "1", "--tokens", "16",
      "--channels", "128"], ["--channels 128", "[1, 127]"]),
])
def test_damp_bad_input_is_refused_by_name(tmp_path, snippet_npy, argv, words):
    names = {"gdn": CKPTS / "stdlib-gdn", "kda_cal": CKPTS / "stdlib-kda" / "damp-calibration.json",
             "missing": tmp_path / "none.json", "ids": snippet_npy, "out": tmp_path / "out.json", "tmp": tmp_path}
    check_refused_by_name(argv, names, words, eval_data=snippet_npy, unwritten=tmp_path / "out.json")


@pytest.mark.parametrize("kda", [False, True])
def test_study_errors_calibrates_damp_on_an_independent_draw(kda):
    from leapquant_jax.studies.errors import ErrorStudyConfig, damp_for_study, run_error_study
    from leapquant_jax.synthetic import SyntheticSpec

    config = ErrorStudyConfig(tokens=256, heads=2, seeds=2, dk=32, dv=32, every=128, window=16, kda=kda)
    method = damp_for_study(config, SyntheticSpec(tokens=256, heads=2, dk=32, dv=32, per_channel_decay=kda))
    assert method.layer == 0 and method.calibration.k_hi == 4 and method.calibration.heads == 2
    r = run_error_study(config, ["int8", "damp"])["methods"]
    assert 0 < r["damp"]["final_rel_state_error"] < r["int8"]["final_rel_state_error"]
    assert r["damp"]["bytes_per_element"] == pytest.approx(bits_per_value(32, 32, 4) / 8)


def test_generate_and_replay_take_damp_per_layer(tmp_path):
    cal = CKPTS / "stdlib-gdn" / "damp-calibration.json"
    traces = tmp_path / "traces"
    code, out, err = run_cli(["generate", CKPTS / "stdlib-gdn", "--prompt-ids", "5,6,7,8,9,10", "--max-new-tokens", 4,
                           "--state", "damp", "--damp-calibration", cal, "--record-traces", traces, "--json"])
    assert code == 0, err
    assert json.loads(out)["method"] == {"method": "damp", "calibration": str(cal)}
    code, out, err = run_cli(["replay", traces / "layer04.npz", "--method", "damp", "--damp-calibration", cal,
                           "--out", tmp_path / "r4.npz", "--json"])
    assert code == 0, err
    # the layer comes from the file name; a renamed trace needs --layer, and a layer the
    # calibration does not cover (3 is an attention layer) is refused
    (traces / "layer04.npz").rename(tmp_path / "trace.npz")
    code, out, err = run_cli(["replay", tmp_path / "trace.npz", "--method", "damp", "--damp-calibration", cal,
                           "--out", tmp_path / "r.npz"])
    assert code == 2 and "pass --layer" in err
    code, out, err = run_cli(["replay", tmp_path / "trace.npz", "--method", "damp", "--damp-calibration", cal,
                           "--layer", 3, "--out", tmp_path / "r.npz"])
    assert code == 2 and "no layer 3" in err and not (tmp_path / "r.npz").exists()
    code, out, err = run_cli(["replay", tmp_path / "trace.npz", "--method", "damp", "--damp-calibration", cal,
                           "--layer", 4, "--out", tmp_path / "r.npz"])
    assert code == 0, err
    np.testing.assert_array_equal(np.load(tmp_path / "r.npz")["state"], np.load(tmp_path / "r4.npz")["state"])
