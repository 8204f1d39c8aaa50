"""RL on `repo` end to end on the CPU: 16 episodes at once in the online pipeline, each with its own sandboxed
workspace and a fresh sandbox to grade it, for a few steps; every sandbox is closed when the run ends."""

import gc
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from assay.core.config import load_config
from assay.core.storage import trajectory_shards
from assay.pipeline.async_pipeline import AsyncPipeline
from assay.sandbox import pool
from assay.sandbox.client import get_launcher
from assay.sandbox.launcher import IDLE_WORKERS, SPARE_SANDBOXES


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = next(line for line in status.read_text().splitlines() if line.startswith("PPid:"))
        except (OSError, StopIteration):
            continue
        parents[int(status.parent.name)] = int(ppid.split()[1])
    return parents


def sandbox_leftovers() -> tuple[int, int, int]:
    """With this process's warm pools closed: the launcher's workspace mounts, its direct children and the
    processes below those. At rest it keeps its spare sandboxes and its idle workers, and nothing runs."""
    with pool._shared_lock:
        for warm in pool._shared.values():
            warm.close()
        pool._shared.clear()
    gc.collect()  # a volume is released by its finalizer; some episodes' sit in reference cycles until collected
    launcher = get_launcher().proc.pid
    mounts = sum(line.split()[4].startswith("/v/") for line in Path(f"/proc/{launcher}/mountinfo").read_text().splitlines())
    parents = _parents()
    children = {p for p, pp in parents.items() if pp == launcher}
    grandchildren = {p for p, pp in parents.items() if pp in children}
    return mounts, len(children), len(grandchildren)


@pytest.mark.slow
def test_rl_on_repo_runs_sixteen_episodes_at_once_and_leaks_no_sandbox(tiny_config, tmp_path):
    domain = {"name": "repo", "env": "repo@4", "group_size": 4, "max_new_tokens": 24, "max_turns": 12,
              "max_context": 6144,  # a level-2 package in a 400-token vocabulary
              "difficulty": {"min": 1, "max": 2, "start": 1, "schedule": "uniform"}}
    cfg = load_config(tiny_config(name="repo_rl", domains=[domain]),
                      ["model.max_position=8192",
                       "train.steps=2", "train.groups_per_step=4", "train.checkpoint_every=2", "pipeline.online=true",
                       "pipeline.mode=async", "train.max_refill_rounds=0", "eval.every=0"])
    AsyncPipeline(cfg, tmp_path / "repo_rl").run()
    records = [json.loads(line) for line in (tmp_path / "repo_rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    rows = [r for shard in trajectory_shards(tmp_path / "repo_rl" / "trajectories")
            for r in pq.read_table(shard, columns=["step", "status", "turns", "finish_reason"]).to_pylist()]
    assert len([r for r in rows if r["step"] == 1]) == 16  # 4 groups of 4, in one online batch
    assert all(r["status"] == "ok" for r in rows), {r["status"] for r in rows}  # no sandbox failed
    assert all(r["turns"] >= 1 for r in rows)  # every episode sampled (an untrained policy seldom calls a tool)
    mounts, workers, running = sandbox_leftovers()  # every episode's and every grader's sandbox is released
    assert (workers, running) == (IDLE_WORKERS, 0) and mounts <= SPARE_SANDBOXES, (mounts, workers, running)
