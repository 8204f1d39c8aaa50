"""The cgroups that cap a sandbox's whole process tree: the v1 probe, cgroup v2 on a fake cgroupfs whose writes
follow the kernel's rules, the choice between them, and the refusal where neither can cap the tree."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from assay.sandbox import cgroups, cgroups2, client, launcher

# ---- cgroup v1 -----------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_root(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroups, "ROOT", str(tmp_path))
    for ctl in cgroups.CONTROLLERS:  # a v1 host mounts each controller's hierarchy there
        (tmp_path / ctl).mkdir()
    return tmp_path


def test_cgroups_are_used_where_a_probe_can_be_limited_and_the_probe_is_removed(fake_root, monkeypatch):
    written = []  # cgroupfs makes its control files itself (and rmdir ignores them); a plain folder would not
    monkeypatch.setattr(cgroups, "_write", lambda path, value: written.append(path.rsplit("/", 1)[1]))
    assert cgroups.available()
    assert written == ["memory.limit_in_bytes", "pids.max"]
    assert [list((fake_root / ctl / cgroups.PARENT).iterdir()) for ctl in cgroups.CONTROLLERS] == [[], []]


def test_a_host_that_refuses_the_limits_falls_back_to_rlimits(fake_root, monkeypatch):
    def refuse(path: str, value: str) -> None:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(cgroups, "_write", refuse)  # as a VM's cgroup v1 answered root
    assert not cgroups.available()
    assert [list((fake_root / ctl / cgroups.PARENT).iterdir()) for ctl in cgroups.CONTROLLERS] == [[], []]


def test_the_v1_probe_makes_nothing_on_a_cgroup2_root(tmp_path, monkeypatch):
    """On a v2-only host ROOT is the cgroup2 tree: a mkdir there would make cgroups named memory and pids."""
    monkeypatch.setattr(cgroups, "ROOT", str(tmp_path))
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    assert not cgroups.available()
    assert [p.name for p in tmp_path.iterdir()] == ["cgroup.controllers"]


# ---- cgroup v2 on a fake cgroupfs ----------------------------------------------------------------------------------

D = "system.slice/app.service"  # our cgroup, as /proc/self/cgroup names it


class FakeKernel:
    """cgroupfs writes as the kernel answers them: enabling controllers for a non-root cgroup's children fails
    with EBUSY while it holds a process, and writing a pid to cgroup.procs moves that process."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.writes: list[tuple[str, str]] = []

    def write(self, path: str, value: str) -> None:
        p = Path(path)
        rel = str(p.relative_to(self.root))
        if p.name == "cgroup.subtree_control" and p.parent != self.root and self.procs(p.parent):
            self.writes.append((rel, f"EBUSY {value}"))
            raise OSError(errno.EBUSY, "Device or resource busy", path)
        self.writes.append((rel, value))
        if p.name == "cgroup.procs":
            for procs in self.root.rglob("cgroup.procs"):
                procs.write_text("".join(f"{pid}\n" for pid in self.procs(procs.parent) if pid != value))
            p.write_text("".join(f"{pid}\n" for pid in [*self.procs(p.parent), value]))
        elif p.name == "cgroup.subtree_control":
            enabled = p.read_text().split() if p.exists() else []
            p.write_text(" ".join([*enabled, *(c.lstrip("+") for c in value.split())]))
        else:
            p.write_text(value)

    @staticmethod
    def procs(d: Path) -> list[str]:
        return (d / "cgroup.procs").read_text().split() if (d / "cgroup.procs").exists() else []


@pytest.fixture
def v2(tmp_path, monkeypatch):
    """A v2-only host's /sys/fs/cgroup, with us (pids 100 and 200) in D, which has memory, pids and cpu."""
    root = tmp_path / "cgroup"
    (root / D).mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids\n")
    (root / D / "cgroup.controllers").write_text("cpu memory pids\n")
    (root / D / "cgroup.procs").write_text("100\n200\n")
    (tmp_path / "self").write_text(f"0::/{D}\n")
    kernel = FakeKernel(root)
    monkeypatch.setattr(cgroups2, "ROOT", str(root))
    monkeypatch.setattr(cgroups2, "SELF", str(tmp_path / "self"))
    monkeypatch.setattr(cgroups2, "DIR", None)
    monkeypatch.setattr(cgroups2, "PATH", None)
    monkeypatch.setattr(cgroups2, "_write", kernel.write)
    return kernel


def test_v2_moves_our_processes_to_a_leaf_then_delegates_memory_pids_and_cpu(v2):
    root = v2.root
    assert cgroups2.available()
    assert (cgroups2.DIR, cgroups2.PATH) == (f"{root}/{D}", f"/{D}")
    assert v2.writes[:4] == [(f"{D}/cgroup.subtree_control", "EBUSY +memory +pids"),
                             (f"{D}/assay-host/cgroup.procs", "100"), (f"{D}/assay-host/cgroup.procs", "200"),
                             (f"{D}/cgroup.subtree_control", "+memory +pids")]
    assert v2.procs(root / D) == [] and v2.procs(root / D / "assay-host") == ["100", "200"]
    assert (root / D / "cgroup.subtree_control").read_text().split() == ["memory", "pids", "cpu"]
    assert (root / D / "assay" / "cgroup.subtree_control").read_text().split() == ["memory", "pids", "cpu"]
    # the probe took the limits (rmdir of a plain folder fails on the files the kernel would not count)
    probe = root / D / "assay" / f"{os.getpid()}-probe"
    assert [(f.name, f.read_text()) for f in sorted(probe.iterdir())] == [("memory.max", str(64 << 20)),
                                                                          ("pids.max", "64")]


def test_v2_in_the_root_cgroup_moves_nothing(v2, tmp_path):
    """The root cgroup may hold processes and enable controllers at once."""
    (tmp_path / "self").write_text("0::/\n")
    (v2.root / "cgroup.procs").write_text("1\n100\n")
    assert cgroups2.available()
    assert (cgroups2.DIR, cgroups2.PATH) == (str(v2.root), "")
    assert not [w for w in v2.writes if w[0].endswith("cgroup.procs")]
    assert (v2.root / "assay-host").is_dir()  # where a run's worker steps out to


def test_v2_without_memory_and_pids_writes_nothing(v2):
    """As the unified tree of a hybrid host, whose memory and pids belong to v1."""
    (v2.root / D / "cgroup.controllers").write_text("hugetlb\n")
    before = sorted(v2.root.rglob("*"))
    assert not cgroups2.available()
    assert v2.writes == [] and sorted(v2.root.rglob("*")) == before


def test_v2_gives_up_when_the_cgroup_keeps_gaining_processes(v2, monkeypatch):
    def fork_more(path: str, value: str) -> None:
        v2.write(path, value)
        if path.endswith("assay-host/cgroup.procs"):
            (v2.root / D / "cgroup.procs").write_text(f"{int(value) + 1000}\n")  # a child born in D meanwhile

    monkeypatch.setattr(cgroups2, "_write", fork_more)
    assert not cgroups2.available()
    assert len([w for w in v2.writes if w[1].startswith("EBUSY")]) == cgroups2.MOVE_ROUNDS


def test_v2_sandbox_limits_counters_and_procs_files(v2):
    assert cgroups2.available()
    sandbox = v2.root / D / "assay" / "7-abc"
    sandbox.mkdir()
    (sandbox / "memory.swap.max").write_text("max")  # the kernel makes it where swap is accounted
    cgroups2.create("7-abc", 256 << 20, 32, cpus=1.5)
    assert {f.name: f.read_text() for f in sandbox.iterdir()} == {
        "memory.max": str(256 << 20), "memory.swap.max": "0", "pids.max": "32", "cpu.max": "150000 100000"}

    (sandbox / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\noom_group_kill 0\n")
    (sandbox / "pids.events").write_text("max 2\n")
    counters = cgroups2.counters("7-abc")
    assert counters.breaches() == (False, False)
    (sandbox / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\noom_group_kill 0\n")
    assert counters.breaches() == (True, False)
    (sandbox / "pids.events").write_text("max 3\n")
    assert counters.breaches() == (True, True)

    (sandbox / "cgroup.procs").write_text("")
    fds = cgroups2.procs_files("7-abc") + cgroups2.procs_files(None)  # in v2 the parent of all holds no process
    try:
        assert [os.readlink(f"/proc/self/fd/{fd}") for fd in fds] == [
            f"{sandbox}/cgroup.procs", f"{v2.root}/{D}/assay-host/cgroup.procs"]
    finally:
        for fd in fds:
            os.close(fd)


def test_v2_home_sweep_and_a_process_already_in_the_leaf(v2, tmp_path):
    assert cgroups2.available()
    (tmp_path / "self").write_text(f"0::/{D}/assay-host\n")  # moved there by the probe
    assert cgroups2.locate() == (f"{v2.root}/{D}", f"/{D}")  # D itself, not a D/assay-host/assay to come
    assert cgroups2.home() is None  # our pid is not listed there (the fake moved 100 and 200)
    (v2.root / D / "assay-host" / "cgroup.procs").write_text(f"100\n{os.getpid()}\n")
    [fd] = cgroups2.home()
    try:
        assert os.readlink(f"/proc/self/fd/{fd}") == f"{v2.root}/{D}/assay-host/cgroup.procs"
    finally:
        os.close(fd)

    parent = v2.root / D / "assay"
    for name in ("999999999-gone", f"{os.getpid()}-live", "not-a-launcher"):
        (parent / name).mkdir()
    cgroups2.sweep()
    assert sorted(p.name for p in parent.iterdir() if p.is_dir()) == [
        f"{os.getpid()}-live", f"{os.getpid()}-probe", "not-a-launcher"]


# ---- which one, and refusing where neither caps the tree ------------------------------------------------------------


@pytest.mark.parametrize(("v1_ok", "v2_ok", "chosen", "probed"), [
    (True, True, "v1", ["v1"]), (False, True, "v2", ["v1", "v2"]), (False, False, None, ["v1", "v2"])])
def test_v1_is_chosen_where_its_probe_passes_else_v2(monkeypatch, v1_ok, v2_ok, chosen, probed):
    calls = []
    monkeypatch.setattr(cgroups, "available", lambda: calls.append("v1") or v1_ok)
    monkeypatch.setattr(cgroups2, "available", lambda: calls.append("v2") or v2_ok)
    cg = launcher.choose_cgroups()
    assert (cg.VERSION if cg else None) == chosen
    assert calls == probed  # v2's probe (which can move processes) never runs where v1 caps the tree


def test_this_hybrid_host_uses_v1_and_its_unified_tree_cannot_cap_memory(isolated, monkeypatch):
    controllers = Path("/sys/fs/cgroup/unified/cgroup.controllers")
    if not controllers.exists() or {"memory", "pids"} <= set(controllers.read_text().split()):
        pytest.skip("not a hybrid host whose unified tree lacks memory and pids")
    monkeypatch.setattr(cgroups2, "DIR", None)
    monkeypatch.setattr(cgroups2, "PATH", None)
    assert not cgroups2.available()
    assert not Path("/sys/fs/cgroup/unified/assay-host").exists()
    assert client.get_launcher().cgroups == "v1"


def test_a_host_without_tree_wide_limits_refuses_unless_per_process_limits_are_allowed(isolated, monkeypatch, capsys):
    monkeypatch.setattr(client.Launcher, "_first_line", lambda self: "ready cgroups=none")
    monkeypatch.delenv(client.PER_PROCESS_ENV, raising=False)
    with pytest.raises(client.SandboxUnavailable, match="no cgroup can cap.*--per-process-limits"):
        client.Launcher()
    monkeypatch.setenv(client.PER_PROCESS_ENV, "1")
    monkeypatch.setattr(client, "_warned_per_process", False)
    started = client.Launcher()
    try:
        assert started.cgroups == "none"
        assert "capped per process" in capsys.readouterr().err
    finally:
        started.close()


def test_per_process_limits_are_an_inherited_opt_in(monkeypatch):
    from assay.sandbox import allow_per_process_limits

    monkeypatch.delenv(client.PER_PROCESS_ENV, raising=False)
    assert not client.per_process_limits_allowed()
    allow_per_process_limits()
    assert os.environ[client.PER_PROCESS_ENV] == "1" and client.per_process_limits_allowed()
    allow_per_process_limits(False)
    assert not client.per_process_limits_allowed({client.PER_PROCESS_ENV: "0"})
    assert client.PER_PROCESS_ENV not in os.environ
