"""The whole machine's CPU time so far (Linux's /proc/stat), which the benches read on both sides of a
timed run: a busy share or stolen seconds tell a slow run from a machine busy with other work or
robbed of a vCPU by its hypervisor."""

from __future__ import annotations

import os

KINDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
BUSY = ("user", "nice", "system", "irq", "softirq")


def cpu_ticks() -> dict[str, int] | None:
    """Clock ticks (`tick_s()` seconds each) of every CPU together, per kind of time; None where there is
    no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            return dict(zip(KINDS, (int(v) for v in f.readline().split()[1:9]), strict=True))
    except (OSError, ValueError):
        return None


def tick_s() -> float:
    return 1 / os.sysconf("SC_CLK_TCK")
