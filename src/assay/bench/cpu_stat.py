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


def tree_cpu_s(root: int | None = None) -> float | None:
    """CPU-seconds (user + system, all threads) used so far by a process and its descendants, live
    or reaped (vLLM runs its engine core in a child); None where there is no /proc. Beside the machine's busy
    seconds it tells a run's own work from other processes' (a previous run's child still exiting)."""
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, CPU-seconds)
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except (OSError, IndexError):
            continue  # gone meanwhile
        stats[pid] = (int(fields[1]), sum(int(v) for v in fields[11:15]) * tick_s())  # utime stime cutime cstime
    root = os.getpid() if root is None else root
    if root not in stats:
        return None
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [p for p, (pp, _) in stats.items() if pp == parent and p not in tree]
        tree.update(children)
        frontier += children
    return sum(stats[p][1] for p in tree)
