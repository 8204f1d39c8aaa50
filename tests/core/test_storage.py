import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pandas as pd
import pytest

from assay.core.errors import AssayError
from assay.core.storage import (
    TrajectoryWriter,
    prepare_run_dir,
    read_metrics,
    read_trajectories,
    release_run_dir,
    run_dir_holder,
    trajectory_shards,
)
from assay.core.types import Message, Task, ToolCall, ToolSpec, Trajectory


def make_traj(i: int) -> Trajectory:
    task = Task(env="toolcalc@4", task_id=f"t{i}", domain="agent", difficulty=2,
                prompt=[Message("user", f"q{i}")], tools=[ToolSpec("lookup", "get", {"type": "object"})],
                payload={"answer": i}, seed=i, env_hash="abc")
    msgs = [Message("assistant", "", [ToolCall("lookup", {"key": "x"})]), Message("tool", "5", name="lookup"),
            Message("assistant", "Answer: 5")]
    return Trajectory(task=task, messages=msgs, token_ids=[1, 2, 3, 4], loss_mask=[0, 1, 0, 1],
                      logprobs=[0.0, -0.5, 0.0, -1.25], prompt_len=1, policy_version=3, turns=2, tool_errors=1,
                      finish_reason="stop", reward=1.0, passed=True, reward_info={"why": "ok"}, env_hash="abc",
                      timings={"generate_s": 0.1}, group_id="g")


def test_trajectories_round_trip_and_read_by_pandas(tmp_path):
    writer = TrajectoryWriter(tmp_path / "trajectories")
    writer.write([make_traj(0), make_traj(1)], step=1)
    writer.write([make_traj(2)], step=2)
    back = list(read_trajectories(tmp_path / "trajectories"))
    assert [t.task.task_id for t in back] == ["t0", "t1", "t2"]
    assert back[0] == make_traj(0)
    df = pd.read_parquet(tmp_path / "trajectories")
    assert len(df) == 3 and set(df["step"]) == {1, 2}
    assert list(df.iloc[0]["loss_mask"]) == [0, 1, 0, 1]


def test_resumed_writer_never_overwrites_and_readers_keep_the_surviving_history(tmp_path):
    first = TrajectoryWriter(tmp_path)
    for step in (1, 2, 3, 4):
        first.write([make_traj(step)], step=step)
    # crashed after step 4 with its last checkpoint at step 2: the resume re-runs steps 3 and 4
    resumed = TrajectoryWriter(tmp_path, start_step=2)
    resumed.write([make_traj(13)], step=3)
    assert len(trajectory_shards(tmp_path, superseded=True)) == 5  # nothing on disk is overwritten or lost
    assert [t.task.task_id for t in read_trajectories(tmp_path)] == ["t1", "t2", "t13"]  # step 4 of attempt 0 too
    TrajectoryWriter(tmp_path, start_step=3).write([make_traj(14)], step=4)
    assert [t.task.task_id for t in read_trajectories(tmp_path)] == ["t1", "t2", "t13", "t14"]


def test_metrics_after_a_resume_supersede_the_steps_run_again(tmp_path):
    lines = [{"step": s, "kind": "train", "v": s} for s in (1, 2, 3)] + [{"step": 3, "kind": "eval"}]
    lines += [{"step": 1, "kind": "resume", "resumed_from": 1}, {"step": 2, "kind": "train", "v": 20}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    kept = read_metrics(tmp_path)
    assert [(r["kind"], r["step"], r.get("v")) for r in kept] == [("train", 1, 1), ("resume", 1, None), ("train", 2, 20)]


def test_torn_writes_leave_earlier_data_readable(tmp_path):
    TrajectoryWriter(tmp_path).write([make_traj(0)], step=1)
    (tmp_path / ".shard.x.tmp").write_bytes(b"PAR1 half a file")  # a crash mid-write
    assert len(list(read_trajectories(tmp_path))) == 1
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "kind": "train"}\n{"step": 2, "ki')
    assert read_metrics(tmp_path) == [{"step": 1, "kind": "train"}]


def test_unwritable_run_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(AssayError, match="not writable"):
        prepare_run_dir(blocker, "x")


def test_the_schema_is_derived_from_the_dataclasses():
    from dataclasses import fields

    from assay.core.storage import TRAJECTORY_SCHEMA
    from assay.core.types import Task, Trajectory

    expected = {"step"} | {f.name for f in fields(Task)} | {f.name for f in fields(Trajectory)} - {"task"}
    assert set(TRAJECTORY_SCHEMA.names) == expected


def test_a_shard_from_before_a_field_was_added_reads_with_its_default(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from assay.core.storage import TRAJECTORY_SCHEMA, trajectory_row

    old = make_traj(0)
    new = make_traj(0)
    new.malformed_calls, new.retries = 2, 1
    gone = ("malformed_calls", "retries")  # columns a shard written before the retry counters lacks
    schema = pa.schema([f for f in TRAJECTORY_SCHEMA if f.name not in gone])
    pq.write_table(pa.Table.from_pylist([trajectory_row(new, 1)], schema=schema), tmp_path / "step_000001_a0.parquet")
    TrajectoryWriter(tmp_path).write([new], step=2)
    first, second = read_trajectories(tmp_path)
    assert first == old and (first.malformed_calls, first.retries) == (0, 0)
    assert second == new


def test_a_fresh_run_never_mixes_with_an_earlier_one_in_its_directory(tmp_path):
    """A second run under the same name would append to the first's metrics and take its checkpoint for its
    own last: `refuse` says so, `move` keeps the first aside, `reuse` (a resume) leaves it in place."""
    import pytest

    from assay.core.errors import AssayError

    first = prepare_run_dir(tmp_path, "r", existing="refuse")
    (first / "metrics.jsonl").write_text('{"step": 1}\n')
    assert prepare_run_dir(tmp_path, "r", existing="refuse") == first  # metrics alone: an attempt to redo
    (first / "checkpoints" / "step_5").mkdir(parents=True)
    with pytest.raises(AssayError, match=r"already holds a run .*--resume .*name=NAME"):
        prepare_run_dir(tmp_path, "r", existing="refuse")
    assert prepare_run_dir(tmp_path, "r") == first and (first / "checkpoints" / "step_5").is_dir()
    again = prepare_run_dir(tmp_path, "r", existing="move")
    (aside,) = tmp_path.glob("r.prev-*")
    assert again == first and [p.name for p in again.iterdir()] == [".lock"]
    assert (aside / "checkpoints" / "step_5").is_dir() and (aside / "metrics.jsonl").read_text() == '{"step": 1}\n'


@contextmanager
def held_elsewhere(root, name: str) -> Iterator[subprocess.Popen]:
    """RUN_DIR `root/name` prepared and held by another process, for as long as the block runs."""
    holder = subprocess.Popen([sys.executable, "-c", "import time\n"
                               "from assay.core.storage import prepare_run_dir\n"
                               f"prepare_run_dir({str(root)!r}, {name!r})\n"
                               "print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def test_a_run_directory_in_use_by_another_process_is_neither_reused_nor_moved(tmp_path):
    """A second job under a running job's name (a bench relaunching an unfinished seed) would interleave its
    records with the live run's, or move the live run's directory from under it: refused, naming the holder."""
    with held_elsewhere(tmp_path, "live") as holder:
        for existing in ("reuse", "refuse", "move"):
            with pytest.raises(AssayError, match=rf"in use by a running process \(pid {holder.pid} on .*name=NAME"):
                prepare_run_dir(tmp_path, "live", existing=existing)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["live"]  # not moved aside
    run = prepare_run_dir(tmp_path, "live", existing="move")  # the holder gone, its lock went with it
    assert prepare_run_dir(tmp_path, "live") == run  # and this process may come back to its own run


def test_a_finished_job_lets_go_of_its_run_directory(tmp_path):
    run = prepare_run_dir(tmp_path, "done")
    release_run_dir(run)  # as a job's end does: another process (a resume, a report) may take it
    taken = subprocess.run([sys.executable, "-c", "from assay.core.storage import prepare_run_dir\n"
                            f"prepare_run_dir({str(tmp_path)!r}, 'done')"], capture_output=True, text=True)
    assert taken.returncode == 0, taken.stderr


def test_a_bench_refuses_to_relaunch_a_seed_that_is_still_running(tmp_path):
    """Relaunching it would truncate the live run's log and write into its directory."""
    from assay.bench.learning import run_seeds

    with held_elsewhere(tmp_path, "b_s0") as holder:
        (tmp_path / "b_s0.log").write_text("the live run's log")
        assert run_dir_holder(tmp_path / "b_s0") == f"pid {holder.pid} on {socket.gethostname()}"
        with pytest.raises(AssayError, match=r"b_s0 is in use by a running process .*finished seeds are reused"):
            run_seeds([0], "b", tmp_path, [], jobs=1, threads=1)
        assert (tmp_path / "b_s0.log").read_text() == "the live run's log"
    assert run_dir_holder(tmp_path / "b_s0") is None
