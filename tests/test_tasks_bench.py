"""``bench.tasks``: the targets read off an accuracy table built here by hand."""

from bench.tasks import deal_states, targets


def _table(**rows):
    return {"results": {k: dict(zip(("1024", "4096"), v)) for k, v in rows.items()}}


def test_targets_on_a_constructed_table():
    r = _table(fp32=(1.0, 0.90), int8=(0.99, 0.70), leapquant=(1.0, 0.895), **{
        "leapquant-b6": (0.99, 0.85), "leapquant-alloc-4": (0.98, 0.60), "stepquant-4": (0.97, 0.60),
        "leapquant-alloc-6": (1.0, 0.86), "stepquant-6": (0.99, 0.85)})
    lines = targets(r, [1024, 4096])
    assert lines[0].startswith("**met**: per-step int8") and "+20.0 points at 4096" in lines[0]
    assert lines[1].startswith("**met**: leapquant within 1") and "+0.5 points at 4096" in lines[1]
    assert lines[2].startswith("**not met**: leapquant-b6 within 2") and "+5.0 points at 4096" in lines[2]
    # alloc-4 level with stepquant-4 at 4096: not strictly above there
    assert lines[3].startswith("**not met**: leapquant-alloc-4 above stepquant-4") and "+0.0 points at 4096" in lines[3]
    assert lines[4].startswith("**met**: leapquant-alloc-6 at least stepquant-6") and "+1.0 points at 1024" in lines[4]
    assert targets({"results": {"int8": {"1024": 1.0}}}, [1024]) == ["fp32 did not run: no target can be evaluated"]


def test_states_dealt_round_robin_with_fp32_in_each_run():
    runs = deal_states("fp32,a,b,c", 2)
    assert len(runs) == 2 and all(r.split(",")[0] == "fp32" for r in runs)
    assert sorted(sum((r.split(",")[1:] for r in runs), [])) == ["a", "b", "c"]
