"""`assay bench agent --scripted`: each context countermeasure against the failure it is for, on real repo tasks."""

from assay.bench.countermeasures import run_countermeasures, table


def test_each_switch_turns_its_scripted_failure_into_a_pass():
    rows, setup = run_countermeasures(("overflow", "drift"), per_level=1, levels=(4,))
    by = {(r.failure, r.setting): r.trajs[0] for r in rows}
    assert by["overflow", "off"].finish_reason == "context" and not by["overflow", "off"].passed
    for setting in ("compaction", "compaction + memory"):
        t = by["overflow", setting]
        assert t.passed and t.compactions >= 1 and t.peak_context <= setup["limits"].max_context
    assert by["overflow", "compaction + memory"].memory_calls >= 2  # wrote the snippet down, read it back
    assert not by["drift", "off"].passed
    assert by["drift", "plan_execute"].passed and by["drift", "plan_execute"].plan_turns >= 1
    text = table(rows, setup)
    assert "| overflow | compaction | 1.00 |" in text and "| drift | plan_execute | 1.00 |" in text
