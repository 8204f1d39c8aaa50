"""The session log: every completed request, in the run store's trajectory schema, in a local directory or
any fsspec URL (s3://, memory://, ...).

Durability. A request's rows are first appended to a journal and made durable before the response goes out:
locally one JSON line per request in `journal-WRITER-K.jsonl`, written and fsynced; on object storage one
object per request under `journal/` (an object store has no append, and a PUT is durable once it returns).
Every `compact_every` requests (and at a clean close) the journal's requests become one Parquet shard,
`part-WRITER-K.parquet` in `storage.TRAJECTORY_SCHEMA`, written whole (a temp file renamed, or one PUT), and
only then is that journal removed. So after a kill -9 every completed request is in a shard or in a journal
(or, killed between the two steps, in both), and `read_sessions` reads both, each request once (by its id).
A journal line torn by the kill belongs to a request that never completed and is skipped."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from assay.core.errors import AssayError
from assay.core.storage import TRAJECTORY_SCHEMA, trajectory_from_row
from assay.core.types import Trajectory

JOURNALS = "journal"  # object storage: one object per request under this prefix


def _fs(url: str, options: dict[str, Any] | None) -> tuple[fsspec.AbstractFileSystem, str]:
    try:
        return fsspec.core.url_to_fs(url, **(options or {}))
    except (ImportError, ValueError) as e:  # an unknown protocol, or its package missing (s3:// needs s3fs)
        raise AssayError(f"--log {url}: {e}; use a local directory or an fsspec URL whose package is installed "
                         "(s3:// needs s3fs)") from None


class SessionLog:
    """Appends requests (each a list of trajectory rows, one per choice) durably; thread-safe."""

    def __init__(self, url: str, compact_every: int = 256, storage_options: dict[str, Any] | None = None) -> None:
        """`storage_options` go to the fsspec filesystem (e.g. an S3 endpoint_url; s3fs also reads the
        AWS_* environment variables)."""
        if compact_every < 1:
            raise AssayError(f"compact_every must be at least 1, got {compact_every}")
        self.url, self.compact_every = url, compact_every
        self.fs, self.root = _fs(url, storage_options)
        self.local = isinstance(self.fs, LocalFileSystem)
        try:
            self.fs.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise AssayError(f"--log {url}: cannot create it ({e}); pick a writable place") from None
        self.writer = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._lock = threading.Lock()
        self._part = 0  # shards written; also numbers the journals
        self._rows: list[dict[str, Any]] = []  # since the last shard
        self._objects: list[str] = []  # object storage: this part's journal objects
        self._seq = 0
        self._file: Any = None
        self._open_journal()

    def _journal_path(self) -> str:
        return f"{self.root}/journal-{self.writer}-{self._part:06d}.jsonl"

    def _open_journal(self) -> None:
        if self.local:
            self._file = open(self._journal_path(), "ab")  # noqa: SIM115 - held open across appends

    def append(self, request_id: str, rows: list[dict[str, Any]]) -> None:
        """Durable when it returns."""
        data = json.dumps({"id": request_id, "rows": rows}, ensure_ascii=False).encode() + b"\n"
        with self._lock:
            if self.local:
                self._file.write(data)
                self._file.flush()
                os.fsync(self._file.fileno())
            else:
                path = f"{self.root}/{JOURNALS}/{self.writer}-{self._seq:09d}.json"
                self.fs.pipe_file(path, data)
                self._objects.append(path)
            self._seq += 1
            self._rows += rows
            if self._seq % self.compact_every == 0:
                self._compact()

    def _compact(self) -> None:
        if not self._rows:
            return
        table = pa.Table.from_pylist(self._rows, schema=TRAJECTORY_SCHEMA)
        shard = f"{self.root}/part-{self.writer}-{self._part:06d}.parquet"
        if self.local:
            tmp = f"{self.root}/.part-{self.writer}-{self._part:06d}.tmp"
            pq.write_table(table, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, shard)
            self._file.close()
            os.remove(self._journal_path())
        else:
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink)
            self.fs.pipe_file(shard, sink.getvalue().to_pybytes())
            self.fs.rm(self._objects)
            self._objects = []
        self._rows = []
        self._part += 1
        self._open_journal()

    def close(self) -> None:
        with self._lock:
            self._compact()
            if self.local and self._file is not None:
                self._file.close()
                path = self._journal_path()
                if os.path.exists(path) and os.path.getsize(path) == 0:
                    os.remove(path)
                self._file = None


def _journal_records(fs: fsspec.AbstractFileSystem, root: str) -> Iterator[dict[str, Any]]:
    paths = sorted(fs.glob(f"{root}/journal-*.jsonl")) + sorted(fs.glob(f"{root}/{JOURNALS}/*.json"))
    for path in paths:
        for line in fs.cat_file(path).splitlines():
            try:
                yield json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):  # torn by a kill: that request never completed
                continue


def read_session_rows(url: str, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every logged choice's row, shards first, then what only the journals hold."""
    fs, root = _fs(url, storage_options)
    if not fs.isdir(root):
        raise AssayError(f"{url}: no session log there; pass the directory or URL given to assay serve --log")
    rows: list[dict[str, Any]] = []
    for shard in sorted(fs.glob(f"{root}/part-*.parquet")):
        with fs.open(shard, "rb") as f:
            rows += pq.read_table(f).to_pylist()
    seen = {r["task_id"] for r in rows}
    for record in _journal_records(fs, root):
        if record["id"] not in seen:
            seen.add(record["id"])
            rows += record["rows"]
    return rows


def read_sessions(url: str, storage_options: dict[str, Any] | None = None) -> list[Trajectory]:
    """The logged choices as trajectories, in the order they completed."""
    rows = read_session_rows(url, storage_options)
    rows.sort(key=lambda r: json.loads(r["payload"]).get("time", 0.0))
    return [trajectory_from_row(r) for r in rows]
