import jax.numpy as jnp
import numpy as np
import pytest

from leapquant_jax.recurrence import delta_rule_token, linear_attention_token, recurrent_scan, recurrent_step, recurrent_step_general
from helpers import numpy_inputs, numpy_reference, rel

# Its tests share compiled programs (the same shapes and configs): one xdist worker compiles
# them once (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("recurrence")


def inputs(seed, kda=False, key_heads=None):
    """The tests' inputs ``[2, 37, 4, ...]`` (12 x 10 heads; a fully decayed head, a head at alpha =
    0.99999, strong tokens), drawn in NumPy: nothing to compile."""
    return numpy_inputs(seed, batch=2, tokens=37, heads=4, dk=12, dv=10, kda=kda, key_heads=key_heads)


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("key_heads", [None, 2])
def test_fp32_scan_matches_numpy_reference(kda, key_heads):
    x = inputs(1, kda, key_heads)
    s0 = np.random.default_rng(3).standard_normal((2, 4, 12, 10)).astype(np.float32)
    o, s = recurrent_scan(jnp.asarray(s0), **x)
    o_ref, s_ref = numpy_reference(**x, s0=s0)
    assert rel(o, o_ref) < 1e-5
    assert rel(s, s_ref) < 1e-5


def zero_inputs(heads, *, batch=2, tokens=3, dk=16, dv=16):
    """All-zero inputs ``[B, T, H, ...]``: the shape checks read no values (nothing to compile)."""
    z = lambda *shape: np.zeros(shape, np.float32)   # noqa: E731
    return dict(q=z(batch, tokens, heads, dk), k=z(batch, tokens, heads, dk), v=z(batch, tokens, heads, dv),
                g=z(batch, tokens, heads), beta=z(batch, tokens, heads))


def test_step_equals_scan():
    # the first 5 tokens of the scan tests' inputs (one input spec to compile)
    x = {n: v[:, :5] for n, v in inputs(2).items()}
    o, s = recurrent_scan(None, **x)
    state = jnp.zeros_like(s)
    for t in range(5):
        ot, state = recurrent_step(state, **{n: v[:, t] for n, v in x.items()})
        np.testing.assert_allclose(ot, o[:, t], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(state, s, rtol=1e-6, atol=1e-6)


def test_general_form_linear_attention_is_plain_accumulation():
    rng = np.random.default_rng(0)
    q, k = jnp.asarray(rng.standard_normal((2, 1, 2, 4)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 2, 3)), jnp.float32)
    tok = linear_attention_token(q=q, k=k, v=v)
    s0 = jnp.ones((1, 2, 4, 3))
    o, s = recurrent_step_general(s0, tok)
    np.testing.assert_allclose(s, s0 + k[..., :, None] * v[..., None, :], rtol=1e-6)
    np.testing.assert_allclose(o, jnp.einsum("bhkv,bhk->bhv", s, q), rtol=1e-5)


def test_gva_maps_value_head_to_key_head_by_integer_division():
    # value heads 0, 1 read key head 0 and 2, 3 key head 1 (not 0, 1, 0, 1): the scan tests' shapes
    x = inputs(4, key_heads=2)
    o, s = recurrent_scan(None, **x)
    expanded = dict(x, q=jnp.repeat(x["q"], 2, axis=2), k=jnp.repeat(x["k"], 2, axis=2))
    o2, s2 = recurrent_scan(None, **expanded)
    np.testing.assert_allclose(o, o2, rtol=1e-6)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda x: dict(x, v=x["v"][..., 0]), "v must be"),
        (lambda x: dict(x, k=x["k"][:, :, :, :-1]), "q and k"),
        (lambda x: dict(x, beta=x["beta"][:, :, :1]), "beta must be"),
        (lambda x: dict(x, g=x["g"][..., None, None]), "g must be"),
        (lambda x: dict(x, q=x["q"][:, :, :0], k=x["k"][:, :, :0]), "heads"),
    ],
)
def test_bad_shapes_name_the_tensor(change, match):
    x = zero_inputs(2)
    with pytest.raises(ValueError, match=match):
        recurrent_scan(None, **change(x))


def test_mismatched_heads_are_rejected():
    x = zero_inputs(3)
    x = dict(x, q=x["q"][:, :, :2], k=x["k"][:, :, :2])
    with pytest.raises(ValueError, match="does not divide"):
        recurrent_scan(None, **x)


def test_integer_inputs_are_rejected():
    x = zero_inputs(2)
    with pytest.raises(TypeError, match="beta must be a floating-point"):
        delta_rule_token(**{n: v[:, 0] for n, v in dict(x, beta=jnp.ones(x["beta"].shape, jnp.int32)).items()})
