"""`assay bench rollout` on a tiny model: every row is produced, each in a process of its own, and the
engine's own counters hold (a smoke test of the harness; speed is read from the real benchmark, never
asserted here)."""

import subprocess
import sys
import time

import pytest

from assay.bench.cpu_stat import tree_cpu_s
from assay.bench.rollout import (
    QUICK_MODEL,
    QUICK_WORKLOADS,
    Settings,
    machine_cpu_s,
    run_rollout_bench,
    summarize,
    table,
)


@pytest.mark.slow  # a fresh process per backend and workload: `make test-slow` (CI runs it)
def test_bench_rollout_alternates_fresh_processes_and_reports_every_workload():
    settings = Settings(model=QUICK_MODEL, kv_cache_mb=16, threads=1)
    rows = run_rollout_bench(settings, QUICK_WORKLOADS, ("hf", "engine"), rounds=2, echo=False)
    grpo, turns = (w.name for w in QUICK_WORKLOADS)
    # the second round starts with the other backend
    assert [(r.workload, r.backend) for r in rows] == [
        (grpo, "hf"), (grpo, "engine"), (turns, "hf"), (turns, "engine"),
        (grpo, "engine"), (grpo, "hf"), (turns, "engine"), (turns, "hf")]
    w = QUICK_WORKLOADS[0]
    for r in rows:
        assert r.seconds > 0 and r.peak_rss_mb > 0 and not r.note
        assert r.busy_s >= 0 and r.steal_s >= 0 and r.own_s >= 0  # measured (ticks of 10 ms: a tiny run may read 0)
        assert r.page_faults is not None and r.page_faults >= 0
        if r.workload == grpo:  # every sample runs to its limit on every backend: the same work
            assert r.tokens == w.prompts * w.group * w.max_tokens
    engine_grpo = next(r for r in rows if r.workload == grpo and r.backend == "engine")
    assert engine_grpo.hit_rate >= (w.group - 1) / w.group  # every sample after the first shares the prompt
    engine_turns = next(r for r in rows if r.workload == turns and r.backend == "engine")
    assert engine_turns.hit_rate > 0.5  # each turn re-reads its history from the cache
    summary = {(s["workload"], s["backend"]): s for s in summarize(rows)}
    assert summary[(grpo, "hf")]["x_hf"] == 1.0 and summary[(grpo, "engine")]["runs"] == 2
    text = table(rows, settings)
    assert "× HF" in text and "assay engine" in text


def test_a_backend_that_fails_is_a_row_naming_the_error():
    rows = run_rollout_bench(Settings(model=QUICK_MODEL, kv_cache_mb=16), QUICK_WORKLOADS[:1], ("warp-drive",),
                             echo=False)
    assert rows[0].tokens == 0 and "unknown backend 'warp-drive'" in rows[0].note
    summary = summarize(rows)
    assert "runs" not in summary[0] and summary[0]["note"] == rows[0].note


def test_the_machines_busy_cpu_seconds_rise_with_work_done_here():
    before = machine_cpu_s()
    end = time.process_time() + 0.3
    while time.process_time() < end:  # 0.3 s of this process's CPU time
        pass
    after = machine_cpu_s()
    assert after[0] - before[0] >= 0.2  # ticks of 10 ms; other processes only add to it
    assert after[1] >= before[1]


def test_a_process_trees_cpu_seconds_count_its_childrens_work():
    before = tree_cpu_s()
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.4\n"
                              "while time.process_time() < end: pass"])
    time.sleep(0.2)
    live = tree_cpu_s()  # the child still running counts
    child.wait()
    after = tree_cpu_s()  # and once reaped, through the parent's children's time
    assert live is not None and after - before >= 0.3 and after >= live
    assert tree_cpu_s(root=2**22 + 1) is None  # no such process
