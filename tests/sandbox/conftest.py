"""Sandbox tests need a host that can isolate (namespaces, overlayfs, root). Elsewhere they skip, with the
reason, rather than fail."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator

import pytest

from assay.sandbox import ExecResult, Limits, NamespaceSandbox


@pytest.fixture
def sbx(isolated: None) -> Iterator[NamespaceSandbox]:
    with NamespaceSandbox(Limits(timeout_s=5)) as s:
        yield s


def _py(sandbox: NamespaceSandbox, code: str, timeout: float | None = None) -> ExecResult:
    return sandbox.run_python(textwrap.dedent(code), timeout=timeout)


@pytest.fixture
def py() -> object:
    """py(sandbox, code): run a dedented Python snippet in the sandbox."""
    return _py
