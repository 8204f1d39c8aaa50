"""ctypes wrappers for the Linux calls Python 3.11's `os` lacks: unshare, mount, pivot_root, capset, prctl.

Stdlib only: the sandbox launcher runs this file in a bare interpreter (see launcher.py)."""

from __future__ import annotations

import ctypes
import os
import platform

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEW_ANY = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWCGROUP

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE, MS_SLAVE, MS_SHARED = 32, 4096, 16384, 1 << 18, 1 << 19, 1 << 20
MNT_DETACH = 2

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2

# Syscall numbers for the two architectures we support (asm/unistd_64.h and asm-generic/unistd.h).
_SYSCALLS = {
    "x86_64": dict(mount=165, umount2=166, pivot_root=155, chroot=161, ptrace=101, process_vm_readv=310,
                   process_vm_writev=311, init_module=175, finit_module=313, delete_module=176, kexec_load=246,
                   kexec_file_load=320, add_key=248, request_key=249, keyctl=250, bpf=321, reboot=169, swapon=167,
                   swapoff=168, unshare=272, setns=308, open_by_handle_at=304, name_to_handle_at=303,
                   perf_event_open=298, userfaultfd=323, acct=163, settimeofday=164, clock_settime=227,
                   clock_adjtime=305, adjtimex=159, sethostname=170, setdomainname=171, iopl=172, ioperm=173,
                   syslog=103, quotactl=179, quotactl_fd=443, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
                   move_mount=429, open_tree=428, mount_setattr=442, clone=56, clone3=435, kcmp=312,
                   lookup_dcookie=212, vhangup=153, uselib=134, capset=126, socket=41, socketpair=53,
                   io_uring_setup=425, io_uring_enter=426, io_uring_register=427, mq_open=240),
    "aarch64": dict(mount=40, umount2=39, pivot_root=41, chroot=51, ptrace=117, process_vm_readv=270,
                    process_vm_writev=271, init_module=105, finit_module=273, delete_module=106, kexec_load=104,
                    kexec_file_load=294, add_key=217, request_key=218, keyctl=219, bpf=280, reboot=142, swapon=224,
                    swapoff=225, unshare=97, setns=268, open_by_handle_at=265, name_to_handle_at=264,
                    perf_event_open=241, userfaultfd=282, acct=89, settimeofday=170, clock_settime=112,
                    clock_adjtime=266, adjtimex=171, sethostname=161, setdomainname=162, syslog=116, quotactl=60,
                    quotactl_fd=443, fsopen=430, fsconfig=431, fsmount=432, fspick=433, move_mount=429,
                    open_tree=428, mount_setattr=442, clone=220, clone3=435, kcmp=272, lookup_dcookie=18,
                    vhangup=58, capset=91, socket=198, socketpair=199, io_uring_setup=425,
                    io_uring_enter=426, io_uring_register=427, mq_open=180),
}
ARCH = platform.machine()
SYSCALLS: dict[str, int] = _SYSCALLS.get(ARCH, {})

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(s: str | None) -> bytes | None:
    return None if s is None else s.encode()


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def mount(source: str | None, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    _check(_libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data)), f"mount {target}")


def umount(target: str, flags: int = MNT_DETACH) -> None:
    _check(_libc.umount2(_b(target), ctypes.c_int(flags)), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_libc.syscall(ctypes.c_long(SYSCALLS["pivot_root"]), _b(new_root), _b(put_old)), "pivot_root")


def sethostname(name: str) -> None:
    raw = name.encode()
    _check(_libc.sethostname(raw, ctypes.c_size_t(len(raw))), "sethostname")


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> None:
    _check(_libc.prctl(option, arg2, arg3, 0, 0), f"prctl({option})")


def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except OSError:
        return 63


_LAST_CAP = _last_cap()


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_capabilities() -> None:
    """Empty every capability set: bounding, ambient, then effective/permitted/inheritable."""
    for cap in range(_LAST_CAP + 1):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:
            _check(-1, f"drop capability {cap}")  # EINVAL just means the kernel has no such capability
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    data = (_CapData * 2)()
    _check(_libc.syscall(ctypes.c_long(SYSCALLS["capset"]), ctypes.byref(header), ctypes.byref(data)), "capset")
