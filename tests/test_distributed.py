"""Decoding as several processes joined by ``jax.distributed`` (``models.distributed``) on the CPU,
over loopback: two processes of two forced host devices each run ``score`` on a ``1 x 4`` mesh
(heads over the processes: the layers' all-reduces cross them), ``generate`` on a ``2 x 2`` one
(prompts of two lengths over the processes, heads within them) and ``bench.serve`` on it,
against the same commands in one process of four devices: the logits equal to 1e-6, the same
tokens, and only process 0 writes or prints (its standard output the JSON lines alone). A mesh
that leaves devices out is refused in one line, as are incomplete or inconsistent process options.

The model is a checkpoint made here, one GDN layer and one attention layer (4 GDN heads, 4
attention heads over 2 KV heads, so that a model axis of 4 splits it). Every process has a
deadline (``DEADLINE_S``) and waits at most ``JOIN_S`` for the others, so a hang fails the test
rather than stalling the suite; the processes' XLA favours compile time
(``helpers.child_xla_flags``), the same in all of them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.inputs import rel
from helpers import child_xla_flags

pytestmark = pytest.mark.xdist_group("distributed")

ROOT = Path(__file__).resolve().parents[1]
JOIN_S, DEADLINE_S = 30, 180

# Runs the commands given as a JSON list of [module, argv] (each module's ``main``), one after the
# other in this process (a second --coordinator finds the process joined), and prints their exit
# codes on stderr.
DRIVER = r'''
import importlib, json, sys
codes = [importlib.import_module(module).main(argv) for module, argv in json.loads(sys.argv[1])]
print("CODES " + json.dumps(codes), file=sys.stderr)
'''


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from models.checkpoint import save_converted
    from models.training.model import hf_config, init_params

    cj = hf_config("gdn", vocab_size=64, eos_token_id=0, size="tiny")
    cj.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=4,
              linear_num_value_heads=4, num_attention_heads=4, num_key_value_heads=2)
    return save_converted(tmp_path_factory.mktemp("ckpt") / "gdn", config_json=cj, params=init_params(cj, seed=0))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(commands: list, devices: int) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {child_xla_flags()}",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(commands)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(procs: dict) -> dict:
    """``{name: (exit codes of the commands, stdout, stderr)}``; every process ends by the deadline."""
    out = {}
    try:
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=DEADLINE_S)
            codes = next((json.loads(x[6:]) for x in stderr.splitlines() if x.startswith("CODES ")), None)
            assert p.returncode == 0 and codes is not None, (name, p.returncode, stderr[-3000:])
            out[name] = (codes, stdout, stderr)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distributed")
    ids_file = tmp / "ids.npy"
    np.save(ids_file, np.random.default_rng(0).integers(1, 64, (4, 8)))
    port = _free_port()

    def commands(tag, join):
        def score(mesh):
            return ["leapquant_cli", ["score", str(checkpoint), "--ids-file", str(ids_file), "--out",
                                      str(tmp / f"logits-{mesh}-{tag}.npy"), "--mesh", *mesh.split("x"), "--json",
                                      *join]]
        gen = ["leapquant_cli", ["generate", str(checkpoint), "--prompt-ids", "5,17,30,42", "--prompt-ids", "9,8",
                                 "--max-new-tokens", "4", "--stop-ids", "", "--mesh", "2", "2", "--json", *join]]
        serve = ["bench.serve", ["--models", "tiny-tp", "--layers", "1", "--prompt", "4", "--generate", "4",
                                 "--chunk", "4", "--prefill-rows", "4", "--batches", "4", "--states", "fp32",
                                 "--copy-bytes", str(1 << 16), "--mesh", "2", "2", "--json", "--out",
                                 str(tmp / f"serve-{tag}"), *join]]
        return [score("1x4"), gen] + ([serve] if join else [])

    join = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--join-timeout", str(JOIN_S)]
    refused = ["leapquant_cli", ["score", str(checkpoint), "--ids-file", str(ids_file), "--out",
                                 str(tmp / "refused.npy"), "--mesh", "1", "2", *join, "--process-id", "0"]]
    procs = {"one": _launch(commands("one", []), devices=4)}
    for i in range(2):
        first = [refused[0], refused[1][:-1] + [str(i)]]
        procs[f"two-{i}"] = _launch([first] + commands("two", join + ["--process-id", str(i)]), devices=2)
    return tmp, _finish(procs)


def _json_lines(stdout: str) -> list:
    return [json.loads(x) for x in stdout.splitlines()]


def test_processes_score_as_one_process(runs):
    tmp, done = runs
    assert done["one"][0] == [0, 0] and done["two-0"][0] == done["two-1"][0] == [2, 0, 0, 0]
    one, two = np.load(tmp / "logits-1x4-one.npy"), np.load(tmp / "logits-1x4-two.npy")
    assert two.shape == one.shape == (4, 8, 64)
    assert rel(two, one) <= 1e-6, rel(two, one)


def test_processes_generate_as_one_process(runs):
    _, done = runs
    one = [r for r in _json_lines(done["one"][1]) if r["command"] == "generate"]
    two = [r for r in _json_lines(done["two-0"][1]) if r.get("command") == "generate"]
    assert len(one) == len(two) == 1
    assert two[0]["generated_ids"] == one[0]["generated_ids"] and [len(t) for t in one[0]["generated_ids"]] == [4, 4]
    assert (two[0]["processes"], one[0]["processes"]) == (2, 1)


def test_only_process_zero_prints_and_writes(runs):
    tmp, done = runs
    # process 0: one JSON object per command that ran (score, generate, serve), nothing else
    assert len(_json_lines(done["two-0"][1])) == 3
    assert done["two-1"][1] == ""
    assert not list(tmp.glob("refused.npy"))
    written = sorted(p.suffix for p in (tmp / "serve-two").iterdir())
    assert written == [".json", ".md"]


def test_serve_runs_as_two_processes(runs):
    tmp, done = runs
    result = _json_lines(done["two-0"][1])[-1]
    assert (result["mesh"], result["processes"]) == ([2, 2], 2) and "x4" in result["device"]
    (row,) = result["rows"]
    assert (row["state"], row["batch"]) == ("fp32", 4) and "error" not in row, row
    assert row["finite"] and row["tokens_per_s"] > 0     # finite logits, tokens in the vocabulary
    assert json.loads(next((tmp / "serve-two").glob("*.json")).read_text())["rows"] == result["rows"]


def test_mesh_that_leaves_devices_out_is_refused(runs):
    _, done = runs
    for tag in ("two-0", "two-1"):
        lines = [x for x in done[tag][2].splitlines() if x.startswith("leapquant: error:")]
        assert lines == ["leapquant: error: --mesh 1 2: a mesh over 2 processes takes all their 4 devices, "
                         "not 1 x 2"], lines


def test_bad_process_options_are_refused_by_name(checkpoint, tmp_path):
    import jax

    from bench import serve
    from leapquant_cli import main

    np.save(tmp_path / "ids.npy", np.zeros((3, 4), np.int64))
    base = ["score", str(checkpoint), "--ids-file", str(tmp_path / "ids.npy"), "--out", str(tmp_path / "o.npy")]
    cases = [
        (["--mesh", "1", "2", "--coordinator", "127.0.0.1:1234"],
         "--num-processes and --process-id must be given with --coordinator"),
        (["--mesh", "1", "2", "--num-processes", "2"], "--coordinator and --process-id must be given with "
                                                       "--num-processes"),
        (["--mesh", "1", "2", "--coordinator", "127.0.0.1", "--num-processes", "2", "--process-id", "0"],
         "--coordinator must be HOST:PORT with a port in [1, 65535], got '127.0.0.1'"),
        (["--mesh", "1", "2", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"],
         "--process-id 2 must be below --num-processes 2"),
        (["--mesh", "1", "2", "--coordinator", "h:1", "--num-processes", "0", "--process-id", "0"],
         "argument --num-processes: must be >= 1, got 0"),
        (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "0"], "--coordinator needs --mesh"),
        (["--mesh", "1", "3"], "--mesh 1 3: a model axis of 3 does not divide the 4 GDN value heads"),
        (["--mesh", "2", "1"], "--mesh 2 1: a data axis of 2 does not divide the batch of 3 sequences"),
        (["--mesh", "0", "1"], "argument --mesh: must be >= 1, got 0"),
    ]
    if len(jax.devices()) < 2:
        cases.append((["--mesh", "1", "2"], "--mesh 1 2: a 1 x 2 mesh needs 2 devices, but 1 are available"))
    for extra, message in cases:
        err = _run_cli(main, base + extra)
        assert message in err, (extra, err)
    # the serving benchmark checks the same options before it starts
    with pytest.raises(SystemExit) as exit_:
        serve.parse_args(["--models", "tiny-tp", "--batches", "4", "--mesh", "2", "2", "--coordinator", "h:1",
                          "--num-processes", "2", "--process-id", "3"])
    assert exit_.value.code == 2


def _run_cli(main, argv) -> str:
    """The one stderr line of a refused ``leapquant`` command (exit code 2)."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        rc = main(argv)
    lines = [x for x in buf.getvalue().splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1, (argv, rc, lines)
    return lines[0]
