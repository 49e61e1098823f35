"""Per-tensor, int16 and block-float (OCP MX, NVFP) state formats against ml_dtypes and NumPy references."""

from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from leapquant_jax import make_method
from leapquant_jax.block_formats import (
    E2M1,
    E2M3,
    E3M2,
    FORMATS,
    MXFormat,
    NVFPFormat,
    element_format,
)
from leapquant_jax.formats import get_state_format
from leapquant_jax.quantizers import pack_codes, packed_rows, tree_bytes, unpack_codes
from leapquant_jax.recurrence import recurrent_scan
from helpers import random_inputs, rel

# The module's fixtures serve all its tests: one xdist worker runs them (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("block_formats")

ML = {"e2m1": ml_dtypes.float4_e2m1fn, "e2m3": ml_dtypes.float6_e2m3fn, "e3m2": ml_dtypes.float6_e3m2fn,
      "e4m3": ml_dtypes.float8_e4m3fn}
SUB_BYTE = [E2M1, E2M3, E3M2]


def _ml_codes(x, element):
    """Bit patterns of ``x`` cast by ml_dtypes (the sub-byte ``fn`` casts saturate)."""
    return np.asarray(x, np.float32).astype(ML[element]).view(np.uint8).astype(np.int32)


def _stored_codes(t, element):
    if element == "e4m3":
        return np.asarray(t.elements).view(np.uint8).astype(np.int32)
    return np.asarray(unpack_codes(t.elements, element_format(element).bits))


def _recip(c):
    """Scales multiply by the fp32 reciprocal of their constant divisor."""
    return np.float32(1.0 / c)


def _block_max(x, block):
    dk = x.shape[-2]
    nb = -(-dk // block)
    a = np.abs(np.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, nb * block - dk), (0, 0)]))
    return a.reshape(x.shape[:-2] + (nb, block, x.shape[-1])).max(axis=-2)


def _rows(s, block, dk):
    return np.repeat(s, block, axis=-2)[..., :dk, :]


def _wide_state(seed, dk, dv, block):
    """Blocks of very different magnitudes (1e-30 .. 1e30), one all-zero block, one zero column."""
    rng = np.random.default_rng(seed)
    nb = -(-dk // block)
    mags = 10.0 ** rng.uniform(-30, 30, size=(nb, dv))
    x = rng.standard_normal((dk, dv)) * _rows(mags, block, dk)
    x[:block, 0] = 0.0
    x[:, -1] = 0.0
    return x.astype(np.float32)


# ----------------------------------------------------------------------------- elements


@pytest.mark.parametrize("elem", SUB_BYTE, ids=lambda e: e.name)
def test_element_decode_matches_ml_dtypes_on_every_code(elem):
    codes = np.arange(2 ** elem.bits, dtype=np.uint8)
    ref = codes.view(ML[elem.name]).astype(np.float32)
    got = np.asarray(jax.jit(elem.decode)(jnp.asarray(codes)))
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(ref))
    assert elem.max == float(ml_dtypes.finfo(ML[elem.name]).max)
    # Every code is a fixed point of decode -> encode (the codes round-trip).
    np.testing.assert_array_equal(np.asarray(jax.jit(elem.encode)(jnp.asarray(got))), codes)


@pytest.mark.parametrize("elem", SUB_BYTE, ids=lambda e: e.name)
def test_element_rounding_matches_ml_dtypes(elem):
    rng = np.random.default_rng(7 + elem.bits)
    grid = np.unique(np.abs(np.arange(2 ** elem.bits, dtype=np.uint8).view(ML[elem.name]).astype(np.float32)))
    smallest = float(grid[1])
    parts = [
        np.exp2(rng.uniform(np.log2(smallest) - 4, np.log2(elem.max) + 3, 4000)),   # subnormals .. saturation
        grid, (grid[1:] + grid[:-1]) / 2,                                          # grid points and ties
        np.nextafter((grid[1:] + grid[:-1]) / 2, np.inf), np.nextafter((grid[1:] + grid[:-1]) / 2, 0),
        np.array([0.0, 1e-30, 1e-40, 1e30, 3e38]),
    ]
    mag = np.concatenate(parts).astype(np.float32)
    x = np.concatenate([mag, -mag])
    got = np.asarray(jax.jit(elem.encode)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, _ml_codes(x, elem.name))


@pytest.mark.parametrize("bits", [4, 6])
def test_element_packing_round_trips_every_code(bits):
    rng = np.random.default_rng(bits)
    codes = np.stack([rng.permutation(np.tile(np.arange(2 ** bits), 2)) for _ in range(3)], axis=-1)   # [2^(b+1), 3]
    packed = pack_codes(jnp.asarray(codes), bits)
    assert packed.dtype == jnp.uint8 and packed.shape == (packed_rows(codes.shape[0], bits), 3)
    np.testing.assert_array_equal(np.asarray(unpack_codes(packed, bits)), codes)


# ----------------------------------------------------------------------------- scales


@pytest.mark.parametrize("element, dk", [("e4m3", 64), ("e2m3", 48), ("e2m1", 40), ("e3m2", 32)])
def test_mx_scales_and_elements_follow_the_ocp_spec(element, dk):
    fmt = MXFormat(element)
    elem = element_format(element)
    x = _wide_state(dk, dk, 6, 32)[None]
    t = jax.jit(fmt.quantize)(jnp.asarray(x))
    bmax = _block_max(x.astype(np.float64), 32)
    with np.errstate(divide="ignore"):
        shared = np.where(bmax > 0, np.clip(np.floor(np.log2(bmax)) - elem.emax, -127, 127), -127).astype(np.int64)
    assert t.exponents.dtype == jnp.uint8 and t.exponents.shape == (1, -(-dk // 32), 6)
    np.testing.assert_array_equal(np.asarray(t.exponents), shared + 127)
    y = (x.astype(np.float64) * np.exp2(-_rows(shared, 32, dk))).astype(np.float32)    # exact: powers of two
    if element == "e4m3":
        y = np.clip(y, -448, 448)
    np.testing.assert_array_equal(_stored_codes(t, element), _ml_codes(y, element))
    dense = np.asarray(jax.jit(fmt.dequantize)(t))
    ref = (_ml_codes(y, element).astype(np.uint8).view(ML[element]).astype(np.float64)
           * np.exp2(_rows(shared, 32, dk)))
    np.testing.assert_array_equal(dense, ref.astype(np.float32))
    assert np.all(dense[0, :32, 0] == 0) and np.all(dense[..., -1] == 0)


@pytest.mark.parametrize("element, dk", [("e2m1", 48), ("e2m3", 40)])
def test_nvfp_scales_and_elements_follow_the_spec(element, dk):
    fmt = NVFPFormat(element)
    elem = element_format(element)
    rng = np.random.default_rng(dk)
    x = (rng.standard_normal((2, dk, 5)) * 10.0 ** rng.uniform(-3, 3, (2, 1, 5))).astype(np.float32)
    x[1, :16, 1] = 0.0
    t = jax.jit(fmt.quantize)(jnp.asarray(x))
    ts = np.abs(x).max(axis=(-2, -1), keepdims=True) * _recip(448 * elem.max)
    np.testing.assert_array_equal(np.asarray(t.tensor_scale), ts)
    bs = np.clip(_block_max(x, 16) * _recip(elem.max) / ts, 0, 448).astype(ml_dtypes.float8_e4m3fn)
    assert t.block_scale.dtype == jnp.float8_e4m3fn and t.block_scale.shape == bs.shape
    np.testing.assert_array_equal(np.asarray(t.block_scale).view(np.uint8), bs.view(np.uint8))
    divisor = _rows(bs.astype(np.float32), 16, dk) * ts
    y = x / np.where(divisor > 0, divisor, np.float32(1))
    np.testing.assert_array_equal(_stored_codes(t, element), _ml_codes(y, element))
    dense = np.asarray(jax.jit(fmt.dequantize)(t))
    np.testing.assert_array_equal(dense, _ml_codes(y, element).astype(np.uint8).view(ML[element]).astype(np.float32) * divisor)
    assert np.all(dense[1, :16, 1] == 0)
    # A block whose scale is an e4m3 normal keeps its maximum to within the scale's rounding (2^-4)
    # plus the element step at the top of the range; smaller block scales lose precision (e4m3 subnormals).
    normal = bs.astype(np.float32) >= 2.0 ** -6
    assert normal.sum() > 10 and (~normal).sum() > 1
    top = _block_max(dense, 16)[normal] / _block_max(x, 16)[normal]
    assert np.all(np.abs(top - 1) < 2 ** -3)


def test_per_tensor_and_int16_scales():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((2, 3, 16, 8)) * np.exp(rng.standard_normal((2, 3, 16, 1)))).astype(np.float32)
    absmax = np.abs(x).max(axis=(-2, -1))[..., None]

    t = jax.jit(get_state_format("int8-tensor").quantize)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(t.scale), absmax * _recip(127))
    err = np.abs(np.asarray(get_state_format("int8-tensor").dequantize(t)) - x)
    assert np.all(err <= 0.5 * np.asarray(t.scale)[..., None] * (1 + 1e-5))

    t = jax.jit(get_state_format("fp8-tensor").quantize)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(t.scale), absmax * _recip(448))
    ref = np.clip(x / (absmax * _recip(448))[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(t.values).view(np.uint8), ref.view(np.uint8))

    fmt = get_state_format("int16")
    t = jax.jit(fmt.quantize)(jnp.asarray(x))
    assert t.codes.dtype == jnp.int16
    np.testing.assert_array_equal(np.asarray(t.scale), np.abs(x).max(axis=-1) * _recip(32767))
    err = np.abs(np.asarray(fmt.dequantize(t)) - x)
    # Half a step, plus the fp32 roundings of x / scale and code * scale (2^-24 |x| each) that a
    # step of 2^-15 of the row maximum no longer hides.
    assert np.all(err <= 0.5 * np.asarray(t.scale)[..., None] + 2.0 ** -23 * np.abs(x))
    assert np.max(err / np.asarray(t.scale)[..., None]) > 0.45


@pytest.mark.parametrize("name, base", [("int8-channel", "int8"), ("fp8-channel", "fp8")])
def test_channel_formats_are_the_base_formats(name, base):
    x = jax.random.normal(jax.random.PRNGKey(4), (2, 16, 8))
    a, b = get_state_format(name).quantize(x), get_state_format(base).quantize(x)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for la, lb in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(la).view(np.uint8), np.asarray(lb).view(np.uint8))


# ----------------------------------------------------------------------------- every format

TINY = Fraction(32, 128 * 128)        # bits of one fp32 scale per 128 x 128 head
BITS_PER_VALUE = {
    "int8-tensor": 8 + TINY, "int8-channel": Fraction(33, 4), "fp8-tensor": 8 + TINY, "fp8-channel": Fraction(33, 4),
    "int16": Fraction(65, 4), "mxfp8": Fraction(33, 4), "mxfp6": Fraction(25, 4), "mxfp4": Fraction(17, 4),
    "nvfp4": Fraction(9, 2) + TINY, "nvfp6": Fraction(13, 2) + TINY,
}


def test_every_format_is_listed_here():
    assert set(BITS_PER_VALUE) == set(FORMATS)


@pytest.mark.parametrize("name", sorted(BITS_PER_VALUE))
def test_bits_per_value_measured_on_the_pytree(name):
    fmt = get_state_format(name)
    t = jax.eval_shape(fmt.quantize, jax.ShapeDtypeStruct((2, 3, 128, 128), jnp.float32))
    assert t.shape == (2, 3, 128, 128)
    assert Fraction(8 * tree_bytes(t), 2 * 3 * 128 * 128) == BITS_PER_VALUE[name]


@pytest.mark.parametrize("name", sorted(BITS_PER_VALUE))
def test_zeros_extremes_and_scale_invariance(name):
    fmt = get_state_format(name)
    q = jax.jit(lambda a: fmt.dequantize(fmt.quantize(a)))
    np.testing.assert_array_equal(np.asarray(q(jnp.zeros((2, 32, 8)))), 0.0)
    wide = _wide_state(11, 32, 8, 16)
    y = np.asarray(q(jnp.asarray(wide)))
    assert np.all(np.isfinite(y)) and np.all(y[:, -1] == 0) and np.all(y[:16, 0] == 0)
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(5), (2, 32, 8)), np.float32)
    base = np.asarray(q(jnp.asarray(x)))
    for k in (-100, 100):       # ~1e-30 and ~1e30: the same rounding, only the scales move
        np.testing.assert_array_equal(np.asarray(q(jnp.asarray(x * np.float32(2.0 ** k)))), base * np.float32(2.0 ** k))
    for s in (1e-30, 1e30):
        z = np.asarray(q(jnp.asarray(x * np.float32(s))))
        assert np.all(np.isfinite(z)) and rel(z, x * np.float32(s)) < 2 * rel(base, x) + 1e-6


# Output error of 32 decode steps against fp32 at dk=32, dv=16, about three times the measured value
# (GDN / KDA: int8-tensor 0.028/0.030, int8-channel 0.0083/0.0089, fp8-tensor 0.033/0.037, fp8-channel
# 0.030/0.036, int16 4.8e-5/4.5e-5, mxfp8 0.057/0.051, mxfp6 0.042/0.051, mxfp4 0.21/0.21, nvfp4 0.12/0.12,
# nvfp6 0.039/0.039).
DECODE_BOUND = {"int8-tensor": 0.09, "int8-channel": 0.027, "fp8-tensor": 0.11, "fp8-channel": 0.11, "int16": 1.5e-4,
                "mxfp8": 0.17, "mxfp6": 0.15, "mxfp4": 0.63, "nvfp4": 0.36, "nvfp6": 0.12}


@pytest.fixture(scope="module")
def gdn_kda_inputs():
    """GDN and KDA inputs ``[B, T, H, ...]`` (dk=32, dv=16) with their fp32 outputs, built once."""
    xs = [random_inputs(21, batch=2, tokens=32, heads=2, dk=32, dv=16, kda=kda) for kda in (False, True)]
    return xs, [recurrent_scan(None, **x)[0] for x in xs]


@pytest.mark.parametrize("name", sorted(DECODE_BOUND))
def test_every_format_decodes_gdn_and_kda_under_jit_and_vmap(name, gdn_kda_inputs):
    m = make_method(name)

    def run(inputs):          # one sequence [T, H, ...] -> o [T, H, dv]
        o, _ = m.decode(m.init(1, 2, 32, 16), **{k: v[None] for k, v in inputs.items()})
        return o[0]

    xs, refs = gdn_kda_inputs
    outs = jax.jit(lambda a, b: (jax.vmap(run)(a), jax.vmap(run)(b)))(*xs)     # one compilation for both
    for kind, o, o_ref in zip(("GDN", "KDA"), outs, refs):
        assert np.all(np.isfinite(np.asarray(o)))
        assert rel(o, o_ref) < DECODE_BOUND[name], (kind, rel(o, o_ref))


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="dk"):
        MXFormat("e2m3").quantize(jnp.ones((2, 30, 4)))          # 6-bit packing needs dk % 4 == 0
    with pytest.raises(ValueError, match="dk"):
        NVFPFormat("e2m1").quantize(jnp.ones((2, 31, 4)))
    with pytest.raises(ValueError, match="element"):
        MXFormat("e5m2")
    with pytest.raises(ValueError, match="sub-byte"):
        NVFPFormat("e4m3")
    with pytest.raises(TypeError, match="floating"):
        MXFormat("e2m1").quantize(jnp.ones((2, 32, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"\[\.\.\., dk, dv\]"):
        get_state_format("int16").quantize(jnp.ones((4,)))
