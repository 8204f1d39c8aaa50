"""Split an assistant turn's text into its reasoning, its content and its `<tool_call>{json}</tool_call>` calls."""

from __future__ import annotations

import json

from assay.core.tokenizer import TOOL_CALL_END, TOOL_CALL_START
from assay.core.types import ToolCall


def split_reasoning(text: str, tags: tuple[str, str] | None) -> tuple[str | None, str]:
    """(reasoning, rest) of a sampled turn. A turn that opens with the template's reasoning tag (`<think>`) is
    reasoning up to the closing tag (`</think>`) and content after it, so a call or an answer inside the
    reasoning is not one; without a closing tag (the turn ran out of tokens) it is all reasoning. The newlines
    around the tags are the template's, not the text's (as Qwen3's template reads a turn). Reasoning is None
    when the turn has no reasoning block or the template renders none (`tags` None)."""
    if tags is None or not text.startswith(tags[0]):
        return None, text
    reasoning, closed, rest = text[len(tags[0]) :].partition(tags[1])
    return reasoning.strip("\n"), rest.lstrip("\n") if closed else ""


def parse_assistant(text: str, style: str = "assay") -> tuple[str, list[ToolCall], str | None]:
    """(content, calls, error). Content is the text before the first call; calls follow it back to back
    (whitespace between them is allowed, other text is not). On any error the calls are dropped and
    content is the whole text, so the recorded message still renders to exactly what was sampled.
    In the `llama3` style a turn that is one JSON object with "name" and "parameters" is a call;
    any other turn is an answer."""
    if style == "llama3":
        return _parse_llama3(text)
    start = text.find(TOOL_CALL_START)
    if start < 0:
        if TOOL_CALL_END in text:
            return text, [], f"found {TOOL_CALL_END} without an opening {TOOL_CALL_START}"
        return text, [], None
    calls: list[ToolCall] = []
    i = start
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return text[:start], calls, None
        n = len(calls) + 1
        if not text.startswith(TOOL_CALL_START, i):
            return text, [], f"text after tool call {n - 1}: {text[i : i + 30]!r}; write text before the calls"
        end = text.find(TOOL_CALL_END, i)
        if end < 0:
            return text, [], f"tool call {n}: {TOOL_CALL_START} without a closing {TOOL_CALL_END}"
        call, err = _parse_call(text[i + len(TOOL_CALL_START) : end])
        if err is not None:
            return text, [], f"tool call {n}: {err}"
        calls.append(call)
        i = end + len(TOOL_CALL_END)


def _parse_call(body: str) -> tuple[ToolCall, None] | tuple[None, str]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"invalid JSON ({e.msg} at char {e.pos})"
    if not isinstance(obj, dict):
        return None, 'expected a JSON object {"name": ..., "arguments": {...}}'
    missing = [k for k in ("name", "arguments") if k not in obj]
    if missing:
        return None, f"missing key {' and '.join(repr(k) for k in missing)}"
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        return None, f"unexpected key {', '.join(repr(k) for k in extra)}; only 'name' and 'arguments'"
    if not isinstance(obj["name"], str) or not obj["name"]:
        return None, "'name' must be a non-empty string"
    if not isinstance(obj["arguments"], dict):
        return None, "'arguments' must be a JSON object"
    return ToolCall(obj["name"], obj["arguments"]), None


def _parse_llama3(text: str) -> tuple[str, list[ToolCall], str | None]:
    body = text.strip()
    if not (body.startswith("{") and '"name"' in body):
        return text, [], None
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return text, [], f"tool call: invalid JSON ({e.msg} at char {e.pos})"
    if not isinstance(obj, dict) or set(obj) != {"name", "parameters"}:
        return text, [], 'tool call: expected exactly {"name": ..., "parameters": {...}}'
    if not isinstance(obj["name"], str) or not obj["name"] or not isinstance(obj["parameters"], dict):
        return text, [], "tool call: 'name' must be a non-empty string and 'parameters' a JSON object"
    return "", [ToolCall(obj["name"], obj["parameters"])], None
