"""The small shared model pieces (``models/layers.py``), the param-tree round trip, prompt
padding and config parsing: pure JAX/numpy, no reference framework needed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import layers as L
from models.checkpoint import flatten_params, unflatten_params
from models.decode import pad_prompts
from models.qwen3_next import config_from_hf, split_interleaved_qkvz


def test_causal_conv1d_with_carried_tail_matches_full_convolution():
    rng = np.random.RandomState(0)
    x = rng.randn(2, 9, 5).astype(np.float32)
    w = rng.randn(5, 4).astype(np.float32)
    full, _ = L.causal_conv1d(jnp.asarray(x), w, tail=jnp.zeros((2, 3, 5)))
    # naive causal conv: y[t] = sum_j w[:, j] * x[t - 3 + j]
    padded = np.concatenate([np.zeros((2, 3, 5), np.float32), x], axis=1)
    naive = sum(padded[:, j : j + 9] * w[:, j] for j in range(4))
    np.testing.assert_allclose(full, naive, rtol=1e-5, atol=1e-6)
    # the same sequence fed as 6 + 3 tokens through the carried tail
    y1, tail = L.causal_conv1d(jnp.asarray(x[:, :6]), w, tail=jnp.zeros((2, 3, 5)))
    y2, _ = L.causal_conv1d(jnp.asarray(x[:, 6:]), w, tail=tail)
    np.testing.assert_allclose(np.concatenate([y1, y2], axis=1), naive, rtol=1e-5, atol=1e-6)


def test_causal_conv1d_tail_ignores_right_padding():
    rng = np.random.RandomState(1)
    x = rng.randn(2, 7, 3).astype(np.float32)
    w = rng.randn(3, 4).astype(np.float32)
    _, tail = L.causal_conv1d(jnp.asarray(x), w, tail=jnp.zeros((2, 3, 3)), lengths=jnp.array([2, 7]))
    np.testing.assert_array_equal(tail[0], np.concatenate([np.zeros((1, 3)), x[0, :2]]))
    np.testing.assert_array_equal(tail[1], x[1, 4:])


def test_partial_rope_rotates_only_the_leading_channels_and_keeps_norms():
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 5, 2, 16))
    inv = L.rope_inv_freq(head_dim=16, partial_rotary_factor=0.25, theta=10000.0)
    y = L.apply_partial_rope(x, jnp.arange(5)[None], inv)
    np.testing.assert_array_equal(y[..., 4:], x[..., 4:])
    np.testing.assert_array_equal(y[:, 0], x[:, 0])  # position 0 is the identity
    np.testing.assert_allclose(jnp.linalg.norm(y[..., :4], axis=-1), jnp.linalg.norm(x[..., :4], axis=-1), rtol=1e-5)


def test_l2norm_and_norm_conventions():
    x = jnp.array([[3.0, 4.0]])
    np.testing.assert_allclose(L.l2norm(x), [[0.6, 0.8]], rtol=1e-6)
    w = jnp.array([0.5, -0.5])
    rms = x / jnp.sqrt(12.5 + 1e-6)
    np.testing.assert_allclose(L.rms_norm_zero_centred(x, w, eps=1e-6), rms * (1 + w), rtol=1e-6)
    np.testing.assert_allclose(L.rms_norm(x, w, eps=1e-6), rms * w, rtol=1e-6)
    z = jnp.array([[1.0, -2.0]])
    np.testing.assert_allclose(L.gated_rms_norm_silu(x, z, w, eps=1e-6), w * rms * jax.nn.silu(z), rtol=1e-6)


def test_top_k_and_top_p_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    assert np.isfinite(L.filter_top_k(logits, 2)).tolist() == [[True, True, False, False]]
    assert np.isfinite(L.filter_top_p(logits, 0.7)).tolist() == [[True, True, False, False]]
    assert np.isfinite(L.filter_top_p(logits, 0.5)).tolist() == [[True, False, False, False]]
    keys = jax.random.split(jax.random.PRNGKey(0), 64)
    draws = jax.vmap(lambda k: L.sample_next(logits, k, L.Sampling(temperature=1.0, top_k=2)))(keys)
    assert set(np.asarray(draws).ravel().tolist()) <= {0, 1}
    assert L.sample_next(logits, keys[0], L.Sampling()).tolist() == [0]


def test_params_flatten_round_trip():
    tree = {"embed": np.ones((2, 3)), "layers": ({"a": np.zeros(1)}, {"b": {"c": np.ones(2)}})}
    flat = flatten_params(tree)
    assert sorted(flat) == ["embed", "layers.0.a", "layers.1.b.c"]
    back = unflatten_params(flat)
    assert isinstance(back["layers"], tuple) and back["layers"][1]["b"]["c"].shape == (2,)


def test_pad_prompts_right_pads_to_a_bucket():
    ids, lengths = pad_prompts([[1, 2, 3], [4]], bucket=4)
    assert ids.tolist() == [[1, 2, 3, 0], [4, 0, 0, 0]] and lengths.tolist() == [3, 1]
    with pytest.raises(ValueError):
        pad_prompts([[]])


QWEN3_NEXT_JSON = dict(
    model_type="qwen3_next", vocab_size=10, hidden_size=8, num_hidden_layers=8, num_attention_heads=2,
    num_key_value_heads=1, head_dim=4, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=2,
    linear_value_head_dim=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4,
    shared_expert_intermediate_size=4, intermediate_size=6, rope_theta=10000.0, partial_rotary_factor=0.25,
)


def test_config_defaults_follow_the_full_attention_interval():
    cfg = config_from_hf(QWEN3_NEXT_JSON)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [3, 7]
    assert cfg.mlp_types == ("moe",) * 8 and cfg.partial_rotary_factor == 0.25
    hash(cfg)


def test_split_interleaved_qkvz_matches_per_group_layout():
    cfg = config_from_hf(dict(QWEN3_NEXT_JSON, linear_num_key_heads=2, linear_num_value_heads=4))
    hk, dk, dv, r, d = 2, 2, 3, 2, 1
    # rows labelled by (group, part, index) so the reordering can be read off
    groups = []
    for g in range(hk):
        groups += [("q", g, i) for i in range(dk)] + [("k", g, i) for i in range(dk)]
        groups += [("v", g, i) for i in range(r * dv)] + [("z", g, i) for i in range(r * dv)]
    code = {lab: n for n, lab in enumerate(groups)}
    qkvz = np.array([[code[lab]] for lab in groups], np.float32)
    ba = np.array([[10 * g + j] for g in range(hk) for j in range(2 * r)], np.float32)
    out = split_interleaved_qkvz(qkvz, ba, cfg)
    want_qkv = [code[(p, g, i)] for p, n in (("q", dk), ("k", dk), ("v", r * dv)) for g in range(hk) for i in range(n)]
    assert out["qkv"][:, 0].tolist() == want_qkv
    assert out["z"][:, 0].tolist() == [code[("z", g, i)] for g in range(hk) for i in range(r * dv)]
    assert out["b"][:, 0].tolist() == [0, 1, 10, 11] and out["a"][:, 0].tolist() == [2, 3, 12, 13]
    assert d == out["qkv"].shape[1]


@pytest.mark.parametrize("t, block", [(10, 4), (8, 4), (3, 4)])
def test_causal_attention_in_query_blocks_equals_the_full_masked_softmax(t, block):
    """Blocked prefill attention (T a multiple of the block or not, or shorter) against one
    softmax over the whole causal [T, T] mask, with grouped KV heads."""
    rng = np.random.default_rng(t)
    q = jnp.asarray(rng.standard_normal((2, t, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, t, 2, 8)), jnp.float32) for _ in range(2))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (2, t, t))
    full = L.grouped_attention(q, k, v, mask=mask, scale=8**-0.5)
    blocked = L.causal_attention(q, k, v, scale=8**-0.5, block=block)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(full), rtol=1e-5, atol=1e-6)


def test_query_blocks_passes_each_block_its_positions():
    x = jnp.arange(2 * 7 * 3, dtype=jnp.float32).reshape(2, 7, 3)
    out = L.query_blocks(lambda xs, pos: xs[0] * 10 + pos[None, :, None], (x,), block=3)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x * 10 + jnp.arange(7)[None, :, None]))
