"""Atomic files and directories: whole or absent, and a replaced target is never missing."""

from __future__ import annotations

import pytest

from assay.core import atomic
from assay.core.atomic import atomic_dir, atomic_path, atomic_write


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "a.json"
    atomic_write(target, "old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.json"]
    atomic_write(target, b"new")
    assert target.read_text() == "new"


@pytest.mark.parametrize("exchange", [True, False])
def test_a_directory_is_swapped_in_whole(tmp_path, monkeypatch, exchange):
    target = tmp_path / "step_3"
    with atomic_dir(target) as d:
        (d / "weights").write_text("v1")
        assert not target.exists()  # invisible until complete
    if not exchange:  # the fallback path, as on a system without renameat2
        monkeypatch.setattr(atomic.ctypes, "CDLL", lambda *a, **k: object())
    seen = []
    real_rename = atomic.Path.rename

    def watching_rename(self, dst):  # the target's contents at every rename: never half of each
        seen.append(sorted(p.name for p in target.iterdir()) if target.exists() else None)
        return real_rename(self, dst)

    monkeypatch.setattr(atomic.Path, "rename", watching_rename)
    with atomic_dir(target) as d:
        (d / "weights").write_text("v2")
        (d / "optimizer").write_text("v2")
    assert (target / "weights").read_text() == "v2" and (target / "optimizer").read_text() == "v2"
    assert [p.name for p in tmp_path.iterdir()] == ["step_3"]  # the old copy and temps are gone
    assert all(s in (["weights"], ["optimizer", "weights"], None) for s in seen)
    if exchange:
        assert seen == []  # one renameat2 call, no rename at all
    with pytest.raises(RuntimeError), atomic_dir(target) as d:
        (d / "weights").write_text("v3")
        raise RuntimeError("crash mid-save")
    assert (target / "weights").read_text() == "v2" and [p.name for p in tmp_path.iterdir()] == ["step_3"]
