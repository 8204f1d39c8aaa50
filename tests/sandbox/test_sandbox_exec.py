"""Running commands in the namespace sandbox: output, exit codes, files, and every limit's status."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from assay.sandbox import Limits, NamespaceSandbox, SandboxError, client
from assay.sandbox import launcher as launcher_module
from assay.sandbox.base import DISK, EXITED, OOM, OUTPUT_TRUNCATED, PIDS, SANDBOX_ERROR, TIMEOUT


def test_exec_output_exit_code_and_stdin(sbx: NamespaceSandbox) -> None:
    r = sbx.exec("echo out; echo err >&2; exit 3")
    assert (r.stdout, r.stderr, r.exit_code, r.status) == ("out\n", "err\n", 3, EXITED)
    assert sbx.exec(["cat"], stdin="fed in").stdout == "fed in"
    assert sbx.exec(["sh", "-c", "pwd; id -u; id -g; hostname"]).stdout.split() == ["/workspace", "1000", "1000",
                                                                                   "sandbox"]
    missing = sbx.exec(["no-such-command"])
    assert missing.exit_code == 127 and missing.status == EXITED


def test_environment_is_the_allowlist_only(sbx: NamespaceSandbox) -> None:
    env = dict(line.split("=", 1) for line in sbx.exec(["env"]).stdout.splitlines())
    assert env == {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/workspace", "TMPDIR": "/tmp",
                   "LANG": "C.UTF-8", "USER": "sandbox", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
    assert sbx.exec("echo $EXTRA", env={"EXTRA": "given"}).stdout == "given\n"


def test_files_round_trip_and_persist_across_calls(sbx: NamespaceSandbox) -> None:
    sbx.write_file("a/b/c.txt", "hello")
    sbx.write_file("bin.dat", bytes(range(256)))
    assert sbx.read_file("a/b/c.txt") == b"hello"
    assert sbx.read_file("bin.dat") == bytes(range(256))
    assert sbx.exec("cat a/b/c.txt; echo more >> a/b/c.txt").stdout == "hello"
    assert sbx.read_file("a/b/c.txt") == b"hellomore\n"
    with pytest.raises(FileNotFoundError):
        sbx.read_file("nope.txt")


def test_tmp_is_private_to_each_call(sbx: NamespaceSandbox) -> None:
    assert sbx.exec("echo x > /tmp/t && cat /tmp/t").stdout == "x\n"
    assert sbx.exec("ls /tmp").stdout == ""


def test_run_python(sbx: NamespaceSandbox) -> None:
    r = sbx.run_python("import sys\nprint(sum(range(10)), sys.stdin.read())", stdin="in")
    assert (r.stdout, r.status) == ("45 in\n", EXITED)
    bad = sbx.run_python("raise SystemExit(7)")
    assert bad.exit_code == 7


def test_timeout_kills_the_whole_tree(isolated: None) -> None:
    with NamespaceSandbox(Limits(timeout_s=0.5)) as s:
        start = time.monotonic()
        r = s.exec("sleep 30 & sleep 30")
        assert r.status == TIMEOUT and r.exit_code == -9
        assert time.monotonic() - start < 5
        assert s.exec("echo alive").stdout == "alive\n"  # the sandbox is fine afterwards


def test_infinite_loop_hits_the_cpu_limit(isolated: None) -> None:
    with NamespaceSandbox(Limits(timeout_s=30, cpu_s=1)) as s:
        r = s.run_python("while True: pass")
        assert (r.status, r.exit_code) == (TIMEOUT, -24)  # SIGXCPU: the CPU limit, long before the wall clock


def test_memory_bomb_is_an_oom_status(isolated: None) -> None:
    with NamespaceSandbox(Limits(memory_mb=64)) as s:
        r = s.run_python("chunks = []\nwhile True: chunks.append(bytearray(1 << 20))")
        assert (r.status, r.exit_code) == (OOM, -9)
        assert s.run_python("print(len(bytearray(16 << 20)))").stdout == "16777216\n"


def test_memory_filled_through_tmpfs_is_an_oom_status(isolated: None) -> None:
    """Files in /tmp are memory too; the run's own pid 1 stays out of the cgroup, so the OOM killer can only
    hit the program, never turn its run into a sandbox error."""
    with NamespaceSandbox(Limits(memory_mb=48, workspace_mb=128)) as s:
        r = s.exec("for i in 1 2 3 4 5 6 7 8 9 10; do head -c 10000000 /dev/zero > /tmp/f$i; done")
        assert r.status == OOM, r


def test_fork_bomb_is_a_pids_status(isolated: None) -> None:
    with NamespaceSandbox(Limits(max_procs=24, timeout_s=2)) as s:
        r = s.exec(["bash", "-c", ":(){ :|:& };:; sleep 1"])  # the sleep keeps the run (and the bomb) going
        assert r.status == PIDS
        assert s.exec("echo alive").stdout == "alive\n"


def test_disk_fill_stops_at_the_workspace_quota(isolated: None) -> None:
    with NamespaceSandbox(Limits(workspace_mb=8, file_size_mb=4)) as s:
        r = s.exec("for i in $(seq 1 20); do head -c 1000000 /dev/zero > f$i || exit 1; done")
        assert r.status == DISK
        used_kb = int(s.exec("du -sk /workspace | cut -f1").stdout)
        assert used_kb <= 8 * 1024
        with pytest.raises(OSError):
            s.write_file("more.bin", b"x" * 2_000_000)


def test_file_size_limit_is_a_disk_status(isolated: None) -> None:
    with NamespaceSandbox(Limits(file_size_mb=1)) as s:
        r = s.exec("head -c 5000000 /dev/zero > big")
        assert r.status == DISK
        assert s.exec("stat -c %s big").stdout == "1048576\n"


def test_output_is_capped(isolated: None) -> None:
    with NamespaceSandbox(Limits(output_bytes=1000)) as s:
        r = s.exec("yes | head -c 100000")
        assert r.status == OUTPUT_TRUNCATED and r.stdout == "y\n" * 500


def test_open_files_limit(isolated: None) -> None:
    with NamespaceSandbox(Limits(open_files=32)) as s:
        r = s.exec("ulimit -n")
        assert r.stdout == "32\n"


def test_async_calls_run_concurrently_across_sandboxes(isolated: None) -> None:
    async def main() -> list[str]:
        boxes = [NamespaceSandbox(Limits()) for _ in range(4)]
        try:
            start = time.monotonic()
            results = await asyncio.gather(*(b.aexec(f"sleep 0.4; echo {i}") for i, b in enumerate(boxes)))
            assert time.monotonic() - start < 1.5  # four 0.4 s sleeps overlapped
            await boxes[0].awrite_file("f.txt", "async")
            assert await boxes[0].aread_file("f.txt") == b"async"
            assert (await boxes[1].arun_python("print(6 * 7)")).stdout == "42\n"
            return [r.stdout for r in results]
        finally:
            for b in boxes:
                b.close()

    assert asyncio.run(main()) == ["0\n", "1\n", "2\n", "3\n"]


def test_a_cancelled_async_call_kills_its_run(sbx: NamespaceSandbox) -> None:
    async def main() -> None:
        task = asyncio.create_task(sbx.aexec("sleep 30"))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    start = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - start < 3
    assert sbx.exec("echo next").stdout == "next\n"


def test_closed_sandbox_refuses(isolated: None) -> None:
    s = NamespaceSandbox(Limits())
    s.close()
    with pytest.raises(SandboxError, match="closed"):
        s.exec("true")


def test_staged_workers_that_die_are_replaced(sbx: NamespaceSandbox) -> None:
    launcher = client.get_launcher()
    sbx.exec("true")
    children = Path(f"/proc/{launcher.proc.pid}/task/{launcher.proc.pid}/children").read_text().split()
    assert len(children) >= launcher_module.IDLE_WORKERS  # (plus, maybe, the last run, still exiting)
    for pid in children:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:  # the last run's worker, gone between the listing and the kill
            pass
    results = [sbx.exec(f"echo {i}") for i in range(launcher_module.IDLE_WORKERS + 3)]
    # Calls that race the kill (a killed staged worker handed out) may fail, but only as sandbox
    # errors, and only until the launcher has restaged: from the first success on, every call works.
    first_ok = next(i for i, r in enumerate(results) if r.ok)
    assert first_ok <= launcher_module.IDLE_WORKERS
    assert all(r.status == SANDBOX_ERROR for r in results[:first_ok])
    assert [r.stdout for r in results[first_ok:]] == [f"{i}\n" for i in range(first_ok, len(results))]


def test_a_nul_byte_in_a_command_is_the_commands_failure_not_an_infrastructure_error(sbx) -> None:
    for result in (sbx.exec(["echo", "a\0b"]), sbx.exec("echo a\0b")):
        assert result.status == "exited" and result.exit_code == 126 and "NUL" in result.stderr
