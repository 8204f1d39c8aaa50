"""Check a parsed tool call against the task's tool schemas before an environment sees it."""

from __future__ import annotations

from collections.abc import Sequence

from jsonschema import validators

from assay.core.types import ToolCall, ToolSpec


def validate_call(call: ToolCall, tools: Sequence[ToolSpec]) -> str | None:
    """None if the call names a tool of the task and its arguments fit the tool's JSON schema, else why not."""
    spec = next((t for t in tools if t.name == call.name), None)
    if spec is None:
        known = ", ".join(t.name for t in tools) or "none"
        return f"unknown tool {call.name!r} (tools: {known})"
    if not spec.parameters:
        return None
    validator = validators.validator_for(spec.parameters)(spec.parameters)
    err = next(iter(sorted(validator.iter_errors(call.arguments), key=lambda e: list(e.path))), None)
    if err is None:
        return None
    where = "/".join(str(p) for p in err.path)
    return f"{call.name}: invalid arguments{' at ' + where if where else ''}: {err.message}"
