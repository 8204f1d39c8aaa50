"""Keep a training run going: when its process dies (killed, out of memory, a crash), start it again
from its last checkpoint, a bounded number of times.

The run itself makes a restart safe: a resumed attempt repeats the steps after its checkpoint
exactly, and readers keep only the surviving history (`core.storage.trajectory_shards`,
`read_metrics`), so a restart loses nothing written and trains no group twice."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from assay.core.checkpoint import list_checkpoints

# Exit codes a restart cannot help: done, bad input (every AssayError), interrupted by the user.
FINAL_CODES = (0, 2, 130)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def supervise(first: Sequence[str], run_dir: Path, max_restarts: int, global_args: Sequence[str] = (),
              log: Callable[[str], None] = print, pause_s: float = 1.0) -> int:
    """Run `assay [global_args] train *first` in a child process; while it dies with a code a restart
    can help, run it again as `train --resume run_dir` (or from the start, before its first
    checkpoint), at most `max_restarts` times. Returns the last child's exit code."""
    command, restarts = list(first), 0
    while True:
        code = subprocess.run([sys.executable, "-m", "assay.cli", *global_args, "train", *command]).returncode
        if code in FINAL_CODES:
            return code
        if restarts == max_restarts:
            log(f"supervisor: the training process died ({describe_exit(code)}); {max_restarts} restarts used, "
                f"giving up; resume by hand with assay train --resume {run_dir}")
            return code
        restarts += 1
        resumable = (run_dir / "config.yaml").is_file() and bool(list_checkpoints(run_dir / "checkpoints"))
        # the run's config.yaml is the config in effect (overrides applied, threads resolved)
        command = ["--resume", str(run_dir), *(a for a in first if a == "--quiet")] if resumable else list(first)
        log(f"supervisor: the training process died ({describe_exit(code)}); restart {restarts} of "
            f"{max_restarts}, {'from its last checkpoint' if resumable else 'from the start (no checkpoint yet)'}")
        time.sleep(pause_s)
