"""The isolated sandbox. Each call runs in fresh namespaces (jail.py) over the sandbox's workspace: an overlay of
read-only layers (the template, then one layer per snapshot) under one writable upper layer, all on the
sandbox's own size-capped tmpfs. Snapshot, restore and fork only rename which layers a call mounts, so they
cost nothing per file. Processes never outlive a call; only files carry over."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import stat
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from assay.core.errors import AssayError
from assay.sandbox.base import SANDBOX_ERROR, ExecResult, Limits, refuse_nul
from assay.sandbox.client import Launcher, get_launcher

MAX_LAYERS = 128  # overlayfs stacks up to 500; the mount options must fit in a page
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/workspace", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
            "USER": "sandbox", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
_SLACK_S = 30.0  # the run enforces its own deadline; the host waits this much longer before giving up


class SandboxError(AssayError, OSError):
    """The sandbox itself failed (not the program in it). An OSError too, so callers that treat OSError from a
    sandbox as an infrastructure failure catch it."""


class _Volume:
    """What the launcher keeps for a sandbox: its tmpfs (the disk quota, holding its upper layers and its
    snapshots' layers), its network and cgroup namespaces and its cgroup. Released when neither the sandbox nor any
    snapshot still needs it."""

    def __init__(self, launcher: Launcher, limits: Limits) -> None:
        reply, _ = _check(launcher.request({"op": "sandbox", "size_mb": limits.workspace_mb,
                                            "memory_mb": limits.memory_mb, "max_procs": limits.max_procs},
                                           timeout=_SLACK_S))
        self.name, self.netns, self.cgroupns, self.cgroup = reply["name"], reply["netns"], reply["cgroupns"], \
            reply["cgroup"]
        weakref.finalize(self, _release, launcher, self.name)


def _release(launcher: Launcher, name: str) -> None:
    if launcher.alive():
        try:
            launcher.post({"op": "release", "name": name})
        except OSError:
            pass


def _check(reply: tuple[dict, list[bytes]]) -> tuple[dict, list[bytes]]:
    if "error" in reply[0]:
        raise SandboxError(f"sandbox launcher: {reply[0]['error']}")
    return reply


@dataclass(frozen=True)
class NsSnapshot:
    """A frozen workspace: read-only layers, top first. Restore to it, or start new sandboxes from it."""
    layers: tuple[str, ...]
    volumes: tuple[_Volume, ...]  # keep the layers' tmpfs alive
    launcher: Launcher
    after: tuple[int, ...] = ()  # runs (host pids) that may still hold these layers: a new run waits for them
    source: str | None = None  # the template directory, when that is all there is: it survives a launcher crash


_templates: dict[tuple[int, str], NsSnapshot] = {}
_templates_lock = threading.Lock()


def template_snapshot(path: str | Path) -> NsSnapshot:
    """A template directory as the bottom layer, copied once per launcher (and so per process). Templates are
    read once: change one, and give it a new path, for sandboxes to see the change."""
    launcher = get_launcher()
    src = os.path.realpath(path)
    if not os.path.isdir(src):
        raise SandboxError(f"sandbox template {path} is not a directory")
    with _templates_lock:
        key = (launcher.generation, src)
        if key not in _templates:
            name = hashlib.sha256(src.encode()).hexdigest()[:16]
            entries, blobs = _read_tree(src)
            _check(launcher.request({"op": "template", "name": name, "entries": entries}, blobs, timeout=_SLACK_S))
            _templates[key] = NsSnapshot((f"t/{name}",), (), launcher, source=src)
        return _templates[key]


def _portable(snap: NsSnapshot) -> NsSnapshot:
    """`snap`, valid for the running launcher: a template (or empty) snapshot is rebuilt after a launcher
    crash; one with layers the crash took away cannot be."""
    if not isinstance(snap, NsSnapshot):
        raise SandboxError(f"not a namespace sandbox snapshot: {snap!r}")
    launcher = get_launcher()
    if snap.launcher is launcher:
        return snap
    if not snap.layers:
        return NsSnapshot((), (), launcher)
    if snap.source is not None and len(snap.layers) == 1:
        return template_snapshot(snap.source)
    raise SandboxError("this snapshot was lost when the sandbox launcher restarted; start again from the template")


def _read_tree(src: str) -> tuple[list[list], list[bytes]]:
    entries: list[list] = []
    blobs: list[bytes] = []
    for top, dirs, files in os.walk(src):
        for name in sorted(dirs) + sorted(files):
            full = os.path.join(top, name)
            rel = os.path.relpath(full, src)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                entries.append([rel, "l", 0, os.readlink(full)])
            elif stat.S_ISDIR(st.st_mode):
                entries.append([rel, "d", stat.S_IMODE(st.st_mode), ""])
            elif stat.S_ISREG(st.st_mode):
                entries.append([rel, "f", stat.S_IMODE(st.st_mode), ""])
                blobs.append(Path(full).read_bytes())
    return entries, blobs


class NamespaceSandbox:
    """Fresh user/mount/PID/IPC/UTS/net namespaces per call, read-only root, private /tmp and /proc, no network
    but loopback, unprivileged uid, no capabilities, seccomp, cgroup limits. `template` is a directory or a
    snapshot (of this or another sandbox) to start from."""

    def __init__(self, limits: Limits | None = None, template: str | Path | NsSnapshot | None = None) -> None:
        self.limits = limits or Limits()
        if template is None:
            base = NsSnapshot((), (), get_launcher())
        elif isinstance(template, NsSnapshot):
            base = _portable(template)
        else:
            base = template_snapshot(template)
        self._launcher = base.launcher
        self._volume: _Volume | None = _Volume(self._launcher, self.limits)
        self._lock = threading.Lock()
        self._inflight: set = set()  # sockets of calls in flight, shut down by close()
        self.errors = 0  # calls that failed in the sandbox itself (a pool health-checks such a sandbox)
        self._gen, self._dirty, self._discard = 0, False, []
        self._lowers, self._volumes, self._after = base.layers, base.volumes, list(base.after)
        self.last_snapshot = base

    # ---- running -------------------------------------------------------------------------------------------------

    def exec(self, cmd: list[str] | str, stdin: str | bytes | None = None, timeout: float | None = None,
             env: Mapping[str, str] | None = None) -> ExecResult:
        """Run a command (a string goes to /bin/sh -c) in /workspace. `env` adds to the allowlisted variables."""
        argv = _argv(cmd)
        return refuse_nul(argv) or self._call_sync(argv, stdin, timeout, env)[0]

    def run_python(self, code: str, stdin: str | bytes | None = None, timeout: float | None = None) -> ExecResult:
        """Write `code` to main.py in the workspace and run it with the sandbox's python3."""
        return self._call_sync(["python3", "main.py"], stdin, timeout, None, writes=[("main.py", code)])[0]

    def write_file(self, path: str, data: bytes | str) -> None:
        result, header, _ = self._call_sync(None, None, None, None, writes=[(path, data)])
        _raise_for(result, header.get("writes", []), [path])

    def read_file(self, path: str) -> bytes:
        result, header, blobs = self._call_sync(None, None, None, None, reads=[path])
        _raise_for(result, header.get("reads", []), [path])
        return blobs[0]

    async def aexec(self, cmd: list[str] | str, stdin: str | bytes | None = None, timeout: float | None = None,
                    env: Mapping[str, str] | None = None) -> ExecResult:
        argv = _argv(cmd)
        return refuse_nul(argv) or (await self._call_async(argv, stdin, timeout, env))[0]

    async def arun_python(self, code: str, stdin: str | bytes | None = None, timeout: float | None = None,
                          ) -> ExecResult:
        return (await self._call_async(["python3", "main.py"], stdin, timeout, None, writes=[("main.py", code)]))[0]

    async def awrite_file(self, path: str, data: bytes | str) -> None:
        result, header, _ = await self._call_async(None, None, None, None, writes=[(path, data)])
        _raise_for(result, header.get("writes", []), [path])

    async def aread_file(self, path: str) -> bytes:
        result, header, blobs = await self._call_async(None, None, None, None, reads=[path])
        _raise_for(result, header.get("reads", []), [path])
        return blobs[0]

    # ---- snapshots -----------------------------------------------------------------------------------------------

    def snapshot(self) -> NsSnapshot:
        """Freeze the workspace as it is: the current upper layer becomes read-only; no file is copied."""
        with self._lock:
            self._require_open()
            if self._dirty:
                if len(self._lowers) >= MAX_LAYERS:
                    raise SandboxError(f"a sandbox stacks at most {MAX_LAYERS} snapshots; restore an earlier "
                                       "snapshot or start a new sandbox from this one's template")
                assert self._volume is not None
                self._lowers = (f"v/{self._volume.name}/u{self._gen}", *self._lowers)
                if self._volume not in self._volumes:
                    self._volumes = (*self._volumes, self._volume)
                self._discard.append(f"w{self._gen}")  # the frozen layer's overlay work dir
                self._gen, self._dirty = self._gen + 1, False
            self.last_snapshot = NsSnapshot(self._lowers, self._volumes, self._launcher, tuple(self._after))
            return self.last_snapshot

    def restore(self, snap: NsSnapshot) -> None:
        """Return the workspace to `snap` (this sandbox's, or any other's). The discarded layer is deleted by
        the next call. Processes never outlive a call, so no process or RNG state comes back with a restore:
        every call's programs seed themselves afresh, and sandboxes forked from one snapshot do not correlate."""
        if not isinstance(snap, NsSnapshot) or snap.launcher is not self._launcher:
            raise SandboxError(f"not a snapshot of this sandbox launcher: {snap!r}")
        with self._lock:
            self._require_open()
            self._discard += [f"u{self._gen}", f"w{self._gen}"]
            self._gen, self._dirty = self._gen + 1, False
            self._lowers, self._volumes = snap.layers, snap.volumes
            self._after = sorted(set(self._after) | set(snap.after))
            self.last_snapshot = snap

    def recover(self) -> None:
        """After a sandbox error: a fresh volume, back at the last snapshot (on a restarted launcher if it
        crashed). Raises if that snapshot was lost with the launcher (start again from the template, as
        SandboxPool does)."""
        snap = _portable(self.last_snapshot)
        with self._lock:
            self._launcher, self.last_snapshot = snap.launcher, snap
            self._volume = _Volume(self._launcher, self.limits)
            self._gen, self._dirty, self._discard = 0, False, []
            self._lowers, self._volumes = self.last_snapshot.layers, self.last_snapshot.volumes
            self._after = list(self.last_snapshot.after)

    def close(self) -> None:
        """Cancel any call in flight (its processes are killed) and free the workspace, unless a snapshot
        still needs it."""
        for s in list(self._inflight):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._volume = None  # the finalizer releases it once no snapshot refers to it either
        self._volumes = ()
        self.last_snapshot = NsSnapshot((), (), self._launcher)

    @property
    def closed(self) -> bool:
        return self._volume is None

    def __enter__(self) -> NamespaceSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- plumbing ------------------------------------------------------------------------------------------------

    def _require_open(self) -> None:
        if self._volume is None:
            raise SandboxError("the sandbox is closed")

    def _request(self, argv: list[str] | None, stdin: str | bytes | None, timeout: float | None,
                 env: Mapping[str, str] | None, writes: list[tuple[str, bytes | str]], reads: list[str],
                 ) -> tuple[dict, list[bytes]]:
        self._require_open()
        assert self._volume is not None
        lim = self.limits
        limits = {"timeout_s": timeout or lim.timeout_s, "cpu_s": lim.cpu_s, "memory_mb": lim.memory_mb,
                  "max_procs": lim.max_procs, "file_size_mb": lim.file_size_mb, "open_files": lim.open_files,
                  "output_bytes": lim.output_bytes}
        header = {"op": "exec", "volume": self._volume.name, "volume_mb": lim.workspace_mb,
                  "netns": self._volume.netns, "cgroupns": self._volume.cgroupns, "cgroup": self._volume.cgroup,
                  "upper": f"u{self._gen}", "lowers": list(self._lowers), "discard": self._discard,
                  "after": self._after,
                  "argv": argv, "env": {**BASE_ENV, **(env or {})}, "limits": limits,
                  "writes": [[path, 0o644] for path, _ in writes], "reads": reads, "stdin": stdin is not None}
        self._discard = []
        self._dirty = self._dirty or bool(argv or writes)  # even if the call then fails: it may have written
        blobs = ([_bytes(stdin)] if stdin is not None else []) + [_bytes(data) for _, data in writes]
        return header, blobs

    def _finish(self, header: dict, blobs: list[bytes], started: float) -> tuple[ExecResult, dict, list[bytes]]:
        if "error" in header:
            self.errors += 1
            return ExecResult("", f"[sandbox] {header['error']}", -1, time.monotonic() - started, SANDBOX_ERROR), \
                header, []
        self._after = [header["pid"]]
        result = ExecResult(blobs[0].decode(errors="replace"), blobs[1].decode(errors="replace"),
                            header["exit_code"], header["duration"], header["status"])
        return result, header, blobs[2:]

    def _call_sync(self, argv: list[str] | None, stdin: str | bytes | None, timeout: float | None,
                   env: Mapping[str, str] | None, writes: list | None = None, reads: list | None = None,
                   ) -> tuple[ExecResult, dict, list[bytes]]:
        started = time.monotonic()
        with self._lock:
            header, blobs = self._request(argv, stdin, timeout, env, writes or [], reads or [])
            try:
                reply = self._launcher.request(header, blobs, header["limits"]["timeout_s"] + _SLACK_S,
                                               track=self._inflight)
            except (OSError, ValueError) as e:
                self.errors += 1
                return _infra_error(e, started), {}, []
            return self._finish(*reply, started)

    async def _call_async(self, argv: list[str] | None, stdin: str | bytes | None, timeout: float | None,
                          env: Mapping[str, str] | None, writes: list | None = None, reads: list | None = None,
                          ) -> tuple[ExecResult, dict, list[bytes]]:
        started = time.monotonic()
        while not self._lock.acquire(blocking=False):  # calls on one sandbox take turns; others keep running
            await asyncio.sleep(0.001)
        try:
            header, blobs = self._request(argv, stdin, timeout, env, writes or [], reads or [])
            try:
                reply = await self._launcher.arequest(header, blobs, header["limits"]["timeout_s"] + _SLACK_S,
                                                      track=self._inflight)
            except (OSError, ValueError, asyncio.IncompleteReadError, TimeoutError) as e:
                self.errors += 1
                return _infra_error(e, started), {}, []
            return self._finish(*reply, started)
        finally:
            self._lock.release()


def _infra_error(e: BaseException, started: float) -> ExecResult:
    return ExecResult("", f"[sandbox] {type(e).__name__}: {e}", -1, time.monotonic() - started, SANDBOX_ERROR)


def _argv(cmd: list[str] | str) -> list[str]:
    if isinstance(cmd, str):
        return ["/bin/sh", "-c", cmd]
    if not cmd:
        raise ValueError("an empty command")
    return list(cmd)


def _bytes(data: str | bytes) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


def _raise_for(result: ExecResult, codes: list[int], paths: list[str]) -> None:
    if result.status == SANDBOX_ERROR:
        raise SandboxError(result.stderr.strip())
    for code, path in zip(codes, paths, strict=False):
        if code:
            raise OSError(code, f"{os.strerror(code)} (in the sandbox)", path)
