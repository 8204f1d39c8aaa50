"""Each test is an attack from inside the sandbox, and each must be contained.

Network tests only ever aim at listeners the test itself starts on this host's loopback (127.0.0.1, ::1) or
on Unix sockets: never at any other address."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from assay.sandbox import Limits, NamespaceSandbox, client, kernel, seccomp
from assay.sandbox.base import EXITED, SANDBOX_ERROR

REPO = Path(__file__).resolve().parents[2]

CONNECT = """
    import socket, sys
    family, kind, addr = {family}, {kind}, {addr!r}
    s = socket.socket(family, kind)
    s.settimeout(1)
    try:
        s.connect(addr if isinstance(addr, str) else tuple(addr))
        s.sendall(b"hello") if kind == socket.SOCK_STREAM else s.send(b"hello")
        print("CONNECTED")
    except OSError as e:
        print("refused", type(e).__name__)
"""


def _listener(family: int, kind: int, addr: object) -> socket.socket:
    s = socket.socket(family, kind)
    try:
        s.bind(addr)
    except OSError as e:
        s.close()
        pytest.skip(f"this host cannot listen on {addr!r}: {e}")
    if kind == socket.SOCK_STREAM:
        s.listen(1)
    s.settimeout(0.3)
    return s


def _nothing_arrived(listener: socket.socket) -> bool:
    try:
        if listener.type == socket.SOCK_STREAM:
            listener.accept()
        else:
            listener.recvfrom(100)
    except TimeoutError:
        return True
    return False


@pytest.mark.parametrize("family,host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
@pytest.mark.parametrize("kind", [socket.SOCK_STREAM, socket.SOCK_DGRAM])
def test_host_loopback_listeners_are_unreachable(sbx: NamespaceSandbox, py, family: int, host: str,
                                                 kind: int) -> None:
    with _listener(family, kind, (host, 0)) as listener:
        port = listener.getsockname()[1]
        r = py(sbx, CONNECT.format(family=int(family), kind=int(kind), addr=[host, port]))
        if kind == socket.SOCK_STREAM:
            assert r.stdout.startswith("refused"), r
        assert _nothing_arrived(listener)


@pytest.mark.parametrize("abstract", [False, True])
def test_host_unix_sockets_are_unreachable(sbx: NamespaceSandbox, py, tmp_path: Path, abstract: bool) -> None:
    addr = f"\0assay-test-{secrets.token_hex(4)}" if abstract else str(tmp_path / "host.sock")
    with _listener(socket.AF_UNIX, socket.SOCK_STREAM, addr) as listener:
        r = py(sbx, CONNECT.format(family=int(socket.AF_UNIX), kind=int(socket.SOCK_STREAM), addr=addr))
        assert r.stdout.startswith("refused"), r
        assert _nothing_arrived(listener)


def test_only_the_sandbox_loopback_exists_and_works(sbx: NamespaceSandbox, py) -> None:
    r = py(sbx, """
        import socket
        print(sorted(name for _, name in socket.if_nameindex()))
        srv = socket.create_server(("127.0.0.1", 0))
        c = socket.create_connection(srv.getsockname())
        conn, _ = srv.accept(); c.sendall(b"ping"); print(conn.recv(4).decode())
    """)
    assert r.stdout.split("\n")[:2] == ["['lo']", "ping"], r


# (family, type, protocol) -> what socket() answers inside: the families a program's own networking needs open;
# every other fails as if the kernel lacked it (AF_VSOCK would reach the VM's vsock port space).
SOCKETS = {
    (socket.AF_UNIX, socket.SOCK_STREAM, 0): "ok", (socket.AF_UNIX, socket.SOCK_DGRAM, 0): "ok",
    (socket.AF_INET, socket.SOCK_STREAM, 0): "ok", (socket.AF_INET, socket.SOCK_DGRAM, 0): "ok",
    (socket.AF_INET6, socket.SOCK_STREAM, 0): "ok", (socket.AF_INET6, socket.SOCK_DGRAM, 0): "ok",
    (socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE): "ok",
    (socket.AF_NETLINK, socket.SOCK_RAW, 4): "EPROTONOSUPPORT",  # NETLINK_SOCK_DIAG
    (socket.AF_NETLINK, socket.SOCK_RAW, 9): "EPROTONOSUPPORT",  # NETLINK_AUDIT
    (socket.AF_NETLINK, socket.SOCK_DGRAM, 15): "EPROTONOSUPPORT",  # NETLINK_KOBJECT_UEVENT: the host's devices
    (socket.AF_NETLINK, socket.SOCK_RAW, 16): "EPROTONOSUPPORT",  # NETLINK_GENERIC
    (40, socket.SOCK_STREAM, 0): "EAFNOSUPPORT", (40, socket.SOCK_DGRAM, 0): "EAFNOSUPPORT",  # AF_VSOCK
    (17, socket.SOCK_RAW, 0x0300): "EAFNOSUPPORT", (17, socket.SOCK_DGRAM, 0x0300): "EAFNOSUPPORT",  # AF_PACKET
    (38, socket.SOCK_SEQPACKET, 0): "EAFNOSUPPORT",  # AF_ALG: the kernel's crypto
    (15, socket.SOCK_RAW, 2): "EAFNOSUPPORT",  # AF_KEY
    (31, socket.SOCK_STREAM, 3): "EAFNOSUPPORT",  # AF_BLUETOOTH
    (30, socket.SOCK_RDM, 0): "EAFNOSUPPORT", (29, socket.SOCK_RAW, 1): "EAFNOSUPPORT",  # AF_TIPC, AF_CAN
    (21, socket.SOCK_SEQPACKET, 0): "EAFNOSUPPORT", (44, socket.SOCK_RAW, 0): "EAFNOSUPPORT",  # AF_RDS, AF_XDP
    (5, socket.SOCK_DGRAM, 0): "EAFNOSUPPORT", (0, socket.SOCK_STREAM, 0): "EAFNOSUPPORT",  # AF_APPLETALK, AF_UNSPEC
}
PAIRS = {socket.AF_UNIX: "ok", 40: "EAFNOSUPPORT", 17: "EAFNOSUPPORT", 38: "EAFNOSUPPORT"}


def test_only_unix_and_ip_socket_families_open(sbx: NamespaceSandbox, py) -> None:
    """Opening and binding only, on the sandbox's own loopback: nothing is ever sent anywhere."""
    r = py(sbx, f"""
        import ctypes, errno, os, socket
        libc = ctypes.CDLL(None, use_errno=True)
        def outcome(ret):
            return "ok" if ret >= 0 else errno.errorcode[ctypes.get_errno()]
        for family, kind, protocol in {[tuple(map(int, key)) for key in SOCKETS]!r}:
            fd = libc.socket(family, kind, protocol)
            print(family, kind, protocol, outcome(fd))
            if fd >= 0:
                os.close(fd)
        pair = (ctypes.c_int * 2)()
        for family in {[int(f) for f in PAIRS]!r}:
            print("pair", family, outcome(libc.socketpair(family, socket.SOCK_STREAM, 0, pair)))
        for family, addr in ((socket.AF_INET, ("127.0.0.1", 0)), (socket.AF_INET6, ("::1", 0)),
                             (socket.AF_UNIX, "/tmp/s.sock"), (socket.AF_UNIX, "\\0abstract"),
                             (socket.AF_NETLINK, (0, 0))):
            with socket.socket(family, socket.SOCK_RAW if family == socket.AF_NETLINK else socket.SOCK_DGRAM) as s:
                s.bind(addr)
                print("bound", family)
        print("interfaces", [name for _, name in socket.if_nameindex()])  # glibc asks NETLINK_ROUTE
        try:
            socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        except OSError as e:
            print("python vsock", errno.errorcode[e.errno])
    """)
    expected = [f"{int(f)} {int(k)} {int(p)} {want}" for (f, k, p), want in SOCKETS.items()]
    expected += [f"pair {int(f)} {want}" for f, want in PAIRS.items()]
    expected += [f"bound {f}" for f in (2, 10, 1, 1, 16)] + ["interfaces ['lo']", "python vsock EAFNOSUPPORT"]
    assert r.stdout.splitlines() == expected, r


def test_host_files_are_out_of_sight(sbx: NamespaceSandbox, py) -> None:
    other = NamespaceSandbox(Limits())
    try:
        token = secrets.token_hex(8)
        other.write_file("secret.txt", token)
        store = client.get_launcher().dir
        paths = ["/etc/shadow", str(REPO / "pyproject.toml"), str(REPO / "src/assay/sandbox/jail.py"),
                 f"/v/{other._volume.name}/u0/secret.txt", f"{store}/store/v/{other._volume.name}/u0/secret.txt",
                 "/root/.bashrc", f"/proc/{os.getpid()}/environ"]
        r = py(sbx, f"""
            for p in {paths!r}:
                try:
                    open(p, "rb").read(); print("READ", p)
                except OSError as e:
                    print("denied", type(e).__name__)
        """)
        assert "READ" not in r.stdout and r.stdout.count("denied") == len(paths), r
        grep = sbx.exec(f"grep -rl {token} /etc /tmp /workspace /root /dev 2>/dev/null; echo done")
        assert grep.stdout == "done\n"
        assert other.read_file("secret.txt") == token.encode()  # it was there all along
    finally:
        other.close()


def test_host_processes_are_invisible_and_untouchable(sbx: NamespaceSandbox, py) -> None:
    token = secrets.token_hex(8)
    victim = subprocess.Popen(["sleep", "30"], env={"SECRET": token})
    try:
        r = py(sbx, f"""
            import ctypes, os, signal
            print(sorted(int(p) for p in os.listdir("/proc") if p.isdigit()) == [1, os.getpid()])
            try:
                print(open("/proc/{victim.pid}/environ", "rb").read())
            except OSError as e:
                print("no environ", type(e).__name__)
            try:
                os.kill({victim.pid}, signal.SIGKILL); print("KILLED")
            except OSError as e:
                print("no kill", type(e).__name__)
            libc = ctypes.CDLL(None, use_errno=True)
            print("attach", libc.ptrace(16, {victim.pid}, 0, 0), ctypes.get_errno())  # PTRACE_ATTACH
            child = os.fork()
            if child == 0:
                import time; time.sleep(5); os._exit(0)
            print("attach own child", libc.ptrace(16, child, 0, 0), ctypes.get_errno())
        """)
        lines = r.stdout.splitlines()
        assert lines[0] == "True", r  # only its own init and itself
        assert lines[1].startswith("no environ") and lines[2].startswith("no kill")
        assert lines[3] == "attach -1 1"  # EPERM: seccomp, before any permission check
        assert lines[4] == "attach own child -1 1"  # even a child it could otherwise trace
        assert token not in r.stdout
        assert victim.poll() is None  # alive
    finally:
        victim.kill()
        victim.wait()


def test_host_environment_does_not_leak(isolated: None, monkeypatch: pytest.MonkeyPatch) -> None:
    token = secrets.token_hex(8)
    monkeypatch.setenv("ASSAY_TEST_SECRET", token)
    client.shutdown()  # a launcher started now inherits the secret: it must still not reach the sandbox
    with NamespaceSandbox(Limits()) as s:
        r = s.exec("env; cat /proc/1/environ /proc/self/environ 2>&1; ls /proc")
        assert r.status == EXITED and token not in r.stdout + r.stderr
        assert str(REPO) not in s.exec("cat /proc/1/cmdline").stdout  # not even the checkout's path


PROC_FILES = ("/proc/1/cmdline", "/proc/1/environ", "/proc/1/cgroup", "/proc/1/mountinfo", "/proc/self/cgroup",
              "/proc/self/mountinfo", "/proc/self/mounts", "/proc/self/environ", "/proc/self/cmdline", "/proc/cmdline")


def _host_details(sbx: NamespaceSandbox) -> dict[str, str]:
    """What would tell a program where the host keeps things, by what it is."""
    details = {"interpreter prefix": sys.prefix, "base prefix": sys.base_prefix, "checkout": str(REPO),
               "launcher directory": client.get_launcher().dir, "volume name": sbx._volume.name}
    home = str(Path.home())
    if home != "/":
        details["home"] = home
    if sbx._volume.cgroup:
        details["sandbox cgroup"] = sbx._volume.cgroup
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.split(":", 2)[2] != "/":
            details[f"host cgroup {line.split(':')[1]}"] = line.split(":", 2)[2]
    return details


def test_proc_shows_nothing_of_the_host(sbx: NamespaceSandbox, py) -> None:
    r = py(sbx, f"""
        import json
        seen = {{}}
        for path in {PROC_FILES!r}:
            try:
                seen[path] = open(path, "rb").read().decode(errors="replace")
            except OSError as e:
                seen[path] = f"unreadable: {{e.strerror}}"
        print(json.dumps(seen))
    """)
    seen = json.loads(r.stdout)
    leaks = [(path, what) for path, text in seen.items() for what, value in _host_details(sbx).items()
             if re.search(re.escape(value) + r"(?=[/\s\0:,]|$)", text)]
    assert not leaks, (leaks, seen)
    assert seen["/proc/1/cmdline"].startswith("/proc/self/exe\0-I\0-S\0-c\0"), seen  # the worker: a bare interpreter
    assert seen["/proc/1/environ"].startswith("unreadable"), seen  # and not ours to read
    assert seen["/proc/cmdline"] == "", seen  # the kernel's: it can name host paths and a VM's vsock ports
    assert {line.split(":", 2)[2] for line in seen["/proc/self/cgroup"].splitlines()} == {"/"}, seen
    mounts = seen["/proc/self/mountinfo"].splitlines()
    sources = {line.split(" - ")[1].split()[1] for line in mounts}
    assert sources <= {"tmpfs", "overlay", "proc"}, seen  # no host device, as a bind mount of /usr would name
    workspace = next(line for line in mounts if " /workspace " in line)
    assert re.search(r"lowerdir=/proc/self/fd/\d+,upperdir=/proc/self/fd/\d+,workdir=/proc/self/fd/\d+", workspace)


def test_fork_bomb_and_memory_bomb_leave_the_host_alone(isolated: None) -> None:
    with NamespaceSandbox(Limits(max_procs=16, memory_mb=48, timeout_s=2)) as s:
        s.exec(["bash", "-c", ":(){ :|:& };:; sleep 1"])
        s.run_python("x = bytearray(1 << 30)")
        assert s.exec("echo fine").stdout == "fine\n"


def test_writes_outside_the_workspace_fail_or_stay_private(sbx: NamespaceSandbox) -> None:
    name = f"assay-escape-{secrets.token_hex(4)}"
    r = sbx.exec(f"for p in /etc/{name} /usr/{name} /{name} /bin/{name} /dev/{name}; do "
                 f"(echo x > $p) 2>/dev/null && echo WROTE $p; done; echo x > /tmp/{name} && echo private")
    assert r.stdout == "private\n", r
    for host_dir in ("/etc", "/usr", "/", "/tmp", "/dev"):
        assert not os.path.exists(f"{host_dir}/{name}")


def test_planted_symlinks_do_not_reach_the_host(sbx: NamespaceSandbox, tmp_path: Path) -> None:
    token = secrets.token_hex(8)
    host_secret = tmp_path / "secret.txt"
    host_secret.write_text(token)
    passwd = Path("/etc/passwd").read_bytes()
    sbx.exec(f"ln -s {host_secret} leak.txt; ln -s /etc/passwd passwd.txt; ln -s / root; ln -s {tmp_path} hostdir")
    for path in ("leak.txt", "passwd.txt", "root/etc/passwd", "hostdir/secret.txt"):
        with pytest.raises(OSError):
            sbx.read_file(path)
    for path in ("passwd.txt", "hostdir/planted.txt", "root/tmp/planted.txt"):
        with pytest.raises(OSError):
            sbx.write_file(path, "overwritten")
    assert Path("/etc/passwd").read_bytes() == passwd
    assert host_secret.read_text() == token and not (tmp_path / "planted.txt").exists()


def test_proc_sys_and_cgroups_are_read_only_or_absent(sbx: NamespaceSandbox) -> None:
    before = Path("/proc/sys/kernel/hostname").read_text()
    r = sbx.exec("echo pwned > /proc/sys/kernel/hostname; echo 1 > /proc/sysrq-trigger; ls /sys/fs/cgroup; "
                 "echo 1 > /sys/fs/cgroup/pids/pids.max; echo end")
    assert r.stdout == "end\n"
    assert "Read-only file system" in r.stderr and "No such file or directory" in r.stderr
    assert Path("/proc/sys/kernel/hostname").read_text() == before


def test_mounts_and_namespace_tricks_are_refused(sbx: NamespaceSandbox, py) -> None:
    nr = kernel.SYSCALLS
    r = py(sbx, f"""
        import ctypes, subprocess
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        for name, n in {dict((k, nr[k]) for k in seccomp.DENIED if k in nr)!r}.items():
            ret = libc.syscall(n, 0, 0, 0, 0, 0, 0)
            print(name, ret, ctypes.get_errno())
        print(subprocess.run(["mount", "-t", "tmpfs", "none", "/tmp"], capture_output=True).returncode)
        print(libc.unshare(0x10000000), ctypes.get_errno())  # a new user namespace, to regain capabilities
    """)
    lines = r.stdout.splitlines()
    refused = [line for line in lines[:-2] if line.endswith(" -1 1")]
    assert len(refused) == len([k for k in seccomp.DENIED if k in nr]), [x for x in lines[:-2] if x not in refused]
    assert lines[-2] != "0" and lines[-1] == "-1 1"


def test_io_uring_is_absent(sbx: NamespaceSandbox, py) -> None:
    """io_uring would open files and sockets in the kernel, past the seccomp filter: it answers ENOSYS, as on a
    kernel without it (the numbers are the same on x86_64 and aarch64)."""
    r = py(sbx, """
        import ctypes, errno
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        params = ctypes.create_string_buffer(120)  # struct io_uring_params
        for name, args in (("setup", (425, 8, params)), ("enter", (426, 0, 1, 0, 0, 0, 0)),
                           ("register", (427, 0, 0, 0, 0))):
            ret = libc.syscall(*args)
            print(name, "ok" if ret >= 0 else errno.errorcode[ctypes.get_errno()])
    """)
    assert r.stdout.split() == ["setup", "ENOSYS", "enter", "ENOSYS", "register", "ENOSYS"], r


def test_no_privileges_inside(sbx: NamespaceSandbox) -> None:
    status = dict(line.split(":\t", 1) for line in sbx.exec("cat /proc/self/status").stdout.splitlines()
                  if ":\t" in line)
    assert status["Uid"].split() == ["1000"] * 4
    assert all(int(status[k], 16) == 0 for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"))
    assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2"
    fds = sbx.run_python("import os; print(sorted(os.listdir('/proc/self/fd')))").stdout
    assert fds == "['0', '1', '2', '3']\n"  # stdio, and the listing's own: nothing inherited from the sandbox


def test_setuid_binaries_grant_nothing(isolated: None, tmp_path: Path) -> None:
    template = tmp_path / "template"
    template.mkdir()
    shutil.copy("/usr/bin/id", template / "id")
    os.chown(template / "id", 0, 0)
    os.chmod(template / "id", 0o4755)  # setuid root, planted by the "environment"
    with NamespaceSandbox(Limits(), template=template) as s:
        r = s.exec("stat -c %a id; ./id -u; ./id -u -r")
        assert r.stdout.split() == ["755", "1000", "1000"]
        mounts = {line.split()[4]: line.split()[5] for line in s.exec("cat /proc/self/mountinfo").stdout.splitlines()}
        for point in ("/", "/usr", "/workspace", "/tmp"):
            assert "nosuid" in mounts[point].split(","), (point, mounts[point])
        passwd = s.exec("/usr/bin/passwd -S root")  # setuid root on the host: here it stays uid 1000
        assert passwd.exit_code != 0


def _host_pids_with(marker: str) -> list[int]:
    pids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{p}/cmdline").read_bytes():
                    pids.append(int(p))
            except OSError:
                pass
    return pids


def test_no_process_survives_a_call_or_close(isolated: None) -> None:
    marker = secrets.token_hex(6)
    s = NamespaceSandbox(Limits(timeout_s=30))
    r = s.exec(f"(setsid sh -c 'sleep 1000; : {marker}' &) ; nohup sh -c 'sleep 1000; : {marker}' & echo bg")
    assert r.stdout == "bg\n" and _host_pids_with(marker) == []
    results = []
    running = threading.Thread(target=lambda: results.append(s.exec(f"sh -c 'sleep 1000; : {marker}'")))
    running.start()
    deadline = time.monotonic() + 10
    while not _host_pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _host_pids_with(marker), "the long call never started"
    s.close()
    running.join(10)
    assert not running.is_alive() and results[0].status == SANDBOX_ERROR
    deadline = time.monotonic() + 5
    while _host_pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _host_pids_with(marker) == []


def test_killing_the_host_side_kills_the_run(sbx: NamespaceSandbox) -> None:
    """The launcher and everything under it die with the host process (here: a killed launcher)."""
    marker = secrets.token_hex(6)
    launcher = client.get_launcher()
    t = threading.Thread(target=lambda: sbx.exec(f"sh -c 'sleep 1000; : {marker}'"))
    t.start()
    deadline = time.monotonic() + 10
    while not _host_pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    workers = Path(f"/proc/{launcher.proc.pid}/task/{launcher.proc.pid}/children").read_text().split()
    os.kill(launcher.proc.pid, signal.SIGKILL)
    t.join(10)
    deadline = time.monotonic() + 5
    while (_host_pids_with(marker) or any(Path(f"/proc/{w}").exists() for w in workers)) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _host_pids_with(marker) == []
    assert not [w for w in workers if Path(f"/proc/{w}").exists()]  # staged workers went with their launcher
    client.shutdown()
