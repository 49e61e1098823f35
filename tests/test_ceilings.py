"""``bench.ceilings``: the bounds of the amortised window recomputed from a run's rows."""

from __future__ import annotations

import json

import pytest

from bench.ceilings import WANTED, ceilings, main


def _run(fla=800.0, window=250.0, step=170.0, flush=1280.0, loads=(130.0, 120.0), mode="GDN"):
    row = lambda impl, kind, us, **kw: dict(impl=impl, kind=kind, us=us, batch=512, heads=32, mode=mode, bytes=4e8,
                                            **kw)
    timings = [row("FLA fp32 fused_recurrent", "fla", fla),
               row("LeapQuant int8 p=16 (steps + flush, per step)", "lq-window", window, bits=8),
               row("LeapQuant int8 step only (mean over window)", "lq-steps", step, bits=8),
               row("LeapQuant int8 flush (per flush)", "lq-flush", flush, bits=8),
               row("LeapQuant int8 Triton step (mean over window)", "lq-steps-triton", 999.0, bits=8),
               row("FLA fp32 fused_recurrent", "fla", 1.0) | dict(batch=32)]
    load_only = [dict(mode=mode, batch=512, us=u, interpret=False, bytes=4e8) for u in loads]
    load_only.append(dict(mode=mode, batch=512, us=float("nan"), interpret=False, bytes=4e8, error="skipped"))
    return dict(bits=8, timings=timings, load_only=load_only)


def test_bounds_follow_the_window_arithmetic():
    c = ceilings(_run(), flush_target_us=600.0)["GDN"]
    rows = {label: (us, ratio) for label, us, ratio in c["rows"]}
    assert rows["measured"] == (250.0, 800.0 / 250.0)
    assert rows["last step free"][0] == pytest.approx(250.0 - 170.0 / 16)
    assert rows["flush at 600 µs"][0] == pytest.approx(170.0 + 600.0 / 16)
    assert rows["flush at 600 µs, last step free"][0] == pytest.approx((15 * 170.0 + 600.0) / 16)
    # the fastest load-only variant, the NaN (skipped) one ignored
    assert c["load_only_us"] == 120.0
    assert rows["load-only step, flush at 600 µs"][0] == pytest.approx(120.0 + 600.0 / 16)
    assert rows["load-only step, no flush"] == (120.0, 800.0 / 120.0)
    # GDN's target ratio r: 800 / r µs per token-step; 16 (goal - 170) µs of flush; goal - 37.5 of step
    goal = 800.0 / WANTED["GDN"]
    assert c["goal_us"] == pytest.approx(goal)
    assert c["flush_us_for_target"] == pytest.approx(16 * (goal - 170.0))
    assert c["step_us_for_target"] == pytest.approx(goal - 37.5)


def test_a_mode_without_its_rows_is_skipped_with_the_reason():
    found = ceilings(_run())
    assert "skipped" in found["KDA"] and "fla" in found["KDA"]["skipped"]
    no_loads = ceilings(_run(loads=()))["GDN"]
    assert no_loads["load_only_us"] is None and len(no_loads["rows"]) == 4


def test_load_only_rows_of_another_run_count_only_with_the_steps_bytes():
    other = [dict(mode="GDN", batch=512, us=100.0, interpret=False, bytes=4e8),
             dict(mode="GDN", batch=512, us=50.0, interpret=False, bytes=3e8),     # other bytes: not this step's
             dict(mode="GDN", batch=512, us=40.0, interpret=True, bytes=4e8)]      # interpret mode: no timing
    assert ceilings(_run(loads=()), load_rows=other)["GDN"]["load_only_us"] == 100.0
    assert ceilings(_run(), load_rows=other)["GDN"]["load_only_us"] == 100.0


def test_cli_writes_the_tables(tmp_path, capsys):
    path = tmp_path / "k.json"
    path.write_text(json.dumps(_run(mode="KDA")))
    out = tmp_path / "c.md"
    main([str(path), "--out", str(out)])
    text = out.read_text()
    assert "## KDA" in text and "| last step free |" in text and f"target ≥ {WANTED['KDA']:.1f}×" in text
    assert text.strip() == capsys.readouterr().out.strip()
    with pytest.raises(SystemExit, match="cannot read"):
        main([str(tmp_path / "missing.json")])
    loads = tmp_path / "loads.json"
    loads.write_text(json.dumps(dict(load_only=[dict(mode="KDA", batch=512, us=90.0, interpret=False, bytes=4e8)])))
    main([str(path), "--load-only-from", str(loads), "--flush-target-us", "480"])
    text = capsys.readouterr().out
    assert "load-only step 90.0 µs" in text and "| load-only step, flush at 480 µs | 120.0 |" in text
