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

from assay.sandbox import cgroups, jail, kernel, protocol

# Host files a program may need, shared read-only; the rest of /etc (shadow, keys, configs) stays out.
ETC_SHARED = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "mime.types", "ssl",
              "protocols", "services")
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


def build_root(root: str) -> None:
    """The sandbox's root filesystem: /usr and a few /etc files of the host, read-only; a minimal /dev;
    mount points for /proc, /tmp and /workspace, which each run mounts afresh."""
    kernel.mount("tmpfs", root, "tmpfs", kernel.MS_NOSUID, "mode=0755,size=1m")
    for d in ("usr", "etc", "dev", "proc", "tmp", "workspace"):
        os.mkdir(f"{root}/{d}", 0o755)
    _bind_ro("/usr", f"{root}/usr")
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):  # merged-/usr links, or real dirs
        if os.path.islink(f"/{name}"):
            os.symlink(os.readlink(f"/{name}"), f"{root}/{name}")
        elif os.path.isdir(f"/{name}"):
            os.mkdir(f"{root}/{name}")
            _bind_ro(f"/{name}", f"{root}/{name}")
    for name, text in ETC_OWN.items():
        with open(f"{root}/etc/{name}", "w") as f:
            f.write(text)
    for name in ETC_SHARED:
        src, dst = f"/etc/{name}", f"{root}/etc/{name}"
        if os.path.isdir(src) and not os.path.islink(src):
            os.mkdir(dst)
        elif os.path.exists(src):
            open(dst, "w").close()
        else:
            continue
        _bind_ro(src, dst)
    for name, (major, minor) in DEVICES.items():
        os.mknod(f"{root}/dev/{name}", 0o666 | 0o020000, os.makedev(major, minor))  # S_IFCHR
        os.chmod(f"{root}/dev/{name}", 0o666)
    for name, target in DEV_LINKS.items():
        os.symlink(target, f"{root}/dev/{name}")
    kernel.mount(None, root, None, kernel.MS_REMOUNT | kernel.MS_RDONLY | kernel.MS_NOSUID)


def _setup(run_dir: str) -> tuple[socket.socket, str, bool]:
    store = f"{run_dir}/store"
    kernel.unshare(kernel.CLONE_NEWNS)
    kernel.mount(None, "/", None, kernel.MS_REC | kernel.MS_PRIVATE)  # nothing we mount reaches the host
    os.makedirs(store, mode=0o700, exist_ok=True)
    kernel.mount("tmpfs", store, "tmpfs", kernel.MS_NOSUID | kernel.MS_NODEV, "mode=0700")
    for d in ("root", "v", "t", "empty"):
        os.mkdir(f"{store}/{d}", 0o755)
    build_root(f"{store}/root")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(f"{run_dir}/sock")
    sock.listen(512)
    return sock, store, cgroups.available()


def main(run_dir: str) -> None:
    os.umask(0o022)
    if not kernel.SYSCALLS:
        print(f"error: unsupported CPU architecture {kernel.ARCH} (the seccomp filter knows x86_64 and aarch64)",
              flush=True)
        return
    try:
        sock, store, use_cgroups = _setup(run_dir)
    except OSError as e:
        print(f"error: {e}", flush=True)
        return
    print(f"ready cgroups={int(use_cgroups)}", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nobody reads our stdout past the ready line
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    poller.register(0, select.POLLIN)
    me = os.getpid()
    while True:
        for fd, _ in poller.poll():
            if fd == 0 and not os.read(0, 1):
                return  # the host is gone
            if fd != sock.fileno():
                continue
            conn, _ = sock.accept()
            _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid == os.getuid() and os.fork() == 0:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                kernel.prctl(kernel.PR_SET_PDEATHSIG, signal.SIGKILL)
                if os.getppid() == me:
                    _serve(conn, store, use_cgroups)
                os._exit(0)
            conn.close()


def _serve(conn: socket.socket, store: str, use_cgroups: bool) -> None:
    try:
        req, blobs = protocol.recv(conn)
        if req["op"] == "exec":
            jail.run(conn, store, req, blobs, use_cgroups)
            return
        if req["op"] == "release":
            release_volume(store, req["volume"])
        elif req["op"] == "template":
            copy_template(req["src"], f"{store}/t/{req['name']}")
        conn.sendall(protocol.encode({"ok": True}))
    except Exception as e:  # noqa: BLE001 - the host gets every failure as an answer
        try:
            conn.sendall(protocol.encode({"error": f"{type(e).__name__}: {e}"}))
        except OSError:
            pass


def release_volume(store: str, name: str) -> None:
    if not jail._NAME.fullmatch(name):
        raise ValueError(f"bad volume name {name!r}")
    path = f"{store}/v/{name}"
    if os.path.isdir(path):
        if os.path.ismount(path):
            kernel.umount(path)
        os.rmdir(path)


def copy_template(src: str, dst: str) -> None:
    """Copy a template directory into a read-only layer owned by the sandbox user, once per template:
    setuid/setgid bits, devices, fifos and sockets are left out."""
    if not jail._NAME.fullmatch(os.path.basename(dst)):
        raise ValueError(f"bad template name {dst!r}")
    if os.path.isdir(dst):
        return
    tmp = f"{dst}.{os.getpid()}"
    for top, dirs, files in os.walk(src):
        out = os.path.join(tmp, os.path.relpath(top, src))
        os.makedirs(out, exist_ok=True)
        os.chmod(out, os.stat(top).st_mode & 0o1777)
        os.chown(out, jail.HOST_ID, jail.HOST_ID)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            s, d = os.path.join(top, name), os.path.join(out, name)
            st = os.lstat(s)
            if os.path.islink(s):
                os.symlink(os.readlink(s), d)
            elif os.path.isfile(s):
                with open(s, "rb") as fin, open(d, "wb") as fout:
                    fout.write(fin.read())
                os.chmod(d, st.st_mode & 0o777)
            else:
                continue
            os.chown(d, jail.HOST_ID, jail.HOST_ID, follow_symlinks=False)
    os.rename(tmp, dst)


if __name__ == "__main__":
    main(sys.argv[1])
