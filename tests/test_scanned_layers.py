"""Layers under ``lax.scan`` (``config.scan_layers``) and the ``fast`` compute setting, on tiny
random models of both architectures with dense and MoE MLPs: the scanned stack gives the logits
of the per-layer one, the plan finds the repeating blocks, the layouts convert both ways, and
bf16-operand matmuls stay close to the exact ones."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from leapquant_jax import make_method
from models import base
from models.checkpoint import architecture_for_config
from models.decode import generate, score, to_device
from models.layers import EXACT, FAST
from models.training.model import hf_config, init_params

from helpers import rel

VOCAB = 64
# One model per architecture for the module (its programs compile once): blocks of a linear- and
# a full-attention layer, repeated twice, after a dense head layer (Kimi) or before a tail layer
# (Qwen3.5), so that the scanned stack runs a head, the blocks and a tail between them.
LAYERS = {"gdn": ("linear_attention", "full_attention") * 2 + ("linear_attention",),
          "kda": ("linear_attention",) + ("full_attention", "linear_attention") * 2}
PLANS = {"gdn": ((), (4,)), "kda": ((0,), ())}  # (head, tail)
# The ids every score of the module takes: the programs of the exact fp32 score are shared.
IDS = np.random.default_rng(2).integers(1, VOCAB, (2, 14))
PREFILL = 5


@functools.lru_cache(maxsize=None)
def tiny(arch: str):
    """A tiny random MoE model of ``LAYERS[arch]``: ``(arch, config, params)``. Kimi keeps its
    first layer dense (``first_k_dense_replace``), so its plan has an unscanned head."""
    types = list(LAYERS[arch])
    layers = len(types)
    cj = hf_config(arch, vocab_size=VOCAB, eos_token_id=0, size="tiny")
    cj.update(num_hidden_layers=layers, layer_types=types)
    if arch == "gdn":
        cj.update(model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                  shared_expert_intermediate_size=16)
    if arch == "kda":
        kda = [i + 1 for i, t in enumerate(types) if t == "linear_attention"]
        cj["linear_attn_config"].update(kda_layers=kda, full_attn_layers=[i + 1 for i in range(layers) if i + 1 not in kda])
        cj["mlp_layer_types"] = ["dense"] + ["sparse"] * (layers - 1)
        cj.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, num_shared_experts=1,
                  routed_scaling_factor=2.0, n_group=1, topk_group=1)
    a = architecture_for_config(cj)
    return a, a.config_from_hf(cj), to_device(init_params(cj, seed=1))


@pytest.mark.parametrize("arch", ["gdn", "kda"])
@pytest.mark.parametrize("state", ["fp32", "leapquant"])
def test_scanned_layers_give_the_unrolled_logits(arch, state):
    a, cfg, params = tiny(arch)
    scanned = dataclasses.replace(cfg, scan_layers=True)
    plan = base.layer_plan(cfg)
    assert (plan.head, plan.tail) == PLANS[arch] and plan.repeats == 2 and plan.period == 2
    method = make_method(state, window=4) if state == "leapquant" else make_method(state)
    want = score(a, params, cfg, IDS, method=method, prefill_len=PREFILL)[0]
    got = score(a, base.scan_params(params, cfg), scanned, IDS, method=method, prefill_len=PREFILL)[0]
    if state == "fp32":
        assert rel(got, want) < 1e-5
        prompts = [list(map(int, IDS[0, :6])), list(map(int, IDS[1, :3]))]
        assert (generate(a, params, cfg, prompts, method=method, max_new_tokens=6).tokens
                == generate(a, base.scan_params(params, cfg), scanned, prompts, method=method,
                            max_new_tokens=6).tokens)
    else:
        # fp32 round-off of another fusion can move a code across a rounding boundary: the scanned
        # logits must be as close to the fp32 state's as the unrolled ones
        fp32 = score(a, params, cfg, IDS, method=make_method("fp32"), prefill_len=PREFILL)[0]
        assert rel(got, want) < 1e-3
        assert rel(got, fp32) < 1.1 * rel(want, fp32)


def test_layer_plan_finds_the_repeating_block():
    class Cfg:
        layer_types: tuple = ()
        mlp_types: tuple = ()

    c = Cfg()
    c.layer_types = tuple(("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(27))
    c.mlp_types = ("dense",) + ("moe",) * 26
    plan = base.layer_plan(c)
    # Kimi-Linear-48B's pattern: one dense layer, then blocks of four from layer 1 to 24, two left
    assert (plan.head, plan.start, plan.period, plan.repeats, plan.tail) == ((0,), 1, 4, 6, (25, 26))
    c.layer_types, c.mlp_types = ("linear_attention", "full_attention", "linear_attention"), ("dense",) * 3
    plan = base.layer_plan(c)
    assert plan.repeats == 0 and plan.head == (0, 1, 2)   # nothing repeats twice: all layers one by one


def test_stack_and_unstack_round_trip():
    a, cfg, params = tiny("kda")
    plan = base.layer_plan(cfg)
    stacked = base.stack_layers(params["layers"], plan)
    assert jax.tree.leaves(stacked["blocks"])[0].shape[0] == plan.repeats
    back = base.unstack_layers(stacked, plan)
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(params["layers"])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    cache = a.init_cache(dataclasses.replace(cfg, scan_layers=True), batch=3, max_len=8, method=make_method("fp32"))
    assert set(cache) == {"pos", "head", "blocks", "tail"}
    assert len(base.layer_caches(cache, cfg)) == cfg.num_layers


def test_mismatched_layouts_are_refused():
    a, cfg, params = tiny("gdn")
    ids = np.ones((1, 4), np.int64)
    with pytest.raises(ValueError, match="scan_params"):
        score(a, params, dataclasses.replace(cfg, scan_layers=True), ids, method=make_method("fp32"))
    with pytest.raises(ValueError, match="scanned layout"):
        score(a, base.scan_params(params, cfg), cfg, ids, method=make_method("fp32"))
    with pytest.raises(ValueError, match="compute must be one of"):
        score(a, params, dataclasses.replace(cfg, compute="fp8"), ids, method=make_method("fp32"))


@pytest.mark.parametrize("arch", ["gdn", "kda"])
def test_fast_compute_is_close_to_exact_and_keeps_kv_in_bf16(arch):
    a, cfg, params = tiny(arch)
    fast = dataclasses.replace(cfg, compute=FAST)
    exact = score(a, params, cfg, IDS, method=make_method("fp32"), prefill_len=PREFILL)[0]
    got = score(a, params, fast, IDS, method=make_method("fp32"), prefill_len=PREFILL)[0]
    # bf16 operands: an 8-bit mantissa per product, so about 1e-3 relative over a few layers
    assert 0 < rel(got, exact) < 2e-2
    cache = a.init_cache(fast, batch=1, max_len=4, method=make_method("fp32"))
    kv = [x.dtype for layer in cache["layers"] if "state" not in layer for x in jax.tree.leaves(layer)]
    assert kv and set(kv) == {np.dtype("bfloat16")}
    assert cfg.compute == EXACT


def test_fingerprint_ignores_how_the_model_runs():
    from models.calibrate import model_fingerprint

    _, cfg, params = tiny("gdn")
    fast = dataclasses.replace(cfg, compute=FAST, scan_layers=True)
    assert model_fingerprint(fast, params) == model_fingerprint(cfg, params)
    assert base.runtime_free_repr(cfg) == repr(cfg).replace(", compute='exact', scan_layers=False", "")
