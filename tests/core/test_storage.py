import pandas as pd
import pytest

from assay.core.errors import AssayError
from assay.core.storage import TrajectoryWriter, prepare_run_dir, read_metrics, read_trajectories
from assay.core.types import Message, Task, ToolCall, ToolSpec, Trajectory


def make_traj(i: int) -> Trajectory:
    task = Task(env="toolcalc@2", task_id=f"t{i}", domain="agent", difficulty=2,
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


def test_resumed_writer_never_overwrites(tmp_path):
    TrajectoryWriter(tmp_path).write([make_traj(0)], step=1)
    TrajectoryWriter(tmp_path).write([make_traj(1)], step=1)  # a resume re-running step 1
    assert len(list(read_trajectories(tmp_path))) == 2


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
