"""CI cannot skip in silence: where CI is set, a test skipped for a missing tool fails (tests/conftest.py)."""

from pathlib import Path

import pytest


@pytest.mark.parametrize("value,fails", [(None, False), ("", False), ("0", False), ("false", False), ("true", True),
                                         ("1", True)])
def test_a_skip_for_a_missing_tool_fails_where_ci_is_set(root_conftest, value: str | None, fails: bool) -> None:
    environ = {} if value is None else {"CI": value}

    def skipped(reason: str) -> pytest.TestReport:
        report = root_conftest.skipped_report(reason)
        root_conftest.require_tools(report, environ)
        return report

    for reason in ("missing tool: the C kernels did not build (a C compiler with OpenMP)",
                   "missing tool: Debian's chromium is not installed (.ci/run installs it)"):
        report = skipped(reason)
        assert report.failed is fails and report.skipped is not fails
        if fails:
            assert str(report.longrepr) == f"CI is set, but a test skipped: {reason}"
    assert skipped("this torch has no oneDNN").skipped  # a skip for what CI need not have stays a skip


def test_the_skips_for_tools_ci_installs_say_so() -> None:
    """The kernels' and the page's skips carry the phrase the CI hook looks for."""
    tests = Path(__file__).parent
    for name in ("rollout/test_cpu_kernel.py", "rollout/test_sampler.py", "rollout/test_engine.py",
                 "eval/test_eval_html.py"):
        assert 'reason="missing tool: ' in (tests / name).read_text() or \
            'pytest.skip("missing tool: ' in (tests / name).read_text(), name
