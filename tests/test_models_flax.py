"""The Flax modules (``models/flax_modules.py``) against the functional forward passes.

Tiny configs are built straight from ``config.json``-style dicts (no transformers needed) and
their weights are random HF-named tensors run through each architecture's converter, so the
params tree is exactly what a converted checkpoint holds. Each architecture covers its
mixers and MLP kinds: Qwen3-Next (GDN + gated attention, dense and MoE MLPs, interleaved
projections), Qwen3.5 (VLM layout, attention biases, tied embeddings), Kimi-Linear (KDA + MLA
with low-rank queries, dense and MoE MLPs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import decode
from models.checkpoint import flatten_params, save_converted
from models.flax_modules import HybridLM, from_checkpoint, param_shapes
from models.registry import architecture_for_config

# The module's fixtures serve all its tests: one xdist worker runs them (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("models_flax")

LINEAR, FULL = "linear_attention", "full_attention"
QWEN_TEXT = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=3, layer_types=[LINEAR, FULL, LINEAR],
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, partial_rotary_factor=0.25,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, intermediate_size=48,
)
CONFIGS = {
    "qwen3_next": dict(QWEN_TEXT, model_type="qwen3_next", num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, shared_expert_intermediate_size=24, mlp_only_layers=[0]),
    "qwen3_5": dict(model_type="qwen3_5", tie_word_embeddings=True,
                    text_config=dict(QWEN_TEXT, model_type="qwen3_5_text", attention_bias=True)),
    "kimi_linear": dict(
        model_type="kimi_linear", vocab_size=64, hidden_size=32, num_hidden_layers=3, intermediate_size=48,
        moe_intermediate_size=16, num_attention_heads=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        routed_scaling_factor=2.446, first_k_dense_replace=1, mla_use_nope=True,
        linear_attn_config={"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                            "kda_layers": [1, 3], "full_attn_layers": [2]},
    ),
}
BATCH, PROMPT_LEN = 2, 8
LENGTHS = np.array([5, PROMPT_LEN], np.int32)
PROMPTS = ([5, 17, 3, 48, 41], [9, 2, 60, 33, 7, 21, 8, 19, 14, 56])
NEW_TOKENS = 5


class Tiny:
    """One architecture at tiny size: config, module, converted random params, inputs."""

    def __init__(self, name: str):
        self.config_json = CONFIGS[name]
        self.arch = architecture_for_config(self.config_json)
        self.config = self.arch.config_from_hf(self.config_json)
        rng = np.random.RandomState(len(name))
        tensors = {n: (0.1 * rng.standard_normal(s)).astype(np.float32)
                   for n, s in self.arch.param_specs(self.config).items()}
        self.params_np = self.arch.convert(tensors, self.config)
        self.params = jax.tree.map(jnp.asarray, self.params_np)
        self.module = HybridLM(arch=self.arch, config=self.config)
        self.method = decode.make_state_method("fp32")
        self.ids = jnp.asarray(rng.randint(0, self.config.vocab_size, (BATCH, PROMPT_LEN)), jnp.int32)
        self.lengths = jnp.asarray(LENGTHS)

        # compiled once per architecture and shared by the tests (eager runs take far longer)
        self.both = jax.jit(self._both)

    def cache(self, max_len: int = PROMPT_LEN + 2):
        return self.module.init_cache(batch=BATCH, max_len=max_len, state_method=self.method)

    def init(self, seed: int = 0):
        """Random params through ``module.init`` with a prefill pass (the documented call)."""
        return self.module.init(jax.random.PRNGKey(seed), self.ids, self.cache(), state_method=self.method,
                                mode="prefill", lengths=self.lengths)

    def _both(self, params):
        """Prefill, then one decode step with the second row inactive, through ``module.apply``
        and through ``arch.forward``: ``(flax outputs, functional outputs)``."""
        apply = lambda ids, cache, **kw: self.module.apply({"params": params}, ids, cache,  # noqa: E731
                                                           state_method=self.method, **kw)
        forward = lambda ids, cache, **kw: self.arch.forward(params, self.config, ids, cache,  # noqa: E731
                                                             method=self.method, **kw)
        outs = []
        for run in (apply, forward):
            logits, cache, _ = run(self.ids, self.cache(), mode="prefill", lengths=self.lengths)
            step, step_cache, _ = run(self.ids[:, :1], cache, mode="decode", active=jnp.array([True, False]))
            outs.append((logits, cache, step, step_cache))
        return tuple(outs)


@functools.lru_cache(maxsize=None)
def _tiny(name: str) -> Tiny:
    # one instance per architecture for the whole module, so its compiled functions are reused
    return Tiny(name)


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request):
    return _tiny(request.param)


def _signature(tree) -> dict:
    """Leaf path -> (shape, dtype); leaves may be arrays or ``jax.ShapeDtypeStruct``."""
    return {jax.tree_util.keystr(path): (tuple(x.shape), jnp.dtype(x.dtype))
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_init_gives_the_converted_tree_shapes_and_dtypes(tiny):
    # the full forward pass under init is traced only: the tree, shapes and dtypes are what count
    variables = jax.eval_shape(tiny.init)
    params = variables["params"]
    assert set(variables) == {"params"}
    assert jax.tree.structure(params) == jax.tree.structure(tiny.params_np)
    assert _signature(params) == _signature(tiny.params_np)
    shapes = param_shapes(tiny.arch, tiny.config)
    assert jax.tree.structure(shapes) == jax.tree.structure(tiny.params_np)
    # initialising without a forward pass gives the same tree
    assert _signature(tiny.module.init(jax.random.PRNGKey(0), method="params_tree")["params"]) == _signature(params)
    # bf16 params on request (what a released checkpoint stores)
    bf16 = HybridLM(arch=tiny.arch, config=tiny.config, param_dtype=jnp.bfloat16).init(
        jax.random.PRNGKey(0), method="params_tree")["params"]
    assert {x.dtype for x in jax.tree.leaves(bf16)} == {jnp.dtype(jnp.bfloat16)}


def test_init_follows_the_stated_initialisers(tiny):
    params = tiny.module.init(jax.random.PRNGKey(3), method="params_tree")["params"]
    flat = {n: np.asarray(x) for n, x in flatten_params(params).items()}
    qwen = tiny.config.model_type.startswith("qwen")
    np.testing.assert_array_equal(flat["final_norm"], 0.0 if qwen else 1.0)  # Qwen norms are (1 + w)
    for name, x in flat.items():
        key = name.rsplit(".", 1)[-1]
        if key == "dt_bias":
            np.testing.assert_array_equal(x, 1.0)
        elif key.endswith("bias"):
            np.testing.assert_array_equal(x, 0.0)
        elif key == "a_log":
            assert np.all((x >= 0.0) & (x <= np.log(16.0)))
        elif x.ndim >= 2:
            assert 0.01 < x.std() < 0.03, name
    if tiny.config.tie_word_embeddings:
        np.testing.assert_array_equal(flat["lm_head"], flat["embed"])
    else:
        assert not np.array_equal(flat["lm_head"], flat["embed"])


def test_init_with_a_forward_pass_runs():
    t = _tiny("qwen3_5")
    variables = jax.jit(t.init)()
    eager = t.module.init(jax.random.PRNGKey(0), method="params_tree")
    assert jax.tree.structure(variables) == jax.tree.structure(eager)
    for x, y in zip(jax.tree.leaves(variables), jax.tree.leaves(eager)):  # jit and eager sampling differ by ulps
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("source", ["converted", "init"])
def test_apply_equals_functional_forward(tiny, source):
    params = tiny.params if source == "converted" else tiny.module.init(
        jax.random.PRNGKey(1), method="params_tree")["params"]
    ours, ref = tiny.both(params)
    _assert_trees_equal(ours, ref)  # logits and caches after prefill and after a decode step


def test_greedy_decode_through_the_module_equals_functional(tiny):
    kw = dict(method=tiny.method, max_new_tokens=NEW_TOKENS)
    ours = decode.generate(tiny.module.as_architecture(), tiny.params, tiny.config, PROMPTS, **kw)
    ref = decode.generate(tiny.arch, tiny.params, tiny.config, PROMPTS, **kw)
    assert ours.tokens == ref.tokens
    assert [len(t) for t in ours.tokens] == [NEW_TOKENS] * len(PROMPTS)


def test_mismatched_params_are_named(tiny):
    params = jax.tree.map(lambda x: x, tiny.params)
    params["final_norm"] = params["final_norm"][:-1]
    with pytest.raises(ValueError, match=r"mis-shaped final_norm"):
        tiny.module.apply({"params": params}, tiny.ids, tiny.cache(), state_method=tiny.method, mode="prefill",
                          lengths=tiny.lengths)


def test_from_checkpoint_roundtrip(tmp_path):
    t = _tiny("kimi_linear")
    ckpt = save_converted(tmp_path / "ckpt", config_json=t.config_json, params=t.params_np)
    module, variables = from_checkpoint(ckpt)
    assert module == t.module  # same arch, config and float32 param dtype
    assert set(variables) == {"params"}
    _assert_trees_equal(variables["params"], t.params)
    ours, ref = t.both(variables["params"])
    _assert_trees_equal(ours, ref)
