"""Isolated execution of model-written code and commands."""

from assay.sandbox.base import ExecResult, Limits, Sandbox
from assay.sandbox.process import ProcessSandbox


def open_sandbox(limits: Limits | None = None) -> Sandbox:
    """The sandbox environments use for model-written code."""
    return ProcessSandbox(limits)


__all__ = ["ExecResult", "Limits", "Sandbox", "ProcessSandbox", "open_sandbox"]
