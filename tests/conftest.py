"""Suite-wide set-up: one torch thread (tests use tiny models), and a clear word when this host
cannot isolate code. Then the sandbox tests skip themselves and the environments' graders run
the test suite's own, trusted programs (references and cheater strategies) without isolation."""

import warnings

import pytest
import torch

torch.set_num_threads(1)


def pytest_configure(config):
    from assay.sandbox import allow_unsafe_sandbox, isolation_problem

    problem = isolation_problem()
    if problem is not None:
        warnings.warn(f"no sandbox on this host ({problem}); sandbox tests skip, graders run unisolated", stacklevel=1)
        allow_unsafe_sandbox()


@pytest.fixture(scope="session")
def isolated() -> None:
    """Skip a test that needs real isolation (sandbox tests, hostile programs) where there is none."""
    from assay.sandbox import isolation_problem

    problem = isolation_problem()
    if problem is not None:
        pytest.skip(f"the namespace sandbox cannot run on this host: {problem}")
