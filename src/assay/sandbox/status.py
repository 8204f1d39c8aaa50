"""ExecResult.status values: why a run ended, apart from the program's own exit code. (Its own module so the
launcher can import it without dataclasses and typing.)"""

EXITED = "exited"
TIMEOUT = "timeout"
OOM = "oom"
PIDS = "pids"
DISK = "disk"
OUTPUT_TRUNCATED = "output_truncated"
SANDBOX_ERROR = "sandbox_error"
