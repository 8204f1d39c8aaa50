"""The run directory: resolved config, metrics, trajectories as append-only Parquet shards.

Every file is written atomically (temp file + rename) or appended line by line, so a crash
leaves everything already recorded readable."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, get_origin, get_type_hints

import pyarrow as pa
import pyarrow.parquet as pq

from assay.core.atomic import atomic_path
from assay.core.atomic import atomic_write as atomic_write  # re-exported for the run directory's writers
from assay.core.errors import AssayError
from assay.core.loggers import RunInfo, close_sinks, open_sinks
from assay.core.types import Message, Task, ToolCall, ToolSpec, Trajectory

log = logging.getLogger(__name__)

# Parquet columns, derived from the dataclasses so the schema cannot drift from them: a Trajectory's
# fields and its Task's, flattened (one env_hash: the trajectory's, else the task's), plus the step.
# Scalars are columns, token-level data typed lists, everything else JSON text.
_SCALARS = {int: pa.int64(), float: pa.float64(), bool: pa.bool_(), str: pa.string()}
_TOKEN_LISTS = {"token_ids": pa.list_(pa.int32()), "loss_mask": pa.list_(pa.int8()), "logprobs": pa.list_(pa.float32()),
                "segment_starts": pa.list_(pa.int32())}


def messages_from(items: list[dict[str, Any]]) -> list[Message]:
    """Messages as stored (their fields as JSON) back as Messages; a field added since takes its default."""
    return [Message(**{**m, "tool_calls": [ToolCall(**c) for c in m.get("tool_calls", [])]}) for m in items]


_FROM_JSON: dict[str, Callable[[Any], Any]] = {
    "prompt": messages_from, "messages": messages_from, "tools": lambda specs: [ToolSpec(**s) for s in specs]}


def _columns(cls: type, skip: set[str]) -> dict[str, pa.DataType | None]:
    """Each field's Arrow type; None for a field stored as JSON text."""
    hints = get_type_hints(cls)

    def arrow(name: str, hint: Any) -> pa.DataType | None:
        return pa.string() if get_origin(hint) is Literal else _TOKEN_LISTS.get(name) or _SCALARS.get(hint)

    return {f.name: arrow(f.name, hints[f.name]) for f in fields(cls) if f.name not in skip}


_TASK_COLUMNS = _columns(Task, skip={"env_hash"})
_TRAJECTORY_COLUMNS = _columns(Trajectory, skip={"task"})
_JSON = {name for name, typ in (_TASK_COLUMNS | _TRAJECTORY_COLUMNS).items() if typ is None}
TRAJECTORY_SCHEMA = pa.schema([("step", pa.int64())] + [(name, typ or pa.string()) for name, typ in
                                                         (_TASK_COLUMNS | _TRAJECTORY_COLUMNS).items()])


def _jsonable(value: Any) -> Any:
    return asdict(value) if is_dataclass(value) and not isinstance(value, type) else str(value)


def trajectory_row(t: Trajectory, step: int) -> dict[str, Any]:
    row: dict[str, Any] = {"step": step}
    for obj, columns in ((t.task, _TASK_COLUMNS), (t, _TRAJECTORY_COLUMNS)):
        for name in columns:
            value = getattr(obj, name)
            row[name] = json.dumps(value, default=_jsonable) if name in _JSON else value
    row["env_hash"] = t.env_hash or t.task.env_hash
    return row


def trajectory_from_row(r: dict[str, Any]) -> Trajectory:
    def value(name: str) -> Any:
        if name not in _JSON:
            return r[name]
        decoded = json.loads(r[name])
        return _FROM_JSON[name](decoded) if name in _FROM_JSON else decoded

    task = Task(**{name: value(name) for name in _TASK_COLUMNS}, env_hash=r["env_hash"])
    # a shard written before a field was added lacks its column: the field's default
    return Trajectory(task=task, **{name: value(name) for name in _TRAJECTORY_COLUMNS if name in r})


def trajectory_plain(t: Trajectory) -> dict[str, Any]:
    """A trajectory as plain data (str, numbers, lists, dicts): what a checkpoint holds, since loading
    it must unpickle nothing but data (`torch.load(weights_only=True)`). Both env hashes are kept apart."""
    return {"row": trajectory_row(t, 0), "env_hash": t.env_hash, "task_env_hash": t.task.env_hash}


def trajectory_from_plain(d: dict[str, Any]) -> Trajectory:
    t = trajectory_from_row(d["row"])
    t.env_hash, t.task.env_hash = d["env_hash"], d["task_env_hash"]
    return t


class TrajectoryWriter:
    """Append-only shards: one Parquet file per write, complete or absent."""

    def __init__(self, directory: Path, start_step: int = 0) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        # A resumed run writes beside the earlier attempt's shards, never over them. The marker is a
        # dot-file (so readers of the directory as one dataset, pandas or DuckDB, skip it) holding the
        # step this attempt resumed from: the earlier attempts' shards after it are superseded.
        self.attempt = sum(1 for _ in directory.glob(".attempt_*"))
        atomic_write(directory / f".attempt_{self.attempt}", str(start_step))

    def write(self, trajectories: Sequence[Trajectory], step: int) -> Path | None:
        if not trajectories:
            return None
        table = pa.Table.from_pylist([trajectory_row(t, step) for t in trajectories], schema=TRAJECTORY_SCHEMA)
        path = self.directory / f"step_{step:06d}_a{self.attempt}.parquet"
        with atomic_path(path) as tmp:
            pq.write_table(table, tmp)
        return path


_SHARD = re.compile(r"step_(\d+)_a(\d+)\.parquet")


def trajectory_shards(directory: Path, superseded: bool = False) -> list[Path]:
    """A run's trajectory shards in step order. A resumed attempt re-runs the steps after the checkpoint
    it resumed from, whose earlier samples trained weights that were lost with the crash: those shards
    stay on disk but are left out unless `superseded` (e.g. for a contamination check, which counts
    everything a run ever sampled). Shards of unknown name are kept."""
    shards = sorted(directory.glob("*.parquet"))
    if superseded:
        return shards
    starts: dict[int, int] = {}
    for marker in directory.glob(".attempt_*"):
        text = marker.read_text().strip()
        if text.isdigit():  # an empty marker (older runs) supersedes nothing
            starts[int(marker.name.removeprefix(".attempt_"))] = int(text)

    def live(shard: Path) -> bool:
        m = _SHARD.fullmatch(shard.name)
        if m is None:
            return True
        step, attempt = int(m[1]), int(m[2])
        return all(step <= start for later, start in starts.items() if later > attempt)

    return [s for s in shards if live(s)]


def read_trajectories(directory: Path) -> Iterator[Trajectory]:
    for shard in trajectory_shards(directory):
        for row in pq.read_table(shard).to_pylist():
            yield trajectory_from_row(row)


class MetricsLogger:
    """metrics.jsonl (one flushed line per step: the run's record, always written) plus the numeric
    values to each configured sink (`assay.core.loggers`; TensorBoard by default)."""

    def __init__(self, run_dir: Path, sinks: Sequence[str] = ("tensorboard",), name: str | None = None,
                 config: dict[str, Any] | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        # sinks first: one that cannot start (a missing package, no server) fails before anything is written
        self._sinks = open_sinks(sinks, RunInfo(run_dir, name or run_dir.name, config or {}))
        self._file = self.path.open("a", buffering=1)

    def log(self, step: int, metrics: dict[str, float | str], kind: str = "train") -> None:
        record = {"step": step, "kind": kind, "time": time.time(), **metrics}
        self._file.write(json.dumps(record) + "\n")
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        for sink in self._sinks if scalars else ():
            sink.log(step, kind, scalars)

    def close(self) -> None:
        self._file.close()
        close_sinks(self._sinks)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics records in order, as its surviving history: a `resume` record at step k (what
    a resumed run logs first) supersedes every earlier record of a step after k, since those steps
    were run again."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise AssayError(f"{path} not found; is {run_dir} a run directory (runs/NAME)?")
    records: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line torn by a crash: everything before it stands
            continue
        if record.get("kind") == "resume":
            records = [r for r in records if r.get("step", 0) <= record["step"]]
        records.append(record)
    return records


def holds_run(run_dir: Path) -> bool:
    """Whether a directory already holds a run that got somewhere: a checkpoint, a saved policy or a summary
    (metrics alone are an attempt that died before its first checkpoint, which a restart redoes from the start
    and marks in the log)."""
    return (any((run_dir / "checkpoints").glob("step_*")) or (run_dir / "policy").is_dir()
            or (run_dir / "summary.json").is_file())


def prepare_run_dir(root: str | Path, name: str, existing: Literal["reuse", "refuse", "move"] = "reuse") -> Path:
    """RUN_DIR/NAME, made, checked writable and held by this process (`lock_run_dir`). Where it already holds a
    run, a fresh run must not mix its records with the old ones (metrics appended to theirs, their checkpoint
    taken for its last): `refuse` says so, `move` renames the old run aside (NAME.prev-TIME) and starts clean;
    `reuse` is for a resume and for the parts of one job. A run directory another process holds is never
    reused, refused as finished or moved: it is refused as in use."""
    run_dir = Path(root) / name
    if run_dir.is_dir():
        lock_run_dir(run_dir)
    if existing != "reuse" and holds_run(run_dir):
        if existing == "refuse":
            raise AssayError(f"{run_dir} already holds a run (checkpoints, a policy or a summary); continue it "
                             f"with `assay train --resume {run_dir}`, or start a new one under another name=NAME")
        aside = run_dir.with_name(f"{run_dir.name}.prev-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}")
        os.close(_held.pop(run_dir.resolve()))  # the lock stays with the old run's directory
        run_dir.rename(aside)
        log.warning("%s held an earlier run: moved to %s", run_dir, aside)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise AssayError(f"run directory {run_dir} is not writable ({e.strerror}); "
                         f"choose another with run_dir=PATH or name=NAME") from None
    lock_run_dir(run_dir)
    return run_dir


_held: dict[Path, int] = {}  # the run directories this process holds: the lock file's descriptor


def lock_run_dir(run_dir: Path) -> None:
    """Hold RUN_DIR/.lock (an exclusive flock) until `release_run_dir`, or until this process ends however it
    ends: two processes writing one run would interleave their metrics, checkpoints and logs. Again in the
    same process: a no-op."""
    key = run_dir.resolve()
    if key in _held:
        return
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder_of(fd)
        os.close(fd)
        raise AssayError(f"{run_dir} is in use by a running process ({holder}); wait for it to end, or start this "
                         "run under another name=NAME") from None
    os.ftruncate(fd, 0)
    os.write(fd, _me().encode())
    _held[key] = fd


def _me() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _holder_of(fd: int) -> str:
    """What the holder wrote into the lock file it holds."""
    return os.read(fd, 200).decode(errors="replace").strip() or "another process"


def run_dir_holder(run_dir: Path) -> str | None:
    """Who holds this run directory ("pid N on HOST"), or None when no running job does."""
    if run_dir.resolve() in _held:
        return _me()
    try:
        fd = os.open(run_dir / ".lock", os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return _holder_of(fd)
    finally:
        os.close(fd)


def release_run_dir(*run_dirs: Path) -> None:
    """Let other processes at these run directories again (the job that wrote them is over)."""
    for run_dir in run_dirs:
        fd = _held.pop(run_dir.resolve(), None)
        if fd is not None:
            os.close(fd)
