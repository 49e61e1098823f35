"""Which implementation runs: one resolver for every op, a kernel where it applies, the reference,
or an error naming why neither may."""

import jax
import jax.numpy as jnp
import pytest

from leapquant_jax import dispatch, windowed
from leapquant_jax.impls import Impl, check_request
from leapquant_jax.methods import PerStepMethod
from leapquant_jax.recurrence import delta_rule_token
from leapquant_jax.state import LeapQuantConfig
from pallas_kernels import api


def state_of(config, dk=64, dv=64, **kw):
    # 4 x 2 heads: the Mosaic GPU step takes B H in multiples of 8 with scalar (GDN) decays
    return jax.eval_shape(lambda: windowed.init_state(config, 4, 2, dk, dv, **kw))


def token_of(dk=128, dv=128):
    z = jnp.zeros((1, 2, dk))
    return delta_rule_token(q=z, k=z, v=jnp.zeros((1, 2, dv)), g=jnp.zeros((1, 2)), beta=jnp.zeros((1, 2)))


def broken_kernels():
    return None, "pallas_kernels is not importable (No module named 'triton')"


def test_auto_on_a_gpu_refuses_a_kernels_package_that_fails_to_import(monkeypatch):
    monkeypatch.setattr(dispatch, "load_kernels", broken_kernels)
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    config = LeapQuantConfig()
    for op in ("step", "flush"):
        with pytest.raises(RuntimeError, match="not importable.*impl='reference'"):
            dispatch.resolve(op, config.impl, config, state_of(config))
    config = LeapQuantConfig(impl="reference")
    assert dispatch.resolve("step", config.impl, config, state_of(config)) is Impl.REFERENCE


def test_auto_off_a_gpu_takes_the_reference_and_an_explicit_kernel_names_the_reason(monkeypatch):
    monkeypatch.setattr(dispatch, "load_kernels", broken_kernels)
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "cpu")
    config = LeapQuantConfig()
    assert dispatch.resolve("flush", "auto", config, state_of(config)) is Impl.REFERENCE
    for impl in ("pallas", "triton", "fused"):
        with pytest.raises(ValueError, match=f"impl='{impl}' cannot run the flush here: .*not importable"):
            dispatch.resolve("flush", impl, config, state_of(config))


def test_auto_on_a_gpu_takes_the_kernels_where_they_apply(monkeypatch):
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")      # not a Hopper GPU: no Mosaic GPU
    config = LeapQuantConfig()
    assert dispatch.resolve("step", "auto", config, state_of(config)) is Impl.TRITON
    assert dispatch.resolve("flush", "auto", config, state_of(config)) is Impl.SPLIT
    config = LeapQuantConfig(fit="svd")                # the exact fit stays in the reference, step and flush alike
    assert dispatch.resolve("step", "auto", config, state_of(config)) is Impl.REFERENCE
    assert dispatch.resolve("flush", "auto", config, state_of(config)) is Impl.REFERENCE
    assert dispatch.resolve("chunk_scan", "auto", 64, 64, 64) is Impl.TRITON
    assert dispatch.resolve("chunk_scan", "auto", 64, 48, 64) is Impl.REFERENCE


def test_auto_takes_the_mosaic_kernels_on_hopper_only(monkeypatch):
    config = LeapQuantConfig(bits=8, window=8)
    st = state_of(config, 128, 128)
    values = jnp.zeros((1, 2, 128, 128))
    assert dispatch.resolve("step", "pallas", config, st) is Impl.TRITON               # no GPU here: interpreted
    assert dispatch.resolve("flush", "pallas", config, st) is Impl.SPLIT
    assert dispatch.resolve("dense_step", "pallas", values, token_of()) is Impl.TRITON
    monkeypatch.setattr(dispatch.jax, "default_backend", lambda: "gpu")
    assert dispatch.resolve("step", "auto", config, st) is Impl.TRITON                 # a GPU, not Hopper
    monkeypatch.setattr(api, "on_hopper", lambda: True)
    assert dispatch.resolve("step", "auto", config, st) is Impl.MOSAIC
    assert dispatch.resolve("step", "auto", config, state_of(config, 128, 128, per_channel_decay=True)) is Impl.MOSAIC
    assert dispatch.resolve("flush", "auto", config, st) is Impl.MOSAIC
    assert dispatch.resolve("dense_step", "auto", values, token_of()) is Impl.MOSAIC
    for bits in (6, 4, 2):     # 128 x 128 heads: the Mosaic GPU step and flush at every width
        cb = LeapQuantConfig(bits=bits, window=8)
        for per_channel_decay in (False, True):
            sb = state_of(cb, 128, 128, per_channel_decay=per_channel_decay)
            assert dispatch.resolve("step", "auto", cb, sb) is Impl.MOSAIC
            assert dispatch.resolve("flush", "auto", cb, sb) is Impl.MOSAIC
    assert dispatch.resolve("step", "auto", config, state_of(config, 64, 128)) is Impl.TRITON
    assert dispatch.resolve("dense_step", "auto", values[..., :64, :], token_of(64)) is Impl.TRITON
    monkeypatch.setattr(api, "on_hopper", lambda: False)
    with pytest.raises(ValueError, match="impl='mosaic' cannot run the step here: .*Hopper"):
        dispatch.resolve("step", "mosaic", config, st)


def test_an_explicit_choice_runs_or_fails_fast_with_its_reason():
    config = LeapQuantConfig(bits=8, window=8)
    st = state_of(config, 128, 128)
    assert dispatch.resolve("step", "mosaic", config, st) is Impl.MOSAIC                # interpreted here
    assert dispatch.resolve("flush", "fused", config, st) is Impl.FUSED
    assert dispatch.resolve("flush", "triton", config, st) is Impl.SPLIT               # the flush's Triton name
    with pytest.raises(ValueError, match="impl='mosaic' cannot run the flush here: dk=64, dv=128"):
        dispatch.resolve("flush", "mosaic", config, state_of(config, 64, 128))
    svd = LeapQuantConfig(fit="svd")
    with pytest.raises(ValueError, match="impl='pallas' cannot run the step here: .*subspace"):
        dispatch.resolve("step", "pallas", svd, state_of(svd))
    with pytest.raises(ValueError, match="impl='triton' cannot run the chunk_scan here: dk=8"):
        dispatch.resolve("chunk_scan", "triton", 8, 16, 16)


def test_requests_are_checked_per_op():
    with pytest.raises(ValueError, match="'fused' is not an implementation of the step"):
        dispatch.resolve("step", "fused", LeapQuantConfig(), state_of(LeapQuantConfig()))
    for impl in ("auto", "pallas", "reference", "triton", "mosaic"):
        LeapQuantConfig(impl=impl)
        PerStepMethod("fp32", impl=impl)
    with pytest.raises(ValueError, match="'split' is not an implementation of the step"):
        LeapQuantConfig(impl="split")                      # a config's impl serves the step and the flush
    with pytest.raises(ValueError, match="'mosaic' is not an implementation of the chunk_scan"):
        check_request("mosaic", ("chunk_scan",))
    with pytest.raises(ValueError, match="fp32 and bf16"):
        PerStepMethod("int8", impl="triton")
