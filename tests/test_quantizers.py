import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from leapquant_jax.quantizers import FloatFormat, Fp8Format, IntFormat, get_format, pack_codes, packed_rows, tree_bytes, unpack_codes

# Its tests share compiled programs (the same shapes and configs): one xdist worker compiles
# them once (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("quantizers")

finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)
states = hnp.arrays(np.float32, st.tuples(st.sampled_from([4, 8, 12]), st.integers(1, 6)), elements=finite)


@settings(max_examples=40, deadline=None)
@given(x=states, bits=st.sampled_from([8, 6, 4, 2]))
def test_int_error_within_half_a_step(x, bits):
    fmt = IntFormat(bits)
    t = fmt.quantize(jnp.asarray(x))
    err = np.abs(np.asarray(fmt.dequantize(t)) - x)
    step = np.asarray(t.scale)[None, :] * (2 if bits == 2 else 1)   # 2 bits: the odd integers
    assert np.all(err <= 0.5 * step * (1 + 1e-5) + 1e-30)


def test_two_bit_codes_are_the_nearest_odd_integers():
    x = np.array([[-3.0], [-2.2], [-1.9], [-0.1], [0.0], [0.4], [1.99], [2.01], [3.0], [-2.0], [0.7], [2.5]],
                 np.float32)
    fmt = IntFormat(2)
    t = fmt.quantize(jnp.asarray(x))
    assert float(t.scale[0]) == 1.0
    np.testing.assert_array_equal(np.asarray(fmt.integer_values(t))[:, 0], [-3, -3, -1, -1, 1, 1, 1, 3, 3, -1, 1, 3])


@settings(max_examples=40, deadline=None)
@given(codes=hnp.arrays(np.int32, st.tuples(st.sampled_from([4, 8, 16]), st.integers(1, 5)), elements=st.integers(1, 255)),
       bits=st.sampled_from([8, 6, 4, 2]))
def test_packing_round_trips_exactly(codes, bits):
    codes = codes % (2 ** bits)
    packed = pack_codes(jnp.asarray(codes), bits)
    assert packed.shape == (packed_rows(codes.shape[0], bits), codes.shape[1])
    np.testing.assert_array_equal(np.asarray(unpack_codes(packed, bits)), codes)


@pytest.mark.parametrize("bits, per_element", [(8, 1.0), (6, 0.75), (4, 0.5), (2, 0.25)])
def test_packed_codes_take_their_bits_in_memory(bits, per_element):
    t = IntFormat(bits).quantize(jnp.ones((3, 128, 64)))
    assert tree_bytes(t.codes) == 3 * 128 * 64 * per_element


@settings(max_examples=30, deadline=None)
@given(x=states, name=st.sampled_from(["bf16", "fp16"]))
def test_float_formats_round_to_nearest(x, name):
    x = np.clip(x, -6e4, 6e4)
    fmt = get_format(name)
    y = np.asarray(fmt.dequantize(fmt.quantize(jnp.asarray(x))))
    ref = x.astype(ml_dtypes.bfloat16 if name == "bf16" else np.float16).astype(np.float32)
    np.testing.assert_array_equal(y, ref)


@settings(max_examples=30, deadline=None)
@given(x=states)
def test_fp8_column_max_maps_to_448_and_error_is_bounded(x):
    fmt = Fp8Format()
    t = fmt.quantize(jnp.asarray(x))
    y = np.asarray(fmt.dequantize(t))
    colmax = np.abs(x).max(axis=0)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values, plus the subnormal floor.
    bound = np.abs(x) * 2.0 ** -4 + colmax / 448.0 * 2.0 ** -9
    assert np.all(np.abs(y - x) <= bound * (1 + 1e-5) + 1e-30)


@pytest.mark.parametrize("fmt", [IntFormat(8), IntFormat(6), IntFormat(4), IntFormat(2), Fp8Format(),
                                 FloatFormat("bfloat16")])
def test_zero_and_tiny_columns_are_safe(fmt):
    x = np.zeros((8, 4), np.float32)
    x[:, 1] = 1e-38
    x[:, 2] = np.linspace(-1e-30, 1e-30, 8)
    x[:, 3] = np.linspace(-3, 5, 8)
    y = np.asarray(fmt.dequantize(fmt.quantize(jnp.asarray(x))))
    assert np.all(np.isfinite(y))
    np.testing.assert_array_equal(y[:, 0], 0.0)
    assert np.abs(y[:, 1:3]).max() <= 1e-29


def test_bad_format_inputs():
    with pytest.raises(ValueError, match="unknown state format"):
        get_format("int5")
    with pytest.raises(ValueError, match="8, 6, 4 or 2"):
        IntFormat(5)
    with pytest.raises(TypeError, match="floating point"):
        IntFormat(8).quantize(jnp.ones((4, 4), jnp.int32))
    with pytest.raises(ValueError, match="divisible by 4"):
        IntFormat(6).quantize(jnp.ones((6, 4)))
    with pytest.raises(ValueError, match="divisible by 4"):
        IntFormat(2).quantize(jnp.ones((6, 4)))
