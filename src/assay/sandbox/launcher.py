"""The sandbox launcher: one small root process per host process (client.py starts it), which forks a worker
per request.

It runs in a bare interpreter (-I -S, stdlib only, few modules), so each fork is cheap, and in a private mount
namespace, so the read-only root it builds and every workspace tmpfs it mounts are invisible to the host and
vanish with it. It listens on a Unix socket in a root-only directory, serves only its own uid, and exits when
the host closes its stdin (the host died or shut it down); its workers die with it (PDEATHSIG)."""

from __future__ import annotations

import os
import select
import signal
import socket
import struct
import sys
from types import ModuleType

from assay.sandbox import cgroups, cgroups2, jail, kernel, protocol

# Host files a program may need, copied; the rest of /etc (shadow, keys, configs) stays out.
ETC_SHARED = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "mime.types", "protocols",
              "services")
ETC_OWN = {
    "passwd": f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{jail.INSIDE_ID}:{jail.INSIDE_ID}::/workspace:/bin/sh\n"
              "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "group": f"root:x:0:\nsandbox:x:{jail.INSIDE_ID}:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1 localhost sandbox\n::1 localhost ip6-localhost\n",
    "hostname": "sandbox\n",
    "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
}
DEVICES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9)}
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2", "shm": "/tmp"}
_RO_BIND = kernel.MS_REMOUNT | kernel.MS_BIND | kernel.MS_RDONLY | kernel.MS_NOSUID | kernel.MS_NODEV


def _bind_ro(src: str, dst: str) -> None:
    kernel.mount(src, dst, None, kernel.MS_BIND | kernel.MS_REC)
    kernel.mount(None, dst, None, _RO_BIND)


def _host_dir(src: str, dst: str) -> None:
    """A read-only view of a host directory. An overlay of it over the store's empty directory (named relative to
    the store, our cwd), so that the sandbox's mount table reads "lowerdir=/usr:empty" where a bind mount would
    name the host's device and its mount options; a bind where the kernel refuses (overlays nest two deep)."""
    try:
        kernel.mount("overlay", dst, "overlay", kernel.MS_RDONLY | kernel.MS_NOSUID | kernel.MS_NODEV,
                     f"lowerdir={src}:empty")
    except OSError:
        _bind_ro(src, dst)


def _copy(src: str, dst: str) -> None:
    """Copy small host files, links and directories of them (a few /etc entries)."""
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
    elif os.path.isdir(src):
        os.mkdir(dst, 0o755)
        for name in os.listdir(src):
            _copy(f"{src}/{name}", f"{dst}/{name}")
    elif os.path.isfile(src):
        with open(src, "rb") as fin, open(dst, "wb") as fout:
            fout.write(fin.read())
        os.chmod(dst, 0o644)


def build_root(root: str) -> None:
    """The sandbox's root filesystem: /usr and a few /etc files of the host, read-only; a minimal /dev;
    mount points for /proc, /tmp and /workspace, which each run mounts afresh. Runs in the store."""
    kernel.mount("tmpfs", root, "tmpfs", kernel.MS_NOSUID, "mode=0755,size=4m")
    for d in ("usr", "etc", "dev", "proc", "tmp", "workspace"):
        os.mkdir(f"{root}/{d}", 0o755)
    _host_dir("/usr", f"{root}/usr")
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):  # merged-/usr links, or real dirs
        if os.path.islink(f"/{name}"):
            os.symlink(os.readlink(f"/{name}"), f"{root}/{name}")
        elif os.path.isdir(f"/{name}"):
            os.mkdir(f"{root}/{name}")
            _host_dir(f"/{name}", f"{root}/{name}")
    for name, text in ETC_OWN.items():
        with open(f"{root}/etc/{name}", "w") as f:
            f.write(text)
    for name in ETC_SHARED:
        if os.path.lexists(f"/etc/{name}"):
            _copy(f"/etc/{name}", f"{root}/etc/{name}")
    for name, (major, minor) in DEVICES.items():
        os.mknod(f"{root}/dev/{name}", 0o666 | 0o020000, os.makedev(major, minor))  # S_IFCHR
        os.chmod(f"{root}/dev/{name}", 0o666)
    for name, target in DEV_LINKS.items():
        os.symlink(target, f"{root}/dev/{name}")
    kernel.mount(None, root, None, kernel.MS_REMOUNT | kernel.MS_RDONLY | kernel.MS_NOSUID)


IDLE_WORKERS = 6  # staged ahead of demand: a request finds its namespaces already made
SPARE_SANDBOXES = 2  # made ahead of demand, of the kind last asked for
STAGING_NICE = 5  # a spare being staged yields to the runs being served (a worker undoes it when it serves)


def choose_cgroups() -> ModuleType | None:
    """The cgroup module that caps a sandbox's whole process tree here: v1 where its probe passes (hybrid hosts,
    as before v2 was supported), else v2 where our cgroup is a delegated subtree, else None (the host then
    refuses, unless per-process rlimits were allowed: client.py)."""
    return next((cg for cg in (cgroups, cgroups2) if cg.available()), None)


def _setup(run_dir: str) -> tuple[socket.socket, socket.socket, ModuleType | None]:
    """Build the store (a private tmpfs), then pivot into it: from here on the launcher, and every worker it
    forks, sees only the sandbox root, the workspace volumes, templates, its own /proc and the cgroup trees."""
    store = f"{run_dir}/store"
    kernel.unshare(kernel.CLONE_NEWNS)
    kernel.mount(None, "/", None, kernel.MS_REC | kernel.MS_PRIVATE)  # nothing we mount reaches the host
    os.makedirs(store, mode=0o700, exist_ok=True)
    kernel.mount("tmpfs", store, "tmpfs", kernel.MS_NOSUID | kernel.MS_NODEV, "mode=0700")
    for d in ("root", "v", "t", "empty", "proc", "cg"):
        os.mkdir(f"{store}/{d}", 0o755)
    os.chdir(store)
    build_root(f"{store}/root")
    kernel.mount("tmpfs", f"{store}/v", "tmpfs", kernel.MS_NOSUID | kernel.MS_NODEV, "mode=0755,size=1m")
    kernel.mount(None, f"{store}/v", None, kernel.MS_SHARED)  # staged workers see volumes mounted later
    kernel.mount("proc", f"{store}/proc", "proc", kernel.MS_NOSUID | kernel.MS_NODEV | kernel.MS_NOEXEC)
    cg = choose_cgroups()
    if cg is not None:
        cg.sweep()
    if cg is cgroups:
        for ctl in cgroups.CONTROLLERS:
            os.mkdir(f"{store}/cg/{ctl}")
            kernel.mount(f"{cgroups.ROOT}/{ctl}", f"{store}/cg/{ctl}", None, kernel.MS_BIND)
    elif cg is cgroups2:  # our delegated cgroup only, not the host's whole tree
        kernel.mount(cgroups2.DIR, f"{store}/cg", None, kernel.MS_BIND)
    socks = []
    for name in ("exec.sock", "ctl.sock"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(f"{run_dir}/{name}")
        sock.listen(512)
        socks.append(sock)
    os.chdir(store)
    kernel.pivot_root(".", ".")
    kernel.umount(".")
    os.chdir("/")
    cgroups.ROOT = cgroups2.DIR = "/cg"
    return socks[0], socks[1], cg


def _peer_ok(conn: socket.socket) -> bool:  # the socket's directory is root-only already; belt and braces
    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return uid == os.getuid()


class _Sandboxes:
    """Per sandbox: its volume (a tmpfs under /v), network and cgroup namespaces (open fds) and cgroup. A couple of
    spares of the kind last asked for are made while idle, so that creating a sandbox costs one round trip."""

    def __init__(self, cg: ModuleType | None) -> None:
        self.cg = cg
        self.host_net = os.open("/proc/self/ns/net", os.O_RDONLY)
        self.host_cgroupns = os.open("/proc/self/ns/cgroup", os.O_RDONLY)
        self.home = cg.home() if cg else None
        self.netns: dict[str, int] = {}
        self.cgroupns: dict[str, int] = {}
        self.spares: list[dict] = []
        self.kind: tuple[int, int, int] | None = None  # (size_mb, memory_mb, max_procs) of the spares
        self.stale_cgroups: set[str] = set()  # still held by a dying run: removed on a later pass

    def make(self, size_mb: int, memory_mb: int, max_procs: int) -> dict:
        kind = (int(size_mb), int(memory_mb), int(max_procs))
        if kind != self.kind:
            for spare in self.spares:
                self.release(spare["name"])
            self.spares, self.kind = [], kind
        return self.spares.pop() if self.spares else self._build(*kind)

    def refill(self) -> None:
        while self.kind is not None and len(self.spares) < SPARE_SANDBOXES:
            self.spares.append(self._build(*self.kind))

    def _build(self, size_mb: int, memory_mb: int, max_procs: int) -> dict:
        name = os.urandom(6).hex()
        os.mkdir(f"/v/{name}")  # staged workers see the mount through propagation
        kernel.mount("tmpfs", f"/v/{name}", "tmpfs", kernel.MS_NOSUID | kernel.MS_NODEV,
                     jail.tmpfs_options(size_mb, "0755"))
        kernel.unshare(kernel.CLONE_NEWNET)  # made here, once per sandbox: cheaper than once per run
        try:
            jail.loopback_up()
            self.netns[name] = os.open("/proc/self/ns/net", os.O_RDONLY)
        finally:
            kernel.setns(self.host_net, kernel.CLONE_NEWNET)
        cgroup = None
        if self.cg:
            cgroup = f"{os.getpid()}-{name}"
            self.cg.create(cgroup, memory_mb << 20, max_procs)
        self.cgroupns[name] = self._cgroup_namespace(cgroup)
        return {"name": name, "netns": self.netns[name], "cgroupns": self.cgroupns[name], "cgroup": cgroup}

    def _cgroup_namespace(self, cgroup: str | None) -> int:
        """A cgroup namespace rooted at the sandbox's cgroup (without one, at ours, where its runs stay): its
        programs see their cgroups as "/", and nothing of the host's tree. The root is the cgroup its maker is in,
        so we step into the sandbox's for a moment, here rather than in each run."""
        procs = self.cg.procs_files(cgroup) if self.cg and cgroup and self.home else []
        try:
            cgroups.move_self(procs)
            kernel.unshare(kernel.CLONE_NEWCGROUP)
            try:
                return os.open("/proc/self/ns/cgroup", os.O_RDONLY)
            finally:
                kernel.setns(self.host_cgroupns, kernel.CLONE_NEWCGROUP)
        finally:
            if procs and self.home:
                cgroups.move_self(self.home)
            for fd in procs:
                os.close(fd)

    def release(self, name: str) -> None:
        if not jail.NAME.fullmatch(name):
            raise ValueError(f"bad sandbox name {name!r}")
        if os.path.ismount(f"/v/{name}"):
            kernel.umount(f"/v/{name}")
        if os.path.isdir(f"/v/{name}"):
            os.rmdir(f"/v/{name}")
        for fds in (self.netns, self.cgroupns):
            if name in fds:
                os.close(fds.pop(name))
        if self.cg:
            self.stale_cgroups.add(f"{os.getpid()}-{name}")
            self.sweep()

    def sweep(self) -> None:
        self.stale_cgroups = {name for name in self.stale_cgroups if not (self.cg and self.cg.remove(name))}


def main(run_dir: str) -> None:
    os.umask(0o022)
    if not kernel.SYSCALLS:
        print(f"error: unsupported CPU architecture {kernel.ARCH} (the seccomp filter knows x86_64 and aarch64)",
              flush=True)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        exec_sock, ctl_sock, cg = _setup(run_dir)
        sandboxes = _Sandboxes(cg)
        own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY)
    except OSError as e:
        print(f"error: {e}", flush=True)
        return
    print(f"ready cgroups={cg.VERSION if cg else 'none'}", flush=True)
    os.dup2(devnull, 1)  # nobody reads our stdout past the ready line
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps our workers
    notify_r, notify_w = os.pipe()  # a worker that took a request writes its pid here
    me = os.getpid()

    poller = select.poll()
    idle: dict[int, int] = {}  # pid -> pidfd of the workers staged and waiting

    def spawn_worker() -> None:
        while True:
            kernel.unshare(kernel.CLONE_NEWPID)  # our next child is pid 1 of a new PID namespace...
            try:
                pid = os.fork()
                if pid == 0:
                    try:
                        ctl_sock.detach()  # (closed below, with the rest: e.g. other sandboxes' netns)
                        _close_fds_but(0, 1, 2, exec_sock.fileno(), notify_w)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        os.nice(STAGING_NICE)
                        jail.worker(exec_sock, notify_w, me, cg)
                    finally:
                        os._exit(0)
            finally:
                kernel.setns(own_pidns, kernel.CLONE_NEWPID)  # ...and the one after that of another
            try:
                idle[pid] = os.pidfd_open(pid)
                break
            except ProcessLookupError:  # on a busy host it can take a request, serve it and be reaped first
                continue  # (its pid, when it comes through notify, is no idle worker's): stage another
        poller.register(idle[pid], select.POLLIN)

    def retire(pid: int) -> None:
        if pid in idle:
            poller.unregister(idle[pid])
            os.close(idle.pop(pid))
            spawn_worker()

    for _ in range(IDLE_WORKERS):
        spawn_worker()
    for fd in (0, ctl_sock.fileno(), notify_r):
        poller.register(fd, select.POLLIN)
    while True:
        for fd, _ in poller.poll(1000 if sandboxes.stale_cgroups else None):
            if fd == 0 and not os.read(0, 1):
                return  # the host is gone (or shut us down); workers die with us
            if fd == notify_r:  # workers that took a request, by pid: stage their replacements
                data = os.read(notify_r, 4 * 64)
                for (pid,) in struct.iter_unpack("<i", data[:len(data) // 4 * 4]):
                    retire(pid)
            elif fd in idle.values() and select.select([fd], [], [], 0)[0]:  # died before serving (not a reused fd)
                retire(next(pid for pid, pidfd in idle.items() if pidfd == fd))
            elif fd == ctl_sock.fileno():
                conn, _ = ctl_sock.accept()
                with conn:
                    if _peer_ok(conn):
                        _control(conn, sandboxes)
        sandboxes.sweep()
        sandboxes.refill()


def _close_fds_but(*keep: int) -> None:
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the directory listing's own fd, already gone


def _control(conn: socket.socket, sandboxes: _Sandboxes) -> None:
    """Small requests the launcher answers itself: make or release a sandbox, store a template, ping."""
    try:
        req, blobs = protocol.recv(conn)
        reply: dict = {"ok": True}
        if req["op"] == "sandbox":
            reply = sandboxes.make(req["size_mb"], req["memory_mb"], req["max_procs"])
        elif req["op"] == "release":
            sandboxes.release(req["name"])
        elif req["op"] == "template":
            write_template(req["name"], req["entries"], blobs)
        elif req["op"] != "ping":
            raise ValueError(f"unknown request {req['op']!r}")
        conn.sendall(protocol.encode(reply))
    except Exception as e:  # the host gets every failure as an answer
        try:
            conn.sendall(protocol.encode({"error": f"{type(e).__name__}: {e}"}))
        except OSError:
            pass


def write_template(name: str, entries: list[list], blobs: list[bytes]) -> None:
    """Store a template (sent by the host, which read it) as a read-only layer owned by the sandbox user."""
    if not jail.NAME.fullmatch(name):
        raise ValueError(f"bad template name {name!r}")
    dst = f"/t/{name}"
    if os.path.isdir(dst):
        return
    tmp = f"{dst}.{os.getpid()}"
    os.mkdir(tmp, 0o755)
    os.chown(tmp, jail.HOST_ID, jail.HOST_ID)
    data = iter(blobs)
    for rel, kind, mode, target in entries:
        path = os.path.join(tmp, rel)
        if ".." in rel.split("/") or rel.startswith("/"):
            raise ValueError(f"bad template path {rel!r}")
        if kind == "d":
            os.mkdir(path, mode & 0o1777)
        elif kind == "l":
            os.symlink(target, path)
        else:
            with open(path, "wb") as f:
                f.write(next(data))
        if kind != "l":
            os.chmod(path, mode & (0o1777 if kind == "d" else 0o777))  # never setuid or setgid
        os.chown(path, jail.HOST_ID, jail.HOST_ID, follow_symlinks=False)
    os.rename(tmp, dst)


if __name__ == "__main__":
    main(sys.argv[1])
