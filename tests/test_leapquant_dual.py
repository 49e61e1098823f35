"""LeapQuant with a dual-axis checkpoint (``leapquant-dual-*``): its checkpoint is STEPQuant's
state of the same plan (bytes and values), its plan is ``stepquant_plan``'s, it replays a trace
closer to fp32 than ``stepquant-4`` rounding every token, the kernels refuse its checkpoint, and
bad input is refused by name."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from leapquant_jax import make_method
from leapquant_jax.leapquant_dual import DualConfig, DualMethod
from leapquant_jax.quantizers import tree_bytes
from leapquant_jax.state import LeapQuantState
from leapquant_jax.stepquant import StepQuantState
from leapquant_jax.traces import Trace, save_trace
from helpers import ROOT, lifetime_traces, numpy_reference, rel

H, DK, DV = 4, 32, 32


@pytest.fixture(scope="module", params=["gdn", "kda"])
def calibrated(request):
    from models.calibrate_stepquant import calibrate_traces

    kda = request.param == "kda"
    traces = lifetime_traces(kda)
    cal, _ = calibrate_traces(traces, every=8, samples=16, horizon=256, pivots=1 if not kda else 4,
                              stepquant_budgets={"stepquant-4": 4}, alloc_budgets={},
                              dual_names=("leapquant-dual-4",))
    return request.param, traces, cal


def test_the_plan_and_the_checkpoint_are_stepquants(calibrated):
    arch, _, cal = calibrated
    assert cal.names == ("stepquant-4", "leapquant-dual-4")
    assert cal.plan("leapquant-dual-4") == dataclasses.replace(cal.plan("stepquant-4"), name="leapquant-dual-4")
    s = jnp.asarray(np.random.default_rng(0).standard_normal((2, H, DK, DV)), jnp.float32)
    dual = make_method("leapquant-dual-4", calibration=cal).for_layer(2)
    step = make_method("stepquant-4", calibration=cal).for_layer(2)
    state = dual.from_dense(s, per_channel_decay=arch == "kda")
    assert isinstance(state, LeapQuantState) and isinstance(state.checkpoint.residual, StepQuantState)
    assert state.checkpoint.comp_k.shape[2] == 0 and state.checkpoint.smooth is None
    assert tree_bytes(state.checkpoint) == tree_bytes(step.from_dense(s))      # the same bytes ...
    np.testing.assert_array_equal(np.asarray(dual.to_dense(state)), np.asarray(step.to_dense(step.from_dense(s))))
    zero = dual.init(2, H, DK, DV, per_channel_decay=arch == "kda")            # ... and the same layout from zero
    assert tree_bytes(zero) == tree_bytes(state)


def test_it_replays_a_trace_closer_to_fp32_than_rounding_every_token(calibrated, tmp_path):
    from leapquant_cli import main

    arch, traces, cal = calibrated
    cal_path = tmp_path / "cal.json"
    cal.save(str(cal_path))
    x = {k: v[0] for k, v in traces[0].items()}
    save_trace(str(tmp_path / "layer00.npz"), Trace(**x))
    _, s_ref = numpy_reference(**{k: v[None] for k, v in x.items()})
    errors = {}
    for name in ("stepquant-4", "leapquant-dual-4"):
        argv = ["replay", str(tmp_path / "layer00.npz"), "--method", name, "--out", str(tmp_path / f"{name}.npz"),
                "--stepquant-calibration", str(cal_path), "--json"]
        assert main(argv) == 0
        out = np.load(tmp_path / f"{name}.npz")
        assert np.all(np.isfinite(out["o"]))
        errors[name] = rel(out["state"], s_ref[0])
    assert errors["leapquant-dual-4"] < errors["stepquant-4"]


def test_the_kernels_refuse_its_checkpoint(calibrated):
    from pallas_kernels.support import unsupported_reason

    arch, _, cal = calibrated
    method = make_method("leapquant-dual-4", calibration=cal).for_layer(0)
    state = method.init(1, H, DK, DV, per_channel_decay=arch == "kda")
    assert "integer tensor" in unsupported_reason(method.windowed(H, DK, DV).config, state)


def test_bad_input_is_refused_by_name(calibrated):
    _, _, cal = calibrated
    with pytest.raises(ValueError, match="takes a calibration, window and impl"):
        make_method("leapquant-dual-4", calibration=cal, bits=4)
    with pytest.raises(ValueError, match="unknown method 'leapquant-dual-5'"):
        DualMethod(plan="leapquant-dual-5")
    with pytest.raises(ValueError, match="no Compensator Tokens"):
        DualConfig(bits=4, rank=0, smoothing=False)
    with pytest.raises(Exception, match="needs a calibration file"):
        make_method("leapquant-dual-4").for_layer(0).from_dense(jnp.zeros((1, H, DK, DV)))
    with pytest.raises(Exception, match="no plan for 'leapquant-dual-6'"):
        make_method("leapquant-dual-6", calibration=cal).for_layer(0).from_dense(jnp.zeros((1, H, DK, DV)))


@pytest.mark.parametrize("model", ["stdlib-gdn", "stdlib-kda"])
def test_shipped_calibrations_hold_the_dual_plans_as_stepquants(model):
    # what ``calibrate-stepquant`` writes: each leapquant-dual-<b> plan is stepquant-<b>'s under its name
    plans = json.loads((ROOT / "models" / "checkpoints" / model / "stepquant-calibration.json").read_text())["plans"]
    for bits in (6, 4):
        assert plans[f"leapquant-dual-{bits}"] == plans[f"stepquant-{bits}"]
