"""A sandbox that is only a child process with rlimits, a private workspace and a scrubbed
environment. It limits resources but does not isolate: the namespace sandbox replaces it for
untrusted code; this one stays as the fallback behind an explicit opt-in."""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from assay.sandbox.base import EXITED, OOM, OUTPUT_TRUNCATED, SANDBOX_ERROR, TIMEOUT, ExecResult, Limits, refuse_nul

_ENV_ALLOWLIST = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
                  "PYTHONHASHSEED": "0"}


class ProcessSandbox:
    def __init__(self, limits: Limits | None = None, template: Path | None = None) -> None:
        self.limits = limits or Limits()
        self.workspace = Path(tempfile.mkdtemp(prefix="assay-sbx-"))
        self._snapshots: list[Path] = []
        if template is not None:
            shutil.copytree(template, self.workspace, symlinks=True, dirs_exist_ok=True)  # never follow a planted link

    def _preexec(self) -> None:
        lim = self.limits
        os.setsid()
        mem = lim.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s + 1))
        fsize = lim.file_size_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim.open_files, lim.open_files))

    def exec(self, cmd: list[str] | str, stdin: str | None = None, timeout: float | None = None) -> ExecResult:
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if (refused := refuse_nul(argv)) is not None:
            return refused
        timeout = timeout or self.limits.timeout_s
        start = time.monotonic()
        env = dict(_ENV_ALLOWLIST, HOME=str(self.workspace), TMPDIR=str(self.workspace))
        try:
            proc = subprocess.Popen(argv, cwd=self.workspace, env=env, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=self._preexec)
        except OSError as e:
            return ExecResult("", str(e), -1, time.monotonic() - start, SANDBOX_ERROR)
        status = EXITED
        try:
            out, err = proc.communicate(stdin.encode() if stdin is not None else None, timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            status = TIMEOUT
        finally:
            try:  # no process may outlive its call
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if status == EXITED and proc.returncode in (-signal.SIGKILL, -signal.SIGXCPU):
            status = TIMEOUT if proc.returncode == -signal.SIGXCPU else status
        if status == EXITED and b"MemoryError" in err[-2000:]:
            status = OOM
        cap = self.limits.output_bytes
        if status == EXITED and (len(out) > cap or len(err) > cap):
            status = OUTPUT_TRUNCATED
        return ExecResult(out[:cap].decode(errors="replace"), err[:cap].decode(errors="replace"),
                          proc.returncode, time.monotonic() - start, status)

    def _path(self, path: str) -> Path:
        p = (self.workspace / path).resolve()
        if not p.is_relative_to(self.workspace.resolve()):
            raise ValueError(f"path {path!r} escapes the sandbox workspace")
        return p

    def write_file(self, path: str, data: bytes | str) -> None:
        p = self._path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)

    def read_file(self, path: str) -> bytes:
        return self._path(path).read_bytes()

    def run_python(self, code: str, stdin: str | None = None, timeout: float | None = None) -> ExecResult:
        self.write_file("main.py", code)
        return self.exec([sys.executable, "-I", "main.py"], stdin=stdin, timeout=timeout)

    def snapshot(self) -> Path:
        """A copy of the workspace (this sandbox copies; the namespace sandbox freezes a layer instead)."""
        snap = Path(tempfile.mkdtemp(prefix="assay-sbx-snap-"))
        self._snapshots.append(snap)  # removed on close even when the copy below fails
        # special files (a FIFO, a device node) are not workspace content: skipping them keeps a
        # policy from turning its own snapshot into an infrastructure error
        shutil.copytree(self.workspace, snap, symlinks=True, dirs_exist_ok=True, ignore=_special_files)
        return snap

    def restore(self, snap: Path) -> None:
        shutil.rmtree(self.workspace, ignore_errors=True)
        shutil.copytree(snap, self.workspace, symlinks=True)

    async def aexec(self, cmd: list[str] | str, stdin: str | None = None, timeout: float | None = None,
                    ) -> ExecResult:
        return await asyncio.to_thread(self.exec, cmd, stdin, timeout)

    async def arun_python(self, code: str, stdin: str | None = None, timeout: float | None = None) -> ExecResult:
        return await asyncio.to_thread(self.run_python, code, stdin, timeout)

    async def awrite_file(self, path: str, data: bytes | str) -> None:
        await asyncio.to_thread(self.write_file, path, data)

    async def aread_file(self, path: str) -> bytes:
        return await asyncio.to_thread(self.read_file, path)

    def close(self) -> None:
        shutil.rmtree(self.workspace, ignore_errors=True)
        for snap in self._snapshots:
            shutil.rmtree(snap, ignore_errors=True)

    def __enter__(self) -> ProcessSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _special_files(directory: str, names: list[str]) -> set[str]:
    out = set()
    for name in names:
        mode = os.lstat(os.path.join(directory, name)).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            out.add(name)
    return out
