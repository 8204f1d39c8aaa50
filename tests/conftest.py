"""Suite-wide set-up: one torch thread (tests use tiny models), and a clear word when this host
cannot isolate code. Then the sandbox tests skip themselves and the environments' graders run
the test suite's own, trusted programs (references and cheater strategies) without isolation.

Where ASSAY_REQUIRE_SANDBOX=1 (CI sets it: it runs as root, so it can isolate), a test skipped for
want of isolation fails instead: such a skip says NO_SANDBOX, wherever it comes from.

Likewise where CI is set (CI systems set it; .ci/run does), a test skipped because a tool CI installs
is missing (a C compiler for the kernels, Chromium for the page) fails instead: such a skip's reason
starts with MISSING_TOOL, so CI cannot skip in silence."""

import os
import sys
import warnings
from collections.abc import Mapping

import pytest
import torch

torch.set_num_threads(1)

REQUIRE = "ASSAY_REQUIRE_SANDBOX"
NO_SANDBOX = "the namespace sandbox cannot run on this host"


def sandbox_required(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(REQUIRE, "0").strip() not in ("", "0")


MISSING_TOOL = "missing tool"  # the start of a skip's reason that CI turns into a failure


def in_ci(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def pytest_configure(config):
    from assay.sandbox import allow_unsafe_sandbox, isolation_problem

    problem = isolation_problem()
    if problem is not None:
        then = "the tests that need it fail" if sandbox_required() else "sandbox tests skip"
        warnings.warn(f"no sandbox on this host ({problem}); {then}, graders run unisolated", stacklevel=1)
        allow_unsafe_sandbox()


@pytest.fixture(scope="session")
def isolated() -> None:
    """Skip a test that needs real isolation (sandbox tests, hostile programs) where there is none."""
    from assay.sandbox import isolation_problem

    problem = isolation_problem()
    if problem is not None:
        pytest.skip(f"{NO_SANDBOX}: {problem}")


def require_sandbox(report: pytest.TestReport, environ: Mapping[str, str]) -> None:
    """Turn a skip for want of isolation into a failure where the sandbox is required."""
    if report.skipped and isinstance(report.longrepr, tuple) and NO_SANDBOX in report.longrepr[2] \
            and sandbox_required(environ):
        report.outcome = "failed"
        report.longrepr = f"{REQUIRE}=1, but {report.longrepr[2].removeprefix('Skipped: ')}"


def require_tools(report: pytest.TestReport, environ: Mapping[str, str]) -> None:
    """Turn a skip for a missing tool into a failure where CI is set."""
    if report.skipped and isinstance(report.longrepr, tuple) and in_ci(environ) \
            and report.longrepr[2].removeprefix("Skipped: ").startswith(MISSING_TOOL):
        report.outcome = "failed"
        report.longrepr = f"CI is set, but a test skipped: {report.longrepr[2].removeprefix('Skipped: ')}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    require_sandbox(report, os.environ)
    require_tools(report, os.environ)
    return report


@pytest.fixture(autouse=True)
def assay_home(tmp_path_factory, monkeypatch):
    """Each test its own Assay home (the QA store, evaluation records), in its environment so that the
    commands it runs inherit it: no test reads or writes the user's ~/.assay, nor another test's records."""
    home = tmp_path_factory.mktemp("assay-home")
    monkeypatch.setenv("ASSAY_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct, as the `real` extra ships it, imported once into a Hugging Face directory.
    The extra is part of `make test`: without it these tests fail, never skip."""
    from assay.core.gguf_import import import_gguf

    return import_gguf("smollm2", tmp_path_factory.mktemp("smollm2") / "model")


_THIS = sys.modules[__name__]  # taken now: other folders' conftest.py later take the same import name


@pytest.fixture(scope="session")
def root_conftest():
    """This module, for the tests of its own hooks."""
    return _THIS


def skipped_report(reason: str) -> pytest.TestReport:
    """A test's report as pytest makes it for `pytest.skip(reason)` in setup."""
    return pytest.TestReport("t.py::t", ("t.py", 1, "t"), {}, "skipped", ("t.py", 1, f"Skipped: {reason}"), "setup")
