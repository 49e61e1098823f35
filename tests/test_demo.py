"""``leapquant demo`` end to end on the shipped GDN checkpoint at a tiny context, its memory per
stream against the per-layer measurement of ``study errors``, the standard-library held-out
reader on a fake standard library, and bad input refused by name."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re

import numpy as np
import pytest

from leapquant_jax.cli_support import ArgumentParser, run_parser
from models.demo import DEFAULT_CHECKPOINT, add_subcommand, stdlib_heldout
from models.loading import read_file_list

from helpers import GDN_CHECKPOINT, heldout_ids_file

# The module's fixtures serve all its tests: one xdist worker runs them (conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("demo")

CKPT = GDN_CHECKPOINT
CONTEXT = 32


def _run(argv):
    # The demo's own parser: the command under test, whatever else `leapquant` registers.
    parser = ArgumentParser(prog="leapquant")
    add_subcommand(parser.add_subparsers(dest="command", required=True))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run_parser(parser, ["demo"] + argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(CKPT / "tokenizer.json"))


@pytest.fixture(scope="module")
def snippet(tmp_path_factory):
    return heldout_ids_file(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def runs(snippet, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("demo_out")
    argv = ["--data", str(snippet), "--context", str(CONTEXT), "--states", "fp32,leapquant",
            "--out-dir", str(out_dir)]
    code, text, err = _run(argv)
    assert code == 0, err
    # The same programs again (compiled above), for the JSON object.
    code, js, err = _run(argv + ["--plot", "", "--json"])
    assert code == 0, err
    return text, json.loads(js), out_dir


def test_default_checkpoint_is_the_shipped_one_from_any_folder():
    assert DEFAULT_CHECKPOINT.is_absolute() and DEFAULT_CHECKPOINT.resolve() == CKPT.resolve()


def test_demo_prints_the_table_and_writes_the_plot(runs, snippet):
    text, result, out_dir = runs
    lines = text.splitlines()
    assert lines[0] == f"checkpoint  {DEFAULT_CHECKPOINT} (qwen3_5_text)"
    assert lines[1] == f"data        --data {snippet}, 256 tokens"
    assert any(line.startswith("method") and "KL to fp32" in line for line in lines)
    table = {line.split()[0]: line.split() for line in lines if len(line.split()) == 8}
    assert list(table) == ["fp32", "leapquant"]
    for label, row in table.items():
        m = result["methods"][label]
        assert row[1:4] == [f"{m['perplexity']:.4f}", f"{m['kl_to_fp32']:.2e}", f"{m['top1_agreement']:.4f}"]
    assert result["methods"]["leapquant"]["kl_to_fp32"] > 0.0 == result["methods"]["fp32"]["kl_to_fp32"]
    assert f"({CONTEXT - 1} scored tokens, context {CONTEXT})" in lines
    png = out_dir / "demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert f"plot: {png}" in lines and result["plot"] is None
    assert result["data"] == {"source": f"--data {snippet}, 256 tokens", "tokens": 256, "files": [],
                              "listed_files": 0, "python": None}


def test_memory_per_stream_is_the_measured_state_of_every_linear_layer(runs):
    from leapquant_jax.studies.errors import state_bytes_per_element
    from leapquant_jax.method_names import methods_for_labels

    text, result, _ = runs
    memory = result["memory"]
    config = json.loads((CKPT / "config.json").read_text())
    layers = config["layer_types"].count("linear_attention")
    heads, dk, dv = config["linear_num_value_heads"], config["linear_key_head_dim"], config["linear_value_head_dim"]
    key_heads = config["linear_num_key_heads"]
    assert memory["layers"] == layers and memory["elements"] == layers * heads * dk * dv
    methods = methods_for_labels(["leapquant"])
    for label, method in methods.items():
        m = memory["methods"][label]
        # the same bytes from one layer's state pytree, measured alone (studies.errors); the
        # model's GVA (4 value heads over 2 key heads) keeps the window's keys once per key head
        per_element = state_bytes_per_element(method, heads, dk, dv, False, key_heads)
        assert m["bytes"] == round(per_element["live"] * memory["elements"])
        assert m["checkpoint_bytes"] == round(per_element["checkpoint"] * memory["elements"])
        row = next(line for line in text.splitlines() if line.split()[:2] == [label, f"{m['bytes']:,}"])
        assert row.split()[3] == f"{m['vs_fp32']:.3f}x"
    fp32, lq = memory["methods"]["fp32"], memory["methods"]["leapquant"]
    assert fp32["bytes_per_element"] == 4.0 and fp32["vs_fp32"] == 1.0
    assert lq["checkpoint_bytes"] < lq["bytes"] < fp32["bytes"]
    per_value_head = state_bytes_per_element(methods["leapquant"], heads, dk, dv, False)["live"] * memory["elements"]
    assert key_heads < heads and lq["bytes"] < per_value_head


def _fake_stdlib(tmp_path, files: dict, listed: list):
    """A standard-library folder holding ``files`` and a checkpoint folder whose DATA_FILES.txt
    lists ``listed`` as ``(split, path, text)``, hashed from ``text``."""
    root, ckpt = tmp_path / "lib", tmp_path / "ckpt"
    ckpt.mkdir()
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    lines = [f"{split} {hashlib.sha256(text.encode()).hexdigest()} {rel}\n" for split, rel, text in listed]
    (ckpt / "DATA_FILES.txt").write_text("".join(lines))
    return root, ckpt


def test_stdlib_reader_keeps_only_held_out_files_whose_hash_matches(tmp_path, tokenizer):
    a, b, c, t = "def f(x):\n    return x + 1\n", "import os\nprint(os.sep)\n", "class C:\n    pass\n", "x = 1\n"
    root, ckpt = _fake_stdlib(
        tmp_path,
        files={"pkg/b.py": b, "a.py": a, "c.py": c + "# changed in another patch version\n", "t.py": t},
        listed=[("heldout", "pkg/b.py", b), ("train", "t.py", t), ("heldout", "c.py", c), ("heldout", "a.py", a),
                ("heldout", "gone.py", "y = 2\n")])
    held = stdlib_heldout(ckpt, tokenizer, min_tokens=2, stdlib=root)
    assert held.files == ("pkg/b.py", "a.py") and held.listed == 4 and held.python is None
    eos = tokenizer.token_to_id("<|endoftext|>")
    expected = tokenizer.encode(b).ids + [eos] + tokenizer.encode(a).ids + [eos]
    np.testing.assert_array_equal(held.ids, expected)
    assert f"2 of 4 files from the standard library at {root}, {len(expected)} tokens" in held.source
    with pytest.raises(ValueError, match=rf"give {len(expected)} tokens from the standard library at .*lib, fewer "
                                         rf"than the 1000 needed: 2 of 4 files have the listed sha256.*--data FILE"):
        stdlib_heldout(ckpt, tokenizer, min_tokens=1000, stdlib=root)
    with pytest.raises(ValueError, match="give 0 tokens"):
        stdlib_heldout(ckpt, tokenizer, min_tokens=2, stdlib=tmp_path / "elsewhere")


@pytest.mark.parametrize("line, message", [
    ("heldout abc a.py", "line 2: sha256 must be 64 lowercase hex digits"),
    (f"valid {'0' * 64} a.py", "line 2: split must be one of"),
    (f"heldout {'0' * 64} ../etc/passwd", "line 2: expected a relative path inside the directory"),
    (f"heldout {'0' * 64}", "line 2: expected 'split sha256 relative/path'"),
])
def test_a_malformed_file_list_is_refused_by_line(tmp_path, line, message):
    path = tmp_path / "DATA_FILES.txt"
    path.write_text(f"train {'1' * 64} dir/with space.py\n{line}\n")
    with pytest.raises(ValueError, match=message):
        read_file_list(path)
    path.write_text(f"train {'1' * 64} dir/with space.py\n")
    assert read_file_list(path) == [("train", "1" * 64, "dir/with space.py")]


def test_bad_input_is_refused_by_name_before_the_model_runs(tmp_path, snippet):
    bare, empty = tmp_path / "bare", tmp_path / "empty"
    bare.mkdir()
    empty.mkdir()
    (bare / "config.json").write_bytes((CKPT / "config.json").read_bytes())
    cases = [
        (["--states", "fp32,int9"], "--states: unknown method 'int9'"),
        (["--context", "1"], "argument --context: must be >= 2"),
        (["--data", str(tmp_path / "missing.npy")], "--data .*missing.npy: No such file"),
        (["--data", str(snippet), "--context", "300"], "--context 300 is longer than the data: --data .* holds 256"),
        (["--checkpoint", str(bare)], "bare has no DATA_FILES.txt .*pass --data FILE"),
        (["--checkpoint", str(tmp_path / "nowhere")], "checkpoint .*nowhere: no such directory"),
        (["--checkpoint", str(empty)], "checkpoint .*empty has no config.json"),
        (["--checkpoint", str(CKPT / "config.json")], "config.json is a file; give the checkpoint's folder"),
        (["--window", "512"], r"argument --window: must be in \[1, 256\]"),
        (["--plot", "demo.xyz"], "--plot 'demo.xyz': the file name must end in one of"),
        (["--states", "leapquant-b4", "--bits", "8"], "leapquant-b4 fixes bits=4"),
    ]
    for argv, message in cases:
        code, out, err = _run(argv + ["--out-dir", str(tmp_path / "out")])
        assert code == 2 and out == "", (argv, out)
        assert err.startswith("leapquant: error: "), err
        assert re.search(message, err), (argv, err)
    assert not (tmp_path / "out").exists()


def test_the_layer_plot_breaks_its_line_at_attention_layers():
    """The x values of the per-layer error plot are the model's layer indices, with no line drawn
    across an attention layer (layers 3 and 7 of the shipped checkpoint)."""
    from models.demo import layer_line

    xs, ys = layer_line({"0": 1.0, "1": 2.0, "2": 3.0, "4": 4.0, "5": 5.0, "6": 6.0})
    assert xs[:3] == [0, 1, 2] and np.isnan(xs[3]) and xs[4:] == [4, 5, 6]
    assert ys[:3] == [1.0, 2.0, 3.0] and np.isnan(ys[3]) and ys[4:] == [4.0, 5.0, 6.0]
    assert layer_line({"2": 0.5, "1": 0.25}) == ([1, 2], [0.25, 0.5])
