"""One cgroup (v1 memory + pids) per sandboxed run: a hard cap on the whole process tree's memory and process
count, and the counters that tell an OOM kill or a refused fork apart from the program's own exit. Stdlib only.

Where cgroup v1 is missing (cgroup v2-only hosts, containers without the controllers) the jail falls back to
rlimits, which cap each process instead of the tree."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

ROOT = "/sys/fs/cgroup"  # the launcher moves it to its own view
PARENT = "assay"
CONTROLLERS = ("memory", "pids")


def available() -> bool:
    try:
        for ctl in CONTROLLERS:
            os.makedirs(f"{ROOT}/{ctl}/{PARENT}", exist_ok=True)
        return True
    except OSError:
        return False


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _counter(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except OSError:
        pass
    return 0


@dataclass
class RunCgroup:
    memory: str
    pids: str

    @classmethod
    def create(cls, name: str) -> RunCgroup:
        cg = cls(f"{ROOT}/memory/{PARENT}/{name}", f"{ROOT}/pids/{PARENT}/{name}")
        cg.remove()  # a leftover from a crashed run under a recycled pid
        os.mkdir(cg.memory)
        os.mkdir(cg.pids)
        return cg

    def limit(self, memory_bytes: int, max_pids: int) -> None:
        _write(f"{self.memory}/memory.limit_in_bytes", str(memory_bytes))
        if os.path.exists(f"{self.memory}/memory.memsw.limit_in_bytes"):  # swap counts too, where accounted
            _write(f"{self.memory}/memory.memsw.limit_in_bytes", str(memory_bytes))
        _write(f"{self.pids}/pids.max", str(max_pids))

    def join(self) -> None:
        """Move the calling process (and so all it will fork) into this cgroup."""
        _write(f"{self.memory}/cgroup.procs", "0")
        _write(f"{self.pids}/cgroup.procs", "0")

    def oom_killed(self) -> bool:
        return _counter(f"{self.memory}/memory.oom_control", "oom_kill") > 0

    def pids_refused(self) -> bool:
        return _counter(f"{self.pids}/pids.events", "max") > 0

    def remove(self) -> None:
        for path in (self.memory, self.pids):
            for _ in range(50):  # the last exiting task may still be on its way out
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.001)


def sweep() -> None:
    """Remove the cgroups of launchers that are gone (named launcher-worker); busy ones refuse rmdir."""
    for ctl in CONTROLLERS:
        parent = f"{ROOT}/{ctl}/{PARENT}"
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            launcher = name.split("-")[0]
            if launcher.isdigit() and not os.path.exists(f"/proc/{launcher}"):
                try:
                    os.rmdir(f"{parent}/{name}")
                except OSError:
                    pass
