"""Isolated execution of model-written code and commands.

`open_sandbox` gives the namespace sandbox (namespace.py) when this host can isolate, and otherwise refuses
with a message that says how to fix it; only an explicit unsafe opt-in gets the unisolated ProcessSandbox."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from assay.core.errors import AssayError
from assay.sandbox.base import ExecResult, Limits, Sandbox
from assay.sandbox.client import PER_PROCESS_ENV, SandboxUnavailable, per_process_limits_allowed
from assay.sandbox.namespace import NamespaceSandbox, NsSnapshot, SandboxError
from assay.sandbox.pool import SandboxPool
from assay.sandbox.process import ProcessSandbox

_FIX = ("The namespace sandbox needs root (or CAP_SYS_ADMIN) with user, mount, PID and network namespaces, "
        "overlayfs, tmpfs, and cgroup v1 memory and pids or a delegated cgroup v2 subtree with them: run as root on "
        "the host, or in a container started with --privileged. To run "
        "without isolation anyway, for trusted code only, pass --unsafe-no-sandbox.")
_state: dict[str, object] = {"unsafe": False, "warned": False}
_lock = threading.Lock()


def allow_unsafe_sandbox(enabled: bool = True) -> None:
    """What --unsafe-no-sandbox sets: open_sandbox falls back to ProcessSandbox where isolation fails."""
    _state["unsafe"] = enabled


def allow_per_process_limits(enabled: bool = True) -> None:
    """What --per-process-limits sets: where no cgroup (v1, or a delegated v2 subtree) can cap a sandbox's whole
    process tree, its memory and processes are capped per process (rlimits) instead of the sandbox refusing.
    An environment variable, so that the processes this one starts (supervised restarts, workers) inherit it."""
    if enabled:
        os.environ[PER_PROCESS_ENV] = "1"
    else:
        os.environ.pop(PER_PROCESS_ENV, None)


def unsafe_allowed() -> bool:
    """Whether --unsafe-no-sandbox was given (a supervisor passes it on to the runs it restarts)."""
    return bool(_state["unsafe"])


def isolation_problem() -> str | None:
    """Why model-written code cannot be isolated here, or None if it can (probed once per process)."""
    with _lock:
        if "problem" not in _state:
            try:
                with NamespaceSandbox(Limits(timeout_s=15)) as sbx:
                    probe = sbx.exec(["/bin/true"])
                _state["problem"] = None if probe.ok else f"a probe run failed ({probe.status}): {probe.stderr.strip()}"
            except (AssayError, OSError) as e:
                _state["problem"] = str(e)
        return _state["problem"]  # type: ignore[return-value]


def open_sandbox(limits: Limits | None = None, template: str | Path | NsSnapshot | None = None,
                 unsafe: bool | None = None) -> Sandbox:
    """The sandbox model-written code runs in. `template`: a directory (or snapshot) the workspace starts from.
    `unsafe` (default: what allow_unsafe_sandbox set) permits the unisolated fallback."""
    problem = isolation_problem()
    if problem is None:
        return NamespaceSandbox(limits, template)
    if not (_state["unsafe"] if unsafe is None else unsafe):
        raise SandboxUnavailable(f"cannot isolate model-written code on this host: {problem}. {_FIX}")
    if isinstance(template, NsSnapshot):
        raise SandboxUnavailable("namespace snapshots need the namespace sandbox, which this host cannot run")
    if not _state["warned"]:
        _state["warned"] = True
        print(f"WARNING: running model-written code WITHOUT a sandbox ({problem}). It can read and change "
              "everything this user can.", file=sys.stderr)
    return ProcessSandbox(limits, Path(template) if template is not None else None)


__all__ = ["ExecResult", "Limits", "NamespaceSandbox", "NsSnapshot", "ProcessSandbox", "Sandbox", "SandboxError",
           "SandboxPool", "SandboxUnavailable", "allow_per_process_limits", "allow_unsafe_sandbox", "isolation_problem",
           "open_sandbox", "per_process_limits_allowed", "unsafe_allowed"]
