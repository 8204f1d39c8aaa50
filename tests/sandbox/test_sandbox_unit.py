"""Parts that need no namespaces: the wire format, the seccomp program, limits, the unsafe fallback."""

from __future__ import annotations

import errno
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import assay.sandbox as sandbox_pkg
from assay.core.errors import ConfigError
from assay.sandbox import Limits, ProcessSandbox, SandboxUnavailable, open_sandbox, protocol, seccomp
from assay.sandbox.kernel import CLONE_NEWNET, CLONE_NEWUSER

ALLOW, KILL, ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
X86_64, AARCH64 = 0xC000003E, 0xC00000B7


def run_bpf(program: bytes, nr: int, arch: int, arg0: int = 0, arg2: int = 0) -> int:
    """A tiny classic-BPF interpreter for the instructions our filter uses, over a struct seccomp_data."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, arg0, 0, arg2, 0, 0, 0)
    ins = [struct.unpack("HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = ins[pc]
        if code == 0x20:  # ld [k]
            acc = struct.unpack_from("<I", data, k)[0]
            pc += 1
        elif code == 0x06:  # ret k
            return k
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if taken else jf)


@pytest.mark.parametrize("arch,audit", [("x86_64", X86_64), ("aarch64", AARCH64)])
def test_seccomp_program(arch: str, audit: int) -> None:
    prog = seccomp.build_filter(arch)
    nr = seccomp.kernel._SYSCALLS[arch]
    denied = [name for name in seccomp.DENIED if name in nr]
    assert len(denied) == len(seccomp.DENIED) - (0 if arch == "x86_64" else 3)  # no iopl, ioperm, uselib on arm
    for name in denied:
        assert run_bpf(prog, nr[name], audit) == ERRNO | errno.EPERM, name
    read_nr = 0 if arch == "x86_64" else 63
    assert run_bpf(prog, read_nr, audit) == ALLOW
    assert run_bpf(prog, nr["clone"], audit, arg0=0x11) == ALLOW  # fork-like clone(SIGCHLD | ...)
    assert run_bpf(prog, nr["clone"], audit, arg0=CLONE_NEWUSER | 0x11) == ERRNO | errno.EPERM
    assert run_bpf(prog, nr["clone"], audit, arg0=CLONE_NEWNET) == ERRNO | errno.EPERM
    for name in ("clone3", "io_uring_setup", "io_uring_enter", "io_uring_register"):
        assert run_bpf(prog, nr[name], audit) == ERRNO | errno.ENOSYS, name
    assert [nr[name] for name in ("io_uring_setup", "io_uring_enter", "io_uring_register")] == [425, 426, 427]
    assert run_bpf(prog, read_nr, audit ^ 1) == KILL  # another ABI's numbers mean other calls
    if arch == "x86_64":
        assert run_bpf(prog, 0x40000000 + read_nr, audit) == ERRNO | errno.EPERM  # x32


@pytest.mark.parametrize("arch,audit", [("x86_64", X86_64), ("aarch64", AARCH64)])
def test_seccomp_socket_families(arch: str, audit: int) -> None:
    prog = seccomp.build_filter(arch)
    nr = seccomp.kernel._SYSCALLS[arch]
    for call in ("socket", "socketpair"):
        for family in (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6):
            assert run_bpf(prog, nr[call], audit, arg0=family, arg2=6) == ALLOW, (call, family)
        assert run_bpf(prog, nr[call], audit, arg0=socket.AF_NETLINK, arg2=socket.NETLINK_ROUTE) == ALLOW
        for proto in (4, 9, 15, 16):  # SOCK_DIAG, AUDIT, KOBJECT_UEVENT, GENERIC
            assert run_bpf(prog, nr[call], audit, arg0=socket.AF_NETLINK, arg2=proto) == \
                ERRNO | errno.EPROTONOSUPPORT, (call, proto)
        for family in (0, 3, 4, 5, 9, 15, 17, 29, 30, 31, 38, 40, 44, 45, 255, 0xFFFF):  # VSOCK 40, PACKET 17, ALG 38
            assert run_bpf(prog, nr[call], audit, arg0=family) == ERRNO | errno.EAFNOSUPPORT, (call, family)
        assert run_bpf(prog, nr[call], audit, arg0=(1 << 32) | 40) == ERRNO | errno.EAFNOSUPPORT  # the int is 40
    assert run_bpf(prog, nr["socketpair"] + 1, audit, arg0=40) == ALLOW  # other calls' arguments are not families


def test_protocol_round_trip() -> None:
    header = {"op": "exec", "argv": ["a", "b"], "n": 3}
    blobs = [b"", b"\x00\xff" * 10, b"text"]
    decoded, got = protocol.decode(protocol.encode(header, blobs))
    assert decoded == dict(header, blobs=[0, 20, 4]) and got == blobs


def test_limits_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="memory_mb"):
        Limits(memory_mb=0)
    assert Limits(timeout_s=0.5).timeout_s == 0.5


def test_process_sandbox_snapshot_restore() -> None:
    with ProcessSandbox(Limits()) as s:
        s.write_file("a.txt", "1")
        snap = s.snapshot()
        s.write_file("a.txt", "2")
        s.write_file("b.txt", "x")
        s.restore(snap)
        assert s.read_file("a.txt") == b"1" and not (s.workspace / "b.txt").exists()


def test_refuses_without_isolation_unless_unsafe(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sandbox_pkg._state, "problem", "unshare: Operation not permitted")
    monkeypatch.setitem(sandbox_pkg._state, "warned", False)
    monkeypatch.setitem(sandbox_pkg._state, "unsafe", False)
    with pytest.raises(SandboxUnavailable, match="unshare: Operation not permitted.*--unsafe-no-sandbox"):
        open_sandbox(Limits())
    s = open_sandbox(Limits(), unsafe=True)
    assert isinstance(s, ProcessSandbox)
    s.close()
    assert "WITHOUT a sandbox" in capsys.readouterr().err
    sandbox_pkg.allow_unsafe_sandbox(True)
    s = open_sandbox(Limits())
    assert isinstance(s, ProcessSandbox)
    s.close()


def test_open_sandbox_isolates_where_it_can(isolated: None) -> None:
    s = open_sandbox(Limits(), unsafe=True)  # unsafe only permits a fallback; it never forces one
    try:
        assert isinstance(s, sandbox_pkg.NamespaceSandbox)
    finally:
        s.close()


@pytest.mark.parametrize("value,fails", [(None, False), ("", False), ("0", False), ("1", True), ("yes", True)])
def test_a_skip_for_want_of_a_sandbox_fails_where_one_is_required(root_conftest, value: str | None,
                                                                   fails: bool) -> None:
    conftest = root_conftest
    environ = {} if value is None else {"ASSAY_REQUIRE_SANDBOX": value}

    def skipped(reason: str) -> pytest.TestReport:
        report = conftest.skipped_report(reason)
        conftest.require_sandbox(report, environ)
        return report

    no_sandbox = skipped(f"{conftest.NO_SANDBOX}: unshare: Operation not permitted")
    assert no_sandbox.failed is fails and no_sandbox.skipped is not fails
    if fails:
        assert "ASSAY_REQUIRE_SANDBOX=1, but the namespace sandbox cannot run" in str(no_sandbox.longrepr)
    assert skipped("no C compiler: only the PyTorch path exists here").skipped  # other skips stay skips


def test_the_suite_fails_without_a_sandbox_where_one_is_required(tmp_path: Path) -> None:
    """End to end: with ASSAY_REQUIRE_SANDBOX=1, a pytest run on a host made to look unable to isolate fails a test
    that needs isolation (elsewhere it skips: see above)."""
    (tmp_path / "no_sandbox_here.py").write_text("import assay.sandbox\n"
                                                 "assay.sandbox._state['problem'] = 'unshare: Operation not permitted'\n")
    env = dict(os.environ, ASSAY_REQUIRE_SANDBOX="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    test = f"{__file__}::test_open_sandbox_isolates_where_it_can"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no_sandbox_here", "-p", "no:cacheprovider",
                          test], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "1 error" in run.stdout, run.stdout + run.stderr
    assert "ASSAY_REQUIRE_SANDBOX=1, but the namespace sandbox cannot run on this host: unshare" in run.stdout
