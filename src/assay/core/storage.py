"""The run directory: resolved config, metrics, trajectories as append-only Parquet shards.

Every file is written atomically (temp file + rename) or appended line by line, so a crash
leaves everything already recorded readable."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from assay.core.atomic import atomic_path
from assay.core.atomic import atomic_write as atomic_write  # re-exported for the run directory's writers
from assay.core.errors import AssayError
from assay.core.types import Message, Task, ToolCall, ToolSpec, Trajectory

# Parquet schema: scalars as columns, token-level data as typed lists, nested structures as JSON.
TRAJECTORY_SCHEMA = pa.schema([
    ("step", pa.int64()),
    ("group_id", pa.string()),
    ("env", pa.string()),
    ("env_hash", pa.string()),
    ("task_id", pa.string()),
    ("domain", pa.string()),
    ("difficulty", pa.int32()),
    ("seed", pa.int64()),
    ("prompt", pa.string()),  # JSON list of messages
    ("tools", pa.string()),  # JSON list of tool specs
    ("payload", pa.string()),  # JSON: hidden answer/tests
    ("messages", pa.string()),  # JSON list of messages
    ("token_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("logprobs", pa.list_(pa.float32())),
    ("prompt_len", pa.int32()),
    ("policy_version", pa.int64()),
    ("turns", pa.int32()),
    ("tool_errors", pa.int32()),
    ("finish_reason", pa.string()),
    ("reward", pa.float64()),
    ("passed", pa.bool_()),
    ("reward_info", pa.string()),  # JSON
    ("status", pa.string()),
    ("timings", pa.string()),  # JSON
])


def _messages_json(messages: Sequence[Message]) -> str:
    return json.dumps([asdict(m) for m in messages])


def _messages_from(text: str) -> list[Message]:
    out = []
    for m in json.loads(text):
        m["tool_calls"] = [ToolCall(**c) for c in m.get("tool_calls", [])]
        out.append(Message(**m))
    return out


def trajectory_row(t: Trajectory, step: int) -> dict[str, Any]:
    task = t.task
    return {
        "step": step, "group_id": t.group_id, "env": task.env, "env_hash": t.env_hash or task.env_hash,
        "task_id": task.task_id, "domain": task.domain, "difficulty": task.difficulty, "seed": task.seed,
        "prompt": _messages_json(task.prompt), "tools": json.dumps([s.to_json() for s in task.tools]),
        "payload": json.dumps(task.payload, default=str), "messages": _messages_json(t.messages),
        "token_ids": t.token_ids, "loss_mask": t.loss_mask, "logprobs": t.logprobs, "prompt_len": t.prompt_len,
        "policy_version": t.policy_version, "turns": t.turns, "tool_errors": t.tool_errors,
        "finish_reason": t.finish_reason, "reward": t.reward, "passed": t.passed,
        "reward_info": json.dumps(t.reward_info, default=str), "status": t.status,
        "timings": json.dumps(t.timings),
    }


def trajectory_from_row(r: dict[str, Any]) -> Trajectory:
    task = Task(env=r["env"], task_id=r["task_id"], domain=r["domain"], difficulty=r["difficulty"],
                prompt=_messages_from(r["prompt"]), tools=[ToolSpec(**s) for s in json.loads(r["tools"])],
                payload=json.loads(r["payload"]), seed=r["seed"], env_hash=r["env_hash"])
    return Trajectory(
        task=task, messages=_messages_from(r["messages"]), token_ids=list(r["token_ids"]),
        loss_mask=list(r["loss_mask"]), logprobs=list(r["logprobs"]), prompt_len=r["prompt_len"],
        policy_version=r["policy_version"], turns=r["turns"], tool_errors=r["tool_errors"],
        finish_reason=r["finish_reason"], reward=r["reward"], passed=r["passed"],
        reward_info=json.loads(r["reward_info"]), status=r["status"], env_hash=r["env_hash"],
        timings=json.loads(r["timings"]), group_id=r["group_id"])


class TrajectoryWriter:
    """Append-only shards: one Parquet file per write, complete or absent."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        # A resumed run writes beside the earlier attempt's shards, never over them. The marker is
        # a dot-file so that readers of the directory as one dataset (pandas, DuckDB) skip it.
        self.attempt = sum(1 for _ in directory.glob(".attempt_*"))
        (directory / f".attempt_{self.attempt}").touch()

    def write(self, trajectories: Sequence[Trajectory], step: int) -> Path | None:
        if not trajectories:
            return None
        table = pa.Table.from_pylist([trajectory_row(t, step) for t in trajectories], schema=TRAJECTORY_SCHEMA)
        path = self.directory / f"step_{step:06d}_a{self.attempt}.parquet"
        with atomic_path(path) as tmp:
            pq.write_table(table, tmp)
        return path


def read_trajectories(directory: Path) -> Iterator[Trajectory]:
    for shard in sorted(directory.glob("*.parquet")):
        for row in pq.read_table(shard).to_pylist():
            yield trajectory_from_row(row)


class MetricsLogger:
    """metrics.jsonl (one flushed line per step) plus TensorBoard scalars."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)
        from torch.utils.tensorboard import SummaryWriter  # heavy import, only when logging

        self._tb = SummaryWriter(log_dir=str(run_dir / "tb"))

    def log(self, step: int, metrics: dict[str, float | str], kind: str = "train") -> None:
        record = {"step": step, "kind": kind, "time": time.time(), **metrics}
        self._file.write(json.dumps(record) + "\n")
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self._tb.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        self._file.close()
        self._tb.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise AssayError(f"{path} not found; is {run_dir} a run directory (runs/NAME)?")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line torn by a crash: everything before it stands
            continue
    return records


def prepare_run_dir(root: str | Path, name: str) -> Path:
    run_dir = Path(root) / name
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise AssayError(f"run directory {run_dir} is not writable ({e.strerror}); "
                         f"choose another with run_dir=PATH or name=NAME") from None
    return run_dir
