"""cgroups.available() probes that a sandbox's cgroup can be limited, not only that the folders can be made."""

import pytest

from assay.sandbox import cgroups


@pytest.fixture
def fake_root(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroups, "ROOT", str(tmp_path))
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
