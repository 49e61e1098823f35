"""Which implementation runs: the kernels, the reference, or an error naming why neither may."""

import jax
import pytest

from leapquant_jax import dispatch, windowed
from leapquant_jax.state import LeapQuantConfig


def state_of(config):
    return jax.eval_shape(lambda: windowed.init_state(config, 1, 2, 64, 64))


def broken_kernels():
    return None, "pallas_kernels is not importable (No module named 'triton')"


def test_auto_on_a_gpu_refuses_a_kernels_package_that_fails_to_import(monkeypatch):
    monkeypatch.setattr(dispatch, "load_kernels", broken_kernels)
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    config = LeapQuantConfig()
    with pytest.raises(RuntimeError, match="not importable.*impl='reference'"):
        dispatch.resolve_impl(config, state_of(config))
    config = LeapQuantConfig(impl="reference")
    assert dispatch.resolve_impl(config, state_of(config)) == "reference"


def test_auto_off_a_gpu_takes_the_reference_and_explicit_pallas_names_the_reason(monkeypatch):
    monkeypatch.setattr(dispatch, "load_kernels", broken_kernels)
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "cpu")
    config = LeapQuantConfig()
    assert dispatch.resolve_impl(config, state_of(config)) == "reference"
    config = LeapQuantConfig(impl="pallas")
    with pytest.raises(ValueError, match="not importable"):
        dispatch.resolve_impl(config, state_of(config))


def test_auto_on_a_gpu_takes_the_kernels_where_they_apply(monkeypatch):
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    config = LeapQuantConfig()
    assert dispatch.resolve_impl(config, state_of(config)) == "pallas"
    config = LeapQuantConfig(fit="svd")                # the exact fit stays in the reference
    assert dispatch.resolve_impl(config, state_of(config)) == "reference"
