"""Workspace layers: templates, snapshot/restore, forks, recovery, and the pool built on them."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from assay.sandbox import Limits, NamespaceSandbox, SandboxError, SandboxPool, client
from assay.sandbox.base import SANDBOX_ERROR
from assay.sandbox.namespace import MAX_LAYERS


@pytest.fixture
def template(tmp_path: Path) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("VALUE = 41\n")
    (tmp_path / "run.sh").write_text("#!/bin/sh\necho run\n")
    os.chmod(tmp_path / "run.sh", 0o755)
    (tmp_path / "link").symlink_to("pkg/mod.py")
    return tmp_path


def test_template_is_the_starting_workspace_and_stays_read_only(isolated: None, template: Path) -> None:
    with NamespaceSandbox(Limits(), template=template) as s:
        assert s.exec("./run.sh; cat link; ls").stdout == "run\nVALUE = 41\nlink\npkg\nrun.sh\n"
        assert s.run_python("from pkg.mod import VALUE\nprint(VALUE + 1)").stdout == "42\n"
        s.exec("echo 'VALUE = 0' > pkg/mod.py; rm run.sh")
        assert s.read_file("pkg/mod.py") == b"VALUE = 0\n"
    assert (template / "pkg" / "mod.py").read_text() == "VALUE = 41\n" and (template / "run.sh").exists()
    with NamespaceSandbox(Limits(), template=template) as fresh:  # the next sandbox starts clean
        assert fresh.read_file("pkg/mod.py") == b"VALUE = 41\n"


def test_snapshot_and_restore(sbx: NamespaceSandbox) -> None:
    sbx.write_file("a.txt", "one")
    first = sbx.snapshot()
    sbx.exec("echo two > a.txt; echo new > b.txt; mkdir d; touch d/x")
    second = sbx.snapshot()
    sbx.exec("rm -r a.txt d; echo three > b.txt")
    assert sbx.exec("ls").stdout == "b.txt\n"
    sbx.restore(second)
    assert sbx.exec("cat a.txt b.txt; ls d").stdout == "two\nnew\nx\n"
    sbx.restore(first)
    assert sbx.exec("ls; cat a.txt").stdout == "a.txt\none"
    sbx.restore(second)  # forward again: snapshots are not consumed by restoring an earlier one
    assert sbx.read_file("b.txt") == b"new\n"


def test_snapshot_without_changes_adds_no_layer(sbx: NamespaceSandbox) -> None:
    sbx.write_file("a.txt", "x")
    a = sbx.snapshot()
    assert sbx.read_file("a.txt") == b"x"  # reading changes nothing
    assert sbx.snapshot().layers == a.layers


def test_many_forks_from_one_snapshot_are_independent(isolated: None) -> None:
    with NamespaceSandbox(Limits()) as base:
        base.write_file("count.txt", "0")
        snap = base.snapshot()
    forks = [NamespaceSandbox(Limits(), template=snap) for _ in range(4)]  # the closed base's layers live on
    try:
        for i, f in enumerate(forks):
            f.exec(f"echo {i} > count.txt; echo {i} > own{i}.txt")
        for i, f in enumerate(forks):
            assert f.exec("cat count.txt; ls").stdout == f"{i}\ncount.txt\nown{i}.txt\n"
        grandchild = NamespaceSandbox(Limits(), template=forks[2].snapshot())
        assert grandchild.read_file("own2.txt") == b"2\n"
        grandchild.close()
    finally:
        for f in forks:
            f.close()


def test_forks_from_one_snapshot_draw_independent_randomness(isolated: None) -> None:
    """Only files are snapshotted, never a process: every run starts fresh, so forks (and restores) share no
    random state and nothing needs reseeding."""
    with NamespaceSandbox(Limits()) as base:
        snap = base.snapshot()
    draw = ["python3", "-c", "import os, random; print(os.urandom(8).hex(), random.random())"]
    forks = [NamespaceSandbox(Limits(), template=snap) for _ in range(3)]
    try:
        draws = [f.exec(draw).stdout for f in forks]
        forks[0].restore(snap)
        draws.append(forks[0].exec(draw).stdout)
    finally:
        for f in forks:
            f.close()
    assert all(d.strip() for d in draws)
    assert len(set(draws)) == len(draws)


def test_restore_frees_the_discarded_layer(isolated: None) -> None:
    with NamespaceSandbox(Limits(workspace_mb=8)) as s:
        snap = s.snapshot()
        for _ in range(4):  # 4 x 5 MB would not fit in 8 MB unless each restore frees the last 5 MB
            assert s.exec("head -c 5000000 /dev/zero > big").ok
            s.restore(snap)
        assert s.exec("ls").stdout == ""


def test_snapshots_stack_to_a_limit(sbx: NamespaceSandbox) -> None:
    for _ in range(MAX_LAYERS):
        sbx._dirty = True  # what a call would do; saves MAX_LAYERS real calls
        sbx.snapshot()
    sbx._dirty = True
    with pytest.raises(SandboxError, match="at most"):
        sbx.snapshot()


def test_recover_after_the_launcher_crashed(isolated: None, template: Path) -> None:
    s = NamespaceSandbox(Limits(), template=template)
    plain = NamespaceSandbox(Limits(), template=template)
    s.write_file("extra.txt", "x")
    snap = s.snapshot()
    launcher = client.get_launcher().proc  # one handle: asked again once it died, get_launcher starts a new one
    launcher.kill()
    launcher.wait()
    assert s.exec("true").status == SANDBOX_ERROR
    with pytest.raises(SandboxError, match="restarted"):
        s.recover()  # its snapshot died with the launcher
    with pytest.raises(SandboxError, match="restarted"):
        NamespaceSandbox(Limits(), template=snap)
    plain.recover()  # a template survives: it is sent again to the new launcher
    assert plain.exec("./run.sh").stdout == "run\n"
    s.close()
    plain.close()


def test_recover_returns_to_the_last_snapshot(sbx: NamespaceSandbox) -> None:
    sbx.write_file("kept.txt", "k")
    sbx.snapshot()
    sbx.write_file("lost.txt", "l")
    sbx.recover()
    assert sbx.exec("ls").stdout == "kept.txt\n"


def test_pool_hands_out_restored_sandboxes(isolated: None, template: Path) -> None:
    with SandboxPool(2, Limits(), template=template, setup=lambda s: s.write_file("setup.txt", "ready")) as pool:
        with pool.sandbox() as s:
            assert s.exec("cat setup.txt; ls").stdout == "readylink\npkg\nrun.sh\nsetup.txt\n"
            s.exec("rm setup.txt; echo dirty > junk.txt")
        for _ in range(2):  # whichever sandbox comes back, it is back at the base
            with pool.sandbox() as s:
                assert s.exec("ls").stdout == "link\npkg\nrun.sh\nsetup.txt\n"
        a, b = pool.acquire(), pool.acquire()
        with pytest.raises(TimeoutError):
            pool.acquire(timeout=0.05)
        pool.release(a)
        pool.release(b)


def test_pool_replaces_a_broken_sandbox(isolated: None) -> None:
    with SandboxPool(1, Limits()) as pool:
        s = pool.acquire()
        s._volume = None  # break it: calls now fail in the sandbox layer
        s.errors += 1
        pool.release(s)
        assert pool.replaced == 1
        with pool.sandbox() as fresh:
            assert fresh is not s and fresh.exec("echo ok").stdout == "ok\n"


def test_pool_async(isolated: None) -> None:
    async def main(pool: SandboxPool) -> list[str]:
        async def job(i: int) -> str:
            async with pool.asandbox() as s:
                await s.awrite_file("i.txt", str(i))
                return (await s.aexec("ls; cat i.txt")).stdout

        return await asyncio.gather(*(job(i) for i in range(6)))  # 6 jobs share 2 sandboxes

    with SandboxPool(2, Limits()) as pool:
        assert asyncio.run(main(pool)) == [f"i.txt\n{i}" for i in range(6)]


def test_the_process_sandbox_copies_a_planted_device_link_as_a_link(tmp_path: Path) -> None:
    from assay.sandbox import ProcessSandbox

    (tmp_path / "answer.txt").symlink_to("/dev/zero")  # following it would copy forever
    box = ProcessSandbox(template=tmp_path)
    try:
        assert (box.workspace / "answer.txt").is_symlink()
    finally:
        box.close()
