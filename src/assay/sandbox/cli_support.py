"""`assay sandbox run`: one command in a fresh sandbox, for debugging environments and templates."""

from __future__ import annotations

import signal
import sys

from assay.sandbox import open_sandbox
from assay.sandbox.base import EXITED, OUTPUT_TRUNCATED, SANDBOX_ERROR, TIMEOUT, ExecResult, Limits


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
