import pytest

from assay.agent.parse import parse_assistant, split_reasoning
from assay.core.types import ToolCall, ToolSpec


def test_plain_answer():
    assert parse_assistant("Answer: 42") == ("Answer: 42", [], None)


def test_content_and_calls():
    text = 'Let me add.<tool_call>{"name":"calc","arguments":{"expression":"1+2"}}</tool_call>'
    assert parse_assistant(text) == ("Let me add.", [ToolCall("calc", {"expression": "1+2"})], None)
    two = '<tool_call>{"name":"a","arguments":{}}</tool_call>\n <tool_call>{"name": "b", "arguments": {"x": 1}}'
    two += "</tool_call>\n"
    assert parse_assistant(two) == ("", [ToolCall("a", {}), ToolCall("b", {"x": 1})], None)


@pytest.mark.parametrize(
    "text,error",
    [
        ('<tool_call>{"name":"calc","arguments":{"expression":"1+2"}</tool_call>', "tool call 1: invalid JSON"),
        ('<tool_call>{"name":"calc"}</tool_call>', "tool call 1: missing key 'arguments'"),
        ('<tool_call>{}</tool_call>', "missing key 'name' and 'arguments'"),
        ('<tool_call>{"name":"c","arguments":{},"id":1}</tool_call>', "unexpected key 'id'"),
        ('<tool_call>{"name":"c","arguments":"x=1"}</tool_call>', "'arguments' must be a JSON object"),
        ('<tool_call>{"name":"","arguments":{}}</tool_call>', "'name' must be a non-empty string"),
        ('<tool_call>[1, 2]</tool_call>', "expected a JSON object"),
        ('<tool_call>{"name":"c","arguments":{}}', "without a closing </tool_call>"),
        ('<tool_call>{"name":"c","arguments":{}}</tool_call> done', "text after tool call 1: 'done'"),
        ('<tool_call>{"name":"c","arguments":{}}</tool_call><tool_call>oops</tool_call>', "tool call 2: invalid JSON"),
        ('answer</tool_call>', "without an opening <tool_call>"),
        ('<tool_call>{"name":"c","arguments":{"n":' + "9" * 5000 + '}}</tool_call>', "more than 4300 digits"),
    ],
)
def test_malformed_calls_are_errors_and_keep_the_whole_text(text, error):
    content, calls, err = parse_assistant(text)
    assert err is not None and error in err
    assert (content, calls) == (text, [])


SPEC = ToolSpec("calc", "Add.", {"type": "object", "properties": {"expression": {"type": "string"}},
                                 "required": ["expression"], "additionalProperties": False})


THINK = ("<think>", "</think>")


@pytest.mark.parametrize(
    "text,split",
    [
        ("<think>\nadd them\n</think>\n\nAnswer: 8", ("add them", "Answer: 8")),
        ("<think>\n\n</think>\n\nAnswer: 8", ("", "Answer: 8")),  # the empty block: reasoning "", not None
        ("<think>\nAnswer: 9?\n</think>\n\nAnswer: 8", ("Answer: 9?", "Answer: 8")),  # the answer is after it
        ('<think>\n<tool_call>{"name":"a","arguments":{}}</tool_call>\n</think>\n\nhi',
         ('<tool_call>{"name":"a","arguments":{}}</tool_call>', "hi")),  # and so are the calls
        ("<think>\nstill thinking <tool_call>", ("still thinking <tool_call>", "")),  # unclosed: all reasoning
        ("Answer: 8", (None, "Answer: 8")),  # no block
        ("Answer: 8 <think>x</think>", (None, "Answer: 8 <think>x</think>")),  # a block only opens a turn
    ],
)
def test_reasoning_is_split_off_before_the_calls_are_parsed(text, split):
    assert split_reasoning(text, THINK) == split
    assert split_reasoning(text, None) == (None, text)  # a template without reasoning splits nothing


def test_repairs_of_common_malformations_and_nothing_else():
    from assay.agent.parse import parse_assistant_repaired, repair_json

    want = [ToolCall("calc", {"expression": "it's \"1+2\""})]
    bodies = [
        '{"name": "calc", "arguments": {"expression": "it\'s \\"1+2\\"",},}',  # trailing commas
        "{'name': 'calc', 'arguments': {'expression': 'it\\'s \"1+2\"'}}",  # single quotes
        '{name: "calc", arguments: {expression: "it\'s \\"1+2\\""}}',  # unquoted keys
        '```json\n{"name": "calc", "arguments": {"expression": "it\'s \\"1+2\\""}}\n```',  # a fenced block
        '{"name": "calc", "arguments": "{\\"expression\\": \\"it\'s \\\\\\"1+2\\\\\\"\\"}"}',  # arguments as a string
    ]
    for body in bodies:
        text = f"Let me add.<tool_call>{body}</tool_call>"
        assert parse_assistant(text)[2] is not None  # malformed as written
        assert parse_assistant_repaired(text) == ("Let me add.", want, None, [True])
    good = '<tool_call>{"name": "calc", "arguments": {"expression": "1"}}</tool_call>'
    assert parse_assistant_repaired(good)[3] == [False]  # a well-formed call is never "repaired"
    unterminated = '<tool_call>{"name": "calc", "arguments": {"expression": "1}}</tool_call>'
    assert parse_assistant_repaired(unterminated)[1:] == ([], parse_assistant(unterminated)[2], [])
    assert repair_json('{"a": "x, }"}') == '{"a": "x, }"}'  # commas and quotes inside strings are text
    assert repair_json('{"a": [true, null], b: "c: d"}') == '{"a": [true, null], "b": "c: d"}'  # keys only
