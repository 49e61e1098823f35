"""``bench.accuracy``: the job list, the tables and targets against independent computations on
constructed records, the time budget, bad input refused by name, and one small run of the whole
pipeline (worker processes on both shipped checkpoints, report, figures)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from bench import accuracy
from bench.accuracy import (TABLE1, TABLE6, all_jobs, build_tables, claim_jobs, markdown, rival_verdicts, run_worker,
                            select_jobs, spread_cell, targets)
from helpers import child_xla_flags

CKPTS = Path(__file__).resolve().parents[1] / "models" / "checkpoints"
METRICS = ("perplexity", "kl_to_fp32", "top1_agreement", "greedy_match_tokens", "state_rel_error")
# method/bits/B/el; step/method; sweep/p/r/method/B/el; method/bits/B/el
LEAD_COLUMNS = {"table1": 3, "table2": 2, "table3": 5, "table6": 3}


def _half_unit(text: str) -> float:
    """Half a unit in the last printed digit of ``text`` ("1.234e-05", "+0.120", "97.152")."""
    mantissa, _, exponent = text.lower().partition("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    return 0.5 * 10.0 ** (int(exponent or 0) - decimals)


def _md_tables(md: str) -> dict:
    """``{(checkpoint, "table1"|"table2"|"table3"): [row cells]}`` parsed from the report."""
    out, ckpt, table = {}, None, None
    for line in md.splitlines():
        if line.startswith("## "):
            ckpt, table = line[3:].strip(), None
        elif line.startswith("### Table "):
            table = f"table{line.split()[2].rstrip(':')}"
            out[(ckpt, table)] = []
        elif line.startswith("### "):
            table = None
        elif table and line.startswith("| ") and not line.startswith("| ---"):
            out[(ckpt, table)].append([c.strip() for c in line.strip().strip("|").split(" | ")])
    for rows in out.values():
        del rows[0]  # the header
    return out


def _check_md_equals_json(md: str, checkpoints: dict) -> int:
    """Every "mean ± spread" cell of the report's tables equals the JSON's numbers to the printed
    digits; rows without numbers carry the JSON's status. Returns the number of cells checked."""
    parsed, checked = _md_tables(md), 0
    for name, ck in checkpoints.items():
        for table, spec in ck["tables"].items():
            rows = parsed[(name, table)]
            assert len(rows) == len(spec["rows"]), (name, table)
            lead = LEAD_COLUMNS[table]
            for md_row, row in zip(rows, spec["rows"]):
                assert row["label"] in md_row[:lead]
                if "cells" not in row:
                    assert md_row[lead] == row["status"]
                    continue
                for text, key in zip(md_row[lead:], spec["columns"]):
                    mean, spread = text.split(" ± ")
                    cell = row["cells"][key]
                    assert abs(float(mean) - cell["mean"]) <= _half_unit(mean) * (1 + 1e-9), (name, row["label"], key)
                    assert abs(float(spread) - cell["spread"]) <= _half_unit(spread) * (1 + 1e-9)
                    checked += 1
    return checked


# ----------------------------------------------------------------------------- jobs and tables


def test_jobs_come_in_priority_order_with_the_configurations_of_their_labels():
    jobs = all_jobs()
    labels = [j.label for j in jobs]
    assert len(set(labels)) == len(labels) == 23 + 32
    assert [j.group for j in jobs] == ["formats"] * 17 + ["sweeps"] * 6 + ["rivals"] * 32
    # Table 6 holds every per-step method there is, each once (and leapquant-alloc, not leapquant-dual)
    from leapquant_jax.leapquant_dual import NAMES as DUAL_NAMES
    from leapquant_jax.methods import METHOD_NAMES, WINDOWED_METHODS

    table6 = [x for group in TABLE6.values() for x in group]
    assert len(set(table6)) == len(table6)
    assert set(table6) - {"leapquant", "leapquant-b6", "leapquant-b4"} == \
        set(METHOD_NAMES) - set(WINDOWED_METHODS) - set(DUAL_NAMES) - {"fp32", "fp16"}
    rivals = select_jobs(None, groups="rivals")
    assert [j.label for j in rivals] == ["fp32"] + [x for x in labels[1:] if x in table6]
    assert [j.label for j in select_jobs(None, groups="sweeps")][1:] == labels[17:23]
    with pytest.raises(ValueError, match="--groups: unknown group 'tables'"):
        select_jobs(None, groups="formats,tables")
    with pytest.raises(ValueError, match="damp: no calibration file"):
        next(j for j in jobs if j.label == "damp").method(None)
    assert labels[:9] == ["fp32", "bf16", "fp8", "int8", "bf16-w", "int8-w", "int8-w+ct", "int8-w+smooth", "leapquant"]
    assert labels.index("leapquant-b4") < labels.index("int6-w") < labels.index("leapquant-p4")
    configs = {j.label: j.method().config for j in jobs if j.group != "rivals" and hasattr(j.method(), "config")}
    for b in (6, 4):
        alone, ct, smooth, full = (configs[x] for x in (f"int{b}-w", f"int{b}-w+ct", f"int{b}-w+smooth",
                                                         f"leapquant-b{b}"))
        assert {c.bits for c in (alone, ct, smooth, full)} == {b}
        assert (alone.compensators, alone.smoothing, ct.compensators, ct.smoothing) == (False, False, True, False)
        assert (smooth.compensators, smooth.smoothing, full.compensators, full.smoothing) == (False, True, True, True)
    sweep = [(c.window, c.effective_rank) for x, c in configs.items() if x.startswith(("leapquant-p", "leapquant-r"))]
    assert sweep == [(4, 4), (8, 4), (32, 4), (16, 2), (16, 8), (16, 16)]
    assert (configs["leapquant"].window, configs["leapquant"].effective_rank, configs["leapquant"].bits) == (16, 4, 8)
    assert all(c.impl == "auto" for c in configs.values())
    tiny = [j.label for j in select_jobs(None, tiny=True)]
    assert "leapquant-b6" in tiny and "leapquant-p8" in tiny
    assert [j.label for j in select_jobs("leapquant-r2,fp32")] == ["fp32", "leapquant-r2"]
    with pytest.raises(ValueError, match="--only: unknown job 'int9'"):
        select_jobs("fp32,int9")
    with pytest.raises(ValueError, match="--only names 'fp32' more than once"):
        select_jobs("fp32,fp32")


def _record(rng, ppl, kl, state, bits=1.0):
    b = len(ppl)
    return {"kind": "job", "result": {"per_row": {
        "perplexity": list(ppl), "kl_to_fp32": list(kl), "top1_agreement": list(rng.uniform(0.9, 1, b)),
        "greedy_match_tokens": list(rng.integers(0, 17, b)), "state_rel_error": list(state)}},
        "bytes_per_element": {"checkpoint": bits, "live": bits + 0.5}}


def test_tables_and_targets_from_constructed_records():
    rng = np.random.default_rng(0)
    fp32 = np.array([10.0, 12.0, 14.0])
    zeros = np.zeros(3)
    records = {
        "fp32": _record(rng, fp32, zeros, zeros, 4.0),
        "leapquant": _record(rng, fp32 * [1.001, 1.002, 1.0], [1e-5] * 3, [1e-3] * 3),     # +0.1 %
        "leapquant-b6": _record(rng, fp32 * 1.02, [1e-4] * 3, [1e-2] * 3),                 # +2 %: misses 1 %
        "leapquant-b4": _record(rng, fp32 * 0.98, [1e-3] * 3, [3e-2] * 3),                 # -2 %: within 3 %
        "int8": _record(rng, fp32, [1e-3] * 3, [1e-2, 2e-2, 3e-2]),
        "int8-w": _record(rng, fp32, [1e-4] * 3, [3e-2] * 3),
        "int8-w+ct": {"kind": "job", "label": "int8-w+ct", "skipped": "time budget"},
    }
    labels = [j.label for j in all_jobs() if j.label != "leapquant-p4"]
    tables = build_tables(records, labels)
    rows1 = {r["label"]: r for r in tables["table1"]["rows"]}
    assert [r["label"] for r in tables["table1"]["rows"]] == list(TABLE1)
    assert rows1["int8-w+ct"]["status"] == "skipped: time budget"
    assert rows1["bf16"]["status"] == "not finished"
    assert {r["label"]: r.get("status") for r in tables["table3"]["rows"]}["leapquant-p4"] == "not run"
    lq = rows1["leapquant"]["cells"]
    np.testing.assert_allclose(lq["dppl_pct"]["mean"], 0.1, rtol=1e-9)
    np.testing.assert_allclose(lq["dppl_pct"]["spread"], 0.1, rtol=1e-9)        # (0.2 - 0.0) / 2
    assert rows1["int8"]["cells"]["state_rel_error"]["mean"] == pytest.approx(2e-2)
    assert rows1["int8"]["cells"]["state_rel_error"]["spread"] == pytest.approx(1e-2)
    # the same row in tables 2 and 3 (leapquant: p = 16, r = 4 in both sweeps)
    assert [r["cells"] for r in tables["table3"]["rows"] if r["label"] == "leapquant"] == [lq, lq]
    met = [(t["target"].split(":")[0], t["met"]) for t in targets(tables)]
    assert met == [("leapquant", True), ("leapquant-b6", False), ("leapquant-b4", True), ("leapquant", True),
                   ("per-step int8 worse than int8-w on KL", True),
                   ("per-step int8 worse than int8-w on state error", False),
                   ("per-step bf16 worse than bf16-w on KL", None),
                   ("per-step bf16 worse than bf16-w on state error", None)]
    results = {"environment": {"date": "d", "jax": "j", "devices": ["cpu"], "command": "c"},
               "config": {"data": "x.npy", "segments": 3, "context": 8, "greedy_tokens": 2, "workers": 2,
                          "time_budget": 1}, "notes": [],
               "checkpoints": {"ck": {"path": "ck", "reference_seconds": [1.0], "jobs": records, "tables": tables,
                                      "targets": targets(tables), "outliers": None, "fig3": None}}}
    md = markdown(results)
    # rows with numbers in tables 1, 2, 3 and 6
    assert _check_md_equals_json(md, results["checkpoints"]) == 6 * (6 + 3 + 2 + 4)
    assert md.count("- **met**") == 4 and md.count("- **not met**") == 2 and md.count("- **not evaluated**") == 2
    assert "half the min-max range" in md


def test_rival_verdicts_compare_at_equal_or_fewer_bytes():
    rng = np.random.default_rng(1)
    one = np.ones(3)
    records = {"fp32": _record(rng, one, 0 * one, 0 * one, 4.0),
               "leapquant": _record(rng, one, 1e-5 * one, 1e-3 * one, 1.2),            # live 1.7 B/el
               "int8": _record(rng, one, 1e-3 * one, 1e-2 * one, 1.0),                 # fewer bytes, worse
               "int8+ef4": _record(rng, one, 2e-3 * one, 5e-4 * one, 1.0),             # fewer bytes, better state
               "int16": _record(rng, one, 1e-6 * one, 1e-4 * one, 2.0),                # better, but more bytes
               "leapquant-b6": _record(rng, one, 1e-4 * one, 1e-4 * one, 1.0)}         # live 1.5 B/el
    verdicts = rival_verdicts(build_tables(records, list(records)))
    assert [(v["leapquant"], v["compared"], [r["label"] for r in v["beaten_by"]]) for v in verdicts] == [
        ("leapquant", 2, ["int8+ef4"]), ("leapquant-b6", 2, [])]
    assert verdicts[0]["beaten_by"][0]["state_rel_error"] == pytest.approx(5e-4)


def test_merge_takes_each_row_from_the_last_run_that_finished_it(tmp_path):
    rng = np.random.default_rng(2)
    one = np.array([10.0, 11.0])

    def part(name, commit, jobs, context=64):
        env = {"date": "d", "jax": "j", "devices": ["cpu"], "commit": commit, "command": f"run {commit}"}
        cfg = {"data": f"/somewhere/{commit}/heldout.npy", "context": context, "segments": 2, "greedy_tokens": 4,
               "error_every": None, "workers": 2, "time_budget": 10, "grace": 1, "jobs": list(jobs)}
        results = {"environment": env, "config": cfg, "notes": [f"note {commit}"], "checkpoints": {"ck": {
            "path": "ck", "reference_seconds": [1.0], "jobs": jobs, "outliers": None}}}
        (tmp_path / name).write_text(json.dumps(results, default=float))
        return str(tmp_path / name)

    first = part("a.json", "aaa", {"fp32": _record(rng, one, 0 * one, 0 * one, 4.0),
                                   "int8": _record(rng, one * 1.01, 1e-3 + 0 * one, 1e-2 + 0 * one),
                                   "leapquant": {"kind": "job", "label": "leapquant", "skipped": "time budget"}})
    lq = _record(rng, one, 1e-5 + 0 * one, 1e-3 + 0 * one)
    second = part("b.json", "bbb", {"leapquant": lq, "int8": {"status": "not finished"}})
    out = accuracy.main(["--merge", first, second, "--out", str(tmp_path / "out")])
    ck = out["checkpoints"]["ck"]
    assert ck["rows_from_run"] == {"fp32": 0, "int8": 0, "leapquant": 1}
    assert ck["jobs"]["leapquant"] == lq and "result" in ck["jobs"]["int8"]
    assert out["environment"]["commit"] == "aaa, bbb" and out["notes"] == ["note aaa", "note bbb"]
    assert ck["targets"][0]["met"] is True                    # leapquant's Δppl against run 0's fp32
    md = next((tmp_path / "out").glob("accuracy-*-merged.md")).read_text()
    assert "Merged from these runs" in md and "`a.json`" in md and "`b.json`" in md
    bad = part("c.json", "ccc", {"fp32": _record(rng, one, 0 * one, 0 * one, 4.0)}, context=128)
    with pytest.raises(SystemExit):
        accuracy.main(["--merge", first, bad, "--out", str(tmp_path / "out2")])


def test_spread_cell_is_half_the_range():
    cell = spread_cell([3.0, 1.0, 2.5])
    assert cell == {"mean": pytest.approx(6.5 / 3), "spread": 1.0, "values": [3.0, 1.0, 2.5]}


# ----------------------------------------------------------------------------- workers


def test_queue_hands_out_each_job_once_and_the_budget_skips_the_rest(tmp_path):
    queue = tmp_path / "queue"
    queue.touch()
    labels = ["fp32", "int8", "leapquant"]
    assert claim_jobs(str(queue), labels) == ["fp32"]
    assert claim_jobs(str(queue), labels) == ["int8"]
    # a worker that starts after its deadline loads nothing and marks what is left
    spec = dict(checkpoint=str(CKPTS / "stdlib-gdn"), name="stdlib-gdn", data="unused.npy", cfg={}, jobs=labels,
                queue=str(queue), jsonl=str(tmp_path / "out.jsonl"), worker=1, start=time.time() - 10,
                deadline=time.time() - 1, fig6=None)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert run_worker(str(tmp_path / "spec.json")) == 0
    events = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert events == [{"kind": "job", "label": "leapquant", "skipped": "time budget", "checkpoint": "stdlib-gdn",
                       "worker": 1}]
    assert claim_jobs(str(queue), labels) == []


@pytest.mark.parametrize("extra, message", [
    (["--only", "fp32,int9"], "--only: unknown job 'int9'"),
    (["--workers", "1"], "--workers 1: need at least one per checkpoint (2)"),
    (["--segments", "9"], "--segments 9 x --context 96 = 864 tokens, but --data"),
    (["--error-every", "200"], "error_every (200) is more than the 96 tokens decoded per row"),
    (["--checkpoints", "models"], "is not a checkpoint directory"),
])
def test_bad_input_is_refused_by_name(tmp_path, capsys, extra, message):
    np.save(tmp_path / "ids.npy", np.arange(300, dtype=np.uint16))
    with pytest.raises(SystemExit) as err:
        accuracy.main(["--context", "96", "--segments", "2", "--workers", "2", "--error-every", "32",
                       "--data", str(tmp_path / "ids.npy"), "--out", str(tmp_path / "out")] + extra)
    assert err.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- the whole pipeline


def test_tiny_run_writes_the_tables_targets_and_figures(tmp_path, monkeypatch):
    # Both shipped checkpoints, one worker each, on their held-out snippets; two jobs (the fp32
    # reference and per-step int8) keep it short: each job is a new compiled program on the CPU,
    # where the workers' XLA favours compile time (they inherit XLA_FLAGS).
    if jax.default_backend() == "cpu":
        monkeypatch.setenv("XLA_FLAGS", " ".join(filter(None, [os.environ.get("XLA_FLAGS"), child_xla_flags()])))
    snippets = [json.loads((CKPTS / c / "heldout_snippet.json").read_text())["ids"]
                for c in ("stdlib-gdn", "stdlib-kda")]
    data = tmp_path / "heldout.npy"
    np.save(data, np.concatenate(snippets)[:200].astype(np.uint16))
    out = tmp_path / "results"
    results = accuracy.main(["--tiny", "--only", "fp32,int8", "--data", str(data), "--out", str(out),
                             "--commit", "abc"])
    files = sorted(p.name for p in out.iterdir())
    stamp = next(m.group(1) for m in map(re.compile(r"(accuracy-\d{8}-\d{6})\.json").fullmatch, files) if m)
    assert files == sorted([f"{stamp}.json", f"{stamp}.jsonl", f"{stamp}.md"] +
                           [f"{stamp}-fig{n}-stdlib-{m}.png" for n in (3, 6) for m in ("gdn", "kda")])
    saved = json.loads((out / f"{stamp}.json").read_text())
    assert saved["checkpoints"].keys() == results["checkpoints"].keys() == {"stdlib-gdn", "stdlib-kda"}
    assert saved["environment"]["commit"] == "abc" and saved["config"]["segments"] == 2
    events = [json.loads(x) for x in (out / f"{stamp}.jsonl").read_text().splitlines()]
    assert sorted((e["checkpoint"], e["kind"], e.get("label")) for e in events) == sorted(
        [(c, k, None) for c in ("stdlib-gdn", "stdlib-kda") for k in ("reference", "outliers")] +
        [(c, "job", x) for c in ("stdlib-gdn", "stdlib-kda") for x in ("fp32", "int8")])
    md = (out / f"{stamp}.md").read_text()
    for name, ck in saved["checkpoints"].items():
        jobs = ck["jobs"]
        for label in ("fp32", "int8"):
            per_row = jobs[label]["result"]["per_row"]
            cells = {r["label"]: r for r in ck["tables"]["table1"]["rows"]}[label]["cells"]
            for key in METRICS:
                assert len(per_row[key]) == 2
                np.testing.assert_allclose(cells[key]["mean"], np.mean(per_row[key]), rtol=1e-12)
                np.testing.assert_allclose(cells[key]["spread"], np.ptp(per_row[key]) / 2, rtol=1e-12, atol=1e-300)
            assert jobs[label]["result"]["state_error_curve"]["tokens"] == [32, 64, 96]
        fp32, int8 = jobs["fp32"]["result"]["per_row"], jobs["int8"]["result"]["per_row"]
        assert fp32["kl_to_fp32"] == [0.0, 0.0] and fp32["top1_agreement"] == [1.0, 1.0]
        assert all(x > 0 for x in int8["kl_to_fp32"] + int8["state_rel_error"])
        assert jobs["fp32"]["bytes_per_element"]["live"] == 4.0 and jobs["int8"]["bytes_per_element"]["live"] < 1.1
        assert len(ck["targets"]) == 8
        o = ck["outliers"]
        assert o["figure"] == f"{stamp}-fig6-{name}.png" and min(o["peak_over_median"].values()) > 1
        assert max(max(rows) for layer in o["state_peak_over_median_all"].values() for rows in layer) == \
            pytest.approx(o["peak_over_median"]["state"])
        for title in ("### Table 1", "### Table 2", "### Table 3", "### Table 6", "### Targets", "### Figure 6"):
            assert md.split(f"## {name}\n")[1].split("\n## ")[0].count(title) == 1, (name, title)
    assert len(re.findall(r"^- \*\*(met|not met|not evaluated)\*\*: ", md, flags=re.M)) == 16
    # fp32 and int8 in table 1, int8 in tables 2 and 6
    assert _check_md_equals_json(md, saved["checkpoints"]) == 2 * (6 + 6 + 6 + 6)
