"""One cgroup (v1 memory + pids) per sandbox: a hard cap on the memory (tmpfs workspace included) and the
number of processes of everything a run starts, and the counters that tell an OOM kill or a refused fork apart
from the program's own exit. Stdlib only.

cgroups2.py does the same in a delegated cgroup v2 subtree, with the same functions; the launcher uses v1 where
its probe passes, else v2, else neither, and then the host refuses to run sandboxes unless per-process rlimits
were allowed (client.py)."""

from __future__ import annotations

import os

ROOT = "/sys/fs/cgroup"  # the launcher moves it into its own view
PARENT = "assay"
CONTROLLERS = ("memory", "pids")
VERSION = "v1"


def available() -> bool:
    """Whether a sandbox's cgroup can be made and limited here. A probe cgroup is made and limited, then removed:
    some hosts let the directories be made but refuse the limits (a VM seen refusing memory.limit_in_bytes to
    root), and there the jail falls back to rlimits rather than failing every sandbox."""
    probe = f"{os.getpid()}-probe"  # named as a launcher's are, so that sweep() removes one a crash left
    try:
        if not all(os.path.isdir(f"{ROOT}/{ctl}") for ctl in CONTROLLERS):
            return False  # not mounted: on a cgroup2 ROOT, makedirs would make cgroups named "memory" and "pids"
        for ctl in CONTROLLERS:
            os.makedirs(f"{ROOT}/{ctl}/{PARENT}", exist_ok=True)
        create(probe, 64 << 20, 64)
        return True
    except OSError:
        return False
    finally:
        remove(probe)


def _path(ctl: str, name: str) -> str:
    return f"{ROOT}/{ctl}/{PARENT}/{name}"


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def create(name: str, memory_bytes: int, max_pids: int) -> None:
    for ctl in CONTROLLERS:
        os.makedirs(_path(ctl, name), exist_ok=True)
    mem = _path("memory", name)
    _write(f"{mem}/memory.limit_in_bytes", str(memory_bytes))
    if os.path.exists(f"{mem}/memory.memsw.limit_in_bytes"):  # swap counts too, where it is accounted
        _write(f"{mem}/memory.memsw.limit_in_bytes", str(memory_bytes))
    _write(f"{_path('pids', name)}/pids.max", str(max_pids))


def procs_files(name: str | None) -> list[int]:
    """The `cgroup.procs` files of a sandbox's cgroup (or, for None, of the parent of all), opened for writing: a
    process that writes "0" there moves in, and all it forks from then on is born there. Opened by root while
    the paths are in sight, so that a process of the sandbox user can move later."""
    return [os.open(f"{_path(ctl, name) if name else f'{ROOT}/{ctl}/{PARENT}'}/cgroup.procs", os.O_WRONLY)
            for ctl in CONTROLLERS]


def home() -> list[int] | None:
    """Our own cgroups' `cgroup.procs` files, opened for writing, to step back into; None where /proc/self/cgroup
    does not name them under ROOT (a container that mounts its own cgroup as the root, say)."""
    paths: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            paths.update(dict.fromkeys(names.split(","), path))
    files = [f"{ROOT}/{ctl}{paths.get(ctl, '/-')}/cgroup.procs" for ctl in CONTROLLERS]
    try:
        for file in files:
            with open(file) as f:
                if str(os.getpid()) not in f.read().split():
                    return None
        return [os.open(file, os.O_WRONLY) for file in files]
    except OSError:
        return None


def move_self(procs: list[int]) -> None:
    for fd in procs:
        os.write(fd, b"0")


def remove(name: str) -> bool:
    """False while a run is still inside (try again later)."""
    try:
        for ctl in CONTROLLERS:
            if os.path.isdir(_path(ctl, name)):
                os.rmdir(_path(ctl, name))
        return True
    except OSError:
        return False


def sweep() -> None:
    """Remove the cgroups of launchers that are gone (named launcherpid-volume)."""
    for ctl in CONTROLLERS:
        try:
            names = os.listdir(f"{ROOT}/{ctl}/{PARENT}")
        except OSError:
            continue
        for name in filter(launcher_gone, names):
            remove(name)


def launcher_gone(name: str) -> bool:
    """Whether a sandbox cgroup (named launcherpid-volume) belongs to a launcher that has exited."""
    launcher = name.split("-")[0]
    return launcher.isdigit() and not os.path.exists(f"/proc/{launcher}")


def counters(name: str) -> Counters:
    return Counters(f"{_path('memory', name)}/memory.oom_control", f"{_path('pids', name)}/pids.events")


class Counters:
    """A sandbox's OOM kills and refused forks ("oom_kill N" and "max N" lines, in v1 and v2 alike), read at the
    start of a run and again at its end. Opened while their paths are in sight: a run reads them after it has
    pivoted away."""

    def __init__(self, oom_file: str, pids_file: str) -> None:
        self._oom = os.open(oom_file, os.O_RDONLY)
        self._pids = os.open(pids_file, os.O_RDONLY)
        self._start = self._read()

    def _read(self) -> tuple[int, int]:
        return _counter(self._oom, "oom_kill"), _counter(self._pids, "max")

    def breaches(self) -> tuple[bool, bool]:
        """(an OOM kill, a refused fork) since the start."""
        now = self._read()
        return now[0] > self._start[0], now[1] > self._start[1]


def _counter(fd: int, key: str) -> int:
    for line in os.pread(fd, 4096, 0).decode().splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0
