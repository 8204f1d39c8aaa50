"""cgroups.py's operations (one cgroup per sandbox, capping memory and processes of all a run starts, with the
counters of OOM kills and refused forks) on cgroup v2, the only hierarchy most current distributions mount.
Stdlib only.

v2 has one tree, and our own cgroup D (where /proc/self/cgroup's "0::" line puts us) is the part we may shape:
a delegated subtree, usable where D's parent gives it the memory and pids controllers. Under D:

    D/assay-host              the processes that were in D: a cgroup may enable controllers for its children
                              only while it holds no process itself ("no internal processes"; the root is exempt),
                              so they move to this leaf first, as container init scripts do
    D/assay                   memory and pids (and cpu, where D has it) enabled for its children
    D/assay/<launcher>-<name> one per sandbox: memory.max, memory.swap.max 0, pids.max, cpu.max when asked

A process already in D/assay-host (a host process started after a launcher moved its parent) finds D as the
parent of its own cgroup, so the layout never nests."""

from __future__ import annotations

import errno
import os

from assay.sandbox.cgroups import Counters, launcher_gone, move_self

ROOT = "/sys/fs/cgroup"  # cgroup2 is mounted here (v2-only hosts), or at ROOT/unified beside v1 (hybrid hosts)
SELF = "/proc/self/cgroup"
PARENT = "assay"
LEAF = "assay-host"
REQUIRED = ("memory", "pids")
OPTIONAL = ("cpu",)  # cpu.max, for a limit on the CPU share; enabled where D has it, never required
CPU_PERIOD_US = 100_000
VERSION = "v2"
MOVE_ROUNDS = 10  # processes forked while D's are moved are born in D: move again, this many times at most

# D: where it is in our mount namespace (the launcher points DIR at its bind mount of D), and its path in the
# hierarchy as /proc/self/cgroup names it ("" for the root). Set by available(), or found by locate().
DIR: str | None = None
PATH: str | None = None

__all__ = ["Counters", "available", "counters", "create", "home", "locate", "move_self", "procs_files", "remove",
           "sweep"]


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def own_path() -> str | None:
    """Our cgroup v2 path ("" for the root), from /proc/self/cgroup; None where there is none, or where it lies
    outside our cgroup namespace (then it reads "/.." and is not ours to shape)."""
    try:
        with open(SELF) as f:
            for line in f:
                if line.startswith("0::"):
                    path = line[3:].rstrip("\n").rstrip("/")
                    return None if "/.." in f"{path}/" else path
    except OSError:
        pass
    return None


def locate() -> tuple[str, str] | None:
    """(D's directory, D's path), or None where no cgroup2 is mounted at ROOT or ROOT/unified."""
    mount = next((d for d in (ROOT, f"{ROOT}/unified") if os.path.isfile(f"{d}/cgroup.controllers")), None)
    path = own_path()
    if mount is None or path is None:
        return None
    parent, _, last = path.rpartition("/")
    if last == LEAF:  # already moved out of D by a launcher
        path = parent
    return f"{mount}{path}", path


def available() -> bool:
    """Whether D can cap a sandbox's memory and processes: D has the memory and pids controllers, our layout
    can enable them, and a probe cgroup takes the limits (then is removed). Nothing is written where D lacks
    a controller (a hybrid host whose v1 hierarchies hold memory and pids, as this one's unified tree has only
    hugetlb). Sets DIR and PATH."""
    global DIR, PATH
    found = locate()
    if found is None:
        return False
    DIR, PATH = found
    probe = f"{os.getpid()}-probe"  # named as a launcher's are, so that sweep() removes one a crash left
    try:
        have = _read(f"{DIR}/cgroup.controllers").split()
        if not all(ctl in have for ctl in REQUIRED):
            return False
        _enable(DIR, have)
        os.makedirs(f"{DIR}/{LEAF}", exist_ok=True)  # where the jail steps out to (assay may hold no process)
        os.makedirs(f"{DIR}/{PARENT}", exist_ok=True)
        _enable(f"{DIR}/{PARENT}", have)  # it holds no process: no move; cpu only if D could enable it
        create(probe, 64 << 20, 64)
        return True
    except OSError:
        return False
    finally:
        remove(probe)


def _enable(d: str, have: list[str]) -> None:
    """Enable the memory and pids controllers (and cpu, if `have` lists it) for d's children, first moving d's
    processes into d/LEAF if the kernel refuses while d holds any (EBUSY)."""
    _delegate(d, " ".join(f"+{ctl}" for ctl in REQUIRED))
    for ctl in OPTIONAL:
        if ctl in have:
            try:
                _delegate(d, f"+{ctl}")
            except OSError:
                pass  # e.g. cpu is refused while a realtime process sits in the subtree: cpu.max is optional


def _delegate(d: str, change: str) -> None:
    for _ in range(MOVE_ROUNDS):
        try:
            _write(f"{d}/cgroup.subtree_control", change)
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
        os.makedirs(f"{d}/{LEAF}", exist_ok=True)
        for pid in _read(f"{d}/cgroup.procs").split():
            try:
                _write(f"{d}/{LEAF}/cgroup.procs", pid)
            except ProcessLookupError:
                pass  # it exited meanwhile
    raise OSError(errno.EBUSY, f"{d} kept gaining processes: cannot enable {change} for its children")


def _path(name: str) -> str:
    return f"{DIR}/{PARENT}/{name}"


def create(name: str, memory_bytes: int, max_pids: int, cpus: float | None = None) -> None:
    """`cpus`: a CPU share in cores (cpu.max), where one is asked for; CPU time is capped per process anyway."""
    path = _path(name)
    os.makedirs(path, exist_ok=True)
    _write(f"{path}/memory.max", str(memory_bytes))
    if os.path.exists(f"{path}/memory.swap.max"):  # v1 caps memory + swap at the limit; here swap is apart: none
        _write(f"{path}/memory.swap.max", "0")
    _write(f"{path}/pids.max", str(max_pids))
    if cpus is not None:
        _write(f"{path}/cpu.max", f"{max(1000, round(cpus * CPU_PERIOD_US))} {CPU_PERIOD_US}")


def procs_files(name: str | None) -> list[int]:
    """The `cgroup.procs` file of a sandbox's cgroup (or, for None, of D/LEAF: the parent of all may hold no
    process in v2), opened for writing while root and the path are in sight (see cgroups.procs_files)."""
    return [os.open(f"{_path(name) if name else f'{DIR}/{LEAF}'}/cgroup.procs", os.O_WRONLY)]


def home() -> list[int] | None:
    """Our own cgroup's `cgroup.procs`, opened for writing, to step back into; None where it is not under D."""
    own = own_path()
    if own is None or PATH is None or not (own == PATH or own.startswith(f"{PATH}/")):
        return None
    file = f"{DIR}{own[len(PATH):]}/cgroup.procs"
    try:
        if str(os.getpid()) not in _read(file).split():
            return None
        return [os.open(file, os.O_WRONLY)]
    except OSError:
        return None


def remove(name: str) -> bool:
    """False while a run is still inside (try again later)."""
    try:
        if os.path.isdir(_path(name)):
            os.rmdir(_path(name))
        return True
    except OSError:
        return False


def sweep() -> None:
    """Remove the cgroups of launchers that are gone (named launcherpid-volume). In the host process (which did
    not probe) D is found afresh."""
    global DIR, PATH
    if DIR is None:
        found = locate()
        if found is None:
            return
        DIR, PATH = found
    try:
        names = os.listdir(f"{DIR}/{PARENT}")
    except OSError:
        return
    for name in filter(launcher_gone, names):
        remove(name)


def counters(name: str) -> Counters:
    return Counters(f"{_path(name)}/memory.events", f"{_path(name)}/pids.events")
