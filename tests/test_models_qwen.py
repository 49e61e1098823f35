"""Qwen3-Next and Qwen3.5 (dense, MoE) against tiny random transformers models.

Each architecture is built once per module at tiny size (3 layers, the middle one full
attention; GVA with Hv = 2 Hk; dk != dv so a transposed state cannot pass; MoE with 4
experts where the architecture has them), saved as safetensors and converted by our
converter. Shapes are shared between tests so each jit program compiles once.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

# The module's fixtures serve all its tests: one xdist worker runs them (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("models_qwen")

sys.path.insert(0, str(Path(__file__).parent))
import model_helpers as mh  # noqa: E402

import jax  # noqa: E402

from leapquant_jax.recurrence import expand_heads  # noqa: E402
from models import decode  # noqa: E402
from models.base import layer_caches  # noqa: E402
from models.checkpoint import convert_checkpoint, load_model  # noqa: E402

torch, transformers = mh.require_reference()

from model_helpers import GREEDY_TOKENS, PROMPT_LEN, PROMPTS  # noqa: E402

COMMON = dict(
    vocab_size=100,
    hidden_size=64,
    num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    initializer_range=0.08,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=40)

ARCHS = {
    # layer 0 is dense (mlp_only_layers), the others MoE: both Qwen3-Next MLP kinds
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(MOE, intermediate_size=48, mlp_only_layers=[0])),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(intermediate_size=48)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", MOE),
}


class Tiny(mh.TinyModel):
    """A tiny reference model of one of ``ARCHS``, its HF directory and our converted checkpoint."""

    def __init__(self, name: str, root: Path):
        config_cls, model_cls, extra = ARCHS[name]
        self.name = name
        super().__init__(mh.build_tiny(getattr(transformers, config_cls), getattr(transformers, model_cls),
                                       seed=len(name), **COMMON, **extra), root, COMMON["vocab_size"])

    def score(self, method_name: str, **options):
        """The logits of ``mh.TinyModel.score``."""
        return super().score(method_name, **options)[0]


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny(request, tmp_path_factory):
    return Tiny(request.param, tmp_path_factory.mktemp(request.param))


def test_prefill_and_decode_logits_match_transformers(tiny):
    ours = tiny.score("fp32")
    assert ours.shape == tiny.ref_logits.shape
    assert ours.dtype == np.float32
    # measured ~3e-7 on all three architectures (fp32 both sides, different summation orders)
    assert mh.relative_logit_error(ours, tiny.ref_logits) <= 1e-4


def test_greedy_batch_of_uneven_prompts_matches_transformers(tiny):
    mh.check_greedy_matches_reference(tiny)


def test_leapquant_8bit_state_stays_close_to_fp32(tiny):
    fp32 = tiny.score("fp32")
    err = mh.relative_logit_error(tiny.score("leapquant", bits=8), fp32)
    print(f"{tiny.name}: leapquant 8-bit max relative logit error {err:.2e}")
    # measured 1.1e-4 (qwen3_next), 2.0e-3 (qwen3_5), 1.1e-4 (qwen3_5_moe) over 12 prefill + 32
    # decode tokens (two window flushes); bound with a 3x margin over the worst. On qwen3_5 the
    # 8-bit residual shows after the first flush; elsewhere the fp16 records of earlier tokens
    # dominate (each token's own output term is exact).
    assert err <= 6e-3, err


@dataclasses.dataclass(frozen=True)
class KeysPerValueHead:
    """A state method whose LeapQuant streams keep one key record per value head, the layout
    before value heads shared their key head's records: keys repeated to the value heads."""

    inner: object

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def for_layer(self, layer):
        return self

    def init(self, *args, key_heads=None, **kwargs):
        return self.inner.init(*args, **kwargs)

    def prefill(self, *, q, k, v, **kwargs):
        h = v.shape[2]
        return self.inner.prefill(q=expand_heads(q, h, axis=2), k=expand_heads(k, h, axis=2), v=v, **kwargs)


def test_leapquant_state_keeps_key_records_per_key_head_with_the_same_logits(next_tiny):
    # GVA (4 value heads, 2 key heads): the window buffer holds each key once per key head, and
    # the logits (12 prefill tokens as records, 32 decode steps, two flushes) are those of the
    # layout with a copy per value head, bit for bit
    cfg = next_tiny.config
    method = decode.make_state_method("leapquant", bits=8)
    cache = jax.eval_shape(lambda: next_tiny.arch.init_cache(cfg, batch=2, max_len=4, method=method))
    states = [c["state"] for c in layer_caches(cache, cfg) if "state" in c]
    assert len(states) == 2
    for st in states:
        assert st.buffer.k.shape == (2, cfg.linear_num_key_heads, 16, cfg.linear_key_head_dim)
        assert st.buffer.u.shape == (2, cfg.linear_num_value_heads, 16, cfg.linear_value_head_dim)
    shared = decode.score(next_tiny.arch, next_tiny.params, cfg, next_tiny.ids, method=method,
                          prefill_len=PROMPT_LEN)[0]
    per_value_head = decode.score(next_tiny.arch, next_tiny.params, cfg, next_tiny.ids,
                                  method=KeysPerValueHead(method), prefill_len=PROMPT_LEN)[0]
    np.testing.assert_array_equal(shared, per_value_head)
    assert mh.relative_logit_error(shared, next_tiny.score("fp32")) <= 6e-3


def test_stop_token_ends_a_row_and_inactive_rows_keep_their_state(tiny):
    method = decode.make_state_method("fp32")
    free = decode.generate(tiny.arch, tiny.params, tiny.config, PROMPTS, method=method, max_new_tokens=GREEDY_TOKENS)
    stop = free.tokens[0][3]
    gen = decode.generate(tiny.arch, tiny.params, tiny.config, PROMPTS, method=method, max_new_tokens=GREEDY_TOKENS,
                          stop_ids=[stop])
    first = free.tokens[0].index(stop)
    assert gen.tokens[0] == free.tokens[0][: first + 1]
    # the other row is unaffected by its neighbour finishing (up to its own stop token)
    other = free.tokens[1]
    cut = other.index(stop) + 1 if stop in other else len(other)
    assert gen.tokens[1] == other[:cut]


# ----------------------------------------------------------------------------- converter


@pytest.fixture(scope="module")
def next_tiny(tmp_path_factory):
    return Tiny("qwen3_next", tmp_path_factory.mktemp("next_conv"))


def test_converter_names_missing_unexpected_and_mis_shaped_tensors_and_writes_nothing(next_tiny, tmp_path):
    mh.check_converter_names_damage(next_tiny.hf_dir, tmp_path, missing="model.layers.2.linear_attn.A_log",
                                    unexpected="model.layers.0.linear_attn.surprise.weight", reshape={
                                        "model.layers.1.self_attn.q_proj.weight": lambda x: x[:-1],
                                        "model.layers.2.mlp.experts.1.down_proj.weight": lambda x: x.T.copy(),
                                    }, shown="(255, 64)")


def test_converter_refuses_to_overwrite(next_tiny, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        convert_checkpoint(next_tiny.hf_dir, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "x"


def test_bf16_sharded_checkpoint_converts_and_stays_bf16(next_tiny, tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    hf_dir = mh.save_tiny(copy.deepcopy(next_tiny.hf).to(torch.bfloat16), tmp_path / "hf", max_shard_size="40KB")
    assert (hf_dir / "model.safetensors.index.json").exists()
    arch, config, params, _ = load_model(convert_checkpoint(hf_dir, tmp_path / "ckpt"))
    assert params["layers"][0]["gdn"]["qkv"].dtype == ml_dtypes.bfloat16
    # reference: the same bf16-rounded weights run in fp32 by transformers
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    ref = mh.reference_logits(ref_model, next_tiny.ids)
    ours = decode.score(arch, decode.to_device(params), config, next_tiny.ids,
                        method=decode.make_state_method("fp32"), prefill_len=PROMPT_LEN)[0]
    assert mh.relative_logit_error(ours, ref) <= 1e-4


def test_qwen3_5_vlm_layout_converts_like_the_text_model(tmp_path):
    """Released Qwen3.5 files nest the decoder under model.language_model. and carry a vision
    tower and MTP head; the converter reads the text part and ignores the rest."""
    text = Tiny("qwen3_5", tmp_path / "text")

    def to_vlm(t):
        for name in [n for n in t if n.startswith("model.")]:
            t["model.language_model." + name[len("model."):]] = t.pop(name)
        t["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((6, 2), np.float32)
        t["mtp.fc.weight"] = np.zeros((2, 2), np.float32)

    def vlm_config(c):
        text_cfg = dict(c, model_type="qwen3_5_text")
        c.clear()
        c.update(model_type="qwen3_5", text_config=text_cfg, tie_word_embeddings=False)

    vlm_dir = mh.rewrite_checkpoint(text.hf_dir, tmp_path / "vlm", edit=to_vlm, config_edit=vlm_config)
    arch, config, params, _ = load_model(vlm_dir)
    assert config.model_type == "qwen3_5"
    ours = decode.score(arch, decode.to_device(params), config, text.ids, method=decode.make_state_method("fp32"),
                        prefill_len=PROMPT_LEN)[0]
    assert mh.relative_logit_error(ours, text.ref_logits) <= 1e-4


# ----------------------------------------------------------------------------- CLI


def test_cli_generate_and_score_with_traces(next_tiny, tmp_path, capsys):
    from leapquant_jax.traces import load_trace
    from leapquant_cli import main

    prompt = ",".join(map(str, PROMPTS[1]))
    # exact matmuls, as transformers computes in fp32 (generate's default is the bf16-operand "fast")
    assert main(["generate", str(next_tiny.ckpt), "--prompt-ids", prompt, "--max-new-tokens", str(GREEDY_TOKENS),
                 "--state", "fp32", "--compute", "exact", "--json", "--record-traces", str(tmp_path / "gen")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["generated_ids"] == [mh.reference_greedy(next_tiny.hf, PROMPTS[1], GREEDY_TOKENS)]
    trace = load_trace(tmp_path / "gen" / "layer00.npz")
    cfg = next_tiny.config
    assert trace.q.shape == (len(PROMPTS[1]) + GREEDY_TOKENS - 1, cfg.linear_num_value_heads, cfg.linear_key_head_dim)
    assert trace.v.shape[-1] == cfg.linear_value_head_dim and trace.g.ndim == 2
    np.testing.assert_allclose(np.linalg.norm(trace.k, axis=-1), 1.0, atol=1e-4)
    assert sorted(p.name for p in (tmp_path / "gen").iterdir()) == ["layer00.npz", "layer02.npz"]

    np.save(tmp_path / "ids.npy", next_tiny.ids)
    assert main(["score", str(next_tiny.hf_dir), "--ids-file", str(tmp_path / "ids.npy"), "--state", "fp32",
                 "--out", str(tmp_path / "logits.npy"), "--json", "--record-traces", str(tmp_path / "score")]) == 0
    capsys.readouterr()
    logits = np.load(tmp_path / "logits.npy")
    assert logits.dtype == np.float32 and logits.shape == next_tiny.ref_logits.shape
    assert mh.relative_logit_error(logits, next_tiny.ref_logits) <= 1e-4
    assert (tmp_path / "score" / "layer02_b1.npz").exists()
    assert load_trace(tmp_path / "score" / "layer02_b1.npz").num_tokens == next_tiny.ids.shape[1]


def test_temperature_sampling_is_reproducible_by_seed(next_tiny):
    from models.layers import Sampling

    def run(seed):
        return decode.generate(next_tiny.arch, next_tiny.params, next_tiny.config, PROMPTS,
                               method=decode.make_state_method("fp32"), max_new_tokens=8, seed=seed,
                               sampling=Sampling(temperature=1.0, top_p=0.9, top_k=10)).tokens

    first = run(3)
    assert first == run(3)
    assert first != run(4)
    assert all(len(t) == 8 and 0 <= min(t) and max(t) < COMMON["vocab_size"] for t in first)
