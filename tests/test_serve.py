"""``python -m bench.serve`` on the tiny model on the CPU: static batches, the fixed memory budget
(with and without prefix states), continuous batching through the pool; files only with ``--out``;
bad arguments refused by name."""

from __future__ import annotations

import json

import pytest

from bench import serve

# Four layers of the tiny model (three GDN layers, one attention layer), 16 + 16 tokens.
TINY = ["--models", "tiny", "--layers", "4", "--prompt", "16", "--generate", "16", "--chunk", "16",
        "--prefill-rows", "2", "--copy-bytes", str(1 << 20)]
# 50 KB for sequences: three fp32 sequences (14 KB each: 12 KB of state, 2 KB of KV at 32 tokens),
# one fp32-w sequence (34 KB), and with two prefix checkpoints each one fp32 sequence and no fp32-w one.
BUDGET_GB = 5e-5


def test_bench_serve_runs_on_the_tiny_model(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = TINY + ["--batches", "1", "--states", "fp32", "fp32-w", "--fit", "--budget", str(BUDGET_GB),
                   "--prefix-every", "16", "--pool", "--pool-states", "fp32-w", "--pool-slots", "2",
                   "--pool-requests", "3", "--pool-prompt", "3", "8", "--pool-generate", "2", "6", "--json",
                   "--out", "results"]
    assert serve.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {(r["kind"], r["state"]): r for r in result["rows"]}
    assert set(rows) == {(k, s) for k in ("batch", "budget", "budget+prefix") for s in ("fp32", "fp32-w")}
    budget = result["models"]["tiny"]["budget_bytes"]
    assert budget == pytest.approx(BUDGET_GB * 1e9)
    assert [rows[k, s]["batch"] for k in ("batch", "budget", "budget+prefix") for s in ("fp32", "fp32-w")] == \
        [1, 1, 3, 1, 1, 0]
    assert rows["budget+prefix", "fp32-w"]["error"] == "not one sequence fits the budget"
    for (kind, state), r in rows.items():
        if r["batch"] == 0:
            continue
        assert "error" not in r, r
        assert r["finite"] and r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 and r["prefill_s"] > 0
        assert r["roofline_ms"] > 0 and r["step_bytes"] > r["batch"] * r["kv_bytes"]
        # groups of two sequences: of three, the second group overlaps the first
        assert r["prefill_groups"] == -(-r["batch"] // 2)
        if kind != "batch":
            # the largest batch whose sequences (state + KV at 32 tokens, two prefix checkpoints) fit
            per_seq = r["state_bytes"] + r["kv_bytes"] + (2 * r["checkpoint_bytes"] if kind == "budget+prefix" else 0)
            assert r["sequence_bytes"] == per_seq and r["batch"] == int(budget // per_seq)
    assert rows["batch", "fp32"]["vs_fp32"] == 1.0 and "vs_fp32" in rows["budget", "fp32-w"]
    # fp32-w's live state is an fp32 checkpoint (the fp32 state's bytes) and its records
    assert rows["batch", "fp32-w"]["checkpoint_bytes"] == rows["batch", "fp32"]["state_bytes"]
    assert rows["batch", "fp32-w"]["state_bytes"] > rows["batch", "fp32"]["state_bytes"]
    pool = {r["kind"]: r for r in result["pool"]}
    assert set(pool) == {"same", "budget"} and pool["same"]["slots"] == 2 and pool["budget"]["slots"] == 1
    for r in pool.values():
        assert r["state"] == "fp32-w" and r["requests"] == 3 and r["failed"] == 0, r
        assert 3 * 2 <= r["generated_tokens"] <= 3 * 6 and r["tokens_per_s"] > 0
        assert 0 < r["ttft_p50_s"] <= r["latency_p50_s"] <= r["latency_p99_s"]
    written = sorted(p.name for p in (tmp_path / "results").iterdir())
    assert [p.split(".")[-1] for p in written] == ["json", "md"]
    assert json.loads((tmp_path / "results" / written[0]).read_text())["rows"] == result["rows"]
    report = (tmp_path / "results" / written[1]).read_text()
    assert "| tiny | budget | fp32-w | 1 |" in report and "not one sequence fits the budget" in report


def test_bench_serve_writes_nothing_without_out(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert serve.main(TINY + ["--batches", "1", "--states", "fp32"]) == 0
    assert "| tiny | batch | fp32 | 1 |" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, words", [
    (["--models", "qwen9"], "--models: invalid choice: 'qwen9'"),
    (["--states", "fp32", "lq5"], "--states: invalid choice: 'lq5'"),
    (["--batches", "0", "32"], "--batches must be positive, got 0 32"),
    (["--generate", "100", "--chunk", "64"], "--chunk (64) must divide --steps (100, default --generate)"),
    (["--steps", "2048"], "--steps must be in [1, --generate = 1024], got 2048"),
    (["--fit", "all"], "--fit: invalid choice: 'all'"),
    (["--prompt", "-1"], "--prompt must be positive"),
    (["--pool-prompt", "512", "64"], "--pool-prompt MIN must not exceed MAX, got 512 64"),
    (["--budget", "0"], "--budget must be a positive number of GB, got 0.0"),
    (["--budget", "lots"], "--budget: invalid float value: 'lots'"),
    (["--states", "fp32", "fp32"], "--states names a state more than once"),
    (["--batches"], "nothing to measure: give --batches, --fit or --pool"),
    (["--pool-slots", "0", "--pool"], "--pool-slots must be positive"),
])
def test_bad_arguments_are_refused_by_name(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        serve.parse_args(argv)
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err
