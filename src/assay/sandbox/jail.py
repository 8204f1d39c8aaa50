"""One sandboxed run, in three processes:

  W  worker (root, in the launcher's view): forked ahead of demand; makes a cgroup and pipes, unshares a PID
     namespace and forks I; then takes one request, prepares the workspace layers, hands the request to I,
     copies output (capped), and kills I on timeout or when the host hangs up.
  I  pid 1 of that namespace. Ahead of demand: new mount/net/IPC/UTS namespaces, loopback up, its own /proc.
     On the request: mounts the overlay workspace and a private /tmp, pivots into the read-only root, joins a
     new user namespace as an unprivileged uid, drops every capability, loads seccomp, writes the requested
     files, spawns C, kills whatever C left behind, reads files back.
  C  the command, spawned (vfork+exec) with only the environment the host allowed.

The PID namespace dies with I, so no process outlives a run. W reads the cgroup's counters to report an OOM
kill or a refused fork as a status apart from the program's exit code. Stdlib only (runs in the launcher)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import resource
import select
import shutil
import signal
import socket
import struct
import time
def _tr(tag):
    os.write(2, f'TR {os.getpid()} {tag} {time.monotonic():.6f}\n'.encode())
from dataclasses import dataclass

from assay.sandbox import kernel, protocol, seccomp
from assay.sandbox.cgroups import RunCgroup
from assay.sandbox.status import DISK, EXITED, OOM, OUTPUT_TRUNCATED, PIDS, SANDBOX_ERROR, TIMEOUT

INSIDE_ID = 1000  # the uid/gid programs see
HOST_ID = 1_879_048_192 + INSIDE_ID  # what it maps to on the host: unprivileged, owned by no host user
ROOT, WORKSPACE, TMP = "/root", "/workspace", "/tmp"  # the sandbox root in the launcher's view; paths inside
SETUP_TIMEOUT_S = 10.0
NAME = re.compile(r"[\w-]+")
_LAYER = re.compile(r"(v/[\w-]+/u\d+|t/[\w-]+)")
_UPPER = re.compile(r"u\d+")
_FILTER = seccomp.build_filter() if kernel.SYSCALLS else b""
_MOUNT_FLAGS = kernel.MS_NOSUID | kernel.MS_NODEV


@dataclass
class Staged:
    """A worker's half of a run prepared before any request: I is waiting for its orders on `ctl`."""
    pid: int
    pidfd: int
    cgroup: RunCgroup | None
    ctl: int  # W -> I: the request, then "go" once its user namespace is mapped
    sync: int  # I -> W: "my user namespace exists"
    report: int  # I -> W: what happened, and the files read back
    stdin: int
    stdout: int
    stderr: int


def open_volume(name: str, size_mb: int) -> str:
    """The sandbox's own tmpfs (its disk quota), mounted in the launcher's view on first use."""
    if not NAME.fullmatch(name):
        raise ValueError(f"bad volume name {name!r}")
    path = f"/v/{name}"
    if not os.path.isdir(f"{path}/work"):
        os.makedirs(path, exist_ok=True)
        kernel.mount("tmpfs", path, "tmpfs", _MOUNT_FLAGS, f"size={size_mb}m,nr_inodes={256 * size_mb + 1024},mode=0755")
        os.mkdir(f"{path}/work", 0o700)
    return path


def _own_dir(path: str, mode: int = 0o755) -> None:
    if not os.path.isdir(path):
        os.mkdir(path)
    os.chown(path, HOST_ID, HOST_ID)
    os.chmod(path, mode)


# ---- W: the worker ---------------------------------------------------------------------------------------------

def stage(use_cgroups: bool, foreign_fds: tuple[int, ...] = ()) -> Staged:
    """Fork I and let it prepare everything that does not depend on the request. `foreign_fds` are the
    launcher's, which I must not hold."""
    cg = RunCgroup.create(f"{os.getppid()}-{os.getpid()}") if use_cgroups else None
    ctl_r, ctl_w = os.pipe()
    sync_r, sync_w = os.pipe()
    rep_r, rep_w = os.pipe()
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    kernel.unshare(kernel.CLONE_NEWPID)
    pid = os.fork()
    if pid == 0:
        try:
            for fd in (ctl_w, sync_r, rep_r, in_w, out_r, err_r, *foreign_fds):
                os.close(fd)
            _init(cg, ctl_r, sync_w, rep_w, (in_r, out_w, err_w))
        except BaseException as e:  # noqa: BLE001 - whatever broke, W must hear of it
            _write_all(rep_w, protocol.encode({"error": f"sandbox setup failed: {type(e).__name__}: {e}"}))
        os._exit(111)
    for fd in (ctl_r, sync_w, rep_w, in_r, out_w, err_w):
        os.close(fd)
    return Staged(pid, os.pidfd_open(pid), cg, ctl_w, sync_r, rep_r, in_w, out_r, err_r)


def serve(conn: socket.socket, st: Staged, req: dict, blobs: list[bytes]) -> None:
    """Run one request on the staged I and answer on conn."""
    _tr("W start")
    lim = req["limits"]
    started = time.monotonic()
    vol = open_volume(req["volume"], req["volume_mb"])
    for name in req["discard"]:
        if _UPPER.fullmatch(name):
            shutil.rmtree(f"{vol}/{name}", ignore_errors=True)
    if not _UPPER.fullmatch(req["upper"]) or not all(_LAYER.fullmatch(p) for p in req["lowers"]):
        raise ValueError("bad layer names")
    _own_dir(f"{vol}/{req['upper']}")
    tmp = f"{vol}/tmp-{os.getpid()}"
    _own_dir(tmp, 0o1777)
    stdin = blobs[0] if req["stdin"] else b""
    files = blobs[1:] if req["stdin"] else blobs
    if st.cgroup is not None:
        st.cgroup.limit(lim["memory_mb"] << 20, lim["max_procs"] + 1)  # +1: I counts too
    _tr("W prepared")
    try:
        _write_all(st.ctl, protocol.encode(dict(req, vol=vol, tmp=tmp), files))
    except BrokenPipeError:
        pass  # I died while staging: its report says why
    # Only a root of the parent user namespace may map I's new user namespace onto another host uid.
    ready, _, _ = select.select([st.sync], [], [], SETUP_TIMEOUT_S)
    if ready and os.read(st.sync, 1) == b"u":
        for kind in ("uid", "gid"):
            with open(f"/proc/{st.pid}/{kind}_map", "w") as f:
                f.write(f"{INSIDE_ID} {HOST_ID} 1\n")
        os.write(st.ctl, b"g")
    _tr("W mapped")
    os.close(st.ctl)
    out, err, rep, timed_out, host_gone = _pump(st, conn, stdin, time.monotonic() + lim["timeout_s"],
                                                lim["output_bytes"])
    _tr("W pumped")
    os.waitpid(st.pid, 0)
    duration = time.monotonic() - started
    report, read_blobs = protocol.decode(rep) if rep else ({}, [])
    cap = lim["output_bytes"]
    status, exit_code, note = _classify(report, timed_out, len(out) > cap or len(err) > cap, st.cgroup, vol)
    if not host_gone:
        header = {"exit_code": exit_code, "status": status, "duration": duration,
                  "writes": report.get("writes", []), "reads": report.get("reads", [])}
        conn.sendall(protocol.encode(header, [out[:cap], err[:cap] + note.encode(), *read_blobs]))
        _tr("W replied")
    conn.close()
    if st.cgroup is not None:
        st.cgroup.remove()
    shutil.rmtree(tmp, ignore_errors=True)


def _pump(st: Staged, conn: socket.socket, stdin: bytes, deadline: float, cap: int,
          ) -> tuple[bytes, bytes, bytes, bool, bool]:
    """Move bytes until I has exited and its pipes are drained; kill I at the deadline or if the host hangs up."""
    bufs = {st.stdout: bytearray(), st.stderr: bytearray(), st.report: bytearray()}
    sizes = {st.stdout: 0, st.stderr: 0}
    poller = select.poll()
    for fd in (st.stdout, st.stderr, st.report, st.pidfd, conn.fileno()):
        poller.register(fd, select.POLLIN)
    pending, in_w = memoryview(stdin), st.stdin
    os.set_blocking(in_w, False)
    poller.register(in_w, select.POLLOUT)
    open_fds, alive, killed, host_gone = set(bufs), True, False, False
    while open_fds or alive:
        wait = deadline - time.monotonic()
        if wait <= 0 and alive and not killed:
            os.kill(st.pid, signal.SIGKILL)
            killed = True
        for fd, _ in poller.poll(int(max(0.0, wait) * 1000) + 1 if alive and not killed else 1000):
            if fd == st.pidfd:
                alive = False
                poller.unregister(fd)
            elif fd == conn.fileno():  # the host closed or cancelled the call: nothing may keep running
                host_gone = True
                poller.unregister(fd)
                if alive and not killed:
                    os.kill(st.pid, signal.SIGKILL)
                    killed = True
            elif fd == in_w:
                try:
                    pending = pending[os.write(in_w, pending[:65536]):] if pending else pending
                except BrokenPipeError:
                    pending = pending[:0]
                if not pending:
                    poller.unregister(in_w)
                    os.close(in_w)
                    in_w = -1
            else:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    poller.unregister(fd)
                    open_fds.discard(fd)
                elif fd == st.report:
                    bufs[fd] += chunk
                else:  # keep draining past the cap so the program is not blocked, but store only cap+1 bytes
                    room = cap + 1 - sizes[fd]
                    if room > 0:
                        bufs[fd] += chunk[:room]
                    sizes[fd] += len(chunk)
    if in_w >= 0:
        os.close(in_w)
    out, err, rep = (bytes(bufs[fd]) for fd in (st.stdout, st.stderr, st.report))
    return out, err, rep, killed and not host_gone, host_gone


def _classify(report: dict, timed_out: bool, truncated: bool, cg: RunCgroup | None, vol: str,
              ) -> tuple[str, int, str]:
    """(status, exit code, a note for stderr): a breached limit is a status, apart from the program's exit code."""
    if timed_out:
        code = -signal.SIGKILL
    elif report.get("wait_status") is not None:
        code = os.waitstatus_to_exitcode(report["wait_status"])
    else:
        code = -1
    fs = os.statvfs(vol)
    if cg is not None and cg.oom_killed():
        return OOM, code, "\n[sandbox] killed: memory limit exceeded\n"
    if cg is not None and cg.pids_refused():
        return PIDS, code, "\n[sandbox] process limit reached: a fork was refused\n"
    if code == -signal.SIGXFSZ or report.get("disk_full") or fs.f_bavail * fs.f_frsize < 65536 or fs.f_favail == 0:
        return DISK, code, "\n[sandbox] disk limit reached (file size or workspace bytes)\n"
    if timed_out or report.get("cpu_exceeded"):
        return TIMEOUT, code, "\n[sandbox] killed: time limit exceeded\n"
    if report.get("error") or "wait_status" not in report:
        return SANDBOX_ERROR, -1, f"\n[sandbox] {report.get('error') or 'the sandbox init died'}\n"
    return (OUTPUT_TRUNCATED if truncated else EXITED), code, ""


# ---- I: pid 1 of the run's PID namespace -----------------------------------------------------------------------

def _init(cg: RunCgroup | None, ctl: int, sync_w: int, rep_w: int, stdio: tuple[int, int, int]) -> None:
    kernel.prctl(kernel.PR_SET_PDEATHSIG, signal.SIGKILL)
    if cg is not None:
        cg.join()
    kernel.unshare(kernel.CLONE_NEWNS | kernel.CLONE_NEWNET | kernel.CLONE_NEWIPC | kernel.CLONE_NEWUTS)
    # Slave, not private: volumes the launcher mounts from now on still appear here; nothing flows back.
    kernel.mount(None, "/", None, kernel.MS_REC | kernel.MS_SLAVE)
    _loopback_up()
    kernel.sethostname("sandbox")
    kernel.mount("proc", f"{ROOT}/proc", "proc", _MOUNT_FLAGS | kernel.MS_NOEXEC)
    kernel.mount(f"{ROOT}/proc/sys", f"{ROOT}/proc/sys", None, kernel.MS_BIND | kernel.MS_REC)
    kernel.mount(None, f"{ROOT}/proc/sys", None,
                 kernel.MS_REMOUNT | kernel.MS_BIND | kernel.MS_RDONLY | _MOUNT_FLAGS | kernel.MS_NOEXEC)
    # Staged: wait for the request.
    req, files = _recv_pipe(ctl)
    _tr("I got req")
    lim = req["limits"]
    os.chdir("/")  # relative layer paths keep the overlay options under one page, so stacks can be deep
    lowers = ":".join(req["lowers"]) or "empty"
    vol = req["vol"].lstrip("/")
    kernel.mount("overlay", f"{ROOT}/workspace", "overlay", _MOUNT_FLAGS,
                 f"lowerdir={lowers},upperdir={vol}/{req['upper']},workdir={vol}/work")
    kernel.mount(req["tmp"], f"{ROOT}/tmp", None, kernel.MS_BIND)
    kernel.mount(None, f"{ROOT}/tmp", None, kernel.MS_REMOUNT | kernel.MS_BIND | _MOUNT_FLAGS)
    _tr("I mounted")
    os.chdir(ROOT)
    kernel.pivot_root(".", ".")  # the old root now sits on top of the new one: detach it, and the host is gone
    kernel.umount(".")
    _tr("I pivoted")
    os.chdir(WORKSPACE)
    mb = 1 << 20
    resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_size_mb"] * mb, lim["file_size_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"], lim["open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if cg is None:  # no cgroup: per-process caps are the best we have
        resource.setrlimit(resource.RLIMIT_AS, (lim["memory_mb"] * mb, lim["memory_mb"] * mb))
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["max_procs"], lim["max_procs"]))
    _tr("I pre-userns")
    kernel.unshare(kernel.CLONE_NEWUSER)
    os.write(sync_w, b"u")
    os.close(sync_w)
    if os.read(ctl, 1) != b"g":
        raise RuntimeError("the worker did not map the sandbox's user namespace")
    os.setgroups([])
    os.setresgid(INSIDE_ID, INSIDE_ID, INSIDE_ID)
    os.setresuid(INSIDE_ID, INSIDE_ID, INSIDE_ID)
    kernel.drop_capabilities()
    kernel.prctl(kernel.PR_SET_DUMPABLE, 0)
    _tr("I mapped")
    seccomp.install(_FILTER)
    _tr("I seccomp")
    report = _act(req, files, stdio, lim)
    blobs = report.pop("blobs")
    _tr("I done")
    _write_all(rep_w, protocol.encode(report, blobs))
    os._exit(0)


def _act(req: dict, files: list[bytes], stdio: tuple[int, int, int], lim: dict) -> dict:
    """As the sandbox user: write files, run the command, kill its leftovers, read files back."""
    writes = [_try(lambda: _write_file(path, data, mode)) for (path, mode), data in zip(req["writes"], files)]
    report: dict = {"writes": writes, "reads": [], "blobs": [], "wait_status": 0}
    if any(writes):
        report["disk_full"] = any(e in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) for e in writes)
    elif req["argv"]:
        status, cpu = _spawn_and_wait(req["argv"], req["env"], stdio)
        report["wait_status"] = status
        report["cpu_exceeded"] = os.WIFSIGNALED(status) and cpu >= lim["cpu_s"] - 0.05
    for fd in stdio:
        os.close(fd)
    for path in req["reads"]:
        box: list[bytes] = []
        report["reads"].append(_try(lambda: box.append(_read_file(path, lim["file_size_mb"] << 20))))
        report["blobs"].append(box[0] if box else b"")
    return report


def _spawn_and_wait(argv: list[str], env: dict[str, str], stdio: tuple[int, int, int]) -> tuple[int, float]:
    in_r, out_w, err_w = stdio
    actions = [(os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)]
    try:
        child = os.posix_spawn(_which(argv[0], env.get("PATH", "")), argv, env, file_actions=actions, setsid=True,
                               setsigmask=(), setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD))
    except OSError as e:
        os.write(err_w, f"{argv[0]}: {e.strerror}\n".encode())
        return (127 if e.errno == errno.ENOENT else 126) << 8, 0.0
    while True:  # as pid 1 we also reap the orphans C leaves behind
        _tr("I spawned")
        pid, status, usage = os.wait4(-1, 0)
        _tr("I waited")
        if pid == child:
            break
    try:  # nothing of C's may outlive it: pid 1 may signal everyone else in its namespace
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break
    return status, usage.ru_utime + usage.ru_stime


def _which(name: str, path: str) -> str:
    if "/" in name:
        return name
    for d in path.split(":"):
        if d and os.access(f"{d}/{name}", os.X_OK):
            return f"{d}/{name}"
    return name


def _inside(path: str) -> str:
    """Resolve (in the sandbox's own view) and refuse anything outside the workspace and /tmp."""
    full = os.path.realpath(path if path.startswith("/") else f"{WORKSPACE}/{path}")
    if not any(full == top or full.startswith(top + "/") for top in (WORKSPACE, TMP)):
        raise OSError(errno.EXDEV, f"{path} is outside the workspace")
    return full


def _write_file(path: str, data: bytes, mode: int) -> None:
    full = _inside(path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    fd = os.open(_inside(full), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)


def _read_file(path: str, limit: int) -> bytes:
    with open(_inside(path), "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"{path} is larger than the file size limit")
    return data


def _try(fn) -> int:  # noqa: ANN001 - a thunk
    try:
        fn()
        return 0
    except OSError as e:
        return e.errno or errno.EIO


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _recv_pipe(fd: int) -> tuple[dict, list[bytes]]:
    def exact(n: int) -> bytes:
        parts = []
        while n:
            chunk = os.read(fd, min(n, 1 << 20))
            if not chunk:
                raise EOFError("the worker went away")
            parts.append(chunk)
            n -= len(chunk)
        return b"".join(parts)
    (n,) = struct.unpack("<I", exact(4))
    header = json.loads(exact(n))
    return header, protocol.split(header, exact(sum(header["blobs"])))


def _loopback_up() -> None:
    """A fresh network namespace has only `lo`, and it is down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = 0x1 | 0x8 | 0x40  # IFF_UP | IFF_LOOPBACK | IFF_RUNNING
        fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH22x", b"lo", flags))  # SIOCSIFFLAGS
