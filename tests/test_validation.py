"""Bad input is refused by name: CLI commands exit with code 2 and one line on stderr, write
nothing, and the API raises a ValueError naming the offending argument or tensor."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import rel  # noqa: E402

from leapquant_jax import make_method  # noqa: E402
from leapquant_jax.method_names import method_for_label, methods_for_labels  # noqa: E402
from leapquant_cli import main  # noqa: E402
from leapquant_jax.recurrence import recurrent_scan  # noqa: E402
from leapquant_jax.studies.memory import MemoryQuery, measure_memory  # noqa: E402
from leapquant_jax.traces import TraceError, load_trace, validate_trace  # noqa: E402

# The module's fixtures serve all its tests: one xdist worker runs them (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("validation")

VOCAB = 100


def refused(capsys, argv, *words, out=None):
    """Runs the CLI; requires exit code 2, one line ``leapquant: error: ...`` naming ``words``,
    nothing on stdout, and ``out`` (if given) not created. Returns the line."""
    assert main([str(a) for a in argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("leapquant: error: "), captured.err
    for word in words:
        assert word in lines[0], lines[0]
    assert captured.out == ""
    if out is not None:
        assert not Path(out).exists()
    return lines[0]


def inputs(seed, *, batch=1, tokens=24, heads=2, dk=8, dv=8, kda=False):
    """``[B, T, H, ...]`` float32 NumPy inputs: unit keys, decays in (0.9, 1), beta in (0.1, 0.9)
    (NumPy, so that the tests compile nothing they do not need)."""
    rng = np.random.default_rng(seed)

    def unit(shape):
        x = rng.normal(size=shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    x = dict(q=unit((batch, tokens, heads, dk)) * dk**-0.5, k=unit((batch, tokens, heads, dk)),
             v=rng.normal(size=(batch, tokens, heads, dv)),
             g=np.log(rng.uniform(0.9, 1.0, size=(batch, tokens, heads) + ((dk,) if kda else ()))),
             beta=rng.uniform(0.1, 0.9, size=(batch, tokens, heads)))
    return {k: v.astype(np.float32) for k, v in x.items()}


def write_trace(path, **replace):
    x = {k: v[0] for k, v in inputs(5).items()}
    x.update(replace)
    np.savez(path, **x)
    return x


@pytest.fixture
def trace(tmp_path):
    write_trace(tmp_path / "t.npz")
    return tmp_path / "t.npz"


# ----------------------------------------------------------------------------- replay


def test_replay_refuses_rank_above_dk(capsys, tmp_path, trace):
    out = tmp_path / "o.npz"
    refused(capsys, ["replay", trace, "--method", "leapquant", "--rank", 9, "--out", out], "rank 9", "min(dk, dv) = 8",
            out=out)


@pytest.mark.parametrize("flag, value", [("--rank", -1), ("--window", 0), ("--chunk", 0), ("--bits", 5)])
def test_replay_refuses_out_of_range_options(capsys, tmp_path, trace, flag, value):
    out = tmp_path / "o.npz"
    refused(capsys, ["replay", trace, "--method", "leapquant", flag, value, "--out", out], f"argument {flag}", out=out)


def test_replay_blames_a_short_v(capsys, tmp_path):
    x = write_trace(tmp_path / "t.npz")
    write_trace(tmp_path / "t.npz", v=x["v"][:-3])
    out = tmp_path / "o.npz"
    line = refused(capsys, ["replay", tmp_path / "t.npz", "--method", "fp32", "--out", out], "'v' has", "v (21, 2, 8)",
                   "q (24, 2, 8)", out=out)
    assert "'q'" not in line and "'k'" not in line


@pytest.mark.parametrize("content", [b"not a trace at all\n", b"PK\x03\x04truncated zip"])
def test_replay_refuses_a_file_that_is_not_an_npz(capsys, tmp_path, content):
    (tmp_path / "t.npz").write_bytes(content)
    out = tmp_path / "o.npz"
    line = refused(capsys, ["replay", tmp_path / "t.npz", "--method", "fp32", "--out", out], "t.npz", out=out)
    assert "pickle" not in line


def test_replay_refuses_an_npy_given_as_a_trace(capsys, tmp_path):
    np.save(tmp_path / "t.npy", np.ones((3, 4), np.float32))
    refused(capsys, ["replay", tmp_path / "t.npy", "--method", "fp32", "--out", tmp_path / "o.npz"],
            "is not a trace .npz file", out=tmp_path / "o.npz")


def test_replay_refuses_positive_log_decays_and_empty_traces(capsys, tmp_path):
    x = write_trace(tmp_path / "t.npz")
    write_trace(tmp_path / "t.npz", g=np.abs(x["g"]) + 0.1)
    refused(capsys, ["replay", tmp_path / "t.npz", "--method", "fp32", "--out", tmp_path / "o.npz"], "'g'", "<= 0")
    write_trace(tmp_path / "t.npz", **{k: v[:0] for k, v in x.items()})
    refused(capsys, ["replay", tmp_path / "t.npz", "--method", "fp32", "--out", tmp_path / "o.npz"], "no tokens")


@pytest.mark.parametrize("value", [5.0, -0.5])
def test_replay_refuses_beta_outside_the_delta_rules_range(capsys, tmp_path, value):
    x = write_trace(tmp_path / "t.npz")
    beta = x["beta"].copy()
    beta[3, 1] = value
    write_trace(tmp_path / "t.npz", beta=beta)
    out = tmp_path / "o.npz"
    refused(capsys, ["replay", tmp_path / "t.npz", "--method", "fp32", "--out", out], f"beta[3, 1] = {value:g}",
            "outside [0, 2]", out=out)


@pytest.mark.parametrize("argv", [
    ["replay", "t.npz", "--method", "leapquant", "--out", "o.npz"],
    ["generate", "ckpt", "--prompt-ids", "1", "--max-new-tokens", 1, "--state", "int8-w"],
    ["eval", "ckpt", "--data", "d.npy"],
    ["study", "errors"],
    ["memory"],
])
def test_a_window_beyond_the_bound_is_refused_by_name(capsys, tmp_path, argv):
    from leapquant_jax.method_names import MAX_WINDOW

    refused(capsys, argv + ["--window", 100000], "argument --window", f"[1, {MAX_WINDOW}], got 100000")
    with pytest.raises(ValueError, match=f"--window {MAX_WINDOW + 1}: a window holds 1 to {MAX_WINDOW} records"):
        method_for_label("leapquant", {"window": MAX_WINDOW + 1})


def test_validate_trace_names_each_tensor_and_shape(tmp_path):
    x = write_trace(tmp_path / "t.npz")
    with pytest.raises(TraceError, match=r"'q' and 'k' have a different number of tokens") as info:
        validate_trace(dict(x, q=x["q"][:-1], k=x["k"][:-1]))
    assert "v (24, 2, 8)" in str(info.value) and "q (23, 2, 8)" in str(info.value)
    with pytest.raises(TraceError, match=r"'g' must be \[T, H\] or \[T, H, dk\]"):
        validate_trace(dict(x, g=x["g"][..., None, None]))


def test_load_trace_refuses_a_folder(tmp_path):
    with pytest.raises(TraceError, match="is a folder"):
        load_trace(tmp_path)


# ----------------------------------------------------------------------------- memory, studies


@pytest.mark.parametrize("flag, value", [("--heads", 0), ("--dk", 0), ("--dv", -1), ("--layers", -3), ("--window", 0),
                                         ("--rank", -2), ("--heads", "two")])
def test_memory_refuses_out_of_range_sizes(capsys, flag, value):
    refused(capsys, ["memory", flag, value], f"argument {flag}")


def test_memory_refuses_rank_above_the_head_size(capsys):
    refused(capsys, ["memory", "--rank", 200], "rank 200", "min(dk, dv) = 128")
    refused(capsys, ["memory", "--dk", 4, "--bits", 4], "rank 6 (the default at 4 bits", "min(dk, dv) = 4")


def test_memory_query_validates_its_fields():
    with pytest.raises(ValueError, match="heads must be a positive integer"):
        measure_memory(MemoryQuery(heads=0))
    with pytest.raises(ValueError, match="rank 200 exceeds"):
        measure_memory(MemoryQuery(rank=200))
    with pytest.raises(ValueError, match="layers must be a positive integer"):
        MemoryQuery(layers=-3)


@pytest.mark.parametrize("argv, words", [
    (["study", "errors", "--window", 0], ["argument --window"]),
    (["study", "errors", "--tokens", 0], ["argument --tokens"]),
    (["study", "errors", "--every", -1], ["argument --every"]),
    (["study", "errors", "--tokens", 100, "--every", 64], ["--tokens 100 must be a multiple of --every 64"]),
    (["study", "errors", "--tokens", 96, "--every", 24], ["--every 24 must be a multiple of --window 16"]),
    (["study", "outliers", "--dk", 0], ["argument --dk"]),
    (["study", "outliers", "--head", -1], ["argument --head"]),
    (["study", "freeze", "--decays", "0.9,1.5"], ["decays", "1.5"]),
])
def test_studies_refuse_out_of_range_options(capsys, tmp_path, argv, words):
    out_dir = [] if argv[1] == "freeze" else ["--out-dir", tmp_path / "out"]
    refused(capsys, argv + out_dir, *words, out=tmp_path / "out")


def test_study_outliers_checks_rank_and_head_against_the_trace(capsys, tmp_path, trace):
    refused(capsys, ["study", "outliers", "--trace", trace, "--rank", 9, "--out-dir", tmp_path / "out"], "rank 9",
            "min(dk, dv) = 8", out=tmp_path / "out")
    refused(capsys, ["study", "outliers", "--trace", trace, "--head", 2, "--out-dir", tmp_path / "out"], "--head 2",
            "2 heads", out=tmp_path / "out")


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        main(["memory", "--help"])
    assert info.value.code == 0
    assert "(default: 128)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: fp32)" in text and "(default: 1.0)" in text
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "generate" in capsys.readouterr().out


def test_top_level_help_describes_every_command_in_whole_sentences(capsys):
    from leapquant_cli import DESCRIPTION

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert " ".join(DESCRIPTION.split()) in text.replace("train- data", "train-data")
    assert DESCRIPTION.endswith(".")
    for command in ("replay", "study", "memory", "convert", "generate", "score", "eval", "recall", "calibrate-damp",
                    "demo", "train-data", "train"):
        assert command in DESCRIPTION


def test_every_command_takes_the_same_method_names():
    """One name table (``method_names.METHOD_LABELS``): ``generate``/``score --state``, ``replay
    --method`` and ``eval``/``recall``/``demo --states`` build the same method from a label."""
    from leapquant_cli import build_parser
    from leapquant_jax.cli_support import method_from_args, state_options

    parser = build_parser()
    want = methods_for_labels(["leapquant-b4"], {"window": 8})["leapquant-b4"]
    assert want.config.bits == 4 and want.config.window == 8
    for argv in (["generate", "c", "--max-new-tokens", "1", "--state", "leapquant-b4"],
                 ["score", "c", "--ids-file", "i.npy", "--out", "o.npy", "--state", "leapquant-b4"],
                 ["replay", "t.npz", "--out", "o.npz", "--method", "leapquant-b4"]):
        assert method_from_args(parser.parse_args(argv + ["--window", "8"])) == want
    for command in ("eval", "recall", "demo"):
        checkpoint = ["c"] if command != "demo" else []
        args = parser.parse_args([command, *checkpoint, "--data", "d.npy", "--states", "int8,leapquant-b4",
                                  "--window", "8"])
        assert methods_for_labels(args.states.split(","), state_options(args))["leapquant-b4"] == want
    # a label fixes what its name says; the method's own name takes the options
    with pytest.raises(ValueError, match="--state leapquant-b4 fixes bits=4, which contradicts --bits 8"):
        method_for_label("leapquant-b4", {"bits": 8})
    assert method_for_label("leapquant", {"bits": 4}) == method_for_label("leapquant-b4")


def test_a_missing_argument_is_one_line(capsys):
    refused(capsys, ["replay"], "required", "leapquant replay --help")
    refused(capsys, ["no-such-command"], "invalid choice")


# ----------------------------------------------------------------------------- the state-method API


def test_make_method_refuses_rank_above_dk_at_init():
    method = make_method("leapquant", rank=64)
    with pytest.raises(ValueError, match=r"rank 64 exceeds min\(dk, dv\) = 32"):
        method.init(1, 2, 32, 32)
    with pytest.raises(ValueError, match="rank 64"):
        method.from_dense(jnp.ones((1, 2, 32, 64)))
    x = inputs(0, tokens=4, dk=32, dv=32)
    with pytest.raises(ValueError, match="rank 64"):
        method.prefill(**x)
    with pytest.raises(ValueError, match="rank must be a non-negative integer"):
        make_method("leapquant", rank=-1)


def test_leapquant_options_are_checked_by_type():
    with pytest.raises(ValueError, match="compensators must be True or False, got 'no'"):
        make_method("leapquant", compensators="no")
    with pytest.raises(ValueError, match="window must be a positive integer, got True"):
        make_method("leapquant", window=True)
    with pytest.raises(ValueError, match="bits must be 8, 6, 4 or 2, got 8.0"):
        make_method("leapquant", bits=8.0)
    with pytest.raises(ValueError, match="fit_iters must be an integer >= 1"):
        make_method("leapquant", fit_iters=1.5)


def test_prefill_refuses_lengths_out_of_range():
    method = make_method("fp32")
    x = inputs(0, batch=2, tokens=4)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, T\] = \[0, 4\], got \[2, 5\]"):
        method.prefill(**x, lengths=np.array([2, 5], np.int32))
    with pytest.raises(ValueError, match="lengths must be integers"):
        method.prefill(**x, lengths=np.array([2.0, 3.0]))


@pytest.mark.parametrize("name", ["fp32", "leapquant"])
@pytest.mark.parametrize("dims, word", [((0, 2, 8, 8), "batch"), ((1, 0, 8, 8), "heads"), ((1, 2, 0, 8), "dk"),
                                        ((1, 2, 8, -1), "dv"), ((1, 2.0, 8, 8), "heads")])
def test_init_refuses_non_positive_sizes(name, dims, word):
    with pytest.raises(ValueError, match=f"{word} must be a positive integer"):
        make_method(name).init(*dims)


@pytest.mark.parametrize("name", ["fp32", "int8", "leapquant"])
def test_step_refuses_a_state_of_another_shape(name):
    method = make_method(name)
    x = inputs(1, tokens=1, dk=16, dv=16)
    # Refused before any arithmetic: the states' shapes are enough.
    state = jax.eval_shape(lambda: method.init(1, 2, 8, 16))
    with pytest.raises(ValueError, match=r"the state holds \[B, H, dk, dv\] = \(1, 2, 8, 16\)"):
        method.step(state, **{k: v[:, 0] for k, v in x.items()})
    state = jax.eval_shape(lambda: method.init(1, 2, 16, 16))
    with pytest.raises(ValueError, match="active must be bool"):
        method.step(state, **{k: v[:, 0] for k, v in x.items()}, active=jnp.ones((2,), bool))


@pytest.mark.parametrize("name", ["fp32", "int8", "damp", "int8+ef", "leapquant"])
@pytest.mark.parametrize("key_heads, words", [(3, "key_heads=3 does not divide the 4 value heads"),
                                               (0, "key_heads must be a positive integer"),
                                               (True, "key_heads must be a positive integer")])
def test_init_refuses_key_heads_that_do_not_divide_the_heads(name, key_heads, words):
    dims = (1, 4, 32, 16) if name == "damp" else (1, 4, 8, 16)
    with pytest.raises(ValueError, match=words):
        make_method(name).init(*dims, key_heads=key_heads)


def test_shared_key_records_refuse_keys_of_another_head_count():
    from leapquant_jax import windowed
    from leapquant_jax.recurrence import delta_rule_token
    from leapquant_jax.state import LeapQuantConfig
    from pallas_kernels import support

    method = make_method("leapquant", window=WINDOW, impl="reference")
    state = jax.eval_shape(lambda: method.init(1, 4, 8, 8, key_heads=2))
    per_value_head = {k: v[:, 0] for k, v in inputs(4, tokens=1, heads=4).items()}
    # a key per value head cannot be kept once per key head
    with pytest.raises(ValueError, match="k has 4 heads but the state keeps key records for 2 key heads"):
        method.step(state, **per_value_head)
    odd = dict(per_value_head, q=per_value_head["q"][:, :3], k=per_value_head["k"][:, :3])
    with pytest.raises(ValueError, match="k has 3 heads"):
        method.step(state, **odd)
    # the same below the method: a token whose write vector has the value heads
    config = LeapQuantConfig(window=WINDOW, impl="reference")
    token = delta_rule_token(**{k: jnp.asarray(v) for k, v in per_value_head.items()})
    with pytest.raises(ValueError, match="token.w has 4 key heads but the window buffer stores key records for 2"):
        windowed.step_reference(config, state, token)
    # a per-step state keeps no key records: its tokens come per value head
    fp32 = make_method("fp32")
    shared_token = delta_rule_token(**{k: jnp.asarray(v[:, :2] if k in ("q", "k") else v)
                                       for k, v in per_value_head.items()}, key_heads=2)
    with pytest.raises(ValueError, match=r"token.w \(the key\) must be \[B, Hk, dk\] = \(1, 4, 8\)"):
        fp32.step_token(fp32.init(1, 4, 8, 8), shared_token)
    # a buffer whose key heads do not divide the value heads is named where it is read
    live = method.init(1, 4, 8, 8, key_heads=2)
    bad = live.replace(buffer=live.buffer.replace(k=jnp.zeros((1, 3, WINDOW, 8), jnp.float16)))
    with pytest.raises(ValueError, match="the window buffer's k has 3 heads, which does not divide the 4 value heads"):
        method.to_dense(bad)
    why = support.unsupported_reason(LeapQuantConfig(window=WINDOW), bad)
    assert why is not None and "with Hk dividing H" in why and "(1, 3, 4, 8)" in why


# A window of 4 and 6 tokens: one flush, then records on top of the new checkpoint.
WINDOW, TOKENS = 4, 6


@pytest.mark.parametrize("name", ["fp32", "int8-w"])
def test_kda_steps_on_a_state_initialised_without_per_channel_decay(name):
    # The widened state must give the outputs of a state initialised for KDA, and (fp32) the
    # dense recurrence.
    method = make_method(name, **({} if name == "fp32" else dict(window=WINDOW, impl="reference")))
    x = inputs(2, batch=2, tokens=TOKENS, kda=True)
    step = jax.jit(lambda s, t: method.step(s, **t))
    outs = {}
    for kda_init in (True, False):
        state, outs[kda_init] = method.init(2, 2, 8, 8, per_channel_decay=kda_init), []
        for t in range(TOKENS):
            o, state = step(state, {k: v[:, t] for k, v in x.items()})
            outs[kda_init].append(o)
    got, want = jnp.stack(outs[False], axis=1), jnp.stack(outs[True], axis=1)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    if name == "fp32":
        assert rel(got, recurrent_scan(None, **x)[0]) < 1e-5


def test_decode_and_prefill_match_the_decay_layout_to_the_tokens():
    # KDA tokens on a scalar-decay state are widened to it; GDN tokens on a KDA state broadcast.
    method = make_method("int8-w", window=WINDOW, impl="reference")

    @jax.jit
    def decode(state, x):
        o, state = method.decode(state, **x)
        return o, method.to_dense(state), state.per_channel_decay

    prefill = jax.jit(lambda state, x: method.prefill(**x, state=state))
    gdn_state, kda_state = (jax.jit(method.init, static_argnums=(0, 1, 2, 3, 4))(2, 2, 8, 8, kda) for kda in (False, True))
    x = inputs(3, batch=2, tokens=TOKENS, kda=True)
    gdn = inputs(3, batch=2, tokens=TOKENS)
    # GDN's scalar decays written out per channel: the same recurrence in KDA form.
    as_kda = dict(gdn, g=np.repeat(gdn["g"][..., None], 8, axis=-1))
    for state0, tokens, reference in ((gdn_state, x, x), (kda_state, gdn, as_kda)):
        want, want_dense, _ = decode(kda_state, reference)
        got, dense, per_channel = decode(state0, tokens)
        assert per_channel
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(dense, want_dense, rtol=1e-6, atol=1e-6)
    want, _ = prefill(kda_state, x)
    got, state = prefill(gdn_state, x)
    assert state.per_channel_decay
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny Qwen3.5 model: its HF directory and our converted checkpoint."""
    import model_helpers as mh

    _, transformers = mh.require_reference()
    from models.checkpoint import convert_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    model = mh.build_tiny(transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, seed=3,
                          vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          layer_types=["linear_attention", "full_attention"], num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                          linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    hf = mh.save_tiny(model, root / "hf")
    return {"hf": hf, "ckpt": convert_checkpoint(hf, root / "ckpt")}


def _generate(ckpt, *extra):
    return ["generate", ckpt, "--max-new-tokens", 2, *extra]


@pytest.mark.parametrize("ids, words", [
    ("5,100", ["--prompt-ids[1] = 100", "vocabulary [0, 100)"]),
    ("5,-1", ["argument --prompt-ids", "-1"]),
    ("2147483648", ["--prompt-ids[0] = 2147483648"]),
    ("3.7", ["argument --prompt-ids", "integers"]),
    ("", ["argument --prompt-ids", "at least one id"]),
])
def test_generate_refuses_bad_prompt_ids(capsys, tiny_model, ids, words):
    refused(capsys, _generate(tiny_model["ckpt"], "--prompt-ids", ids), *words)


def test_generate_names_the_prompt_of_a_batch(capsys, tiny_model):
    refused(capsys, _generate(tiny_model["ckpt"], "--prompt-ids", "1,2", "--prompt-ids", "3,999"),
            "--prompt-ids (prompt 2)[1] = 999")


@pytest.mark.parametrize("flag, value", [("--max-new-tokens", 0), ("--temperature", -1), ("--temperature", "nan"),
                                         ("--top-p", 0), ("--top-p", 1.5), ("--top-k", -1), ("--seed", -1)])
def test_generate_refuses_out_of_range_sampling(capsys, tiny_model, flag, value):
    refused(capsys, ["generate", tiny_model["ckpt"], "--prompt-ids", "1,2", "--max-new-tokens", 2, flag, value],
            f"argument {flag}")


def test_generate_refuses_stop_ids_outside_the_vocabulary(capsys, tiny_model):
    refused(capsys, _generate(tiny_model["ckpt"], "--prompt-ids", "1,2", "--stop-ids", "3,100"), "--stop-ids[1] = 100")


def test_generate_refuses_rank_above_the_head_size(capsys, tiny_model, tmp_path):
    traces = tmp_path / "traces"
    refused(capsys, _generate(tiny_model["ckpt"], "--prompt-ids", "1,2", "--state", "leapquant", "--rank", 17,
                              "--record-traces", traces), "rank 17", "min(dk, dv) = 16", out=traces)


def test_generate_refuses_options_a_per_step_state_does_not_take(capsys, tiny_model):
    refused(capsys, _generate(tiny_model["ckpt"], "--prompt-ids", "1,2", "--state", "int8", "--rank", 2), "per-step")
    refused(capsys, _generate(tiny_model["ckpt"], "--prompt-ids", "1,2", "--state", "int9"), "argument --state")


def test_generate_refuses_prompt_text_without_a_tokenizer(capsys, tiny_model):
    refused(capsys, _generate(tiny_model["ckpt"], "--prompt", "hello"), "--prompt needs a tokenizer")


def test_generate_names_a_malformed_tokenizer(capsys, tiny_model, tmp_path):
    d = _copy(tiny_model["ckpt"], tmp_path / "ckpt")
    (d / "tokenizer.json").write_text("{")
    refused(capsys, _generate(d, "--prompt", "hello"), "tokenizer.json is not a readable tokenizer file")


def test_a_checkpoint_folder_without_config_or_a_file_is_named(capsys, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(capsys, ["generate", empty, "--prompt", "hello", "--max-new-tokens", 2], f"{empty} has no config.json")
    (tmp_path / "file").write_text("x")
    refused(capsys, ["generate", tmp_path / "file", "--prompt-ids", "1", "--max-new-tokens", 2], "is a file")
    refused(capsys, ["convert", tmp_path / "file", tmp_path / "out"], "hf_dir", "is a file", out=tmp_path / "out")


def test_generate_refuses_more_new_tokens_than_memory_holds(capsys, tiny_model, tmp_path):
    """Refused before anything is allocated, with XLA's count for the compiled program (which
    compiling allocates nothing for) and about how many new tokens would fit; nothing written."""
    import re

    from models.base import with_runtime
    from models.checkpoint import load_model
    from models.cli import MAX_NEW_TOKENS
    from models.decode import available_memory, generation_program_bytes

    traces = tmp_path / "traces"
    argv = _generate(tiny_model["ckpt"], "--prompt-ids", "1,2,3", "--max-new-tokens", MAX_NEW_TOKENS, "--stop-ids", "",
                     "--record-traces", traces)
    line = refused(capsys, argv, f"--max-new-tokens {MAX_NEW_TOKENS}: decoding 1 sequence(s) of 3 + {MAX_NEW_TOKENS}",
                   out=traces)
    arch, config, params, _ = load_model(tiny_model["ckpt"])
    config, params = with_runtime(config, params, compute="fast", scan_layers=False)  # generate's default
    need = generation_program_bytes(arch, params, config, [[1, 2, 3]], method=make_method("fp32"),
                                    max_new_tokens=MAX_NEW_TOKENS, record=True)
    free, _ = available_memory()
    assert need > free and f"needs {need / 2**30:,.2f} GiB" in line
    fit = int(re.search(r"at most about ([\d,]+) new tokens would fit", line).group(1).replace(",", ""))
    assert fit == int(MAX_NEW_TOKENS * free / need)
    refused(capsys, _generate(tiny_model["ckpt"], "--prompt-ids", "1", "--max-new-tokens", MAX_NEW_TOKENS + 1),
            "argument --max-new-tokens", f"[1, {MAX_NEW_TOKENS}]", "int32")


def test_a_load_state_of_another_method_names_the_differing_fields():
    from models.prefix_state import method_difference

    diff = method_difference(repr(make_method("leapquant", bits=4, window=8)), repr(make_method("leapquant")))
    assert diff == "config.bits 4 in the file, 8 here; config.window 8 in the file, 16 here"
    diff = method_difference(repr(make_method("fp32")), repr(make_method("leapquant")))
    assert diff == "PerStepMethod(format_name='fp32', impl='auto') in the file, WindowedMethod(label='leapquant') here"


def test_a_checkpoint_with_many_wrong_tensors_is_named_in_one_short_line():
    from leapquant_jax.cli_support import one_line
    from models.base import ConversionError

    err = ConversionError(unexpected=[f"model.layers.{i}.mlp.gate.weight" for i in range(300)],
                          missing=["model.norm.weight"], context="qwen3_5_text")
    line = one_line(err)
    assert len(line) < 400 and len(err.unexpected) == 300
    assert "unexpected tensors (300): model.layers.0.mlp.gate.weight, model.layers.1.mlp.gate.weight" in line
    assert line.endswith("model.layers.4.mlp.gate.weight and 295 more")
    assert "missing tensors (1): model.norm.weight" in line


def test_generate_refuses_a_missing_checkpoint_and_a_file_as_trace_folder(capsys, tiny_model, tmp_path):
    refused(capsys, _generate(tmp_path / "nothing", "--prompt-ids", "1"), "nothing", "no such directory")
    (tmp_path / "file").write_text("x")
    refused(capsys, _generate(tiny_model["ckpt"], "--prompt-ids", "1", "--record-traces", tmp_path / "file"),
            "--record-traces", "not a folder")


def _score(capsys, tiny_model, tmp_path, ids_file, *words):
    out = tmp_path / "logits.npy"
    return refused(capsys, ["score", tiny_model["ckpt"], "--ids-file", ids_file, "--out", out], *words, out=out)


def test_score_refuses_float_ids(capsys, tiny_model, tmp_path):
    np.save(tmp_path / "ids.npy", np.array([[1.0, 3.7]]))
    _score(capsys, tiny_model, tmp_path, tmp_path / "ids.npy", "--ids-file", "integer ids", "float64")


@pytest.mark.parametrize("value", [2**32 + 5, VOCAB, -1])
def test_score_refuses_ids_outside_the_vocabulary(capsys, tiny_model, tmp_path, value):
    np.save(tmp_path / "ids.npy", np.array([[1, 2], [3, value]], np.int64))
    _score(capsys, tiny_model, tmp_path, tmp_path / "ids.npy", f"--ids-file ids[1, 1] = {value}", "vocabulary")


def test_score_refuses_an_empty_ids_file(capsys, tiny_model, tmp_path):
    np.save(tmp_path / "ids.npy", np.zeros((1, 0), np.int32))
    _score(capsys, tiny_model, tmp_path, tmp_path / "ids.npy", "--ids-file", "no tokens", "(1, 0)")


@pytest.mark.parametrize("kind", ["text", "npz", "object", "truncated", "missing"])
def test_score_refuses_an_ids_file_that_is_not_an_npy_array(capsys, tiny_model, tmp_path, kind):
    path = tmp_path / "ids.npy"
    if kind == "text":
        path.write_text("1, 2, 3\n")
    elif kind == "npz":
        np.savez(path, ids=np.ones((1, 3), np.int32))
    elif kind == "object":
        np.save(path, np.array([1, "a"], dtype=object), allow_pickle=True)
    elif kind == "truncated":
        np.save(path, np.ones((2, 50), np.int32))
        path.write_bytes(path.read_bytes()[:-40])
    line = _score(capsys, tiny_model, tmp_path, path, "--ids-file", "ids.npy")
    assert "pickle" not in line


def test_score_refuses_a_folder_as_output(capsys, tiny_model, tmp_path):
    np.save(tmp_path / "ids.npy", np.ones((1, 3), np.int32))
    refused(capsys, ["score", tiny_model["ckpt"], "--ids-file", tmp_path / "ids.npy", "--out", tmp_path], "--out",
            "is a folder")


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("which", ["ckpt", "hf"])
def test_a_truncated_safetensors_file_is_named(capsys, tiny_model, tmp_path, which):
    d = _copy(tiny_model[which], tmp_path / which)
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    np.save(tmp_path / "ids.npy", np.ones((1, 3), np.int32))
    line = refused(capsys, ["score", d, "--ids-file", tmp_path / "ids.npy", "--out", tmp_path / "l.npy"],
                   str(weights), "not a readable safetensors file", out=tmp_path / "l.npy")
    assert "Traceback" not in line


def test_convert_of_a_truncated_file_writes_nothing(capsys, tiny_model, tmp_path):
    d = _copy(tiny_model["hf"], tmp_path / "hf")
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100])
    refused(capsys, ["convert", d, tmp_path / "out"], "model.safetensors", out=tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_convert_reports_a_damaged_checkpoint_on_one_line(capsys, tiny_model, tmp_path):
    import model_helpers as mh

    src = mh.rewrite_checkpoint(tiny_model["hf"], tmp_path / "hf", edit=lambda t: t.pop("model.norm.weight"))
    refused(capsys, ["convert", src, tmp_path / "out"], "missing tensors (1): model.norm.weight", out=tmp_path / "out")


@pytest.mark.parametrize("edit, words", [
    (lambda text: text[: len(text) // 2], ["config.json is not valid JSON"]),
    (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "vocab_size"}),
     ["config.json lacks the field 'vocab_size'"]),
    (lambda text: json.dumps(dict(json.loads(text), model_type="mamba")), ["config.json", "unsupported model_type"]),
])
def test_a_bad_config_json_is_named(capsys, tiny_model, tmp_path, edit, words):
    d = _copy(tiny_model["hf"], tmp_path / "hf")
    (d / "config.json").write_text(edit((d / "config.json").read_text()))
    refused(capsys, ["convert", d, tmp_path / "out"], *words, out=tmp_path / "out")


def test_model_api_refuses_bad_ids(tiny_model):
    from models import decode
    from models.checkpoint import load_model
    from models.layers import Sampling

    arch, config, params, _ = load_model(tiny_model["ckpt"])
    method = make_method("fp32")

    def gen(prompts, **kw):
        return decode.generate(arch, params, config, prompts, method=method, **dict(dict(max_new_tokens=2), **kw))

    with pytest.raises(ValueError, match=r"prompts\[0\]\[1\] = 100 is outside the vocabulary \[0, 100\)"):
        gen([[1, 100]])
    with pytest.raises(ValueError, match=r"prompts\[1\]\[0\] = -1"):
        gen([[1], [-1]])
    with pytest.raises(ValueError, match=r"prompts\[0\]\[0\] = 2147483648"):
        gen([[2**31]])
    with pytest.raises(ValueError, match=r"prompts\[0\]\[0\] = 3.5 is not an integer"):
        gen([[3.5]])
    with pytest.raises(ValueError, match=r"stop_ids\[0\] = 100"):
        gen([[1]], stop_ids=[100])
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        gen([[1]], max_new_tokens=0)
    with pytest.raises(ValueError, match="finite temperature"):
        gen([[1]], sampling=Sampling(temperature=float("nan")))
    with pytest.raises(ValueError, match="prompts must be a non-empty list"):
        gen([])
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        gen([[]])
    with pytest.raises(ValueError, match="integer array"):
        decode.score(arch, params, config, np.array([[1.0, 3.7]]), method=method)
    with pytest.raises(ValueError, match=r"ids\[0, 1\] = 4294967296"):
        decode.score(arch, params, config, np.array([[1, 2**32]]), method=method)
    with pytest.raises(ValueError, match="at least one token"):
        decode.score(arch, params, config, np.zeros((1, 0), np.int32), method=method)
    with pytest.raises(ValueError, match="prefill_len"):
        decode.score(arch, params, config, np.ones((1, 3), np.int32), method=method, prefill_len=3)
