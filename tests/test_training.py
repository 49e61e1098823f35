"""Training (``models.training``): data preparation, the optax loop, resuming, export, shipped checkpoints.

One tiny GDN run goes through the whole ``leapquant train`` command on a fake standard library
(module fixture); the other tests reuse its state and output, and run the loop with settings
equal to the command's, so the jitted programs compile once. The shipped checkpoints in
``models/checkpoints/*/`` are checked against their ``SHA256SUMS`` and against transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import model_helpers as mh  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from models.base import ConversionError  # noqa: E402
from models.checkpoint import load_model, read_safetensors, save_hf  # noqa: E402
from models.export import to_hf_tensors  # noqa: E402
from models.registry import architecture_for_config, get_architecture  # noqa: E402
from models.training import data as D  # noqa: E402
from models.training import loop, report  # noqa: E402
from leapquant_cli import main as train_main  # noqa: E402
from models.training.model import TrainingRecurrence, forward_logits, hf_config, init_params  # noqa: E402

# The module's fixtures serve all its tests: one xdist worker runs them (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("training")

CHECKPOINTS = Path(__file__).resolve().parent.parent / "models" / "checkpoints"
STEPS = 6
RECALL = D.RecallSpec(fraction=0.5, pairs=4, min_gap=16)
TINY = dict(size="tiny", seq_len=64, batch=4, peak_lr=1e-2, warmup_steps=2, recurrence="chunked", chunk=16,
            eval_every=3, eval_windows=4, final_eval_windows=4)
# the same settings as command-line flags (the command then builds an equal TrainConfig)
TINY_FLAGS = ["--size", "tiny", "--seq-len", "64", "--batch", "4", "--lr", "0.01", "--warmup", "2",
              "--recurrence", "chunked", "--chunk", "16", "--eval-every", "3", "--eval-windows", "4",
              "--final-eval-windows", "4", "--spectrum-windows", "4", "--recall-fraction", "0.5",
              "--recall-pairs", "4", "--recall-min-gap", "16", "--steps", str(STEPS), "--no-progress"]
WORDS = ("def", "return", "self", "import", "class", "for", "in", "if", "else:", "value", "items", "None", "True",
         "print(", ")", "len(", "range(", "=", "+", "x", "y", "name", "data", "#", "while", "yield")


def tiny_cfg(arch: str) -> loop.TrainConfig:
    return loop.TrainConfig(arch=arch, steps=STEPS, recall=RECALL, **TINY)


def fake_stdlib(root: Path, *, files: int = 40, seed: int = 0) -> Path:
    """A directory shaped like a standard library: packages, and the things the corpus skips."""
    rng = np.random.default_rng(seed)
    for i in range(files):
        sub = root / f"pkg{i % 3}" if i % 2 else root
        sub.mkdir(parents=True, exist_ok=True)
        lines = ["    " * int(rng.integers(0, 3)) + " ".join(rng.choice(WORDS, int(rng.integers(2, 9)))) for _ in range(80)]
        (sub / f"mod{i}.py").write_text("\n".join(lines) + "\n")
    for skipped in ("site-packages/pkg/x.py", "__pycache__/y.py", "config-3.11-x86_64-linux-gnu/python-config.py",
                    "_sysconfigdata__linux_x86_64-linux-gnu.py"):
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_text("x = 1\n")
    (root / "latin1.py").write_bytes(b"s = '\xe9t\xe9'\n")
    (root / "notes.txt").write_text("not python\n")
    return root


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    D.prepare_data(fake_stdlib(root / "stdlib"), root / "data", spec=D.DataSpec(vocab_size=300, held_out_fraction=0.2),
                   python_version="fake")
    return root / "data"


@pytest.fixture(scope="module")
def gdn_run(corpus_dir, tmp_path_factory) -> dict:
    """``leapquant train`` end to end on the tiny GDN model: checkpoint and training state."""
    root = tmp_path_factory.mktemp("gdn_run")
    out, state = root / "tiny-gdn", root / "state"
    assert train_main(["train", "--arch", "gdn", "--data", str(corpus_dir), "--out", str(out),
                       "--state-dir", str(state), *TINY_FLAGS]) == 0
    return {"out": out, "state": state, "run": json.loads((out / "training.json").read_text())}


def _model(arch_name: str, vocab: int = 300):
    config_json = hf_config(arch_name, vocab_size=vocab, eos_token_id=0, size="tiny")
    arch = architecture_for_config(config_json)
    return arch, arch.config_from_hf(config_json), config_json


@functools.partial(jax.jit, static_argnames=("arch", "config"))
def _forward(params, ids, *, arch, config):
    return forward_logits(arch, config, params, ids, TrainingRecurrence("chunked", 16))


def _logits(arch, config, params, ids) -> np.ndarray:
    # every leaf as fp32 (the model upcasts bf16 weights itself), so one program serves all calls
    params = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float32)), params)
    return np.asarray(_forward(params, jnp.asarray(ids, jnp.int32), arch=arch, config=config))


# ----------------------------------------------------------------------------- data


def test_data_preparation_is_deterministic_and_documented(tmp_path):
    src = fake_stdlib(tmp_path / "stdlib", files=12, seed=3)
    spec = D.DataSpec(vocab_size=290, held_out_fraction=0.25)
    first = D.prepare_data(src, tmp_path / "a", spec=spec, python_version="fake")
    D.prepare_data(src, tmp_path / "b", spec=spec, python_version="fake")
    for name in sorted(p.name for p in (tmp_path / "a").iterdir()):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    listed = D.list_sources(src)
    assert "latin1.py" in listed and not any(p.startswith(("site-packages", "__pycache__", "config-", "_sysconfigdata"))
                                             for p in listed)
    assert [e["path"] for e in first["excluded"]] == ["latin1.py"]
    used = [p for p in listed if p != "latin1.py"]
    assert first["files"] == len(used) == 12
    assert first["file_list_sha256"] == hashlib.sha256("\n".join(used).encode()).hexdigest()
    lines = (tmp_path / "a" / D.FILES_LIST).read_text().splitlines()
    assert first["contents_sha256"] == hashlib.sha256((tmp_path / "a" / D.FILES_LIST).read_bytes()).hexdigest()
    for line, path in zip(lines, used):
        split, digest, rel = line.split(" ", 2)
        assert rel == path and digest == hashlib.sha256((src / path).read_bytes()).hexdigest()
        assert split == ("heldout" if D.is_held_out(path, 0.25) else "train")
    assert {line.split()[0] for line in lines} == {"train", "heldout"}
    # the token stream is the training files in order, each closed by <|endoftext|>, and decodes back
    from tokenizers import Tokenizer

    corpus = D.load_corpus(tmp_path / "a")
    tok = Tokenizer.from_file(str(tmp_path / "a" / D.TOKENIZER))
    first_train = next(rel for line, rel in zip(lines, used) if line.startswith("train"))
    eos = int(np.argmax(corpus.train == corpus.special(D.EOS)))
    assert tok.decode(corpus.train[:eos].tolist()) == (src / first_train).read_text()
    assert corpus.train.dtype == np.uint16 and corpus.train.max() < first["vocab_size"] <= 290
    with pytest.raises(FileExistsError):
        D.prepare_data(src, tmp_path / "a", spec=spec)


def test_a_damaged_token_file_is_refused(corpus_dir, tmp_path):
    import shutil

    copy = Path(shutil.copytree(corpus_dir, tmp_path / "copy"))
    ids = np.load(copy / D.HELDOUT_TOKENS)
    ids[3] ^= 1
    np.save(copy / D.HELDOUT_TOKENS, ids)
    with pytest.raises(ValueError, match="heldout.npy has sha256"):
        D.load_corpus(copy)


def test_recall_rows_ask_for_every_pair_after_a_gap():
    stream = np.arange(5000, dtype=np.uint16) % 200 + 3
    spec = D.RecallSpec(fraction=1.0, pairs=5, min_gap=20)
    rng = np.random.default_rng(0)
    ids, loss, answer = D.recall_row(stream, rng, 60, spec, vocab_size=300, recall_id=1, query_id=2)
    pairs = dict(zip(ids[1:11:2].tolist(), ids[2:11:2].tolist()))
    assert ids[0] == 1 and len(pairs) == 5 and min(pairs) >= spec.first_id
    q0 = int(np.flatnonzero(ids == 2)[0])
    assert q0 == 60 - 11 and q0 - 11 >= spec.min_gap
    asked = np.flatnonzero(answer)  # target ids[t + 1] is the value of key ids[t]
    assert sorted(ids[asked].tolist()) == sorted(pairs)
    assert all(ids[t + 1] == pairs[ids[t]] for t in asked)
    # the loss counts the gap's text and the answers, never the unpredictable pairs or query keys
    assert loss[:11].sum() == 0 and loss[11:q0 - 1].all() and np.array_equal(loss[q0:], answer[q0:])


# ----------------------------------------------------------------------------- the loop


def test_learning_rate_warms_up_then_decays_to_its_floor():
    cfg = loop.TrainConfig(steps=100, peak_lr=1e-3, warmup_steps=10, final_lr_fraction=0.1)
    lr = np.array([float(loop.learning_rate(s, 100, cfg)) for s in range(101)])
    np.testing.assert_allclose(lr[:10], 1e-3 * np.arange(1, 11) / 10, rtol=1e-6)
    assert np.all(np.diff(lr[10:]) <= 1e-12) and lr[10] == pytest.approx(1e-3)
    assert lr[55] == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5), rel=1e-5) and lr[100] == pytest.approx(1e-4, rel=1e-5)
    with pytest.raises(ValueError, match="warmup_steps must exceed"):
        loop.TrainConfig(minutes=1.0, warmup_steps=5)


def test_only_tensors_without_an_hf_name_are_frozen_and_only_matrices_decay():
    from models.training.model import trainable_mask, weight_decay_mask

    params = init_params(ROUND_TRIP_CONFIGS["kda"], seed=0)
    frozen = [jax.tree_util.keystr(p) for p, t in jax.tree_util.tree_flatten_with_path(trainable_mask(params))[0] if not t]
    assert frozen == [f"['layers'][{i}]['kda']['g_b_bias']" for i in (0, 1, 2)]
    decayed = {jax.tree_util.keystr(p).rsplit("[", 1)[-1] for p, d in
               jax.tree_util.tree_flatten_with_path(weight_decay_mask(params))[0] if d}
    assert decayed == {f"'{k}']" for k in ("embed", "lm_head", "q", "k", "v", "b", "o", "f_a", "f_b", "g_a", "g_b",
                                           "kv_a", "kv_b", "gate", "up", "down")}


def test_train_steps_reduce_the_loss_on_a_repeated_batch(corpus_dir):
    corpus = D.load_corpus(corpus_dir)
    arch, config, config_json = _model("gdn", corpus.vocab_size)
    trainer = loop.Trainer(arch, config, tiny_cfg("gdn"))
    params = jax.tree.map(jnp.asarray, init_params(config_json, seed=0))
    opt_state = trainer.init_optimizer(params)
    batch = D.sample_batch(corpus.train, seed=5, step=0, batch=4, seq_len=64)
    losses = []
    for step in range(STEPS):
        params, opt_state, metrics = trainer.step(params, opt_state, batch["ids"], batch["mask"], np.int32(step),
                                                  np.int32(STEPS))
        losses.append(float(metrics["loss"]))
    # measured 5.70, 5.45, 5.09, 4.73, 4.43, 4.23 (ln 300 = 5.70 at the start)
    assert losses[0] == pytest.approx(np.log(corpus.vocab_size), abs=0.1)
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 1.0, losses


def test_resumed_run_continues_exactly(corpus_dir, gdn_run, tmp_path):
    corpus = D.load_corpus(corpus_dir)
    arch, config, config_json = _model("gdn", corpus.vocab_size)
    trainer = loop.Trainer(arch, config, tiny_cfg("gdn"))
    common = dict(state_dir=tmp_path / "state", start_time=0.0, meta_extra={}, progress=False, log=lambda m: None)
    _, first = loop.train(trainer, corpus, init_params(config_json, seed=0), stop_at_step=3, **common)
    assert first.step == 3 and first.stopped_by == "stop_at_step"
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [loop.LATEST, "ckpt-00000003"]
    # a different initialisation is ignored: the checkpoint wins
    params, resumed = loop.train(trainer, corpus, init_params(config_json, seed=99), **common)
    assert resumed.step == STEPS
    whole = gdn_run["run"]["history"]
    assert [e["step"] for e in resumed.history["train"]] == list(range(1, STEPS + 1))
    assert [e["loss"] for e in resumed.history["train"]] == [e["loss"] for e in whole["train"]]
    assert resumed.history["eval"][-1] == whole["eval"][-1]
    # settings that change the trajectory refuse to resume, naming the difference
    other = loop.Trainer(arch, config, dataclasses.replace(tiny_cfg("gdn"), peak_lr=2e-2))
    with pytest.raises(ValueError, match="peak_lr"):
        loop.train(other, corpus, init_params(config_json, seed=0), **common)


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import safetensors.numpy

    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "layers": ({"b": np.ones(2, np.float32)},)}
    opt = (np.int32(4), {"mu": np.zeros(3, np.float32)})
    loop.save_state(tmp_path, params=params, opt_state=opt, meta={"step": 1})

    def broken(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.numpy, "save_file", broken)
    with pytest.raises(KeyboardInterrupt):
        loop.save_state(tmp_path, params=params, opt_state=opt, meta={"step": 2})
    monkeypatch.undo()
    latest = loop.latest_state(tmp_path)
    assert latest.name == "ckpt-00000001" and sorted(p.name for p in tmp_path.iterdir()) == [loop.LATEST, latest.name]
    p, o, meta = loop.load_state(latest, params_template=params, opt_template=opt)
    np.testing.assert_array_equal(p["w"], params["w"])
    assert int(o[0]) == 4 and meta["step"] == 1
    with pytest.raises(ValueError, match=r"opt_state\[1\]\['mu'\]: expected \(4,\)"):
        loop.load_state(latest, params_template=params, opt_template=(np.int32(0), {"mu": np.zeros(4, np.float32)}))


# ----------------------------------------------------------------------------- the command's output


def test_train_command_writes_a_complete_checkpoint(gdn_run, corpus_dir):
    out, run = gdn_run["out"], gdn_run["run"]
    names = {p.name for p in out.iterdir()}
    assert names == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "TRAINING.md",
                     "training.json", "loss_curve.png", "decay_spectrum.png", "DATA_FILES.txt",
                     "heldout_snippet.json", report.SUMS_FILE}
    assert report.check_sha256sums(out) == []
    manifest = json.loads((corpus_dir / D.MANIFEST).read_text())
    assert (out / "DATA_FILES.txt").read_bytes() == (corpus_dir / D.FILES_LIST).read_bytes()
    text = (out / "TRAINING.md").read_text()
    assert text == report.render_training_md(run)
    for needle in (manifest["file_list_sha256"], manifest["contents_sha256"], "CPython fake",
                   f"{STEPS} of a {STEPS}-step schedule", f"{run['final']['heldout_loss']:.4f}",
                   "![loss curve](loss_curve.png)"):
        assert needle in text, needle
    tensors = read_safetensors([out / "model.safetensors"])
    for name, x in tensors.items():
        assert str(x.dtype) == ("float32" if name.endswith(("A_log", "dt_bias")) else "bfloat16"), name
    assert [e["step"] for e in run["history"]["eval"]] == [0, 3, 6]
    train_losses = [e["loss"] for e in run["history"]["train"]]
    assert len(train_losses) == STEPS and train_losses[-1] < train_losses[0]
    spectrum = run["spectrum"]
    assert spectrum["kind"] == "gdn" and [lay["layer"] for lay in spectrum["layers"]] == [0, 1, 2]
    for lay in spectrum["layers"]:
        assert len(lay["heads"]) == 2
        for h in lay["heads"]:
            assert 0.0 < h["p10"] <= h["p50"] <= h["p90"] < 1.0 and 0.0 < h["mean_alpha"] < 1.0
    assert run["progress"]["tokens_seen"] == STEPS * 4 * 64
    state = loop.latest_state(gdn_run["state"])
    assert state.name == f"ckpt-{STEPS:08d}"


def test_export_gives_the_trained_params_logits(corpus_dir, gdn_run, tmp_path):
    corpus = D.load_corpus(corpus_dir)
    arch, config, config_json = _model("gdn", corpus.vocab_size)
    template = init_params(config_json, seed=0)
    trained, _, _ = loop.load_state(loop.latest_state(gdn_run["state"]), params_template=template,
                                    opt_template=loop.make_optimizer(tiny_cfg("gdn"), template).init(template))
    ids = corpus.heldout[None, :48].astype(np.int32)
    want = _logits(arch, config, trained, ids)
    # an fp32 export reproduces the trained params exactly
    save_hf(tmp_path / "fp32", config_json=config_json, tensors=to_hf_tensors(config, trained))
    _, _, loaded, _ = load_model(tmp_path / "fp32")
    np.testing.assert_array_equal(_logits(arch, config, loaded, ids), want)
    # the shipped bf16 file equals the trained params rounded to bf16, the decay gates kept in fp32
    import ml_dtypes

    def rounded(path, x):
        key = jax.tree_util.keystr(path)
        return x if key.endswith(("['a_log']", "['dt_bias']")) else np.asarray(x).astype(ml_dtypes.bfloat16)

    _, _, shipped, _ = load_model(gdn_run["out"])
    np.testing.assert_array_equal(_logits(arch, config, shipped, ids),
                                  _logits(arch, config, jax.tree_util.tree_map_with_path(rounded, trained), ids))
    assert not np.array_equal(_logits(arch, config, shipped, ids), want)  # rounding did happen


ROUND_TRIP_CONFIGS = {
    "qwen3_next_moe": dict(model_type="qwen3_next", vocab_size=50, hidden_size=16, num_hidden_layers=3,
                           layer_types=["linear_attention", "full_attention", "linear_attention"],
                           num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=1,
                           linear_num_value_heads=2, linear_key_head_dim=4, linear_value_head_dim=6, num_experts=3,
                           num_experts_per_tok=2, moe_intermediate_size=5, shared_expert_intermediate_size=7,
                           intermediate_size=9, mlp_only_layers=[0], attention_bias=True),
    "qwen3_5_vlm": dict(model_type="qwen3_5", tie_word_embeddings=True,
                        text_config=dict(model_type="qwen3_5_text", vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=4,
                                         linear_value_head_dim=4, intermediate_size=9,
                                         layer_types=["linear_attention", "full_attention"])),
    "kimi_moe_q_lora": dict(model_type="kimi_linear", vocab_size=50, hidden_size=16, num_hidden_layers=3,
                            num_attention_heads=2, kv_lora_rank=6, q_lora_rank=5, qk_nope_head_dim=4,
                            qk_rope_head_dim=2, v_head_dim=3, intermediate_size=9, moe_intermediate_size=5,
                            num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, attention_bias=True,
                            first_k_dense_replace=1,
                            linear_attn_config={"num_heads": 2, "head_dim": 4, "short_conv_kernel_size": 3,
                                                "kda_layers": [1, 3], "full_attn_layers": [2]}),
    "gdn": hf_config("gdn", vocab_size=40, eos_token_id=0, size="tiny"),
    "kda": hf_config("kda", vocab_size=40, eos_token_id=0, size="tiny"),
}


@pytest.mark.parametrize("name", list(ROUND_TRIP_CONFIGS))
def test_export_inverts_the_converter(name):
    config_json = ROUND_TRIP_CONFIGS[name]
    arch = get_architecture(config_json["model_type"])
    config = arch.config_from_hf(config_json)
    rng = np.random.default_rng(len(name))
    hf = {n: rng.standard_normal(shape).astype(np.float32) for n, shape in arch.param_specs(config).items()}
    params = arch.convert(hf, config)
    back = to_hf_tensors(config, params)  # HF -> ours -> HF
    assert sorted(back) == sorted(hf)
    for n in hf:
        np.testing.assert_array_equal(back[n], hf[n], err_msg=n)
    again = arch.convert(back, config)  # ours -> HF -> ours
    assert jax.tree.all(jax.tree.map(np.array_equal, again, params))


def test_export_names_what_does_not_fit():
    config_json = ROUND_TRIP_CONFIGS["kda"]
    arch = get_architecture("kimi_linear")
    config = arch.config_from_hf(config_json)
    params = init_params(config_json, seed=0)
    params["layers"][0]["kda"]["f_b"] = params["layers"][0]["kda"]["f_b"][:-1]
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.self_attn\.f_b_proj\.weight: expected"):
        to_hf_tensors(config, params)
    params = init_params(config_json, seed=0)
    params["layers"][1]["kda"]["g_b_bias"] = np.ones_like(params["layers"][1]["kda"]["g_b_bias"])
    assert "model.layers.1.self_attn.g_b_proj.bias" in to_hf_tensors(config, params)  # kept, never dropped


@pytest.mark.parametrize("arch_name", ["gdn", "kda"])
def test_exported_model_loads_in_transformers_with_matching_logits(arch_name, corpus_dir, gdn_run, tmp_path):
    torch, transformers = mh.require_reference()
    from models.training.run_record import export_tensors

    if arch_name == "gdn":
        out = gdn_run["out"]
    else:  # untrained: the export path is what is checked here
        arch, config, config_json = _model("kda", D.load_corpus(corpus_dir).vocab_size)
        out = save_hf(tmp_path / "kda", config_json=config_json,
                      tensors=export_tensors(config, init_params(config_json, seed=1)))
    ids = np.asarray(json.loads((gdn_run["out"] / "heldout_snippet.json").read_text())["ids"][:48])[None]
    arch, config, params, _ = load_model(out)
    ours = _logits(arch, config, params, ids)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # measured 3.6e-7 (gdn) and 2.3e-6 (kda): fp32 on both sides, different summation orders
    assert mh.relative_logit_error(ours, mh.reference_logits(model.eval(), ids)) <= 1e-4


# ----------------------------------------------------------------------------- shipped checkpoints


SHIPPED = sorted(p.parent for p in CHECKPOINTS.glob("*/config.json") if not (p.parent / "task.json").exists())  # recall ones: test_tasks


@pytest.mark.parametrize("folder", SHIPPED or [pytest.param(None, marks=pytest.mark.skip("no shipped checkpoints"))],
                         ids=[p.name for p in SHIPPED] or ["none"])
def test_shipped_checkpoint_matches_its_fingerprints_and_transformers(folder):
    from models import decode

    assert report.check_sha256sums(folder) == []
    listed = {line.split("  ", 1)[1] for line in (folder / report.SUMS_FILE).read_text().splitlines()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "TRAINING.md", "heldout_snippet.json"} <= listed
    assert (folder / "model.safetensors").stat().st_size <= 16 * 10**6
    torch, transformers = mh.require_reference()
    ids = np.asarray(json.loads((folder / "heldout_snippet.json").read_text())["ids"][:96])[None]
    arch, config, params, _ = load_model(folder)
    ours = decode.score(arch, decode.to_device(params), config, ids, method=decode.make_state_method("fp32"),
                        prefill_len=64)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert mh.relative_logit_error(ours, mh.reference_logits(model, ids)) <= 1e-4
