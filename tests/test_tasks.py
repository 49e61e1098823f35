"""Long-memory tasks: the generators (``models.tasks``), the training rows (``task_data``), a tiny
pure Gated DeltaNet trained here that recalls in fp32, ``leapquant task`` end to end (on the tiny
model and on a shipped recall checkpoint, with measured bounds), ``leapquant eval --generate``,
and bad input refused by name with nothing written."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.evaluate import first_divergence, repetition_rate
from models.tasks import TaskSpec, TaskVocab, generate
from models.training.task_data import TaskMix, task_batch
from helpers import run_cli, run_cli_served

# The module's fixtures serve all its tests: one xdist worker runs them (pyproject: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("tasks")

CHECKPOINTS = Path(__file__).resolve().parents[1] / "models" / "checkpoints"
VOCAB = TaskVocab(size=48, keys=12, values=12)


# ----------------------------------------------------------------------------- generators


@pytest.mark.parametrize("filler", ["noise", "pairs"])
@pytest.mark.parametrize("gap,span", [(0, None), (6, None), (0, 8), (10, 12)])
def test_mqar_rows_ask_every_pair_once_with_its_value(filler, gap, span):
    spec = TaskSpec("mqar", length=41, pairs=4, gap=gap, span=span, filler=filler, vocab=VOCAB)
    b = generate(3, spec, 16)
    v = VOCAB
    assert b.ids.shape == b.targets.shape == b.mask.shape == (16, 41)
    assert b.ids.dtype == b.targets.dtype == np.int32 and b.mask.dtype == bool
    np.testing.assert_array_equal(b.targets[:, :-1], b.ids[:, 1:])
    for ids, targets, mask in zip(b.ids, b.targets, b.mask):
        keys, values = ids[0:8:2], ids[1:8:2]
        assert len(set(keys.tolist())) == 4 and np.all((keys >= v.key_start) & (keys < v.value_start))
        assert np.all((values >= v.value_start) & (values < v.filler_start))
        pos = np.flatnonzero(mask)
        assert len(pos) == 4 and sorted(ids[pos].tolist()) == sorted(keys.tolist())   # every key asked once
        answer = dict(zip(keys.tolist(), values.tolist()))
        assert [answer[k] for k in ids[pos]] == targets[pos].tolist()                   # the value it was given
        assert pos.min() >= 8 + gap and pos.max() + 1 < (41 if span is None else 8 + gap + span)
        others = np.ones(41, bool)
        others[:8] = False
        others[pos] = others[pos + 1] = False
        rest = ids[others]
        if filler == "noise":
            assert np.all(rest >= v.filler_start) and np.all(rest < v.size)
        else:  # distractor pairs on the even grid, never on a queried key
            grid = np.flatnonzero(others[:40])
            dkeys = ids[grid[grid % 2 == 0]]
            assert np.all((dkeys >= v.key_start) & (dkeys < v.value_start)) and not set(dkeys) & set(keys.tolist())
            assert np.all(ids[grid[grid % 2 == 1]] >= v.value_start)


@pytest.mark.parametrize("filler", ["noise", "pairs"])
@pytest.mark.parametrize("length", [20, 21])
def test_needle_rows_query_their_one_pair_at_the_end(filler, length):
    b = generate(5, TaskSpec("needle", length=length, pairs=1, filler=filler, vocab=VOCAB), 32)
    v = VOCAB
    for ids, targets, mask in zip(b.ids, b.targets, b.mask):
        (q,) = np.flatnonzero(mask)
        assert q >= length - 2
        key = ids[q]
        where = np.flatnonzero(ids == key)
        assert len(where) == 2 and where[1] == q                       # the pair and its query only
        assert ids[where[0] + 1] == targets[q] and v.value_start <= targets[q] < v.filler_start
    depth = generate(5, TaskSpec("needle", length=101, pairs=1, depth=0.5, vocab=v), 4)
    assert np.all(depth.ids[:, 49] == depth.ids[:, 100])               # round(0.5 x 98) = 49


def test_generators_are_deterministic_per_key():
    spec = TaskSpec("mqar", length=64, pairs=6, filler="pairs", vocab=VOCAB)
    a, b, c = generate(7, spec, 8), generate(jax.random.PRNGKey(7), spec, 8), generate(8, spec, 8)
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_array_equal(a.mask, b.mask)
    assert not np.array_equal(a.ids, c.ids)
    assert len({tuple(r) for r in a.ids.tolist()}) == 8                 # rows differ within a batch
    # the rows of these seeds, as the generator has always made them (the results cite seeds)
    assert digest(a) == "b01c640808833828"
    needle = generate(5, TaskSpec("needle", length=21, pairs=1, filler="pairs", vocab=VOCAB), 32)
    assert digest(needle) == "f1bf6b5f431df9aa"


def digest(rows) -> str:
    h = hashlib.sha256()
    for x in (rows.ids, rows.targets, rows.mask):
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("kwargs,match", [
    (dict(length=15, pairs=4), "smaller than the 16 tokens that 4 pairs need"),
    (dict(length=40, pairs=4, gap=30), "smaller than the 46 tokens"),
    (dict(length=40, pairs=4, span=6), "span must be an integer >= 2 x pairs"),
    (dict(length=40, pairs=13), "13 pairs need as many distinct keys"),
    (dict(length=40, pairs=12, filler="pairs"), "leave none of the vocabulary's 12 key ids"),
    (dict(length=40, pairs=4, gap=3, filler="pairs"), "gap must be even"),
    (dict(task="needle", length=2, pairs=1), "smaller than the 3 tokens a needle needs"),
    (dict(task="needle", length=20, pairs=2), "the needle task has one pair"),
    (dict(task="needle", length=20, pairs=1, depth=1.5), "depth must be in"),
    (dict(task="copy", length=20), "unknown task 'copy'"),
    (dict(length=20, pairs=2, filler="silence"), "unknown filler 'silence'"),
])
def test_impossible_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TaskSpec(**{"vocab": VOCAB, **kwargs})


def test_a_vocabulary_too_small_for_its_split_is_refused():
    with pytest.raises(ValueError, match="too small for the split"):
        TaskVocab(size=25, keys=12, values=12)


def test_task_mix_shares_the_batch_and_keeps_tokens_per_step_over_its_curriculum():
    mix = TaskMix(pairs=(2, 4), spreads=(0.0, 1.0), fillers=("noise", "pairs"), lengths=(16, 32, 32), vocab=VOCAB)
    mix.check(seq_len=32, batch=8)
    assert mix.rows(8) == [1] * 8 and mix.rows(10) == [2, 2] + [1] * 6
    assert [mix.stage(s, 30, seq_len=32, batch=8) for s in (0, 9, 10, 29)] == [(16, 16), (16, 16), (32, 8), (32, 8)]
    assert mix.stage(0, None, seq_len=32, batch=8) == (16, 16)       # before the schedule is fixed
    b = task_batch(mix, seed=1, step=3, batch=16, seq_len=16)
    assert b["ids"].shape == (16, 17) and b["mask"].shape == (16, 16)
    np.testing.assert_array_equal(b["mask"].sum(axis=1), [2] * 4 + [4] * 4 + [2] * 4 + [4] * 4)  # filler, pairs, spread
    np.testing.assert_array_equal(b["ids"], task_batch(mix, seed=1, step=3, batch=16, seq_len=16)["ids"])
    with pytest.raises(ValueError, match="must divide seq_len"):
        dataclasses.replace(mix, lengths=(24,)).check(seq_len=32, batch=8)
    with pytest.raises(ValueError, match="cannot hold"):
        mix.check(seq_len=32, batch=4)


def test_repetition_rate_and_first_divergence():
    assert repetition_rate(np.array([1, 2, 3, 4, 5, 6]), n=2) == 0.0
    assert repetition_rate(np.array([1, 2, 1, 2, 1, 2]), n=2) == pytest.approx(1 - 2 / 5)
    assert repetition_rate(np.array([7, 7, 7]), n=4) == 0.0
    ref = np.array([[1, 2, 3, 4], [1, 2, 3, 4]])
    np.testing.assert_array_equal(first_divergence(np.array([[1, 2, 3, 4], [1, 9, 3, 4]]), ref), [4, 1])


# ----------------------------------------------------------------------------- a tiny model that recalls

# size recall-tiny (one layer, one head of 16 x 16), 4 keys: recalls in about 100 steps (measured: accuracy 1.0 at
# step 150 on the training forward, 0.98 at step 100).
TINY_TASK = TaskMix(pairs=(2,), gap=8, vocab=TaskVocab(size=16, keys=4, values=4))
TINY_STEPS, TINY_LENGTH = 150, 24


@pytest.fixture(scope="module")
def tiny_recall(tmp_path_factory):
    """A pure Gated DeltaNet trained here on MQAR rows, exported as a task checkpoint."""
    from models.checkpoint import save_hf
    from models.registry import architecture_for_config
    from models.training import loop
    from models.training import model as M
    from models.training.run_record import export_tensors
    from models.training.task_cli import TASK_FILE, task_file

    cfg = loop.TrainConfig(arch="gdn", size="recall-tiny", seq_len=TINY_LENGTH, batch=64, peak_lr=1e-2,
                           warmup_steps=10, weight_decay=0.0, chunk=8, steps=TINY_STEPS, task=TINY_TASK,
                           recall=loop.D.RecallSpec(fraction=0.0))
    config_json = M.hf_config("gdn", vocab_size=TINY_TASK.vocab.size, eos_token_id=0, size="recall-tiny")
    arch = architecture_for_config(config_json)
    config = arch.config_from_hf(config_json)
    trainer = loop.Trainer(arch, config, cfg)
    params = jax.tree.map(jnp.asarray, M.init_params(config_json, seed=0))
    opt = trainer.init_optimizer(params)
    for step in range(TINY_STEPS):
        b = task_batch(TINY_TASK, seed=0, step=step, batch=cfg.batch, seq_len=cfg.seq_len)
        params, opt, _ = trainer.step(params, opt, b["ids"], b["mask"], np.int32(step), np.int32(TINY_STEPS))
    _, train_accuracy = loop.task_metrics(trainer, params, loop.heldout_task_rows(cfg))
    root = tmp_path_factory.mktemp("tiny-recall")
    ckpt = save_hf(root / "ckpt", config_json=config_json, tensors=export_tensors(config, jax.device_get(params)),
                   files={})
    (ckpt / TASK_FILE).write_text(json.dumps(task_file(TINY_TASK, TINY_LENGTH, "mqar")))
    bare = save_hf(root / "no-task-file", config_json=config_json,
                   tensors=export_tensors(config, jax.device_get(params)), files={})
    return {"ckpt": ckpt, "bare": bare, "train_accuracy": train_accuracy, "root": root}


def test_a_tiny_pure_gdn_trained_here_recalls_in_fp32(tiny_recall):
    assert tiny_recall["train_accuracy"] >= 0.9
    code, out, err = run_cli(["task", str(tiny_recall["ckpt"]), "--task", "mqar", "--lengths", "24", "48",
                           "--samples", "64", "--states", "fp32", "--json"])
    assert code == 0, err
    result = json.loads(out)
    # through the decode path (one step per token), at the training length and twice it:
    # measured 1.0 and 0.99; chance is 1/4
    assert result["results"]["fp32"]["24"] >= 0.9 and result["results"]["fp32"]["48"] >= 0.75
    assert result["spec"]["pairs"] == 2 and result["train_length"] == TINY_LENGTH


def test_task_command_gives_every_method_the_same_rows(tiny_recall, tmp_path):
    plot = tmp_path / "acc.png"
    code, out, err = run_cli(["task", str(tiny_recall["ckpt"]), "--task", "mqar", "--lengths", "24", "40",
                           "--samples", "8", "--states", "fp32,bf16,int8,leapquant,damp", "--window", "4",
                           "--json", "--plot", str(plot)])
    assert code == 0, err
    result = json.loads(out)
    assert result["task"] == "mqar" and list(result["results"]) == ["fp32", "bf16", "int8", "leapquant", "damp"]
    assert all(set(r) == {"24", "40"} for r in result["results"].values())
    assert result["damp_calibrated_here"] and plot.stat().st_size > 0
    # bf16 keeps this tiny state almost exactly: the same answers as fp32 on the same rows
    assert abs(result["results"]["bf16"]["24"] - result["results"]["fp32"]["24"]) <= 1 / 16


@pytest.mark.parametrize("argv,match", [
    (["--lengths", "7"], "--lengths 7 is smaller than the 8 tokens that 2 pairs need"),
    (["--lengths", "24", "--pairs", "3", "--gap", "20"], "smaller than the 32 tokens"),
    (["--lengths", "24", "--states", "fp32,int9"], "unknown method 'int9'"),
    (["--lengths", "24", "--samples", "0"], "--samples: must be >= 1"),
    (["--lengths", "24", "--task", "copy"], "invalid choice: 'copy'"),
    (["--lengths", "24", "--task", "needle", "--pairs", "2"], "the needle task has one pair"),
    (["--lengths", "24", "--depth", "0.5"], "--depth is a needle setting"),
])
def test_task_command_refuses_bad_input_by_name_and_writes_nothing(tiny_recall, tmp_path, argv, match):
    plot = tmp_path / "acc.png"
    args = ["task", str(tiny_recall["ckpt"])] + (["--task", "mqar"] if "--task" not in argv else []) + argv
    code, out, err = run_cli(args + ["--plot", str(plot)])
    assert code == 2 and out == "" and match in err and err.count("\n") == 1
    assert not plot.exists()


def test_task_command_refuses_a_vocabulary_that_cannot_hold_the_task(tiny_recall, tmp_path):
    # no task.json: the default split of 2,048 ids does not fit the 16-id vocabulary
    plot = tmp_path / "acc.png"
    code, out, err = run_cli(["task", str(tiny_recall["bare"]), "--task", "mqar", "--pairs", "2", "--lengths", "24",
                           "--plot", str(plot)])
    assert code == 2 and "vocabulary of 16 ids, which cannot hold the task's 2048" in err and not plot.exists()


def test_eval_generate_compares_free_running_generation_with_fp32(tiny_recall, tmp_path):
    data = tmp_path / "ids.npy"
    np.save(data, generate(1, TaskSpec("mqar", length=24, pairs=2, gap=8, vocab=TINY_TASK.vocab), 4).ids.reshape(-1))
    code, out, err = run_cli(["eval", str(tiny_recall["ckpt"]), "--data", str(data), "--context", "12", "--batch", "3",
                           "--generate", "10", "--states", "fp32,bf16,int8", "--json"])
    assert code == 0, err
    result = json.loads(out)
    assert result["generate"] == 10 and result["prompts"] == 3 and list(result["methods"]) == ["fp32", "bf16", "int8"]
    fp32 = result["methods"]["fp32"]
    assert fp32["first_divergence"]["per_prompt"] == [10, 10, 10] and fp32["kl_to_fp32"] == 0.0
    for m in result["methods"].values():
        assert 0 <= m["first_divergence"]["min"] <= m["first_divergence"]["median"] <= 10
        assert m["kl_to_fp32"] >= 0 and 0 <= m["repetition_rate"] <= 1 and len(m["kl_per_prompt"]) == 3
    # bf16 rounds this small state by about 1e-3: its next-token distributions stay close to fp32's
    assert result["methods"]["bf16"]["kl_to_fp32"] < 1e-2
    code, _, err = run_cli(["eval", str(tiny_recall["ckpt"]), "--data", str(data), "--context", "12", "--batch", "3",
                         "--generate", "10", "--error-every", "4"])
    assert code == 2 and "--generate prefills each prompt exactly" in err


# ----------------------------------------------------------------------------- shipped recall checkpoints

SHIPPED = sorted(p.parent for p in CHECKPOINTS.glob("*/task.json"))


@pytest.mark.parametrize("folder", SHIPPED or [pytest.param(None, marks=pytest.mark.skip("no recall checkpoints"))],
                         ids=[p.name for p in SHIPPED] or ["none"])
def test_shipped_recall_checkpoint_recalls_at_a_short_length(folder):
    """fp32 and LeapQuant-8 on 16 rows of 256 tokens with 16 pairs (distractor-pair filler), through
    the decode path. Measured on the CPU: fp32 1.0 and LeapQuant-8 1.0 on both checkpoints (256
    scored values each); the bounds leave two of them."""
    # a long run of few programs: compiled as served (``helpers.run_cli_served``)
    code, out, err = run_cli_served(["task", str(folder), "--task", "mqar", "--pairs", "16", "--lengths", "256",
                                     "--samples", "16", "--filler", "pairs", "--states", "fp32,leapquant", "--json"])
    assert code == 0, err
    acc = json.loads(out)["results"]
    assert acc["fp32"]["256"] >= 1 - 2 / 256 and abs(acc["leapquant"]["256"] - acc["fp32"]["256"]) <= 2 / 256


GDN = CHECKPOINTS / "recall-gdn"
needs_recall_gdn = pytest.mark.skipif(not (GDN / "task.json").is_file(), reason="no recall-gdn checkpoint")


@needs_recall_gdn
def test_task_calibrates_the_lifetime_methods_on_the_training_rows():
    """stepquant-4 and leapquant-alloc-4 without a calibration file: calibrated inside ``leapquant
    task`` on 16 training rows of 2,048 tokens, then 16 rows of 256 tokens with 16 pairs. Measured
    on the CPU: fp32, stepquant-4 and leapquant-alloc-4 all 1.0 (256 scored values); the bounds
    leave two of them for fp32 and ten for the 4-bit states."""
    # a long run of few programs: compiled as served (the suite's fast compile runs it 4x slower)
    code, out, err = run_cli_served(["task", str(GDN), "--task", "mqar", "--pairs", "16", "--lengths", "256",
                                     "--samples", "16", "--filler", "pairs", "--states", "stepquant-4,leapquant-alloc-4",
                                     "--json"])
    assert code == 0, err
    result = json.loads(out)
    assert result["stepquant_calibrated_here"] and not result["damp_calibrated_here"]
    assert result["calibration_rows"] == [16, result["train_length"]] == [16, 2048]
    acc = {label: row["256"] for label, row in result["results"].items()}
    assert list(acc) == ["fp32", "stepquant-4", "leapquant-alloc-4"] and all(0 <= a <= 1 for a in acc.values())
    assert acc["fp32"] >= 1 - 2 / 256
    assert acc["stepquant-4"] >= 1 - 10 / 256 and acc["leapquant-alloc-4"] >= 1 - 10 / 256


@needs_recall_gdn
def test_task_refuses_a_lifetime_calibration_of_another_model(tmp_path):
    plot = tmp_path / "acc.png"
    other = CHECKPOINTS / "stdlib-gdn" / "stepquant-calibration.json"
    code, out, err = run_cli(["task", str(GDN), "--task", "mqar", "--pairs", "16", "--lengths", "256", "--samples", "2",
                           "--states", "int8,stepquant-4", "--stepquant-calibration", str(other), "--plot", str(plot)])
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "lifetime calibration does not match this model" in err and "made on another model" in err
    assert not plot.exists()


def test_shipped_recall_checkpoints_match_their_fingerprints_and_transformers():
    from models import decode
    from models.checkpoint import load_model
    from models.training import report

    if not SHIPPED:
        pytest.skip("no recall checkpoints")
    import model_helpers as mh

    torch, transformers = mh.require_reference()
    for folder in SHIPPED:
        assert report.check_sha256sums(folder) == []
        assert (folder / "model.safetensors").stat().st_size <= 16 * 10**6
        ids = generate(0, TaskSpec("mqar", length=96, pairs=8, filler="pairs",
                                   vocab=TaskVocab(**json.loads((folder / "task.json").read_text())["mix"]["vocab"])),
                       1).ids
        arch, config, params, _ = load_model(folder)
        ours = decode.score(arch, decode.to_device(params), config, ids, method=decode.make_state_method("fp32"))[0]
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        with torch.no_grad():  # no cache: transformers' masks need an attention layer in the cache
            theirs = model(torch.as_tensor(ids, dtype=torch.long), use_cache=False).logits.float().numpy()
        assert mh.relative_logit_error(ours, theirs) <= 1e-4
