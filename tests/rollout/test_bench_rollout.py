"""`assay bench rollout` on a tiny model: every row is produced and the engine's own counters hold
(a smoke test of the harness; speed is read from the real benchmark, never asserted here)."""

from assay.bench.rollout import QUICK, run_rollout_bench, table


def test_bench_rollout_reports_every_workload_and_the_group_hit_rate():
    rows, meta = run_rollout_bench(QUICK, hf_paged=False)
    assert [(r.workload, r.backend) for r in rows] == [
        ("a: GRPO", "HF generate"), ("a: GRPO", "assay engine"),
        ("b: multi-turn", "HF generate"), ("b: multi-turn", "assay engine")]
    assert all(r.tokens > 0 and r.seconds > 0 for r in rows)
    grpo = rows[1]
    assert grpo.hit_rate >= (QUICK.group - 1) / QUICK.group  # every sample after the first shares the prompt
    assert rows[3].hit_rate > 0.5  # each turn re-reads its history from the cache
    text = table(rows, meta)
    assert "× HF generate" in text and "assay engine" in text
