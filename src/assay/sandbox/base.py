"""The sandbox seam: every model-written program or command runs behind this interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from assay.core.errors import ConfigError
from assay.sandbox.status import DISK, EXITED, OOM, OUTPUT_TRUNCATED, PIDS, SANDBOX_ERROR, TIMEOUT

__all__ = ["DISK", "EXITED", "OOM", "OUTPUT_TRUNCATED", "PIDS", "SANDBOX_ERROR", "TIMEOUT", "ExecResult", "Limits",
           "Sandbox"]


@dataclass
class Limits:
    timeout_s: float = 5.0  # wall clock per call; kills the whole process tree
    cpu_s: int = 5  # per process (RLIMIT_CPU)
    memory_mb: int = 512  # the whole sandbox, its tmpfs files included (cgroup); per process where no cgroup
    max_procs: int = 64  # processes alive at once in a call (cgroup); per uid (RLIMIT_NPROC) where no cgroup
    file_size_mb: int = 16  # largest file a process may write (RLIMIT_FSIZE)
    open_files: int = 256  # per process (RLIMIT_NOFILE)
    output_bytes: int = 64 * 1024  # per stream; beyond it the status is output_truncated
    workspace_mb: int = 256  # all bytes the sandbox's files may hold (its workspace layers; /tmp has as much again)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ConfigError(f"sandbox limit {name} must be positive, got {value!r}")


@dataclass
class ExecResult:
    stdout: str
    stderr: str
    exit_code: int
    duration: float
    status: str = EXITED

    @property
    def ok(self) -> bool:
        return self.status == EXITED and self.exit_code == 0


def refuse_nul(argv: list[str]) -> ExecResult | None:
    """No program can receive an argument holding a NUL byte. That is the command's own failure
    (exit 126, as a shell reports a command it cannot execute), never an infrastructure error: a
    policy must not be able to turn a wrong answer into an excluded one."""
    if any("\0" in a for a in argv):
        return ExecResult("", "sandbox: a command argument contains a NUL byte; no program can receive it\n", 126, 0.0)
    return None


class Sandbox(Protocol):
    """Paths are relative to the workspace. `snapshot()` returns an opaque value only `restore` (and, for the
    namespace sandbox, a new sandbox's `template`) understands."""

    def exec(self, cmd: list[str] | str, stdin: str | None = None, timeout: float | None = None) -> ExecResult: ...
    def write_file(self, path: str, data: bytes | str) -> None: ...
    def read_file(self, path: str) -> bytes: ...
    def run_python(self, code: str, stdin: str | None = None, timeout: float | None = None) -> ExecResult: ...
    def snapshot(self) -> object: ...
    def restore(self, snap: object) -> None: ...
    def close(self) -> None: ...
    async def aexec(self, cmd: list[str] | str, stdin: str | None = None, timeout: float | None = None,
                    ) -> ExecResult: ...
    async def arun_python(self, code: str, stdin: str | None = None, timeout: float | None = None,
                          ) -> ExecResult: ...
    async def awrite_file(self, path: str, data: bytes | str) -> None: ...
    async def aread_file(self, path: str) -> bytes: ...
