"""STEPQuant and LeapQuant with lifetime-aware widths: the fit against a NumPy oracle, the packed
layouts' bits measured on the pytrees, the calibration's plans (budget, pivots, the risky units
wider), both methods through ``replay``, a mixed-width state through prefix save and restore, the
calibration file and its fingerprint check, and bad input refused by name."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from leapquant_jax import make_method
from leapquant_jax.leapquant_alloc import AllocState, default_budget, option_bytes, width_plan
from leapquant_jax.lifetime import (LifetimeCalibration, LifetimeCalibrationError, StepQuantPlan, WidthPlan,
                                    layer_statistics)
from leapquant_jax.quantizers import tree_bytes
from leapquant_jax.stepquant import (Layout, StepQuantMethod, fit, impact_weights, pack_2bit, stepquant_plan,
                                     unpack_2bit)
from leapquant_jax.traces import Trace, save_trace
from helpers import (calibrate_then_eval, check_refused_by_name, heldout_ids_file, lifetime_traces, numpy_reference,
                     rel)

# The module's fixtures serve all its tests: one xdist worker runs them (pyproject: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("stepquant")

CKPTS = Path(__file__).resolve().parents[1] / "models" / "checkpoints"
H, DK, DV = 4, 32, 32


def _half(x):
    return np.clip(x, 2.0 ** -24, 65504).astype(np.float16).astype(np.float64)


def fit_oracle(x, bits, w, arch):
    """The dual-axis fit written out per head in float64 NumPy (scales rounded to fp16 first)."""
    out = np.zeros_like(x, np.float64)
    for b in range(x.shape[0]):
        for h in range(x.shape[1]):
            s, bh, wh = x[b, h].astype(np.float64), bits[h], w[h]
            integer = bh != 16
            two = (bh == 2) & (arch == "gdn")
            qmax = np.where(two, 3, 2.0 ** (np.minimum(bh, 8) - 1) - 1)
            n = 2.0 ** (8 - np.minimum(bh, 8)) if arch == "kda" else np.ones(len(bh))
            n = np.where(integer, n, 1.0)
            r = _half(np.sqrt(np.maximum(np.abs(s).mean(axis=1), 1e-20) / wh))[:, None] * np.ones_like(s)
            g = min(32, s.shape[1])
            for i in np.flatnonzero(two):
                blocks = np.abs(s[i]).reshape(-1, g).mean(axis=1)
                r[i] = np.repeat(_half(np.sqrt(np.maximum(blocks, 1e-20) / wh[i])), g)
            y = s / r
            lim = (qmax * n)[:, None]
            c = _half(np.max(np.where(integer[:, None], np.abs(y) / lim, 0), axis=0))

            def codes(c):
                t = y / (c[None] * n[:, None])
                z = np.clip(np.round(t), -qmax[:, None], qmax[:, None])
                odd = np.where(t >= 0, 1, -1) * np.where(np.abs(t) >= 2, 3, 1)
                return np.where(two[:, None], odd, z)

            z = codes(c)
            v = r * n[:, None] * z
            wt = np.where(integer, wh ** 2, 0)[:, None]
            num, den = (wt * v * s).sum(0), (wt * v * v).sum(0)
            c = _half(np.where(den > 0, num / np.where(den > 0, den, 1), c))
            z = codes(c)
            fp16 = np.clip(s, -65504, 65504).astype(np.float16).astype(np.float64)
            out[b, h] = np.where(integer[:, None], r * c[None] * n[:, None] * z, fp16)
    return out


def mixed_bits(arch, rng):
    if arch == "gdn":   # one width per head
        return np.repeat(np.array([2, 4, 8, 16])[:, None], DK, axis=1)
    return rng.choice([2, 4, 6, 8, 16], size=(H, DK), p=[0.2, 0.3, 0.2, 0.2, 0.1])


@pytest.mark.parametrize("arch", ["gdn", "kda"])
def test_fit_matches_a_numpy_oracle_and_the_state_holds_what_it_counts(arch):
    rng = np.random.default_rng(len(arch))
    x = (rng.standard_normal((2, H, DK, DV)) * np.exp(rng.uniform(-3, 3, (2, H, DK, 1)))).astype(np.float32)
    x[0, 1, 3] = 0.0                                              # an all-zero row stays zero
    bits = mixed_bits(arch, rng)
    w = impact_weights(rng.uniform(1e-4, 1.0, (H, DK)))
    layout = Layout(bits=bits, impact=w, architecture=arch)
    recon = np.asarray(fit(jnp.asarray(x), layout)[-1])
    want = fit_oracle(x, bits, w, arch)
    # equal but where fp32 rounding puts a value on the other side of a half-code
    assert np.mean(np.isclose(recon, want, rtol=1e-5, atol=1e-6 * np.abs(x).max())) > 0.995
    assert rel(recon, want) < 1e-3 and np.all(recon[0, 1, 3] == 0)
    method = StepQuantMethod(plan="s", calibration=_calibration(arch, {0: bits}, w)).for_layer(0)
    state = method.from_dense(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(method.to_dense(state)), recon, rtol=1e-6, atol=1e-7)
    # bits per value as the pytree holds them: codes, fp16 row factors (grouped for GDN's 2-bit
    # rows), fp16 column scales of heads with integer rows, fp16 pivot rows
    flat = bits.reshape(-1)
    grouped = (flat == 2) & (arch == "gdn")
    want_bits = (np.where(flat == 16, 16 * DV, flat * DV).sum() + 16 * np.sum((flat != 16) & ~grouped)
                 + 16 * grouped.sum() * DV // 32 + 16 * DV * np.sum((bits != 16).any(axis=1)))
    assert tree_bytes(state) * 8 == 2 * want_bits
    assert tree_bytes(method.init(2, H, DK, DV)) == tree_bytes(state)


def test_two_bit_codes_round_trip():
    codes = jnp.asarray(np.random.default_rng(0).integers(0, 4, (3, 16, 5)))
    packed = pack_2bit(codes)
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 4, 5)
    np.testing.assert_array_equal(np.asarray(unpack_2bit(packed)), np.asarray(codes))


def _calibration(arch, bits_by_layer, w=None, model="", alloc=None):
    layers = tuple(sorted(bits_by_layer))
    w = np.ones((H, DK)) if w is None else w
    plans = [StepQuantPlan(name="s", budget=6.0, candidates=(4, 6, 8), pivots=0,
                           bits=tuple(tuple(map(tuple, np.asarray(bits_by_layer[x]).tolist())) for x in layers),
                           impact=tuple(tuple(map(tuple, np.asarray(w, float).tolist())) for _ in layers))]
    if alloc is not None:
        plans.append(alloc)
    return LifetimeCalibration(architecture=arch, layers=layers, heads=H, dk=DK, dv=DV, horizon=256,
                               plans=tuple(plans), model=model)


# ----------------------------------------------------------------------------- calibration


@pytest.fixture(scope="module", params=["gdn", "kda"])
def calibrated(request):
    kda = request.param == "kda"
    traces = lifetime_traces(kda)
    stats = {layer: layer_statistics(x, every=8, max_samples=16, horizon=256) for layer, x in traces.items()}
    plans = [stepquant_plan(stats, b, name=f"stepquant-{b}", pivots=1 if not kda else 4)[0] for b in (6, 4)]
    # a few options (each compiles a flush): every width without tokens, and 4 bits with two
    options = ((2, 0), (4, 0), (4, 2), (6, 0), (8, 0))
    plans += [width_plan(stats, b, name=f"leapquant-alloc-{b}", options=options)[0] for b in (6, 4)]
    cal = LifetimeCalibration(architecture=request.param, layers=(0, 2), heads=H, dk=DK, dv=DV, horizon=256,
                              plans=tuple(plans))
    return request.param, traces, stats, cal


def test_plans_keep_their_budgets_and_widen_the_long_lived_units(calibrated):
    arch, _, stats, cal = calibrated
    for name, budget in (("stepquant-6", 6), ("stepquant-4", 4)):
        plan = cal.plan(name)
        bits = np.stack([np.asarray(b) for b in plan.bits])                      # [L, H, dk]
        units = bits[:, :, 0] if arch == "gdn" else bits
        assert np.sum(units == 16) == plan.pivots
        assert np.sum(np.where(units == 16, 8, units)) <= budget * units.size     # a pivot counted as 8
        if arch == "gdn":
            assert np.all(bits == bits[..., :1])
        # the long-lived heads (0, 1) get at least the short-lived ones' (2, 3) widths, on average
        assert bits[:, :2].mean() >= bits[:, 2:].mean()
    for name in ("leapquant-alloc-6", "leapquant-alloc-4"):
        plan = cal.plan(name)
        spent = sum(option_bytes(plan.options[j], DK, DV) for c in plan.choice for j in c)
        assert spent * 8 <= plan.budget * 2 * H * DK * DV
        assert plan.budget == default_budget(int(name[-1]), DK, DV)


def test_both_methods_replay_a_trace_with_the_bits_their_pytrees_hold(calibrated, tmp_path):
    from leapquant_cli import main

    arch, traces, _, cal = calibrated
    cal_path = tmp_path / "cal.json"
    cal.save(str(cal_path))
    assert LifetimeCalibration.load(str(cal_path)) == cal
    x = {k: v[0] for k, v in traces[2].items()}
    trace = tmp_path / "layer02.npz"
    save_trace(str(trace), Trace(**x))
    o_ref, s_ref = numpy_reference(**{k: v[None] for k, v in x.items()})
    errors = {}
    for name in ("int6", "stepquant-6", "stepquant-4", "leapquant-alloc-6", "leapquant-alloc-4"):
        argv = ["replay", str(trace), "--method", name, "--out", str(tmp_path / f"{name}.npz"), "--json"]
        if name != "int6":
            argv += ["--stepquant-calibration", str(cal_path)]
        assert main(argv) == 0
        out = np.load(tmp_path / f"{name}.npz")
        assert np.all(np.isfinite(out["o"]))
        errors[name] = rel(out["state"], s_ref[0])
        if name == "int6":
            continue
        method = make_method(name, calibration=cal).for_layer(2)
        state = method.init(1, H, DK, DV, per_channel_decay=arch == "kda")
        got = tree_bytes(state) * 8 / (H * DK * DV)
        if name.startswith("stepquant"):
            bits = np.asarray(cal.plan(name).bits[1])
            grouped = (bits == 2) & (arch == "gdn")
            want = (np.where(bits == 16, 16, bits).sum() * DV + 16 * np.sum((bits != 16) & ~grouped)
                    + 16 * grouped.sum() * DV // 32 + 16 * DV * np.sum((bits != 16).any(axis=1))) / (H * DK * DV)
        else:
            assert isinstance(state, AllocState)
            choice = cal.plan(name).choice[1]
            ckpt = sum(option_bytes(cal.plan(name).options[j], DK, DV) for j in choice)
            records = H * 16 * (2 * DK + 2 * DV + 2 * (DK if arch == "kda" else 1)) + 4 * len(state.groups)
            want = 8 * (ckpt + records) / (H * DK * DV)
            assert tree_bytes([g.checkpoint for g in state.groups]) == ckpt
        assert got == pytest.approx(want)
    # calibrated on these heads: more bits, less error; at 4 bits the windowed state is ahead
    assert errors["stepquant-6"] < errors["stepquant-4"] and errors["leapquant-alloc-6"] < errors["leapquant-alloc-4"]
    assert errors["leapquant-alloc-4"] < errors["stepquant-4"]


def test_the_methods_decode_like_their_references(calibrated):
    arch, traces, _, cal = calibrated
    x = {k: jnp.asarray(v) for k, v in traces[0].items()}
    for name in ("stepquant-4", "leapquant-alloc-4"):
        method = make_method(name, calibration=cal).for_layer(0)
        state = method.init(2, H, DK, DV, per_channel_decay=arch == "kda")
        o, final = jax.jit(lambda s, x: method.decode(s, **x))(state, x)
        o_ref, s_ref = numpy_reference(**x)
        assert np.all(np.isfinite(np.asarray(o))) and rel(o, o_ref) < 0.5
    # the grouped LeapQuant state is each group's own LeapQuant state on its heads
    method = make_method("leapquant-alloc-4", calibration=cal).for_layer(0)
    layout = method.layout(H, DK, DV)
    s = np.random.default_rng(3).standard_normal((2, H, DK, DV)).astype(np.float32)
    dense = np.asarray(method.to_dense(method.from_dense(jnp.asarray(s))))
    for (bits, rank), heads in zip(layout.options, layout.heads):
        alone = make_method("leapquant", bits=bits, rank=rank)
        want = alone.to_dense(alone.from_dense(jnp.asarray(s[:, list(heads)])))
        np.testing.assert_allclose(dense[:, list(heads)], np.asarray(want), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- save and restore


def test_a_mixed_width_state_round_trips_through_a_prefix_file(tmp_path):
    from models import prefix_state as ps
    from models.calibrate import model_fingerprint
    from models.checkpoint import architecture_for_config
    from models.decode import to_device
    from models.training.model import hf_config, init_params

    cj = hf_config("gdn", vocab_size=64, eos_token_id=0, size="tiny")
    cj.update(num_hidden_layers=3, layer_types=["linear_attention", "linear_attention", "full_attention"],
              initializer_range=0.2)
    arch = architecture_for_config(cj)
    config, params = arch.config_from_hf(cj), to_device(init_params(cj, seed=0))
    heads, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    options = ((4, 2), (6, 4), (8, 6))
    plan = WidthPlan(name="leapquant-alloc-4", budget=99.0, options=options, choice=((0, 2), (1, 0)))
    cal = LifetimeCalibration(architecture="gdn", layers=(0, 1), heads=heads, dk=dk, dv=dv, horizon=64,
                              plans=(plan,), model=model_fingerprint(config, params))
    method = make_method("leapquant-alloc-4", calibration=cal)
    ids = np.random.default_rng(5).integers(0, 64, 2 * method.window + 3)
    cps = ps.checkpoint_every(arch, params, config, ids, method=method)
    first, second = cps.states
    names = [n for n in first.leaves if ".state." in n]
    assert any(".groups.1.checkpoint.residual.codes" in n for n in names)
    assert not [n for n in names if "buffer" in n or n.endswith(".pos")]
    codes = {n: first.leaves[n] for n in names if n.endswith("residual.codes")}
    assert sorted({x.dtype.name for x in codes.values()}) == ["int8", "uint8"]      # 8 bits and packed 4/6
    loaded = ps.load_prefix(ps.save_prefix(tmp_path / "prefix.safetensors", first))
    assert all(np.array_equal(loaded.leaves[n], first.leaves[n]) for n in first.leaves)
    cache = ps.restore_cache(arch, params, config, loaded, method=method, max_len=ids.shape[0])
    w = method.window
    logits, cache = ps.decode_tokens(arch, params, config, cache, ids[None, w:2 * w], method=method)
    again = ps.take_prefix(arch, params, config, cache, 0, method=method, ids=ids[:2 * w], logits=logits[0, -1])
    assert np.array_equal(again.logits, second.logits)
    assert all(np.array_equal(again.leaves[n], second.leaves[n]) for n in second.leaves)
    other = make_method("leapquant-alloc-4", calibration=dataclasses.replace(
        cal, plans=(dataclasses.replace(plan, choice=((2, 0), (1, 0))),)))
    with pytest.raises(ps.PrefixStateError, match="state method"):
        ps.restore_cache(arch, params, config, loaded, method=other, max_len=ids.shape[0])


# ----------------------------------------------------------------------------- refusals


def test_bad_input_is_refused_by_name(calibrated, tmp_path):
    _, _, stats, cal = calibrated
    with pytest.raises(ValueError, match="below the smallest width 2"):
        stepquant_plan(stats, 1)
    with pytest.raises(ValueError, match="below the smallest width's"):
        width_plan(stats, budget=2.0)
    with pytest.raises(ValueError, match="unknown width 5"):
        width_plan(stats, options=((4, 2), (5, 2)))
    with pytest.raises(ValueError, match="unknown width 5"):
        width_plan(stats, 5)
    with pytest.raises(LifetimeCalibrationError, match=r"unknown width\(s\) \[3\]"):
        _calibration("kda", {0: np.full((H, DK), 3)})
    path = tmp_path / "cal.json"
    cal.save(str(path))
    d = json.loads(path.read_text())
    d["plans"]["leapquant-alloc-4"]["options"][0][0] = 5
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(LifetimeCalibrationError, match="bad.json.*unknown width 5"):
        LifetimeCalibration.load(str(tmp_path / "bad.json"))
    with pytest.raises(LifetimeCalibrationError, match="needs a calibration file"):
        make_method("stepquant-4").for_layer(0).from_dense(jnp.zeros((1, H, DK, DV)))
    with pytest.raises(LifetimeCalibrationError, match="for_layer"):
        make_method("leapquant-alloc-4", calibration=cal).from_dense(jnp.zeros((1, H, DK, DV)))
    with pytest.raises(LifetimeCalibrationError, match="no layer 1 .* another model"):
        make_method("stepquant-6", calibration=cal).for_layer(1).from_dense(jnp.zeros((1, H, DK, DV)))
    with pytest.raises(LifetimeCalibrationError, match="no plan for 'nope'"):
        StepQuantMethod(plan="nope", calibration=cal).for_layer(0).from_dense(jnp.zeros((1, H, DK, DV)))
    with pytest.raises(ValueError, match="takes only a calibration"):
        make_method("stepquant-6", bits=4)
    made_on = dataclasses.replace(cal, model="abc")
    with pytest.raises(LifetimeCalibrationError, match="another model"):
        made_on.check_model(fingerprint="xyz", layers=(0, 2), heads=H, dk=DK, dv=DV)
    with pytest.raises(LifetimeCalibrationError, match=r"layers \[0, 2\] vs the model's \[0, 1\]"):
        cal.check_model(fingerprint="", layers=(0, 1), heads=H, dk=DK, dv=DV)


def test_a_calibration_plans_the_names_asked_each_as_alone():
    from models.calibrate_stepquant import calibrate_lifetime, calibrate_traces

    traces = lifetime_traces(False)
    kw = dict(every=8, samples=16, horizon=256, alloc_budgets={}, dual_names=())
    one, _ = calibrate_traces(traces, stepquant_budgets={"stepquant-4": 4}, **kw)
    both, _ = calibrate_traces(traces, stepquant_budgets={"stepquant-6": 6, "stepquant-4": 4}, **kw)
    assert one.names == ("stepquant-4",) and both.names == ("stepquant-6", "stepquant-4")
    # a plan does not depend on the others made with it (runs that split the names agree)
    assert one.plan("stepquant-4").to_json(one.layers) == both.plan("stepquant-4").to_json(both.layers)
    for names, words in ((["int4"], "unknown method 'int4'"), ([], "no method to plan")):
        with pytest.raises(ValueError, match=words):
            calibrate_lifetime(None, None, None, None, names=names)


# ----------------------------------------------------------------------------- the commands


@pytest.fixture(scope="module")
def snippet_npy(tmp_path_factory):
    return heldout_ids_file(tmp_path_factory.mktemp("stepquant"), CKPTS / "stdlib-gdn")


@pytest.mark.parametrize("name", ["stdlib-gdn", "stdlib-kda"])
def test_shipped_calibrations_belong_to_their_checkpoints(name):
    from models.calibrate import check_state_method, linear_state_layout
    from models.checkpoint import load_model

    arch, config, params, _ = load_model(CKPTS / name)
    cal = LifetimeCalibration.load(str(CKPTS / name / "stepquant-calibration.json"))
    assert cal.layers == linear_state_layout(arch, config)[0]
    assert set(cal.names) == {"stepquant-6", "stepquant-4", "leapquant-alloc-6", "leapquant-alloc-4", "leapquant-dual-6",
                              "leapquant-dual-4"}
    check_state_method(make_method("leapquant-alloc-4", calibration=cal), arch, config, params)
    check_state_method(make_method("leapquant-dual-4", calibration=cal), arch, config, params)
    other = "stdlib-kda" if name == "stdlib-gdn" else "stdlib-gdn"
    wrong = make_method("stepquant-4", calibration=str(CKPTS / other / "stepquant-calibration.json"))
    with pytest.raises(LifetimeCalibrationError, match="another model"):
        check_state_method(wrong, arch, config, params)


def test_calibrate_then_eval_on_a_shipped_checkpoint(tmp_path, snippet_npy):
    cal = tmp_path / "cal.json"
    report, m = calibrate_then_eval("calibrate-stepquant", CKPTS / "stdlib-gdn", snippet_npy, cal,
                                    ["--rows", 2, "--tokens", 48, "--samples", 8],
                                    ["--context", 48, "--states", "stepquant-4,leapquant-alloc-4",
                                     "--stepquant-calibration", cal])
    assert report["layers"] == [0, 1, 2, 4, 5, 6] and report["architecture"] == "gdn"
    assert report["plans"]["leapquant-alloc-4"]["budget"] == default_budget(4, 128, 128) == 4.25
    loaded = LifetimeCalibration.load(str(cal))
    assert json.loads(cal.read_text())["calibration"]["rows"] == 2 and loaded.model
    assert all(np.isfinite(m[k]["perplexity"]) and m[k]["kl_to_fp32"] >= 0 for k in m)


@pytest.mark.parametrize("argv, words", [
    (["eval", "{gdn}", "--states", "stepquant-6"], ["--states stepquant-6 needs its calibration file"]),
    (["eval", "{gdn}", "--states", "int8", "--stepquant-calibration", "{kda_cal}"], ["--states does not name"]),
    (["eval", "{gdn}", "--states", "leapquant-alloc-4", "--stepquant-calibration", "{kda_cal}"],
     ["does not match this model", "another model"]),
    (["eval", "{gdn}", "--states", "stepquant-4", "--stepquant-calibration", "{missing}"], ["no such file"]),
    (["score", "{gdn}", "--ids-file", "{ids}", "--out", "{out}", "--state", "leapquant-alloc-6"],
     ["method leapquant-alloc-6 needs its calibration file"]),
    (["score", "{gdn}", "--ids-file", "{ids}", "--out", "{out}", "--state", "int4", "--stepquant-calibration",
      "{kda_cal}"], ["--stepquant-calibration is the calibration of methods"]),
    (["memory", "--stepquant-calibration", "{kda_cal}"], ["pass --methods too"]),
    (["memory", "--methods", "stepquant-4", "--stepquant-calibration", "{kda_cal}"], ["2 x 128 x 128 vs"]),
])
def test_command_line_refuses_by_name(tmp_path, snippet_npy, argv, words):
    names = {"gdn": CKPTS / "stdlib-gdn", "kda_cal": CKPTS / "stdlib-kda" / "stepquant-calibration.json",
             "missing": tmp_path / "none.json", "ids": snippet_npy, "out": tmp_path / "out.npy"}
    check_refused_by_name(argv, names, words, eval_data=snippet_npy, unwritten=tmp_path / "out.npy")


def test_memory_measures_the_calibrated_layouts():
    from leapquant_jax.studies.memory import method_memory

    path = CKPTS / "stdlib-gdn" / "stepquant-calibration.json"
    cal = LifetimeCalibration.load(str(path))
    plain = method_memory(["stepquant-4", "leapquant-alloc-4"], heads=4)
    got = method_memory(["stepquant-4", "leapquant-alloc-4", "int4"], heads=4, calibration=str(path))
    assert plain["stepquant-4"]["checkpoint_bits_per_value"] == 4.25          # every row at 4 bits
    layers = [make_method("stepquant-4", calibration=cal).for_layer(x).init(1, 4, 128, 128) for x in cal.layers]
    assert got["stepquant-4"]["live_gdn_bytes_per_head"] == tree_bytes(layers) / len(layers) / 4
    plan = cal.plan("leapquant-alloc-4")
    spent = np.mean([sum(option_bytes(plan.options[j], 128, 128) for j in c) for c in plan.choice]) * 8 / (4 * 128 * 128)
    assert got["leapquant-alloc-4"]["checkpoint_bits_per_value"] == pytest.approx(spent)
    assert spent <= plan.budget == 4.25                                        # within its budget
    assert got["int4"] == method_memory(["int4"], heads=4)["int4"]


@pytest.mark.parametrize("arch", ["gdn", "kda"])
def test_the_zero_state_is_the_fit_of_zeros(arch):
    from leapquant_jax.stepquant import encode, zero_state

    layout = Layout(bits=mixed_bits(arch, np.random.default_rng(1)), impact=np.full((H, DK), 0.5), architecture=arch)
    want = encode(jnp.zeros((2, H, DK, DV)), layout)
    got = zero_state(2, H, DK, DV, layout)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def test_the_grouped_zero_state_is_each_groups_own():
    from leapquant_jax import windowed

    # a group with Compensator Tokens (their fit starts from a seeded draw) and one without
    plan = WidthPlan(name="leapquant-alloc-4", budget=99.0, options=((4, 2), (8, 0)), choice=((0, 1, 1, 0),))
    cal = LifetimeCalibration(architecture="gdn", layers=(0,), heads=H, dk=DK, dv=DV, horizon=64, plans=(plan,))
    method = make_method("leapquant-alloc-4", calibration=cal, window=8).for_layer(0)
    layout = method.layout(H, DK, DV)
    assert layout.sizes == [2, 2]
    for per_channel_decay in (True, False):
        traced = jax.jit(lambda: method.init(3, H, DK, DV, per_channel_decay))()    # first made under a trace
        state = method.init(3, H, DK, DV, per_channel_decay)
        for got, again, config, n in zip(state.groups, traced.groups, method.configs(layout), layout.sizes):
            want = windowed.init_state(config, 3, n, DK, DV, per_channel_decay)
            assert jax.tree.structure(got) == jax.tree.structure(want) == jax.tree.structure(again)
            for a, b, c in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(again)):
                assert a.shape == b.shape and a.dtype == b.dtype
                assert np.array_equal(np.asarray(a), np.asarray(b)) and np.array_equal(np.asarray(c), np.asarray(b))
