"""A seccomp filter, as a classic BPF program built with struct: no libseccomp, no new dependency.

It refuses (EPERM) the calls a sandboxed program never needs and that widen the kernel surface it can
reach: mounts, ptrace, kernel modules, keyrings, bpf, reboot, namespaces, clock changes; it answers ENOSYS for
clone3 and io_uring; and it lets `socket` and `socketpair` open only the families a program's own networking
needs. Stdlib only."""

from __future__ import annotations

import ctypes
import errno
import socket
import struct

from assay.sandbox import kernel

DENIED = (
    "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree",
    "mount_setattr", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "init_module", "finit_module",
    "delete_module", "kexec_load", "kexec_file_load", "add_key", "request_key", "keyctl", "bpf", "reboot", "swapon",
    "swapoff", "unshare", "setns", "open_by_handle_at", "name_to_handle_at", "perf_event_open", "userfaultfd", "acct",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname", "iopl", "ioperm",
    "syslog", "quotactl", "quotactl_fd", "lookup_dcookie", "vhangup", "uselib",
    "mq_open",  # a POSIX queue outlives its maker, and no call lists them for a batch to remove
)

# These fail as on a kernel without them (ENOSYS), which is what makes programs fall back. clone3 passes its flags
# in memory BPF cannot read: libc falls back to clone, whose flags it can. io_uring performs opens, socket calls
# and more in the kernel, out of this filter's sight: liburing's users and libuv fall back to plain calls.
ABSENT = ("clone3", "io_uring_setup", "io_uring_enter", "io_uring_register")

# A network namespace isolates IP, not the other families: AF_VSOCK, for one, reaches the VM's own vsock port
# space. Anything else fails as on a kernel built without it (EAFNOSUPPORT).
FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)
# Of netlink, only NETLINK_ROUTE, which glibc's getifaddrs, if_nameindex and getaddrinfo(AI_ADDRCONFIG) use: it
# sees the sandbox's own network namespace (loopback only) and cannot change it (that needs CAP_NET_ADMIN there).
# The other protocols reach far more kernel code, and some of the host: NETLINK_KOBJECT_UEVENT hears its devices.
NETLINK_PROTOCOLS = (socket.NETLINK_ROUTE,)

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _KILL_PROCESS, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_OFF_NR, _OFF_ARCH, _OFF_ARG0, _OFF_ARG2 = 0, 4, 16, 32  # struct seccomp_data; args' low words (little-endian)


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def build_filter(arch: str = kernel.ARCH) -> bytes:
    nr = kernel._SYSCALLS[arch]
    eperm = _ins(_RET, _ERRNO | errno.EPERM)
    prog = [_ins(_LD_W_ABS, _OFF_ARCH), _ins(_JEQ, _AUDIT_ARCH[arch], 1, 0), _ins(_RET, _KILL_PROCESS),
            _ins(_LD_W_ABS, _OFF_NR)]
    if arch == "x86_64":  # the x32 ABI numbers its calls from 2**30: refuse all of them
        prog += [_ins(_JGE, 0x40000000, 0, 1), eperm]
    for name in DENIED:
        if name in nr:  # iopl, ioperm and uselib exist on x86 only
            prog += [_ins(_JEQ, nr[name], 0, 1), eperm]
    for name in ABSENT:
        prog += [_ins(_JEQ, nr[name], 0, 1), _ins(_RET, _ERRNO | errno.ENOSYS)]
    prog += _socket_rule(nr)
    prog += [_ins(_JEQ, nr["clone"], 0, 3), _ins(_LD_W_ABS, _OFF_ARG0), _ins(_JSET, kernel.CLONE_NEW_ANY, 0, 1),
             eperm, _ins(_RET, _ALLOW)]
    return b"".join(prog)


def _socket_rule(nr: dict[str, int]) -> list[bytes]:
    """socket(family, type, protocol) and socketpair (same arguments first): allowed families pass, netlink only
    for its allowed protocols; any other call falls through with the syscall number still loaded. The kernel
    reads family and protocol as ints, so their low words are all there is to check."""
    allow = 3 + len(FAMILIES) + 4 + len(NETLINK_PROTOCOLS)  # the index of the closing ALLOW; the next rule follows
    rule = [_ins(_JEQ, nr["socket"], 1, 0), _ins(_JEQ, nr["socketpair"], 0, allow - 1), _ins(_LD_W_ABS, _OFF_ARG0)]
    for family in FAMILIES:
        rule.append(_ins(_JEQ, family, allow - len(rule) - 1, 0))
    rule += [_ins(_JEQ, socket.AF_NETLINK, 1, 0), _ins(_RET, _ERRNO | errno.EAFNOSUPPORT), _ins(_LD_W_ABS, _OFF_ARG2)]
    for protocol in NETLINK_PROTOCOLS:
        rule.append(_ins(_JEQ, protocol, allow - len(rule) - 1, 0))
    rule += [_ins(_RET, _ERRNO | errno.EPROTONOSUPPORT), _ins(_RET, _ALLOW)]
    assert len(rule) == allow + 1
    return rule


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(program: bytes | None = None) -> None:
    """Set no_new_privs and load the filter into this process; it is inherited by every child and exec."""
    program = program or build_filter()
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.addressof(buf))
    kernel.prctl(kernel.PR_SET_NO_NEW_PRIVS, 1)
    kernel.prctl(kernel.PR_SET_SECCOMP, kernel.SECCOMP_MODE_FILTER, ctypes.addressof(fprog))
