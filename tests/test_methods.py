"""Every method behind one interface: jit, vmap, prefill and masking."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from leapquant_jax import make_method
from leapquant_jax.methods import WINDOWED_METHODS
from leapquant_jax.recurrence import recurrent_scan
from helpers import random_inputs, rel

# Its tests share compiled programs (the same shapes and configs): one xdist worker compiles
# them once (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("methods")


def _method(name):
    return make_method(name, impl="reference") if name.endswith("-w") or name == "leapquant" else make_method(name)


# The base formats and the windowed methods; each rival format's module has its own test file
# with its own measured bounds.
BASE_METHODS = ("fp32", "bf16", "fp16", "int8", "fp8", "int6", "int4") + WINDOWED_METHODS


@pytest.mark.parametrize("name", BASE_METHODS)
def test_every_method_decodes_close_to_fp32_under_jit_and_vmap(name):
    x = random_inputs(1, batch=2, tokens=40, heads=2, dk=16, dv=16)
    m = _method(name)

    def run(inputs):          # one sequence [T, H, ...] -> o [T, H, dv]
        batched = {k: v[None] for k, v in inputs.items()}
        o, _ = m.decode(m.init(1, 2, 16, 16), **batched)
        return o[0]

    o = jax.jit(jax.vmap(run))(x)
    o_ref, _ = recurrent_scan(None, **x)
    # about three times the measured error of each rounding (int8 8e-3, int6 3e-2, int4 0.15, fp8 3e-2)
    bound = {"fp8": 0.3, "int8": 0.05, "int6": 0.1, "int4": 0.4}.get(name, 0.02)
    assert rel(o, o_ref) < bound
    if name == "fp32":
        assert rel(o, o_ref) < 1e-6


@pytest.mark.parametrize("name", ["int8", "leapquant"])
def test_prefill_of_ragged_prompts_continues_like_decode(name):
    x = random_inputs(2, batch=2, tokens=24, heads=2, dk=16, dv=16, kda=True)
    m = _method(name)
    lengths = jnp.array([24, 19])
    o, state = jax.jit(lambda a: m.prefill(**a, lengths=lengths))(x)
    o_ref, s_ref = recurrent_scan(None, **{k: v[1:] for k, v in x.items()})
    _, s_short = recurrent_scan(None, **{k: v[1:, :19] for k, v in x.items()})
    dense = m.to_dense(state)
    # Exact up to the last boundary, then one rounding: close to fp32 for both lengths.
    assert rel(dense[1], s_short[0]) < 0.02
    if name == "leapquant":
        assert list(np.asarray(state.pos)) == [24 % 16, 19 % 16]
        assert rel(o[1, :16], o_ref[0, :16]) < 1e-5       # before the boundary: exact fp32


def test_inactive_sequences_keep_their_state():
    # the first token and head of the decode tests' input spec (each new spec compiles the generator)
    x = {k: v[:, :1, :1] for k, v in random_inputs(3, batch=2, tokens=40, heads=2, dk=16, dv=16).items()}
    m = _method("leapquant")
    state = m.from_dense(jax.random.normal(jax.random.PRNGKey(0), (2, 1, 16, 16)))
    _, new = m.step(state, **{k: v[:, 0] for k, v in x.items()}, active=jnp.array([True, False]))
    assert list(np.asarray(new.pos)) == [1, 0]
    for a, b in zip(jax.tree_util.tree_leaves(new.buffer), jax.tree_util.tree_leaves(state.buffer)):
        np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))
