"""One sandboxed run, served by a worker the launcher forks ahead of demand as pid 1 of a fresh PID namespace.

Staged (before any request): new mount/IPC/UTS namespaces, its own /proc, the read-only root prepared. Then it
takes one request straight from the host's socket: joins the sandbox's network and cgroup namespaces and its
cgroup, mounts the overlay workspace and a private /tmp, pivots into the read-only root, becomes an unprivileged uid in a new
user namespace, drops every capability, loads seccomp, writes the requested files, spawns the command, copies
its output (capped), kills everything at the deadline, reads files back and answers.

The PID namespace dies with its pid 1, so no process outlives a run. A breached limit (OOM kill, refused fork,
full disk, timeout) comes back as a status apart from the program's exit code. Stdlib only (runs in the
launcher)."""

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
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from assay.sandbox import cgroups, kernel, protocol, seccomp
from assay.sandbox.status import DISK, EXITED, OOM, OUTPUT_TRUNCATED, PIDS, TIMEOUT

INSIDE_ID = 1000  # the uid/gid programs see
HOST_ID = 1_879_048_192 + INSIDE_ID  # what it is on the host: unprivileged, owned by no host user
ROOT, WORKSPACE = "/root", "/workspace"  # the sandbox root in the launcher's view; the workspace inside
NAME = re.compile(r"[\w-]+")
T = TypeVar("T")
_LAYER = re.compile(r"(v/[\w-]+/u\d+|t/[\w-]+)")
_UPPER = re.compile(r"u\d+")
_DISCARD = re.compile(r"[uw]\d+")
_FILTER = seccomp.build_filter() if kernel.SYSCALLS else b""
_MOUNT_FLAGS = kernel.MS_NOSUID | kernel.MS_NODEV


def tmpfs_options(size_mb: int, mode: str) -> str:
    return f"size={size_mb}m,nr_inodes={256 * size_mb + 1024},mode={mode}"


def own_dir(path: str, mode: int = 0o755) -> None:
    if not os.path.isdir(path):
        os.mkdir(path)
    os.chown(path, HOST_ID, HOST_ID)
    os.chmod(path, mode)


def worker(exec_sock: socket.socket, notify_w: int, launcher_pid: int, cg: ModuleType | None) -> None:
    """pid 1 of a fresh PID namespace: stage, serve one request, exit (and the namespace with us)."""
    kernel.prctl(kernel.PR_SET_PDEATHSIG, signal.SIGKILL)
    if _host_ppid() != launcher_pid:  # it died before we asked to die with it
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # pid 1 gets only the signals it handles: handle none
    problem, host_pid = None, 0
    try:
        host_pid = int(os.readlink("/proc/self"))  # the launcher's /proc shows the host's PID namespace
        _prestage()
    except Exception as e:  # told to whoever asks next, so a broken host fails loudly, not in a loop
        problem = f"sandbox setup failed: {type(e).__name__}: {e}"
    while True:
        conn, _ = exec_sock.accept()
        _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid == os.getuid():
            break
        conn.close()
    os.setpriority(os.PRIO_PROCESS, 0, 0)  # staging ran niced (see launcher.py); serving does not
    os.write(notify_w, struct.pack("<i", host_pid))  # the launcher stages our replacement
    exec_sock.close()
    os.close(notify_w)
    try:
        req, blobs = protocol.recv(conn)
        if problem is not None:
            raise RuntimeError(problem)
        header, out = _serve(conn, req, blobs, launcher_pid, cg)
        if header is not None:
            header["pid"] = host_pid
    except Exception as e:  # the host gets every failure as an answer
        header, out = {"error": f"{type(e).__name__}: {e}"}, []
    if header is not None:
        try:
            conn.sendall(protocol.encode(header, out))
        except OSError:
            pass


def _host_ppid() -> int:
    """Our parent's pid as the host sees it (getppid() says 0: our parent is outside our PID namespace)."""
    with open("/proc/self/status") as f:  # the launcher's /proc: the host's PID namespace
        return int(next(line for line in f if line.startswith("PPid:")).split()[1])


def _prestage() -> None:
    """Everything that does not depend on the request."""
    kernel.unshare(kernel.CLONE_NEWNS | kernel.CLONE_NEWIPC | kernel.CLONE_NEWUTS)
    # Slave, not private: volumes the launcher mounts from now on still appear here; nothing flows back.
    kernel.mount(None, "/", None, kernel.MS_REC | kernel.MS_SLAVE)
    kernel.sethostname("sandbox")
    kernel.mount("proc", f"{ROOT}/proc", "proc", _MOUNT_FLAGS | kernel.MS_NOEXEC)
    kernel.mount(f"{ROOT}/proc/sys", f"{ROOT}/proc/sys", None, kernel.MS_BIND | kernel.MS_REC)
    kernel.mount(None, f"{ROOT}/proc/sys", None,
                 kernel.MS_REMOUNT | kernel.MS_BIND | kernel.MS_RDONLY | _MOUNT_FLAGS | kernel.MS_NOEXEC)
    # The kernel's command line can name host paths (an initrd's init) and, in a VM, its vsock ports: read empty.
    kernel.mount(f"{ROOT}/dev/null", f"{ROOT}/proc/cmdline", None, kernel.MS_BIND)


def _serve(conn: socket.socket, req: dict, files: list[bytes], launcher_pid: int, cg: ModuleType | None,
           ) -> tuple[dict | None, list]:
    lim = req["limits"]
    started = time.monotonic()
    vol = f"/v/{req['volume']}"
    if not NAME.fullmatch(req["volume"]) or not os.path.ismount(vol):
        raise FileNotFoundError(f"no workspace volume {req['volume']!r} (closed, or the launcher restarted)")
    if not _UPPER.fullmatch(req["upper"]) or not all(_LAYER.fullmatch(p) for p in req["lowers"]):
        raise ValueError("bad layer names")
    for pid in req["after"]:
        _wait_gone(pid)
    for name in req["discard"]:
        if _DISCARD.fullmatch(name):
            shutil.rmtree(f"{vol}/{name}", ignore_errors=True)
    upper, work = req["upper"], "w" + req["upper"][1:]
    for layer in req["lowers"]:  # a layer frozen after a call that failed before making it holds no changes
        if layer.startswith(vol[1:] + "/") and not os.path.isdir(f"/{layer}"):
            own_dir(f"/{layer}")
    own_dir(f"{vol}/{upper}")
    os.makedirs(f"{vol}/{work}", 0o700, exist_ok=True)
    # The cgroup files are opened before we join the sandbox's cgroup namespace: cgroup v2 checks a move against
    # the namespace its file was opened in (with nsdelegate), and from inside that one our own cgroup is out of sight.
    counters, cgroup_moves = None, None
    if req["cgroup"]:
        if cg is None or not NAME.fullmatch(req["cgroup"]):
            raise ValueError("bad cgroup name")
        counters = cg.counters(req["cgroup"])
        cgroup_moves = cg.procs_files(req["cgroup"]), cg.procs_files(None)
    # The sandbox's own network namespace (loopback only) and cgroup namespace (its cgroup seen as "/"), kept by the
    # launcher across its runs.
    for key, kind in (("netns", kernel.CLONE_NEWNET), ("cgroupns", kernel.CLONE_NEWCGROUP)):
        fd = os.open(f"/proc/{launcher_pid}/fd/{int(req[key])}", os.O_RDONLY)
        kernel.setns(fd, kind)
        os.close(fd)
    # Layers named by open fds: the sandbox's mount table then shows /proc/self/fd/N, not the launcher's layout
    # (whose volume names are also its cgroups'), and the options stay under a page however deep the stack.
    layers = [os.open(path, os.O_PATH | os.O_DIRECTORY)
              for path in ([f"/{layer}" for layer in req["lowers"]] or ["/empty"]) + [f"{vol}/{upper}", f"{vol}/{work}"]]
    try:
        *lowers, up, wk = (f"/proc/self/fd/{fd}" for fd in layers)
        kernel.mount("overlay", f"{ROOT}/workspace", "overlay", _MOUNT_FLAGS,
                     f"lowerdir={':'.join(lowers)},upperdir={up},workdir={wk}")
    finally:
        for fd in layers:
            os.close(fd)
    kernel.mount("tmpfs", f"{ROOT}/tmp", "tmpfs", _MOUNT_FLAGS, tmpfs_options(req["volume_mb"], "1777"))
    disks = [os.open(d, os.O_RDONLY | os.O_DIRECTORY) for d in (vol, f"{ROOT}/tmp")]  # to see if they filled
    os.chdir(ROOT)
    kernel.pivot_root(".", ".")  # the old root now sits on top of the new one: detach it, and the host is gone
    kernel.umount(".")
    os.chdir(WORKSPACE)
    stdin = files.pop(0) if req["stdin"] else b""
    _confine(lim, counters is not None)
    writes = [_attempt(_write_file, path, data, mode)[0] for (path, mode), data in zip(req["writes"], files,
                                                                                         strict=True)]
    header: dict = {"writes": writes, "reads": [], "exit_code": 0}
    out = err = b""
    timed_out = cpu_out = truncated = False
    if any(writes):
        header["disk_full"] = any(e in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) for e in writes)
    elif req["argv"]:
        run = _run(req["argv"], req["env"], stdin, conn, started + lim["timeout_s"], lim["output_bytes"],
                   cgroup_moves)
        if run is None:
            return None, []  # the host hung up: everything is already killed
        status, cpu, out, err, timed_out = run
        header["exit_code"] = -signal.SIGKILL if timed_out else os.waitstatus_to_exitcode(status)
        # SIGXCPU is the kernel enforcing RLIMIT_CPU; rusage can lag the limit under load, so the
        # signal alone decides (a program that sends itself SIGXCPU only earns a failure).
        cpu_out = os.WIFSIGNALED(status) and (os.WTERMSIG(status) == signal.SIGXCPU or cpu >= lim["cpu_s"] - 0.05)
        cap = lim["output_bytes"]
        truncated, out, err = len(out) > cap or len(err) > cap, out[:cap], err[:cap]
    blobs = []
    for path in req["reads"]:
        code, data = _attempt(_read_file, path, lim["file_size_mb"] << 20)
        header["reads"].append(code)
        blobs.append(data or b"")
    full = any(s.f_bavail * s.f_frsize < 65536 or s.f_favail == 0 for s in map(os.fstatvfs, disks))
    oom, pids = counters.breaches() if counters is not None else (False, False)
    status, note = _classify(header, oom, pids, timed_out, cpu_out, truncated, full)
    header.update(status=status, duration=time.monotonic() - started)
    return header, [out, err + note.encode(), *blobs]


def _wait_gone(pid: int, limit_s: float = 2.0) -> None:
    """Wait until an earlier run of this sandbox (its pid 1, by host pid) has exited: its overlay over the same
    layers is released when its namespaces are, before it turns zombie. Runs reply before that, to be fast."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    return
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return
        time.sleep(0.0002)


def _confine(lim: dict, have_cgroup: bool) -> None:
    """From root to an unprivileged uid in a fresh user namespace, with limits, no capabilities and seccomp."""
    mb = 1 << 20
    resource.setrlimit(resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_size_mb"] * mb, lim["file_size_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"], lim["open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if not have_cgroup:  # per-process caps are the best we have
        resource.setrlimit(resource.RLIMIT_AS, (lim["memory_mb"] * mb, lim["memory_mb"] * mb))
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["max_procs"], lim["max_procs"]))
    os.setgroups([])
    os.setresgid(HOST_ID, HOST_ID, HOST_ID)
    os.setresuid(HOST_ID, HOST_ID, HOST_ID)  # no longer root anywhere on the host
    kernel.unshare(kernel.CLONE_NEWUSER)
    kernel.prctl(kernel.PR_SET_DUMPABLE, 1)  # our /proc/self files are ours again, long enough to map our ids
    for name, text in (("setgroups", "deny"), ("uid_map", f"{INSIDE_ID} {HOST_ID} 1\n"),
                       ("gid_map", f"{INSIDE_ID} {HOST_ID} 1\n")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    kernel.drop_capabilities()  # the creator of a user namespace holds all of them inside it
    kernel.prctl(kernel.PR_SET_DUMPABLE, 0)  # the program may not read our memory or our /proc files
    seccomp.install(_FILTER)


def _run(argv: list[str], env: dict[str, str], stdin: bytes, conn: socket.socket, deadline: float, cap: int,
         cgroup_moves: tuple[list[int], list[int]] | None) -> tuple[int, float, bytes, bytes, bool] | None:
    """Start the command, feed its stdin, keep cap+1 bytes of each output, reap orphans, kill everything at the
    deadline. None if the host hung up."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    actions = [(os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)]
    if cgroup_moves is not None:  # the command is born in the sandbox's cgroup; we step in for that moment only,
        cgroups.move_self(cgroup_moves[0])  # so the OOM killer can never pick us and fail the run
    try:
        child = os.posix_spawn(_which(argv[0], env.get("PATH", "")), argv, env, file_actions=actions, setsid=True,
                               setsigmask=(), setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT))
    except OSError as e:
        code = 127 if e.errno == errno.ENOENT else 126
        return code << 8, 0.0, b"", f"{argv[0]}: {e.strerror}\n".encode(), False
    finally:
        if cgroup_moves is not None:
            cgroups.move_self(cgroup_moves[1])
        for fd in (in_r, out_w, err_w):
            os.close(fd)
    bufs = {out_r: bytearray(), err_r: bytearray()}
    exited = os.pidfd_open(child)  # readable once C has exited (its pipes may close before that)
    poller = select.poll()
    for fd in (out_r, err_r, conn.fileno(), exited):
        poller.register(fd, select.POLLIN)
    pending = memoryview(stdin)
    os.set_blocking(in_w, False)
    poller.register(in_w, select.POLLOUT)
    status, usage, timed_out, open_fds = None, None, False, {out_r, err_r, in_w}
    while status is None:
        wait = deadline - time.monotonic()
        if wait <= 0:
            timed_out = True
            break
        for fd, _ in poller.poll(min(wait, 0.1) * 1000):  # wake now and then to reap orphans
            if fd == conn.fileno():  # the host closed or cancelled the call: nothing may keep running
                _kill_all()
                return None
            if fd == exited:
                poller.unregister(fd)
            elif fd == in_w:
                try:
                    pending = pending[os.write(in_w, pending[:65536]):]
                except BrokenPipeError:
                    pending = pending[:0]
                if not pending:
                    poller.unregister(in_w)
                    os.close(in_w)
                    open_fds.discard(in_w)
            else:
                _drain(fd, bufs[fd], cap, poller, open_fds)
        while True:  # as pid 1 we inherit every orphan: reap them, and notice C's own exit
            try:
                pid, st, ru = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == child:
                status, usage = st, ru
    _kill_all()  # nothing of C's may outlive it
    os.close(exited)
    for fd in (out_r, err_r):
        while fd in open_fds:
            _drain(fd, bufs[fd], cap, poller, open_fds)
    if in_w in open_fds:
        os.close(in_w)
    cpu = usage.ru_utime + usage.ru_stime if usage else 0.0
    return status if status is not None else 0, cpu, bytes(bufs[out_r]), bytes(bufs[err_r]), timed_out


def _drain(fd: int, buf: bytearray, cap: int, poller: select.poll, open_fds: set[int]) -> None:
    chunk = os.read(fd, 1 << 16)
    if not chunk:
        poller.unregister(fd)
        open_fds.discard(fd)
        os.close(fd)
    elif len(buf) <= cap:  # keep draining past the cap so the program is not blocked; store cap+1 bytes
        buf += chunk[:cap + 1 - len(buf)]


def _kill_all() -> None:
    try:  # pid 1 may signal everyone else in its namespace
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return


def _classify(header: dict, oom: bool, pids: bool, timed_out: bool, cpu_out: bool, truncated: bool,
              disk_full: bool) -> tuple[str, str]:
    """(status, a note for stderr): a breached limit is a status, apart from the program's exit code."""
    code = header["exit_code"]
    if oom:
        return OOM, "\n[sandbox] killed: memory limit exceeded\n"
    if pids:
        return PIDS, "\n[sandbox] process limit reached: a fork was refused\n"
    if code in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or header.get("disk_full") or disk_full:  # 128+n: a shell's
        return DISK, "\n[sandbox] disk limit reached (file size or workspace bytes)\n"
    if timed_out or cpu_out:
        return TIMEOUT, "\n[sandbox] killed: time limit exceeded\n"
    return (OUTPUT_TRUNCATED if truncated else EXITED), ""


def _which(name: str, path: str) -> str:
    if "/" in name:
        return name
    for d in path.split(":"):
        if d and os.access(f"{d}/{name}", os.X_OK):
            return f"{d}/{name}"
    return name


def _inside(path: str) -> str:
    """Resolve in the sandbox's own view (so a planted symlink cannot point at the host) and refuse anything
    outside the workspace."""
    full = os.path.realpath(path if path.startswith("/") else f"{WORKSPACE}/{path}")
    if not full.startswith(WORKSPACE + "/"):
        raise OSError(errno.EXDEV, f"{path} is outside the workspace")
    return full


def _write_file(path: str, data: bytes, mode: int) -> None:
    full = _inside(path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    fd = os.open(_inside(full), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _read_file(path: str, limit: int) -> bytes:
    with open(_inside(path), "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"{path} is larger than the file size limit")
    return data


def _attempt(fn: Callable[..., T], *args: Any) -> tuple[int, T | None]:
    """(errno or 0, fn's result)."""
    try:
        return 0, fn(*args)
    except OSError as e:
        return e.errno or errno.EIO, None


def loopback_up() -> None:
    """A fresh network namespace has only `lo`, and it is down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = 0x1 | 0x8 | 0x40  # IFF_UP | IFF_LOOPBACK | IFF_RUNNING
        fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH22x", b"lo", flags))  # SIOCSIFFLAGS

