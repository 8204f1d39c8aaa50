"""One sandboxed run, in three processes:

  W  worker (root, the launcher's namespaces): mounts the sandbox's workspace volume, makes a cgroup and pipes,
     unshares a PID namespace, then copies output (capped) and kills I on timeout or when the host hangs up.
  I  pid 1 of that namespace: new mount/net/IPC/UTS namespaces; overlay workspace, private /tmp, own /proc;
     pivots into the read-only root; joins a new user namespace as an unprivileged uid; drops every
     capability; loads seccomp; writes the requested files, spawns C, kills what C left, reads files back.
  C  the command, spawned (vfork+exec) with only the environment the host allowed.

The PID namespace dies with I, so no process outlives a run. W reads the cgroup's counters to report an OOM
kill or a refused fork as a status apart from the program's exit code. Stdlib only (runs in the launcher)."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import resource
import select
import shutil
import signal
import socket
import struct
import time

from assay.sandbox import kernel, protocol, seccomp
from assay.sandbox.status import DISK, EXITED, OOM, OUTPUT_TRUNCATED, PIDS, SANDBOX_ERROR, TIMEOUT
from assay.sandbox.cgroups import RunCgroup

INSIDE_ID = 1000  # the uid/gid programs see
HOST_ID = 1_879_048_192 + INSIDE_ID  # what it maps to on the host: unprivileged, owned by no host user
WORKSPACE, TMP = "/workspace", "/tmp"
SETUP_TIMEOUT_S = 10.0
_LAYER = re.compile(r"(v/[\w-]+/u\d+|t/[\w-]+)")
_NAME = re.compile(r"[\w-]+")
_UPPER = re.compile(r"u\d+")


def _own_dir(path: str, mode: int = 0o755) -> None:
    if not os.path.isdir(path):
        os.mkdir(path)
    os.chown(path, HOST_ID, HOST_ID)
    os.chmod(path, mode)


def open_volume(store: str, name: str, size_mb: int) -> str:
    """The sandbox's own tmpfs (its disk quota), mounted in the launcher's namespace on first use."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"bad volume name {name!r}")
    path = f"{store}/v/{name}"
    if not os.path.isdir(f"{path}/work"):
        os.makedirs(path, exist_ok=True)
        kernel.mount("tmpfs", path, "tmpfs", kernel.MS_NOSUID | kernel.MS_NODEV,
                     f"size={size_mb}m,nr_inodes={256 * size_mb + 1024},mode=0755")
        os.mkdir(f"{path}/work", 0o700)
    return path


def run(conn: socket.socket, store: str, req: dict, blobs: list[bytes], use_cgroups: bool) -> None:
    """Serve one exec request (in a fresh worker process) and answer on conn."""
    lim = req["limits"]
    vol = open_volume(store, req["volume"], req["volume_mb"])
    for name in req["discard"]:
        if _UPPER.fullmatch(name):
            shutil.rmtree(f"{vol}/{name}", ignore_errors=True)
    if not _UPPER.fullmatch(req["upper"]) or not all(_LAYER.fullmatch(p) for p in req["lowers"]):
        raise ValueError("bad layer names")
    _own_dir(f"{vol}/{req['upper']}")
    tmp = f"{vol}/tmp-{os.getpid()}"
    _own_dir(tmp, 0o1777)
    stdin = blobs[0] if req["stdin"] else None
    files = blobs[1:] if req["stdin"] else blobs
    cg = RunCgroup.create(f"{os.getppid()}-{os.getpid()}", lim["memory_mb"] << 20, lim["max_procs"] + 1) \
        if use_cgroups else None  # +1: the init process counts too
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    rep_r, rep_w = os.pipe()
    sync_r, sync_w = os.pipe()
    go_r, go_w = os.pipe()
    in_r, in_w = os.pipe() if stdin is not None else (-1, -1)
    kernel.unshare(kernel.CLONE_NEWPID)
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            for fd in (conn.fileno(), out_r, err_r, rep_r, sync_r, go_w, in_w):
                if fd >= 0:
                    os.close(fd)
            _init(store, vol, tmp, req, files, cg, (in_r, out_w, err_w), rep_w, sync_w, go_r)
        except BaseException as e:  # noqa: BLE001 - whatever broke, W must hear of it
            _write_all(rep_w, protocol.encode({"error": f"sandbox setup failed: {type(e).__name__}: {e}"}))
        os._exit(111)
    for fd in (out_w, err_w, rep_w, sync_w, go_r, in_r):
        if fd >= 0:
            os.close(fd)
    pidfd = os.pidfd_open(pid)
    # Only a root of the parent user namespace may map I's user namespace onto another host uid.
    ready, _, _ = select.select([sync_r], [], [], SETUP_TIMEOUT_S)
    if ready and os.read(sync_r, 1) == b"u":
        for kind in ("uid", "gid"):
            with open(f"/proc/{pid}/{kind}_map", "w") as f:
                f.write(f"{INSIDE_ID} {HOST_ID} 1\n")
        os.write(go_w, b"g")
    os.close(go_w)
    os.close(sync_r)
    out, err, rep, timed_out, host_gone = _pump(pid, pidfd, conn, out_r, err_r, rep_r, in_w, stdin,
                                                started + lim["timeout_s"], lim["output_bytes"])
    os.waitpid(pid, 0)
    duration = time.monotonic() - started
    report, read_blobs = protocol.decode(rep) if rep else ({"error": None}, [])
    cap = lim["output_bytes"]
    status, exit_code, message = _classify(report, timed_out, len(out) > cap or len(err) > cap, cg, vol, lim)
    if not host_gone:
        stderr = err[:cap] + message.encode()
        header = {"exit_code": exit_code, "status": status, "duration": duration,
                  "writes": report.get("writes", []), "reads": report.get("reads", [])}
        conn.sendall(protocol.encode(header, [out[:cap], stderr, *read_blobs]))
    conn.close()
    if cg is not None:
        cg.remove()
    shutil.rmtree(tmp, ignore_errors=True)


def _pump(pid: int, pidfd: int, conn: socket.socket, out_r: int, err_r: int, rep_r: int, in_w: int,
          stdin: bytes | None, deadline: float, cap: int) -> tuple[bytes, bytes, bytes, bool, bool]:
    """Move bytes until I has exited and its pipes are drained; kill I at the deadline or if the host hangs up."""
    bufs: dict[int, bytearray] = {out_r: bytearray(), err_r: bytearray(), rep_r: bytearray()}
    sizes = {out_r: 0, err_r: 0}
    poller = select.poll()
    for fd in (out_r, err_r, rep_r, pidfd):
        poller.register(fd, select.POLLIN)
    poller.register(conn.fileno(), select.POLLIN)
    pending = memoryview(stdin or b"")
    if in_w >= 0:
        os.set_blocking(in_w, False)
        poller.register(in_w, select.POLLOUT)
    open_fds, alive, killed, host_gone = {out_r, err_r, rep_r}, True, False, False
    while open_fds or alive:
        wait = deadline - time.monotonic()
        if wait <= 0 and alive and not killed:
            os.kill(pid, signal.SIGKILL)
            killed = True
        for fd, ev in poller.poll(max(0, int(wait * 1000)) + 1 if alive and not killed else 1000):
            if fd == pidfd:
                alive = False
                poller.unregister(pidfd)
            elif fd == conn.fileno():  # the host closed or cancelled the call: nothing may keep running
                host_gone = True
                poller.unregister(fd)
                if alive:
                    os.kill(pid, signal.SIGKILL)
                    killed = True
            elif fd == in_w:
                try:
                    pending = pending[os.write(in_w, pending[:65536]):]
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
                elif fd == rep_r:
                    bufs[fd] += chunk
                else:  # keep draining past the cap so the program is not blocked, but store only cap+1 bytes
                    room = cap + 1 - sizes[fd]
                    if room > 0:
                        bufs[fd] += chunk[:room]
                    sizes[fd] += len(chunk)
    if in_w >= 0:
        os.close(in_w)
    return bytes(bufs[out_r]), bytes(bufs[err_r]), bytes(bufs[rep_r]), killed and not host_gone, host_gone


def _classify(report: dict, timed_out: bool, truncated: bool, cg: RunCgroup | None, vol: str,
              lim: dict) -> tuple[str, int, str]:
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


# ---- inside: pid 1 of the new PID namespace -------------------------------------------------------------------

_MOUNT_FLAGS = kernel.MS_NOSUID | kernel.MS_NODEV


def _init(store: str, vol: str, tmp: str, req: dict, files: list[bytes], cg: RunCgroup | None,
          stdio: tuple[int, int, int], rep_w: int, sync_w: int, go_r: int) -> None:
    kernel.prctl(kernel.PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    lim = req["limits"]
    if cg is not None:
        cg.join()
    kernel.unshare(kernel.CLONE_NEWNS | kernel.CLONE_NEWNET | kernel.CLONE_NEWIPC | kernel.CLONE_NEWUTS)
    _loopback_up()
    root = f"{store}/root"
    os.chdir(store)  # relative layer paths keep the overlay options under one page, so stacks can be deep
    lowers = ":".join(req["lowers"]) or "empty"
    rel = os.path.relpath(vol, store)
    kernel.mount("overlay", f"{root}/workspace", "overlay", _MOUNT_FLAGS,
                 f"lowerdir={lowers},upperdir={rel}/{req['upper']},workdir={rel}/work")
    kernel.mount(tmp, f"{root}/tmp", None, kernel.MS_BIND)
    kernel.mount(None, f"{root}/tmp", None, kernel.MS_REMOUNT | kernel.MS_BIND | _MOUNT_FLAGS)
    kernel.mount("proc", f"{root}/proc", "proc", _MOUNT_FLAGS | kernel.MS_NOEXEC)
    kernel.mount(f"{root}/proc/sys", f"{root}/proc/sys", None, kernel.MS_BIND | kernel.MS_REC)
    kernel.mount(None, f"{root}/proc/sys", None,
                 kernel.MS_REMOUNT | kernel.MS_BIND | kernel.MS_RDONLY | _MOUNT_FLAGS | kernel.MS_NOEXEC)
    kernel.sethostname("sandbox")
    os.chdir(root)
    kernel.pivot_root(".", ".")  # the old root now sits on top of the new one: detach it, and the host is gone
    kernel.umount(".")
    os.chdir(WORKSPACE)
    mb = 1 << 20
    resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_size_mb"] * mb, lim["file_size_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"], lim["open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if cg is None:  # no cgroup: per-process caps are the best we have
        resource.setrlimit(resource.RLIMIT_AS, (lim["memory_mb"] * mb, lim["memory_mb"] * mb))
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["max_procs"], lim["max_procs"]))
    kernel.unshare(kernel.CLONE_NEWUSER)
    os.write(sync_w, b"u")
    os.close(sync_w)
    if os.read(go_r, 1) != b"g":
        raise RuntimeError("the worker did not map the sandbox's user namespace")
    os.setgroups([])
    os.setresgid(INSIDE_ID, INSIDE_ID, INSIDE_ID)
    os.setresuid(INSIDE_ID, INSIDE_ID, INSIDE_ID)
    kernel.drop_capabilities()
    kernel.prctl(kernel.PR_SET_DUMPABLE, 0)
    seccomp.install()
    report = _act(req, files, stdio, lim)
    blobs = report.pop("blobs")
    _write_all(rep_w, protocol.encode(report, blobs))
    os._exit(0)


def _act(req: dict, files: list[bytes], stdio: tuple[int, int, int], lim: dict) -> dict:
    """As the sandbox user: write files, run the command, kill its leftovers, read files back."""
    writes = [_try(lambda: _write_file(path, data, mode)) for (path, mode), data in zip(req["writes"], files)]
    report: dict = {"writes": writes, "reads": [], "blobs": [], "wait_status": 0}
    if any(writes):
        report["disk_full"] = any(e in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) for e in writes)
        return report
    if req["argv"]:
        status, cpu = _spawn_and_wait(req["argv"], req["env"], stdio)
        report["wait_status"] = status
        report["cpu_exceeded"] = os.WIFSIGNALED(status) and cpu >= lim["cpu_s"] - 0.05
    for fd in stdio:
        if fd >= 0:
            os.close(fd)
    for path in req["reads"]:
        box: list[bytes] = []
        code = _try(lambda: box.append(_read_file(path, lim["file_size_mb"] << 20)))
        report["reads"].append(code)
        report["blobs"].append(box[0] if box else b"")
    return report


def _spawn_and_wait(argv: list[str], env: dict[str, str], stdio: tuple[int, int, int]) -> tuple[int, float]:
    in_r, out_w, err_w = stdio
    exe = _which(argv[0], env.get("PATH", ""))
    stdin = in_r if in_r >= 0 else os.open("/dev/null", os.O_RDONLY)
    actions = [(os.POSIX_SPAWN_DUP2, stdin, 0), (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)]
    try:
        child = os.posix_spawn(exe, argv, env, file_actions=actions, setsid=True, setsigmask=(),
                               setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGINT))
    except OSError as e:
        os.write(err_w, f"{argv[0]}: {e.strerror}\n".encode())
        return (127 if e.errno == errno.ENOENT else 126) << 8, 0.0
    while True:  # as pid 1 we also reap the orphans C leaves behind
        pid, status, usage = os.wait4(-1, 0)
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


def _loopback_up() -> None:
    """A fresh network namespace has only `lo`, and it is down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = 0x1 | 0x8 | 0x40  # IFF_UP | IFF_LOOPBACK | IFF_RUNNING
        fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH22x", b"lo", flags))  # SIOCSIFFLAGS
