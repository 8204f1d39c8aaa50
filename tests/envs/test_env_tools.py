from __future__ import annotations

import pytest
from jsonschema.exceptions import SchemaError

from assay.core.types import ToolCall, ToolSpec
from assay.envs.tools import INVALID_CALL, object_schema, parse_call, validate_call

CALC = ToolSpec("calc", "Evaluate an expression.", object_schema({"expression": {"type": "string"}}))
MOVE = ToolSpec("move", "Move.", object_schema({"dx": {"type": "integer", "minimum": -3, "maximum": 3},
                                                "dy": {"type": "integer"}}))
TOOLS = [CALC, MOVE]


def test_object_schema_is_strict():
    assert object_schema({"a": {"type": "string"}}) == {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": False}


def test_valid_calls():
    assert validate_call(ToolCall("calc", {"expression": "3+4"}), TOOLS) is None
    assert validate_call(ToolCall("move", {"dx": -3, "dy": 10}), TOOLS) is None


@pytest.mark.parametrize("call, message", [
    (ToolCall("search", {}), "unknown tool 'search'; known tools: calc, move"),
    (ToolCall("calc", {}), "calc: invalid arguments: 'expression' is a required property"),
    (ToolCall("calc", {"expression": 3}), "calc: invalid expression: 3 is not of type 'string'"),
    (ToolCall("calc", {"expression": "1", "x": 1}),
     "calc: invalid arguments: Additional properties are not allowed ('x' was unexpected)"),
    (ToolCall("move", {"dx": 4, "dy": 0}), "move: invalid dx: 4 is greater than the maximum of 3"),
    (ToolCall("move", {"dx": 1.5, "dy": 0}), "move: invalid dx: 1.5 is not of type 'integer'"),
    (ToolCall("calc", ["3+4"]), "calc: arguments must be a JSON object, got list"),  # type: ignore[arg-type]
])
def test_invalid_calls_name_path_and_reason(call, message):
    assert validate_call(call, TOOLS) == message


def test_no_tools_at_all():
    assert validate_call(ToolCall("calc", {}), []) == "unknown tool 'calc'; known tools: none (answer directly)"


def test_parse_call():
    assert parse_call('{"name":"calc","arguments":{"expression":"3+4"}}') == ToolCall("calc", {"expression": "3+4"})
    for text, reason in [('{"name":"calc"', "not valid JSON"), ("[1]", 'expected {"name"'),
                         ('{"name":"calc","arguments":"3+4"}', "arguments must be a JSON object"),
                         ('{"name":"calc","arguments":{},"extra":1}', "unexpected keys ['extra']")]:
        call = parse_call(text)
        assert call.name == INVALID_CALL and reason in call.arguments["error"]
        assert validate_call(call, TOOLS).startswith("unparsable tool call: ")


def test_a_broken_tool_schema_is_the_environments_bug():
    broken = ToolSpec("bad", "", {"type": "no-such-type"})
    with pytest.raises(SchemaError):
        validate_call(ToolCall("bad", {}), [broken])
