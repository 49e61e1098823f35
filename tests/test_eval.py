"""``leapquant eval`` on a shipped checkpoint: fp32 against itself, LeapQuant against fp32 within
measured bounds, the per-row numbers and the state-error curve against the means they explain,
the metrics and the replay against direct computations, and bad input refused by name."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from leapquant_jax.method_names import methods_for_labels
from models.evaluate import (EvalConfig, greedy_match, load_data, next_token_metrics, replay_states,
                             segment_rows)

from helpers import GDN_CHECKPOINT, heldout_ids_file, run_cli

# The module's fixtures serve all its tests: one xdist worker runs them (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("eval")

CKPT = GDN_CHECKPOINT
# Two rows (disjoint segments) of 64 tokens; the state every 24 decoded tokens (24, 48, then the end).
CONTEXT, GREEDY, BATCH, EVERY = 64, 8, 2, 24


@pytest.fixture(scope="module")
def heldout_npy(tmp_path_factory):
    return heldout_ids_file(tmp_path_factory.mktemp("eval"))


@pytest.fixture(scope="module")
def result(heldout_npy):
    code, out, err = run_cli(["eval", str(CKPT), "--data", str(heldout_npy), "--context", str(CONTEXT),
                           "--batch", str(BATCH), "--greedy-tokens", str(GREEDY), "--error-every", str(EVERY),
                           "--states", "fp32,leapquant", "--json"])
    assert code == 0, err
    return json.loads(out)


def test_eval_json_has_the_documented_fields(result):
    assert result["context"] == CONTEXT and result["error_every"] == EVERY
    assert result["tokens"] == BATCH * (CONTEXT - 1)
    assert list(result["methods"]) == ["fp32", "leapquant"]
    for entry in result["methods"].values():
        assert set(entry) == {"perplexity", "kl_to_fp32", "top1_agreement", "greedy_match_tokens", "state_rel_error",
                              "per_row", "state_error_curve"}
        # the six Gated DeltaNet layers of the checkpoint (layers 3 and 7 are attention)
        assert list(entry["state_rel_error"]) == ["0", "1", "2", "4", "5", "6"]
        assert set(entry["per_row"]) == {"perplexity", "kl_to_fp32", "top1_agreement", "greedy_match_tokens",
                                         "state_rel_error"}
        assert all(len(v) == BATCH for v in entry["per_row"].values())
        curve = entry["state_error_curve"]
        assert curve["tokens"] == [24, 48, 64]
        assert list(curve["per_layer"]) == list(entry["state_rel_error"])
        assert all(len(c) == 3 for c in list(curve["per_layer"].values()) + [curve["mean"]])


def test_eval_fp32_against_itself_is_exact(result):
    fp32 = result["methods"]["fp32"]
    assert fp32["kl_to_fp32"] == 0.0
    assert fp32["top1_agreement"] == 1.0
    assert fp32["greedy_match_tokens"] == GREEDY
    assert all(e == 0.0 for e in fp32["state_rel_error"].values())
    rows = fp32["per_row"]
    assert rows["kl_to_fp32"] == [0.0] * BATCH and rows["top1_agreement"] == [1.0] * BATCH
    assert rows["greedy_match_tokens"] == [GREEDY] * BATCH and rows["state_rel_error"] == [0.0] * BATCH
    assert all(x == 0.0 for c in fp32["state_error_curve"]["per_layer"].values() for x in c)
    # a trained model on held-out code: far better than uniform over 4,096 tokens, not perfect;
    # the two segments differ (so the per-row numbers are not one number repeated)
    assert all(5.0 < p < 1000.0 for p in rows["perplexity"]) and rows["perplexity"][0] != rows["perplexity"][1]


def test_eval_leapquant_within_measured_bounds(result):
    # Measured on this data (2 rows of 64 tokens, JAX 0.10.2, CPU): perplexity ratio 1 + 3.0e-5
    # (rows 1 + 7.0e-5 and 1 - 1.0e-5), KL 5.6e-7 (rows 5.4e-7, 5.8e-7), top-1 agreement 1.0,
    # state error per layer 1.0e-3 .. 3.7e-3 (greedy match 3 and 8 of 8: a near tie at the fourth
    # token of the first row, checked exactly in the next test). Bounds: about 3x the measured
    # errors, far below a per-step int8 state (KL 1.7e-4, state error 2.9e-2 at context 512).
    lq, fp32 = result["methods"]["leapquant"], result["methods"]["fp32"]
    assert abs(lq["perplexity"] / fp32["perplexity"] - 1) < 2e-4
    assert 0.0 < lq["kl_to_fp32"] < 1.5e-6
    assert lq["top1_agreement"] >= 125 / 126
    errors = list(lq["state_rel_error"].values())
    assert all(0.0 < e < 1e-2 for e in errors), errors
    for mine, ref in zip(lq["per_row"]["perplexity"], fp32["per_row"]["perplexity"]):
        assert abs(mine / ref - 1) < 2e-4
    assert all(0.0 < x < 1.5e-6 for x in lq["per_row"]["kl_to_fp32"])
    assert all(0.0 < x < 1e-2 for c in lq["state_error_curve"]["per_layer"].values() for x in c)


def test_per_row_numbers_aggregate_to_the_reported_means(result):
    for label, entry in result["methods"].items():
        rows = entry["per_row"]
        # every row scores CONTEXT - 1 positions: exp(mean NLL) = exp(mean over rows of log perplexity)
        np.testing.assert_allclose(np.exp(np.mean(np.log(rows["perplexity"]))), entry["perplexity"], rtol=1e-12)
        for key in ("kl_to_fp32", "top1_agreement", "greedy_match_tokens"):
            np.testing.assert_allclose(np.mean(rows[key]), entry[key], rtol=1e-12, atol=1e-300, err_msg=key)
        # equal counts of rows and heads in every layer: the mean of the per-row means is the mean over layers
        np.testing.assert_allclose(np.mean(rows["state_rel_error"]), np.mean(list(entry["state_rel_error"].values())),
                                   rtol=1e-6, atol=1e-300)


def test_state_error_curve_ends_at_the_final_state_error(result):
    for label, entry in result["methods"].items():
        curve = entry["state_error_curve"]
        for layer, err in entry["state_rel_error"].items():
            assert curve["per_layer"][layer][-1] == err, (label, layer)
        np.testing.assert_allclose(curve["mean"], np.mean(list(curve["per_layer"].values()), axis=0), rtol=1e-12)


def test_greedy_match_equals_the_methods_own_greedy_decoding(result, heldout_npy):
    # The eval scores each method teacher-forced on fp32's continuation; here each method
    # decodes greedily on its own, both rows at once, through the same decode path (programs
    # already compiled by the eval above: same shapes and methods).
    from models.checkpoint import load_model
    from models.decode import generate, score, to_device

    arch, config, params, _ = load_model(CKPT)
    params = to_device(params)
    rows = np.load(heldout_npy)[:BATCH * CONTEXT].astype(np.int32).reshape(BATCH, CONTEXT)
    methods = methods_for_labels(["leapquant"])
    reference = np.asarray(generate(arch, params, config, list(rows), method=methods["fp32"],
                                    max_new_tokens=GREEDY).tokens)
    for label, method in methods.items():
        ids = np.zeros((BATCH, CONTEXT + GREEDY), np.int32)
        ids[:, :CONTEXT] = rows
        own = []
        for i in range(GREEDY):
            logits, _ = score(arch, params, config, ids, method=method)
            own.append(logits[:, CONTEXT - 1 + i].argmax(-1))
            if CONTEXT + i < ids.shape[1]:
                ids[:, CONTEXT + i] = own[-1]
        same = np.stack(own, axis=1) == reference                                  # [B, G]
        matched = np.where(same.all(axis=1), GREEDY, np.argmin(same, axis=1))
        assert result["methods"][label]["per_row"]["greedy_match_tokens"] == matched.tolist(), (label, own, reference)
        assert result["methods"][label]["greedy_match_tokens"] == matched.mean()


def _random_traces(seed, batch=2, tokens=48, heads=2, dim=16):
    """Decode inputs ``[B, T, H, ...]`` like a model's: unit keys, queries scaled by dim^-1/2,
    decays near 1, beta in (0.1, 0.9)."""
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    shape = (batch, tokens, heads)
    return {"q": unit(rng.normal(size=shape + (dim,))).astype(np.float32) / np.float32(dim ** 0.5),
            "k": unit(rng.normal(size=shape + (dim,))).astype(np.float32),
            "v": rng.normal(size=shape + (dim,)).astype(np.float32),
            "g": -rng.uniform(1e-3, 0.1, size=shape).astype(np.float32),
            "beta": rng.uniform(0.1, 0.9, size=shape).astype(np.float32)}


def test_replay_snapshots_are_the_states_of_the_prefixes():
    # Snapshots every 12 decoded tokens. int8 per step after a 4-token prefill (44 decoded
    # tokens: blocks of 12, then 8 left over): the first snapshot is, to the bit, the final state
    # of a plain replay of that many tokens. LeapQuant over 48 tokens, whose windows of 16 the
    # blocks cut across: the final state is, to the bit, that of the plain replay (one scan over
    # every token), so taking snapshots leaves the final state error as it was.
    every = 12
    traces = {0: _random_traces(0), 2: _random_traces(1)}                         # two "layers"
    for label, prefill in (("int8", 4), ("leapquant", 0)):
        method = methods_for_labels([label])[label]
        final, snaps = replay_states(method, traces, prefill=prefill, every=every)
        tokens = EvalConfig(context=48, prefill=prefill, error_every=every).curve_tokens
        assert tokens == ([12, 24, 36, 44] if prefill else [12, 24, 36, 48])
        if label == "int8":
            cut = {layer: {n: a[:, :prefill + every] for n, a in tr.items()} for layer, tr in traces.items()}
            plain, none = replay_states(method, cut, prefill=prefill)
            assert none is None
        else:
            plain, _ = replay_states(method, traces, prefill=prefill)
        for layer in traces:
            assert snaps[layer].shape == (len(tokens),) + final[layer].shape
            np.testing.assert_array_equal(snaps[layer][-1], final[layer])
            np.testing.assert_array_equal(snaps[layer][0] if label == "int8" else final[layer], plain[layer])
            assert np.abs(snaps[layer][0] - final[layer]).max() > 1e-3     # the points differ


def test_next_token_metrics_match_a_direct_computation():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(2, 5, 11)).astype(np.float32)
    logits = (ref + 0.3 * rng.normal(size=ref.shape)).astype(np.float32)
    targets = rng.integers(0, 11, size=(2, 5))
    m = next_token_metrics(logits, ref, targets)
    logp, logq = jax.nn.log_softmax(logits.astype(np.float64)), jax.nn.log_softmax(ref.astype(np.float64))
    nll = -np.take_along_axis(np.asarray(logp), targets[..., None], axis=-1).mean()
    kl = np.mean(np.sum(np.exp(logq) * (logq - logp), axis=-1))
    agree = np.mean(logits.argmax(-1) == ref.argmax(-1))
    np.testing.assert_allclose([m["perplexity"], m["kl_to_fp32"], m["top1_agreement"]], [np.exp(nll), kl, agree],
                               rtol=1e-6)
    assert m["kl_to_fp32"] > 0 and next_token_metrics(ref, ref, targets)["kl_to_fp32"] == 0.0
    chunked = next_token_metrics(logits, ref, targets, chunk_elements=2 * 11 * 2)  # 2 positions at a time
    np.testing.assert_allclose([chunked[k] for k in m], list(m.values()), rtol=1e-12)
    rows = next_token_metrics(logits, ref, targets, chunk_elements=2 * 11 * 2, per_row=True)
    assert [rows[k] for k in m] == [chunked[k] for k in m]
    for b in range(2):
        one = next_token_metrics(logits[b:b + 1], ref[b:b + 1], targets[b:b + 1])
        np.testing.assert_allclose([rows["per_row"][k][b] for k in one], list(one.values()), rtol=1e-12)


def test_greedy_match_counts_the_leading_agreement():
    continuation = np.array([[3, 1, 2, 0], [1, 1, 1, 1], [2, 2, 2, 2]])
    logits = np.full((3, 4, 4), -1.0)
    for b, i, tok in [(0, 0, 3), (0, 1, 1), (0, 2, 0), (0, 3, 0), (1, 0, 0),
                      (2, 0, 2), (2, 1, 2), (2, 2, 2), (2, 3, 2)]:
        logits[b, i, tok] = 1.0
    logits[1, 1:, 1] = 1.0  # agreeing after the first miss does not count
    assert greedy_match(logits, continuation).tolist() == [2, 0, 4]


def test_segment_rows_and_methods_refuse_what_does_not_fit():
    stream = np.arange(100)
    rows = segment_rows(stream, EvalConfig(context=30, batch=3))
    assert rows.shape == (3, 30) and rows[1, 0] == 30 and rows[2, -1] == 89
    with pytest.raises(ValueError, match="--batch 4 x --context 30"):
        segment_rows(stream, EvalConfig(context=30, batch=4))
    with pytest.raises(ValueError, match="prefill"):
        EvalConfig(context=8, prefill=7)
    methods = methods_for_labels(["leapquant-b4", "int8-w+ct"], {"window": 8})
    assert list(methods) == ["fp32", "leapquant-b4", "int8-w+ct"]
    assert methods["leapquant-b4"].config.bits == 4 and methods["int8-w+ct"].config.window == 8
    assert not methods["int8-w+ct"].config.smoothing


@pytest.mark.parametrize("case, message", [
    ("missing", "--data {missing}: No such file"),
    ("empty_text", "--data {empty_text} is empty"),
    ("empty_npy", "--data {empty_npy} holds no tokens"),
    ("too_long", "--context 300 is longer than the data"),
    ("unknown", "--states: unknown method 'int9'"),
    ("contradiction", "--states leapquant-b6 fixes bits=6"),
    ("every_zero", "argument --error-every: must be >= 1, got 0"),
    ("every_too_long", "error_every (65) is more than the 64 tokens decoded per row"),
])
def test_eval_refuses_bad_input_by_name(tmp_path, heldout_npy, case, message):
    files = {"missing": tmp_path / "nope.txt", "empty_text": tmp_path / "empty.txt",
             "empty_npy": tmp_path / "empty.npy"}
    files["empty_text"].write_text("")
    np.save(files["empty_npy"], np.zeros((0,), np.int32))
    data = files.get(case, heldout_npy)
    argv = ["eval", str(CKPT), "--data", str(data), "--context", "300" if case == "too_long" else "64"]
    argv += {"unknown": ["--states", "fp32,int9"],
             "contradiction": ["--states", "leapquant-b6", "--bits", "4"],
             "every_zero": ["--error-every", "0"], "every_too_long": ["--error-every", "65"]}.get(case, [])
    code, out, err = run_cli(argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("leapquant: error: ")
    assert message.format(**files) in lines[0]


def test_load_data_reads_text_with_the_checkpoint_tokenizer_and_npy_rows(tmp_path):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(CKPT / "tokenizer.json"))
    text = "def add(a, b):\n    return a + b  # é\n"
    (tmp_path / "x.py").write_text(text, encoding="utf-8")
    assert load_data(tmp_path / "x.py", tokenizer).tolist() == tokenizer.encode(text).ids
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_data(tmp_path / "x.py", None)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="neither UTF-8 text nor a .npy file"):
        load_data(tmp_path / "latin1.txt", tokenizer)
    np.save(tmp_path / "rows.npy", np.arange(12).reshape(3, 4))
    assert load_data(tmp_path / "rows.npy", None).shape == (3, 4)
    np.save(tmp_path / "floats.npy", np.ones(4))
    with pytest.raises(ValueError, match="--data .*floats.npy must hold integer ids"):
        load_data(tmp_path / "floats.npy", None)


def test_eval_warns_when_the_data_is_in_the_checkpoints_training_split(tmp_path):
    """A ``--data`` file whose sha256 ``DATA_FILES.txt`` lists in the train split gets one warning
    line on stderr (its numbers are not held-out numbers); the run goes on. A held-out file gets none."""
    import hashlib

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in CKPT.iterdir():
        if f.name != "DATA_FILES.txt":
            (ckpt / f.name).symlink_to(f)
    text = "def add(a, b):\n    return a + b\n" * 4
    data = tmp_path / "decoder.py"
    data.write_text(text)
    digest = hashlib.sha256(text.encode()).hexdigest()
    argv = ["eval", str(ckpt), "--data", str(data), "--context", "4", "--greedy-tokens", "1", "--states", "fp32",
            "--json"]
    for split, warned in (("train", True), ("heldout", False)):
        (ckpt / "DATA_FILES.txt").write_text(f"heldout {'0' * 64} other.py\n{split} {digest} json/decoder.py\n")
        code, out, err = run_cli(argv)
        assert code == 0, err
        assert json.loads(out)["context"] == 4
        warnings = [line for line in err.splitlines() if line.startswith("leapquant: warning: ")]
        assert len(warnings) == warned, err
        if warned:
            assert f"--data {data} is training data" in warnings[0] and "train split as json/decoder.py" in warnings[0]
