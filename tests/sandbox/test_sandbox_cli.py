"""`assay sandbox` (what enforces each limit), `assay sandbox run` and `assay bench sandbox`, through the plain
functions the CLI calls."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from assay.bench.sandbox import Timing, measure, run_sandbox_bench
from assay.sandbox import Limits
from assay.sandbox.base import EXITED, OOM, SANDBOX_ERROR, TIMEOUT, ExecResult
from assay.sandbox.cli_support import enforcement, exit_code, run_command, sandbox_report


def test_exit_codes_follow_shell_conventions() -> None:
    def code(status: str, exit_code_: int) -> int:
        return exit_code(ExecResult("", "", exit_code_, 0.0, status))

    assert [code(EXITED, 0), code(EXITED, 3), code(TIMEOUT, -9), code(SANDBOX_ERROR, -1), code(OOM, -9)] == \
        [0, 3, 124, 125, 137]


def test_run_command(isolated: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "hello.txt").write_text("from the template\n")
    assert run_command(["sh", "-c", "cat hello.txt; echo oops >&2; exit 4"], str(tmp_path), Limits(), False) == 4
    out = capsys.readouterr()
    assert out.out == "from the template\n" and out.err == "oops\n"
    assert run_command(["sleep", "5"], None, Limits(timeout_s=0.3), False) == 124
    assert "[sandbox] status: timeout" in capsys.readouterr().err


def test_measure_percentiles() -> None:
    t = measure(lambda: None, seconds=0.0, max_n=10)
    assert isinstance(t, Timing) and t.n == 5 and 0 <= t.p50_ms <= t.p99_ms


def test_bench_prints_every_row(isolated: None) -> None:
    text = run_sandbox_bench(seconds=0.05, concurrency=(1, 2))
    for row in ("create + exec true + destroy", "exec true", "exec python -c pass", "snapshot", "restore",
                "throughput, 1 concurrent", "throughput, 2 concurrent"):
        assert row in text
    assert len(re.findall(r"\d+\.\d\dx", text)) == 7  # a ratio on every row


LIMITS = ["memory", "processes", "CPU time", "wall time", "file size", "disk", "open files", "output", "network",
          "filesystem", "system calls", "privileges"]


@pytest.mark.parametrize(("cgroups", "memory", "processes"), [
    ("v1", "cgroup v1", "cgroup v1"), ("v2", "cgroup v2", "cgroup v2"),
    ("none", "rlimit per process", "rlimit per process"), (None, "rlimit per process", "none")])
def test_each_limit_names_what_enforces_it(cgroups: str | None, memory: str, processes: str) -> None:
    rows = dict(enforcement(cgroups))
    assert list(rows) == LIMITS
    assert rows["memory"].startswith(memory) and rows["processes"].startswith(processes)
    assert rows["CPU time"].startswith("rlimit per process")
    isolated = cgroups is not None
    assert rows["network"].startswith("namespace" if isolated else "none")
    assert rows["system calls"] == ("seccomp" if isolated else "none")


def test_assay_sandbox_reports_this_hosts_mechanisms(isolated: None) -> None:
    from typer.testing import CliRunner

    from assay.cli import app
    from assay.sandbox.client import get_launcher

    result = CliRunner().invoke(app, ["sandbox"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "namespace sandbox"
    expected = {"v1": "cgroup v1", "v2": "cgroup v2", "none": "rlimit per process"}[get_launcher().cgroups]
    rows = dict(enforcement(get_launcher().cgroups))
    assert [line.split(None, 1) for line in lines[1:3]] == [["memory", rows["memory"]],
                                                          ["processes", rows["processes"]]]
    assert rows["memory"].startswith(expected) and rows["processes"].startswith(expected)


def test_assay_sandbox_says_why_it_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    import assay.sandbox as sandbox_pkg
    from assay.sandbox.client import NO_CGROUP

    monkeypatch.setitem(sandbox_pkg._state, "problem", NO_CGROUP)  # as isolation_problem() finds on such a host
    monkeypatch.setitem(sandbox_pkg._state, "unsafe", False)
    text, ok = sandbox_report()
    assert not ok and text.startswith("no sandbox: cannot isolate") and "--per-process-limits" in text
    monkeypatch.setitem(sandbox_pkg._state, "unsafe", True)
    monkeypatch.setitem(sandbox_pkg._state, "warned", True)
    text, ok = sandbox_report()
    assert ok and text.splitlines()[0].startswith("NO isolation")
    assert ["processes", "none"] in [line.split(None, 1) for line in text.splitlines()]
