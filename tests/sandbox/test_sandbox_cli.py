"""`assay sandbox run` and `assay bench sandbox`, through the plain functions the CLI calls."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from assay.bench.sandbox import Timing, measure, run_sandbox_bench
from assay.sandbox import Limits
from assay.sandbox.base import EXITED, OOM, SANDBOX_ERROR, TIMEOUT, ExecResult
from assay.sandbox.cli_support import exit_code, run_command


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
