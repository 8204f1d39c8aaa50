"""The host's handle on its sandbox launcher: started on first use, restarted if it died, one Unix-socket
connection per request (sync or asyncio). Closing a connection early cancels that run."""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import os
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from assay.core.errors import AssayError
from assay.sandbox import cgroups, cgroups2, protocol

# The launcher imports only stdlib and its own sandbox modules; registering the two packages by path skips
# assay/__init__.py and assay/sandbox/__init__.py, which may import heavier things. A sandboxed program can read
# its pid 1's command line (the worker's: the launcher's), so the paths come on stdin, NUL-terminated, and argv[0]
# is /proc/self/exe, which finds the interpreter (and through it, its prefix) without naming it.
_BOOTSTRAP = """
import os, sys, types
data = b""
while data.count(b"\\0") < 2:
    chunk = os.read(0, 4096)
    if not chunk:
        sys.exit(1)
    data += chunk
src, run_dir = data.decode().split("\\0")[:2]
for name in ("assay", "assay.sandbox"):
    pkg = types.ModuleType(name)
    pkg.__path__ = [src + "/" + name.replace(".", "/")]
    sys.modules[name] = pkg
from assay.sandbox.launcher import main
main(run_dir)
"""
_SRC = str(Path(__file__).resolve().parents[2])
_PREFIX = "assay-sandbox-"
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}  # nothing of the host's environment
START_TIMEOUT_S = 15.0
PER_PROCESS_ENV = "ASSAY_SANDBOX_PER_PROCESS_LIMITS"  # "1": rlimits where no cgroup caps the whole process tree
NO_CGROUP = ("no cgroup can cap the memory and process count of a sandbox's whole process tree here (cgroup v1: no "
             "usable memory and pids hierarchies; cgroup v2: our cgroup lacks the memory and pids controllers, or "
             "they cannot be enabled for its children). Run as root where cgroup v1 mounts memory and pids, or in a "
             "delegated cgroup v2 subtree with memory and pids (a systemd unit with Delegate=yes, a container with "
             "its own cgroup namespace); or, to cap each process instead (rlimits, which many processes together "
             f"can exceed), set {PER_PROCESS_ENV}=1 or pass --per-process-limits")
_CGROUPS = {cgroups.VERSION: cgroups, cgroups2.VERSION: cgroups2}
_warned_per_process = False


def per_process_limits_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a sandbox may run with per-process rlimits where no cgroup can cap its process tree."""
    return environ.get(PER_PROCESS_ENV, "0").strip() not in ("", "0")


class SandboxUnavailable(AssayError):
    """Isolation does not work on this host."""


class Launcher:
    _generations = itertools.count(1)

    def __init__(self) -> None:
        self.generation = next(self._generations)
        self.owner = os.getpid()
        _sweep_dirs()
        self.dir = tempfile.mkdtemp(prefix=_PREFIX)  # mode 0700: only we reach the sockets
        self.exec_path, self.ctl_path = f"{self.dir}/exec.sock", f"{self.dir}/ctl.sock"
        python = getattr(sys, "_base_executable", sys.executable)  # no venv needed: stdlib only
        self.proc = subprocess.Popen(["/proc/self/exe", "-I", "-S", "-c", _BOOTSTRAP], executable=python, env=_ENV,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"{_SRC}\0{self.dir}\0".encode())
            self.proc.stdin.flush()
        except OSError:
            pass  # it died at start: its first line (none) says so
        Path(self.dir, "pid").write_text(str(self.proc.pid))  # for _sweep_dirs, should we die uncleanly
        self.cgroups = "none"  # what caps memory and processes: "v1", "v2" (cgroups), or "none" (rlimits)
        line = self._first_line()
        if not line.startswith("ready"):
            self.close()
            raise SandboxUnavailable(line.removeprefix("error: ") or "the sandbox launcher exited at start")
        self.cgroups = line.partition("cgroups=")[2].split(" ")[0] or "none"
        if self.cgroups == "none":
            if not per_process_limits_allowed():
                self.close()
                raise SandboxUnavailable(NO_CGROUP)
            _warn_per_process()

    def _first_line(self) -> str:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(START_TIMEOUT_S):
                return "error: the sandbox launcher did not start in time"
        return self.proc.stdout.readline().decode(errors="replace").strip()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def request(self, header: dict, blobs: Sequence[bytes] = (), timeout: float | None = None,
                track: set | None = None) -> tuple[dict, list[bytes]]:
        """Send a request (an exec goes to a staged worker, anything else to the launcher) and wait. While it
        is in flight its socket sits in `track`: shutting that down cancels the run."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            if track is not None:
                track.add(s)
            try:
                s.settimeout(timeout)
                s.connect(self.exec_path if header["op"] == "exec" else self.ctl_path)
                s.sendall(protocol.encode(header, blobs))
                return protocol.recv(s)
            finally:
                if track is not None:
                    track.discard(s)

    def post(self, header: dict) -> None:
        """Send a control request without waiting for its answer."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(self.ctl_path)
            s.sendall(protocol.encode(header))

    async def arequest(self, header: dict, blobs: Sequence[bytes] = (), timeout: float | None = None,
                       track: set | None = None) -> tuple[dict, list[bytes]]:
        """`request` for asyncio; cancelling the task cancels the run."""
        path = self.exec_path if header["op"] == "exec" else self.ctl_path
        reader, writer = await asyncio.open_unix_connection(path, limit=1 << 20)
        sock = writer.get_extra_info("socket")
        if track is not None:
            track.add(sock)
        try:
            writer.write(protocol.encode(header, blobs))
            await writer.drain()
            return await asyncio.wait_for(_arecv(reader), timeout)
        finally:
            if track is not None:
                track.discard(sock)
            writer.close()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # the launcher exits at EOF, and its workers with it
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.cgroups in _CGROUPS:
            _CGROUPS[self.cgroups].sweep()  # the launcher's sandboxes' cgroups, now that it is gone


def _warn_per_process() -> None:
    global _warned_per_process
    if not _warned_per_process:
        _warned_per_process = True
        print(f"WARNING: no cgroup caps the sandbox's process tree here; memory and processes are capped per "
              f"process ({PER_PROCESS_ENV}=1)", file=sys.stderr)


async def _arecv(reader: asyncio.StreamReader) -> tuple[dict, list[bytes]]:
    (n,) = protocol.LENGTH.unpack(await reader.readexactly(4))
    header = json.loads(await reader.readexactly(n))
    return header, protocol.split(header, await reader.readexactly(sum(header["blobs"])))


def _sweep_dirs() -> None:
    """Remove the directories of launchers whose host process was killed before it could clean up."""
    for d in Path(tempfile.gettempdir()).glob(f"{_PREFIX}*"):
        try:
            pid = int((d / "pid").read_text())
        except (OSError, ValueError):
            continue
        if not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


_current: Launcher | None = None
_lock = threading.Lock()


def get_launcher() -> Launcher:
    """This process's launcher, started (or restarted after a crash, or after a fork) as needed."""
    global _current
    with _lock:
        if _current is None or _current.owner != os.getpid() or not _current.alive():
            if _current is not None and _current.owner == os.getpid():
                _current.close()
            _current = Launcher()
        return _current


def shutdown() -> None:
    global _current
    with _lock:
        if _current is not None and _current.owner == os.getpid():
            _current.close()
        _current = None


atexit.register(shutdown)
