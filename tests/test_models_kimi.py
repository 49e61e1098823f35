"""Kimi-Linear (KDA + MLA, MoE) against tiny random transformers models and a NumPy KDA.

transformers' ``kimi_linear`` port runs on the CPU without fla or causal-conv1d: its
``chunk_kda``, ``fused_recurrent_kda``, ``causal_conv1d_fn`` and ``causal_conv1d_update`` are
decorated with ``use_kernel_func_from_hub_with_fallback`` and, when those packages are absent,
fall back to the pure-torch reference functions in ``modeling_kimi_linear.py`` (it logs
"falling back to its reference PyTorch implementation"). Full forwards of more than one token
take the chunked torch path, ``generate``'s decode steps the recurrent one; nothing is patched.

``save_pretrained`` writes the released naming (``q_conv1d``, ``f_a_proj``,
``block_sparse_moe.experts.{e}.w1``): transformers reverses its load-time renaming on save.
The port's own in-memory naming (packed ``conv1d``, ``forget_gate.*``, fused experts) is
produced here by saving ``model.state_dict()`` as is.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import numpy as np
import pytest

# The module's fixtures serve all its tests: one xdist worker runs them (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("models_kimi")

sys.path.insert(0, str(Path(__file__).parent))
import model_helpers as mh  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import leapquant_jax  # noqa: E402
from models import kimi_linear  # noqa: E402
from models.checkpoint import convert_hf, flatten_params  # noqa: E402
from models.kimi_layers import kda_log_decay, kda_lower_bound_log_decay, route_sigmoid_grouped  # noqa: E402
from models.moe import routed_experts  # noqa: E402

COMMON = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=24,
    num_local_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    routed_scaling_factor=2.446,
    mla_use_nope=True,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.08,
)
VARIANTS = {
    # KDA, MLA, KDA, KDA (released 1-indexed lists); layer 0 dense, the rest MoE
    "main": dict(
        num_hidden_layers=4,
        first_k_dense_replace=1,
        linear_attn_config={"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4,
                            "kda_layers": [1, 3, 4], "full_attn_layers": [2]},
    ),
    # MLA first, low-rank queries, grouped routing (2 groups, best 1), two dense layers
    "q_lora_grouped": dict(
        num_hidden_layers=3,
        first_k_dense_replace=2,
        q_lora_rank=24,
        n_group=2,
        topk_group=1,
        linear_attn_config={"num_heads": 3, "head_dim": 16, "short_conv_kernel_size": 3,
                            "kda_layers": [2, 3], "full_attn_layers": [1]},
    ),
}



def _build(variant: str, seed: int):
    torch, transformers = mh.require_reference()  # skips the tests that need a reference model
    model = mh.build_tiny(transformers.KimiLinearConfig, transformers.KimiLinearForCausalLM, seed=seed,
                          **COMMON, **VARIANTS[variant])
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer: perturb it so it steers selection
                buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))
    return model


class Tiny(mh.TinyModel):
    """A tiny reference model of one of ``VARIANTS``, its HF directory and our converted checkpoint."""

    def __init__(self, variant: str, root: Path):
        super().__init__(_build(variant, seed=len(variant)), root, COMMON["vocab_size"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return Tiny("main", tmp_path_factory.mktemp("kimi_main"))


# ----------------------------------------------------------------------------- against transformers


def test_config_reads_released_layer_lists_and_moe_names(tiny):
    cfg = tiny.config
    assert cfg.layer_types == ("linear_attention", "full_attention", "linear_attention", "linear_attention")
    assert cfg.mlp_types == ("dense", "moe", "moe", "moe")
    assert (cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_kernel) == (2, 32, 4)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.num_shared_experts) == (4, 2, 1)
    assert cfg.mla_use_nope and cfg.gate_lower_bound is None
    raw = json.loads((tiny.hf_dir / "config.json").read_text())
    raw["layer_types"] = ["full_attention"] * 4
    with pytest.raises(ValueError, match="disagrees"):
        kimi_linear.config_from_hf(raw)


def test_prefill_and_decode_logits_match_transformers(tiny):
    ours, traces = tiny.score("fp32", record=True)
    assert ours.shape == tiny.ref_logits.shape and ours.dtype == np.float32
    # measured 2.7e-6 (fp32 on both sides, different summation orders); breaking KDA (a per-head
    # instead of per-channel decay, channel-reversed decay, no KDA output) gives 0.9 to 1.4
    assert mh.relative_logit_error(ours, tiny.ref_logits) <= 1e-4
    # traces: the KDA layers' recurrence inputs, per-channel decay
    assert sorted(traces) == [0, 2, 3]
    t, h, d = tiny.ids.shape[1], tiny.config.kda_num_heads, tiny.config.kda_head_dim
    assert traces[0]["g"].shape == (2, t, h, d) and traces[0]["beta"].shape == (2, t, h)
    assert np.all(traces[0]["g"] < 0)
    np.testing.assert_allclose(np.linalg.norm(traces[2]["k"], axis=-1), 1.0, atol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(traces[2]["q"], axis=-1), d**-0.5, atol=1e-4)


def test_second_variant_q_lora_grouped_routing_matches_transformers(tmp_path):
    other = Tiny("q_lora_grouped", tmp_path)
    assert other.config.layer_types[0] == "full_attention" and other.config.q_lora_rank == 24
    assert other.config.num_expert_group == 2 and other.config.mlp_types == ("dense", "dense", "moe")
    ours, _ = other.score("fp32")
    assert mh.relative_logit_error(ours, other.ref_logits) <= 1e-4


def test_greedy_batch_of_uneven_prompts_matches_transformers(tiny):
    mh.check_greedy_matches_reference(tiny)


def test_leapquant_8bit_state_stays_close_to_fp32(tiny):
    fp32, traces = tiny.score("fp32", record=True)
    lq8, _ = tiny.score("leapquant", bits=8)
    err = mh.relative_logit_error(lq8, fp32)
    print(f"kimi_linear: leapquant 8-bit max relative logit error {err:.2e}")
    # measured 9.7e-3 (12 prefill + 32 decode tokens, window 16, two flushes). Already ~1e-3
    # inside the first window, where only the 2-byte records round; this random model amplifies
    # state error more than the Qwen tiny models do (per-step bf16 gives 1.5e-2, int8 4.8e-2 here)
    assert err <= 3e-2, err
    assert np.mean(lq8.argmax(-1) == fp32.argmax(-1)) >= 0.95  # measured 1.0

    # on the model's own KDA traces, the 8-bit windowed state beats per-step bf16 and int8:
    # measured final-state errors (max abs / max abs) ~1.8e-3 against ~8e-3 and ~2.5e-2
    for layer in (0, 2, 3):
        inputs = {n: jnp.asarray(x) for n, x in traces[layer].items()}
        ref = np.asarray(_final_state(leapquant_jax.make_method("fp32"), inputs))
        errs = {}
        for name, opts in (("leapquant", dict(bits=8)), ("bf16", {}), ("int8", {})):
            state = _final_state(leapquant_jax.make_method(name, **opts), inputs)
            errs[name] = np.abs(np.asarray(state) - ref).max() / np.abs(ref).max()
        assert errs["leapquant"] <= 5e-3 and errs["leapquant"] < errs["bf16"] < errs["int8"], (layer, errs)


@functools.partial(jax.jit, static_argnums=0)
def _final_state(method, inputs):
    """Token-serial decode of one layer's trace ``{q, k, v, g, beta}: [B, T, H, ...]`` from a
    zero state; the final state in fp32."""
    b, _, h, d = inputs["q"].shape
    _, state = method.decode(method.init(b, h, d, inputs["v"].shape[-1], per_channel_decay=True), **inputs)
    return method.to_dense(state)


# ----------------------------------------------------------------------------- converter


def _leaves(params) -> dict:
    return {k: np.asarray(v) for k, v in flatten_params(params).items()}


def _assert_same_params(a, b):
    fa, fb = _leaves(a), _leaves(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        assert fa[name].shape == fb[name].shape and np.array_equal(fa[name], fb[name]), name


def test_port_and_fla_namings_convert_to_identical_params(tiny, tmp_path):
    from safetensors.numpy import save_file

    _, _, released, _ = convert_hf(tiny.hf_dir)
    # the transformers port's module tree, saved as is
    port_dir = tmp_path / "port"
    port_dir.mkdir()
    state = {k: v.detach().numpy().copy() for k, v in tiny.hf.state_dict().items()}
    assert "model.layers.0.self_attn.conv1d.weight" in state
    assert "model.layers.2.self_attn.forget_gate.A_log" in state
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file(state, str(port_dir / "model.safetensors"))
    (port_dir / "config.json").write_text((tiny.hf_dir / "config.json").read_text())
    _, _, port, _ = convert_hf(port_dir)
    _assert_same_params(released, port)

    # fla's KimiDeltaAttention names (f_proj / g_proj Sequentials, A_log [H]) on the KDA layers
    def to_fla(t):
        for i in (0, 2, 3):
            sa = f"model.layers.{i}.self_attn."
            t[sa + "f_proj.0.weight"] = t.pop(sa + "f_a_proj.weight")
            t[sa + "f_proj.1.weight"] = t.pop(sa + "f_b_proj.weight")
            t[sa + "g_proj.0.weight"] = t.pop(sa + "g_a_proj.weight")
            t[sa + "g_proj.1.weight"] = t.pop(sa + "g_b_proj.weight")
            t[sa + "A_log"] = t[sa + "A_log"].reshape(-1)

    _, _, fla, _ = convert_hf(mh.rewrite_checkpoint(tiny.hf_dir, tmp_path / "fla", edit=to_fla))
    _assert_same_params(released, fla)


def test_param_specs_are_the_released_names(tiny):
    from models.checkpoint import read_safetensors, safetensors_files

    on_disk = {k: tuple(v.shape) for k, v in read_safetensors(safetensors_files(tiny.hf_dir)).items()}
    # save_pretrained puts the dense layer's MLP under block_sparse_moe. too (it reverses the
    # port's block_sparse_moe -> mlp renaming everywhere); released files use mlp. there
    on_disk = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): s for k, s in on_disk.items()}
    assert kimi_linear.param_specs(tiny.config) == on_disk


def test_converter_names_missing_unexpected_and_mis_shaped_tensors_and_writes_nothing(tiny, tmp_path):
    mh.check_converter_names_damage(tiny.hf_dir, tmp_path, missing="model.layers.2.self_attn.k_conv1d.weight",
                                    unexpected="model.layers.0.self_attn.surprise.weight", reshape={
                                        "model.layers.0.self_attn.dt_bias": lambda x: x[:-1],
                                        "model.layers.3.block_sparse_moe.experts.1.w2.weight": lambda x: x.T.copy(),
                                        "model.layers.1.self_attn.kv_b_proj.weight": lambda x: x[:, :-2],
                                    }, shown="(63,)")


# ----------------------------------------------------------------------------- KDA maths


def _l2norm(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _softplus(x):
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _silu(x):
    return x * _sigmoid(x)


def naive_kda_numpy(q, k, v, g, beta, scale):
    """fla ``naive_recurrent_kda`` with ``use_qk_l2norm_in_kernel``, in float64 NumPy, one
    sequence: q, k ``[T, H, K]``, v ``[T, H, V]``, g ``[T, H, K]`` (log-decay), beta ``[T, H]``.
    Decay the state per key channel, then the delta update, then read with the query."""
    q, k = _l2norm(q) * scale, _l2norm(k)
    t, h, dk = k.shape
    s = np.zeros((h, dk, v.shape[-1]))
    o = np.zeros(v.shape)
    for i in range(t):
        s = s * np.exp(g[i])[..., None]
        delta = v[i] - np.einsum("hk,hkv->hv", k[i], s)
        s = s + np.einsum("hk,hv->hkv", beta[i][:, None] * k[i], delta)
        o[i] = np.einsum("hk,hkv->hv", q[i], s)
    return o, s


def _kda_layer_numpy(p, x, cfg):
    """The whole KDA mixer in float64 NumPy for one sequence ``x [T, D]`` (FLA's layer maths)."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    t = x.shape[0]
    h, d, kc = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_kernel

    def conv(y, w):  # causal depthwise, y [T, C], w [C, Kc], zero history
        pad = np.concatenate([np.zeros((kc - 1, y.shape[1])), y])
        return np.stack([np.sum(pad[i:i + kc].T * w, axis=1) for i in range(t)])

    q, k, v = (_silu(conv(x @ p[n].T, p[f"{n}_conv"])).reshape(t, h, d) for n in ("q", "k", "v"))
    f = (x @ p["f_a"].T @ p["f_b"].T + p["dt_bias"]).reshape(t, h, d)
    g = -np.exp(p["a_log"])[:, None] * _softplus(f)
    beta = _sigmoid(x @ p["b"].T)
    o, _ = naive_kda_numpy(q, k, v, g, beta, d**-0.5)
    gate = (x @ p["g_a"].T @ p["g_b"].T + p["g_b_bias"]).reshape(t, h, d)
    y = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + cfg.rms_norm_eps) * p["o_norm"] * _sigmoid(gate)
    return y.reshape(t, h * d) @ p["o"].T


def test_kda_recurrence_matches_numpy_naive_fla():
    """fp32 state method (prefill with right padding, then steps) against FLA's naive KDA in
    float64, with awkward sizes (T = 37, dk = 20 != dv = 12, 3 heads)."""
    rng = np.random.default_rng(0)
    b, t, h, dk, dv = 2, 37, 3, 20, 12
    q, k = rng.normal(size=(2, b, t, h, dk))
    v = rng.normal(size=(b, t, h, dv))
    g = -np.exp(rng.normal(-2.0, 1.5, size=(b, t, h, dk)))  # per-channel log-decays, some near 0
    beta = _sigmoid(rng.normal(size=(b, t, h)))
    lengths = np.array([t, 23])
    ref = [naive_kda_numpy(q[i, :n], k[i, :n], v[i, :n], g[i, :n], beta[i, :n], dk**-0.5) for i, n in enumerate(lengths)]

    method = leapquant_jax.make_method("fp32")
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    qn = f32(_l2norm(q) * dk**-0.5)
    kn = f32(_l2norm(k))
    split = 30
    o, state = method.prefill(q=qn[:, :split], k=kn[:, :split], v=f32(v[:, :split]), g=f32(g[:, :split]),
                              beta=f32(beta[:, :split]), lengths=jnp.asarray(np.minimum(lengths, split), jnp.int32))
    outs = [np.asarray(o)]
    for i in range(split, t):
        active = jnp.asarray(i < lengths)
        o_i, state = method.step(state, q=qn[:, i], k=kn[:, i], v=f32(v[:, i]), g=f32(g[:, i]), beta=f32(beta[:, i]),
                                 active=active)
        outs.append(np.asarray(o_i)[:, None])
    o = np.concatenate(outs, axis=1)
    dense = np.asarray(method.to_dense(state))
    for i, n in enumerate(lengths):
        o_ref, s_ref = ref[i]
        np.testing.assert_allclose(o[i, :n], o_ref, rtol=0, atol=2e-5 * np.abs(o_ref).max())
        np.testing.assert_allclose(dense[i], s_ref, rtol=0, atol=2e-5 * np.abs(s_ref).max())


def test_kda_gates_match_the_fla_formulas():
    rng = np.random.default_rng(1)
    f = rng.normal(0, 8, size=(5, 3, 4))  # reaches the softplus threshold at 20
    a_log, dt_bias = rng.normal(size=3), rng.normal(size=(3, 4))
    x = f + dt_bias
    want = -np.exp(a_log)[:, None] * _softplus(x)
    got = kda_log_decay(jnp.asarray(f, jnp.float32), a_log=jnp.asarray(a_log), dt_bias=jnp.asarray(dt_bias))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    lb = kda_lower_bound_log_decay(jnp.asarray(f, jnp.float32), a_log=jnp.asarray(a_log), dt_bias=jnp.asarray(dt_bias),
                                   lower_bound=-5.0)
    np.testing.assert_allclose(np.asarray(lb), -5.0 * _sigmoid(np.exp(a_log)[:, None] * x), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(lb) >= -5.0) and np.all(np.asarray(lb) <= 0.0)  # (lb, 0) up to fp32 saturation


def test_kda_layer_prefill_then_decode_matches_numpy(tiny):
    """Our whole KDA mixer (projections, three short convs with tails carried from prefill into
    decode, gate, l2norm, recurrence, sigmoid-gated norm, o_proj) against float64 NumPy."""
    cfg, p = tiny.config, tiny.params["layers"][2]["kda"]
    rng = np.random.default_rng(2)
    t, split = 21, 13
    x = rng.normal(size=(1, t, cfg.hidden_size))
    method = leapquant_jax.make_method("fp32")
    cache = kimi_linear.init_cache(cfg, batch=1, max_len=t, method=method)["layers"][2]
    xj = jnp.asarray(x, jnp.float32)
    y, cache, _ = kimi_linear.kda_layer(p, xj[:, :split], cache, cfg, method=method, mode="prefill",
                                        lengths=jnp.asarray([split], jnp.int32), active=None)
    ys = [np.asarray(y)]
    for i in range(split, t):
        y, cache, _ = kimi_linear.kda_layer(p, xj[:, i:i + 1], cache, cfg, method=method, mode="decode",
                                            lengths=None, active=None)
        ys.append(np.asarray(y))
    ours = np.concatenate(ys, axis=1)[0]
    want = _kda_layer_numpy(p, x[0], cfg)
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-5 * np.abs(want).max())


# ----------------------------------------------------------------------------- MoE


@pytest.mark.parametrize("algorithm", ["ragged", "scan"])
def test_routed_expert_paths_agree(algorithm):
    rng = np.random.default_rng(3)
    n, d, i, e, k = 6, 8, 5, 4, 2
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    w1, w3 = (jnp.asarray(rng.normal(size=(e, d, i)), jnp.float32) for _ in range(2))
    w2 = jnp.asarray(rng.normal(size=(e, i, d)), jnp.float32)
    weights, idx = route_sigmoid_grouped(jnp.asarray(rng.normal(size=(n, e)), jnp.float32),
                                         correction_bias=jnp.zeros(e), top_k=k, num_groups=1, top_k_groups=1,
                                         normalize=True, scaling=2.0)
    np.testing.assert_allclose(np.asarray(jnp.sum(weights, -1)), 2.0, rtol=1e-6)
    ragged = routed_experts(x, weights, idx, w1=w1, w3=w3, w2=w2, algorithm=algorithm)  # n * k >= e
    gathered = sum(routed_experts(x[j:j + 1], weights[j:j + 1], idx[j:j + 1], w1=w1, w3=w3, w2=w2)
                   * (jnp.arange(n) == j)[:, None] for j in range(n))  # one token at a time: n * k < e
    xs, ws = np.asarray(x, np.float64), np.asarray(weights, np.float64)
    want = np.zeros((n, d))
    for r in range(n):
        for j, ex in enumerate(np.asarray(idx[r])):
            h = _silu(xs[r] @ np.asarray(w1[ex], np.float64)) * (xs[r] @ np.asarray(w3[ex], np.float64))
            want[r] += ws[r, j] * (h @ np.asarray(w2[ex], np.float64))
    np.testing.assert_allclose(np.asarray(ragged), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gathered), want, rtol=1e-5, atol=1e-5)


def test_correction_bias_selects_but_does_not_weight():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]], jnp.float32)
    bias = jnp.asarray([0.0, 0.0, 5.0, 0.0])
    weights, idx = route_sigmoid_grouped(logits, correction_bias=bias, top_k=2, num_groups=1, top_k_groups=1,
                                         normalize=False, scaling=1.0)
    assert sorted(np.asarray(idx)[0].tolist()) == [0, 2]
    s = _sigmoid(np.array([2.0, 1.0, 0.0, -1.0]))
    np.testing.assert_allclose(sorted(np.asarray(weights)[0]), sorted([s[0], s[2]]), rtol=1e-6)
