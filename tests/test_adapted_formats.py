"""KV-cache methods adapted to a recurrent state: QuaRot, KVQuant and TurboQuant formats."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.special import ndtri

from leapquant_jax import make_method
from leapquant_jax.adapted_formats import (FORMATS, KVQuantFormat, QuaRotFormat, TurboQuantFormat, _turbo_constants,
                                           hadamard_transform, lloyd_max_levels, normal_float_levels, pack_bits,
                                           qjl_estimate, qjl_sketch, sparse_count, unpack_bits)
from leapquant_jax.formats import get_state_format
from leapquant_jax.quantizers import IntFormat, tree_bytes, unpack_codes
from leapquant_jax.recurrence import recurrent_scan
from helpers import random_inputs, rel

# Its tests share compiled programs (the same shapes and configs): one xdist worker compiles
# them once (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("adapted_formats")

NAMES = ["quarot", "quarot-b6", "quarot-b4", "kvquant", "kvquant-b6", "kvquant-b4",
         "turboquant", "turboquant-b6", "turboquant-b4"]


def _sylvester(dk):
    h = np.ones((1, 1))
    while h.shape[0] < dk:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(dk)


@functools.partial(jax.jit, static_argnums=0)
def _quantize(fmt, x):
    return fmt.quantize(x)


@functools.partial(jax.jit, static_argnums=0)
def _dequantize(fmt, t):
    return fmt.dequantize(t)


def _round_trip(fmt, x):
    return np.asarray(_dequantize(fmt, _quantize(fmt, jnp.asarray(x))))


SHAPE = (4, 16, 16)       # one shape for every round trip, so each format compiles once


def _state(seed, shape, outlier_row=None):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if outlier_row is not None:
        x[..., outlier_row, :] *= 40.0
    return x


def test_names_are_registered():
    assert sorted(FORMATS) == sorted(NAMES)
    for n in NAMES:
        assert get_state_format(n).name == n


@pytest.mark.parametrize("dk", [2, 8, 32])
def test_hadamard_transform_is_the_normalized_sylvester_matrix(dk):
    x = _state(0, (3, dk, 5))
    y = np.asarray(jax.jit(hadamard_transform)(jnp.asarray(x)))
    np.testing.assert_allclose(y, np.einsum("ij,bjv->biv", _sylvester(dk), x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.jit(hadamard_transform)(jnp.asarray(y))), x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_quarot_is_the_integer_format_of_the_rotated_state(bits):
    x = _state(1, SHAPE, outlier_row=3)
    fmt = QuaRotFormat(bits)
    t = _quantize(fmt, jnp.asarray(x))
    h = _sylvester(16)
    ref = IntFormat(bits).quantize(jnp.asarray(np.einsum("ij,bjv->biv", h, x), jnp.float32))
    np.testing.assert_array_equal(np.asarray(t.rotated.codes), np.asarray(ref.codes))
    np.testing.assert_allclose(np.asarray(t.rotated.scale), np.asarray(ref.scale), rtol=1e-5)
    back = np.einsum("ji,bjv->biv", h, np.asarray(IntFormat(bits).dequantize(ref), np.float64))
    np.testing.assert_allclose(np.asarray(_dequantize(fmt, t)), back, rtol=1e-4, atol=1e-4 * np.abs(x).max())


def test_quarot_spreads_an_outlier_key_row():
    # One key row 40x larger: per-column int4 scales follow the outlier and flush the other rows to 0;
    # after the rotation every row carries 1/sqrt(dk) of it.
    x = _state(2, (4, 32, 16), outlier_row=5)
    rest = np.ones(32, bool)
    rest[5] = False
    err = {}
    for fmt in (IntFormat(4), QuaRotFormat(4)):
        y = _round_trip(fmt, x)
        err[fmt.name] = rel(y[:, rest], x[:, rest])
    assert err["quarot-b4"] < 0.5 * err["int4"]


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_normal_float_codebook(bits):
    levels = normal_float_levels(bits)
    n = 2 ** bits - 1
    assert levels.dtype == np.float16 and levels.shape == (n,)
    assert np.all(np.diff(levels.astype(np.float32)) > 0)
    assert levels[n // 2] == 0 and levels[0] == -1 and levels[-1] == 1
    np.testing.assert_array_equal(levels, -levels[::-1])
    q = np.asarray(ndtri(jnp.asarray((np.arange(n) + 0.5) / n, jnp.float32)), np.float64)
    np.testing.assert_allclose(levels, (q / q[-1]).astype(np.float16), atol=2e-3)


def _kvquant_reference(x, bits):
    """NumPy dense-and-sparse reference: top-k exact (fp16 relative to the head max), rest per-row NF."""
    dk, dv = x.shape[-2:]
    k = sparse_count(dk, dv)
    levels = normal_float_levels(bits).astype(np.float32)
    out = np.empty_like(x)
    tops = []
    for idx in np.ndindex(x.shape[:-2]):
        flat = x[idx].reshape(-1).copy()
        top = np.argsort(-np.abs(flat), kind="stable")[:k]
        tops.append(set(top.tolist()))
        head = np.abs(flat[top]).max()
        sparse = (flat[top] / head).astype(np.float16).astype(np.float32) * head
        flat[top] = 0
        rest = flat.reshape(dk, dv)
        scale = np.abs(rest).max(axis=1, keepdims=True)
        codes = np.argmin(np.abs(rest[..., None] / scale[..., None] - levels), axis=-1)
        y = (levels[codes] * scale).reshape(-1)
        y[top] = sparse
        out[idx] = y.reshape(dk, dv)
    return out, tops


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_kvquant_matches_a_numpy_reference(bits):
    x = _state(3 + bits, SHAPE, outlier_row=7)
    x[..., 2] *= 10.0                                         # an outlier value column too
    fmt = KVQuantFormat(bits)
    t = _quantize(fmt, jnp.asarray(x))
    ref, tops = _kvquant_reference(x, bits)
    assert t.sparse_values.shape == (SHAPE[0], sparse_count(16, 16)) and t.sparse_index.dtype == jnp.uint16
    got_tops = [set(np.asarray(t.sparse_index)[i].tolist()) for i in range(SHAPE[0])]
    assert got_tops == tops
    np.testing.assert_allclose(np.asarray(_dequantize(fmt, t)), ref, rtol=1e-5, atol=1e-6)


# Max (1960), Table I: mean squared error of the optimal quantizer for N(0, 1) with 2, 4, 8, 16 levels.
MAX_1960_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


def _gaussian_mse(levels):
    x = np.linspace(-12, 12, 2_000_001)
    q = levels[np.searchsorted((levels[1:] + levels[:-1]) / 2, x)]
    w = np.exp(-x ** 2 / 2) / math.sqrt(2 * math.pi)
    return float(np.sum((x - q) ** 2 * w) * (x[1] - x[0]))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_lloyd_max_levels_reach_max_1960_distortion(bits):
    levels = lloyd_max_levels(bits)
    assert levels.shape == (2 ** bits,)
    assert _gaussian_mse(levels) == pytest.approx(MAX_1960_MSE[bits], rel=2e-3)
    if bits == 2:
        np.testing.assert_allclose(levels, [-1.510, -0.4528, 0.4528, 1.510], atol=1e-3)


@pytest.mark.parametrize("bits", [6, 8])
def test_lloyd_max_levels_are_centroids_of_their_cells(bits):
    levels = lloyd_max_levels(bits)
    x = np.linspace(-10, 10, 4_000_001)       # beyond +-10 the normal density is below 1e-22
    w = np.exp(-x ** 2 / 2)
    cell = np.searchsorted((levels[1:] + levels[:-1]) / 2, x)
    mean = np.bincount(cell, w * x, len(levels)) / np.bincount(cell, w, len(levels))
    spacing = np.diff(levels)
    # Each level within 1% of its cell's width of the cell's mean (the fixed point of Lloyd's iteration).
    assert np.all(np.abs(mean - levels)[1:-1] < 0.01 * np.minimum(spacing[1:], spacing[:-1]))


def test_pack_bits_round_trips_every_byte():
    every = jnp.arange(256, dtype=jnp.uint8).reshape(1, 256)
    unpacked = unpack_bits(every)
    assert unpacked.shape == (8, 256) and unpacked.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(pack_bits(unpacked)), np.asarray(every))
    b = np.random.default_rng(4).random((2, 16, 8)) < 0.5
    packed = pack_bits(jnp.asarray(b))
    assert packed.shape == (2, 2, 8) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(unpack_bits(packed)), b)


def test_qjl_estimate_is_unbiased():
    m, dk, dv, n = 16, 16, 4, 4000
    r = jnp.asarray(_state(5, (dk, dv)))
    q = jnp.asarray(_state(6, (dk,)))

    @jax.jit
    def moments(gs):          # mean and standard error of the estimate and of q^T estimate
        est = jax.vmap(lambda g: qjl_estimate(*qjl_sketch(r, g), g))(gs)
        ip = jnp.einsum("d,ndv->nv", q, est)
        return [(jnp.mean(a, axis=0), jnp.std(a, axis=0) / math.sqrt(n)) for a in (est, ip)]

    gs = np.random.default_rng(9).standard_normal((n, m, dk)).astype(np.float32)
    (mean, se), (ip_mean, ip_se) = moments(jnp.asarray(gs))
    assert np.all(np.abs(np.asarray(mean - r)) < 5 * np.asarray(se))
    assert np.all(np.abs(np.asarray(ip_mean - q @ r)) < 5 * np.asarray(ip_se))


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_turboquant_matches_a_numpy_reference(bits):
    x = _state(7 + bits, SHAPE, outlier_row=2)
    fmt = TurboQuantFormat(bits)
    t = _quantize(fmt, jnp.asarray(x))
    signs, g = _turbo_constants(0, 16)
    y = np.einsum("ij,bjv->biv", _sylvester(16), x.astype(np.float64) * signs[:, None])
    rms = np.sqrt(np.mean(y ** 2, axis=1, keepdims=True))
    z = y / rms
    levels = lloyd_max_levels(bits)
    codes = np.argmin(np.abs(z[..., None] - levels), axis=-1)
    r = z - levels[codes]
    np.testing.assert_allclose(np.asarray(t.scale), rms[:, 0], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(unpack_codes(t.codes, bits)), codes)
    np.testing.assert_array_equal(np.asarray(unpack_bits(t.sketch)), np.einsum("md,bdv->bmv", g, r) >= 0)
    np.testing.assert_allclose(np.asarray(t.residual_norm, np.float32), np.linalg.norm(r, axis=1), rtol=1e-3)
    z_hat = levels[codes] + math.sqrt(math.pi / 2) / 16 * np.linalg.norm(r, axis=1)[:, None] * np.einsum(
        "md,bmv->bdv", g, np.where(np.einsum("md,bdv->bmv", g, r) >= 0, 1.0, -1.0))
    back = signs[:, None] * np.einsum("ij,bjv->biv", _sylvester(16), z_hat * rms)
    np.testing.assert_allclose(np.asarray(_dequantize(fmt, t)), back, rtol=1e-3, atol=1e-3 * np.abs(x).max())
    if bits == 4:             # without the sketch's estimate: the levels alone, rotated back
        plain = signs[:, None] * np.einsum("ij,bjv->biv", _sylvester(16), levels[codes] * rms)
        np.testing.assert_allclose(np.asarray(_dequantize(TurboQuantFormat(bits, sketch=False), t)), plain,
                                   rtol=1e-4, atol=1e-4 * np.abs(x).max())


# b + per-layout overhead at dk = dv = 128 (each module docstring derives these).
OVERHEAD = {"quarot": 0.25, "kvquant": (512 + 164 * 4 + 4) * 8 / 16384, "turboquant": 1.375}


@pytest.mark.parametrize("name", NAMES)
def test_bits_per_value_at_128(name):
    fmt = get_state_format(name)
    t = jax.eval_shape(fmt.quantize, jax.ShapeDtypeStruct((128, 128), jnp.float32))
    bits = 8 if "-b" not in name else int(name[-1])
    assert tree_bytes(t) * 8 / (128 * 128) == bits + OVERHEAD[name.split("-")[0]]
    assert t.shape == (128, 128)


@pytest.mark.parametrize("name", NAMES)
def test_zero_tiny_and_huge_states(name):
    fmt = get_state_format(name)
    x = _state(8, SHAPE)
    x[0] = 0.0
    x[1] *= 1e30
    x[2] *= 1e-30
    x[3, :, 4] = 0.0
    y = _round_trip(fmt, x)
    assert y.dtype == np.float32 and np.all(np.isfinite(y))
    np.testing.assert_array_equal(y[0], 0.0)
    np.testing.assert_array_equal(y[3, :, 4], 0.0)
    # Every head scales with its own magnitude: the relative error does not depend on it.
    errs = [rel(y[i], x[i]) for i in (1, 2, 3)]
    assert max(errs) < 0.5 and max(errs) - min(errs) < 0.5 * max(errs)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="power of two"):
        QuaRotFormat(4).quantize(jnp.ones((12, 8)))
    with pytest.raises(ValueError, match="dk must be >= 8"):
        TurboQuantFormat(4).quantize(jnp.ones((4, 8)))
    with pytest.raises(ValueError, match="65536"):
        jax.eval_shape(KVQuantFormat(8).quantize, jax.ShapeDtypeStruct((512, 256), jnp.float32))
    with pytest.raises(ValueError, match="8, 6 or 4"):
        KVQuantFormat(5)
    with pytest.raises(TypeError, match="floating"):
        TurboQuantFormat(8).quantize(jnp.ones((16, 16), jnp.int32))


# About three times the error measured on these inputs (GDN, KDA): quarot 7e-3, 3e-2, 0.14;
# kvquant 1.5e-2, 3e-2, 0.11; turboquant 1.4e-2, 5e-2, 0.30 (the residual sketch is unbiased but
# adds variance that every re-quantization compounds).
BOUNDS = {"quarot": 0.025, "quarot-b6": 0.09, "quarot-b4": 0.4, "kvquant": 0.045, "kvquant-b6": 0.1,
          "kvquant-b4": 0.33, "turboquant": 0.045, "turboquant-b6": 0.16, "turboquant-b4": 0.9}


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_every_method_decodes_close_to_fp32_under_jit_and_vmap(kda):
    x = random_inputs(1, batch=2, tokens=40, heads=2, dk=16, dv=16, kda=kda)
    o_ref, _ = recurrent_scan(None, **x)
    methods = [make_method(n) for n in NAMES]

    def run(inputs):          # one sequence [T, H, ...] -> o [T, H, dv] per method
        batched = {k: v[None] for k, v in inputs.items()}
        return [m.decode(m.init(1, 2, 16, 16), **batched)[0][0] for m in methods]

    outs = jax.jit(jax.vmap(run))(x)
    for name, o in zip(NAMES, outs):
        assert np.all(np.isfinite(np.asarray(o))), name
        assert rel(o, o_ref) < BOUNDS[name], (name, rel(o, o_ref))
