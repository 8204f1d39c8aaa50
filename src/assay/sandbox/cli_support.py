"""`assay sandbox run`: one command in a fresh sandbox, for debugging environments and templates; `assay sandbox`:
which sandbox this host gives, and what enforces each of its limits."""

from __future__ import annotations

import signal
import sys

from assay.sandbox import NamespaceSandbox, SandboxUnavailable, open_sandbox
from assay.sandbox.base import EXITED, OUTPUT_TRUNCATED, SANDBOX_ERROR, TIMEOUT, ExecResult, Limits
from assay.sandbox.client import get_launcher

_TREE = {"v1": ("cgroup v1 (memory.limit_in_bytes, the whole sandbox, its tmpfs files included)",
                "cgroup v1 (pids.max, the whole sandbox)"),
         "v2": ("cgroup v2 (memory.max, the whole sandbox, its tmpfs files included; memory.swap.max 0)",
                "cgroup v2 (pids.max, the whole sandbox)"),
         "none": ("rlimit per process (RLIMIT_AS; --per-process-limits)",
                  "rlimit per process (RLIMIT_NPROC, per uid; --per-process-limits)")}


def enforcement(cgroups: str | None) -> list[tuple[str, str]]:
    """(limit, what enforces it) for the namespace sandbox whose launcher caps memory and processes with
    `cgroups` ("v1", "v2", "none"), or, for None, for the unisolated ProcessSandbox."""
    if cgroups is None:
        return [("memory", "rlimit per process (RLIMIT_AS)"), ("processes", "none"),
                ("CPU time", "rlimit per process (RLIMIT_CPU)"),
                ("wall time", "the process group is killed at the deadline (a process can leave it)"),
                ("file size", "rlimit per process (RLIMIT_FSIZE)"), ("disk", "none"),
                ("open files", "rlimit per process (RLIMIT_NOFILE)"), ("output", "capped by the reader"),
                ("network", "none"), ("filesystem", "none (a private working directory, nothing enforced)"),
                ("system calls", "none"), ("privileges", "none (the calling user)")]
    memory, processes = _TREE[cgroups]
    return [("memory", memory), ("processes", processes), ("CPU time", "rlimit per process (RLIMIT_CPU)"),
            ("wall time", "namespace (the run's PID namespace is killed at the deadline, every process with it)"),
            ("file size", "rlimit per process (RLIMIT_FSIZE)"),
            ("disk", "tmpfs size (the workspace layers, and /tmp)"),
            ("open files", "rlimit per process (RLIMIT_NOFILE)"), ("output", "capped by the reader"),
            ("network", "namespace (loopback only) and seccomp (socket families)"),
            ("filesystem", "namespace (read-only root, overlay workspace, private /tmp and /proc)"),
            ("system calls", "seccomp"),
            ("privileges", "namespace (user: an unprivileged uid, no capabilities, no_new_privs)")]


def sandbox_report(limits: Limits | None = None) -> tuple[str, bool]:
    """What `assay sandbox` prints: the sandbox this host gives and what enforces each limit; False where it
    refuses (the text then says why and how to fix it)."""
    try:
        sandbox = open_sandbox(limits or Limits(timeout_s=15))
    except SandboxUnavailable as e:
        return f"no sandbox: {e}", False
    try:
        if isinstance(sandbox, NamespaceSandbox):
            head, rows = "namespace sandbox", enforcement(get_launcher().cgroups)
        else:
            head, rows = "NO isolation: the process sandbox (--unsafe-no-sandbox)", enforcement(None)
    finally:
        sandbox.close()
    width = max(len(limit) for limit, _ in rows)
    return "\n".join([head, *(f"  {limit:<{width}}  {how}" for limit, how in rows)]), True


def exit_code(result: ExecResult) -> int:
    """A shell-style exit code: the program's own, 124 for a timeout (as timeout(1)), 125 if the sandbox
    itself failed, 128+N for a signal (137 for an OOM kill)."""
    if result.status == TIMEOUT:
        return 124
    if result.status == SANDBOX_ERROR:
        return 125
    if result.exit_code < 0:
        return 128 + min(-result.exit_code, int(signal.SIGRTMAX))
    return result.exit_code


def run_command(cmd: list[str], template: str | None, limits: Limits, unsafe: bool | None = None) -> int:
    """Run `cmd` in a sandbox (starting from `template`, a directory, if given); print its output and, when a
    limit ended it, the status; return the exit code."""
    sandbox = open_sandbox(limits, template, unsafe=unsafe)
    try:
        result = sandbox.exec(cmd)
    finally:
        sandbox.close()
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    if result.status not in (EXITED, OUTPUT_TRUNCATED):
        print(f"[sandbox] status: {result.status}", file=sys.stderr)
    elif result.status == OUTPUT_TRUNCATED:
        print(f"[sandbox] output truncated at {limits.output_bytes} bytes per stream", file=sys.stderr)
    return exit_code(result)
