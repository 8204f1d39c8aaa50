"""Tool calls: parse the model's JSON, validate it against the tool's JSON schema.

A call the model got wrong is an observation for the model (a short message it can act on),
never an exception: `validate_call` returns the message, or None when the call is valid."""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from assay.core.types import ToolCall, ToolSpec

# The name `parse_call` gives a call it could not parse; `validate_call` reports why.
INVALID_CALL = "<invalid>"


def parse_call(text: str) -> ToolCall:
    """Parse `{"name": ..., "arguments": {...}}`; never raises. An unparsable call comes back named
    INVALID_CALL with the reason in its arguments, so the episode can answer it with an error observation."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return _invalid(text, f"not valid JSON ({e.msg} at char {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return _invalid(text, 'expected {"name": "<tool>", "arguments": {...}}')
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return _invalid(text, "arguments must be a JSON object")
    extra = sorted(set(obj) - {"name", "arguments", "id"})
    if extra:
        return _invalid(text, f"unexpected keys {extra}; a call has only name and arguments")
    return ToolCall(name=obj["name"], arguments=args, id=str(obj.get("id", "")))


def _invalid(text: str, reason: str) -> ToolCall:
    return ToolCall(name=INVALID_CALL, arguments={"raw": text[:200], "error": reason})


@lru_cache(maxsize=256)
def _validator(schema_json: str) -> Draft202012Validator:
    schema = json.loads(schema_json)
    Draft202012Validator.check_schema(schema)  # a broken tool schema is the environment's bug: raise
    return Draft202012Validator(schema)


def validate_call(call: ToolCall, tools: Sequence[ToolSpec]) -> str | None:
    """None if `call` names a known tool and its arguments satisfy that tool's schema, else a short reason."""
    if call.name == INVALID_CALL:
        return f"unparsable tool call: {call.arguments.get('error', 'bad JSON')}"
    spec = next((t for t in tools if t.name == call.name), None)
    if spec is None:
        known = ", ".join(t.name for t in tools) or "none (answer directly)"
        return f"unknown tool {call.name!r}; known tools: {known}"
    if not isinstance(call.arguments, dict):
        return f"{call.name}: arguments must be a JSON object, got {type(call.arguments).__name__}"
    validator = _validator(json.dumps(spec.parameters, sort_keys=True))
    error = best_match(validator.iter_errors(call.arguments))
    if error is None:
        return None
    path = "/".join(str(p) for p in error.absolute_path) or "arguments"
    return f"{call.name}: invalid {path}: {error.message}"


def object_schema(properties: dict[str, Any]) -> dict[str, Any]:
    """A strict object schema: every property required, nothing else allowed."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}
