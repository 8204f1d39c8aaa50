"""Split an assistant turn's text into its reasoning, its content and its `<tool_call>{json}</tool_call>` calls."""

from __future__ import annotations

import json
import sys
from typing import Any

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
    content, calls, err, _ = parse_repairing(text, style, repair=False)
    return content, calls, err


def parse_assistant_repaired(text: str, style: str = "assay") -> tuple[str, list[ToolCall], str | None, list[bool]]:
    """`parse_assistant`, and where a call does not parse, its body repaired (`repair_json`) and parsed
    again: (content, calls, error, which calls needed a repair). A repair changes what is acted on, never
    the sampled tokens; the error is the unrepaired text's when the repair does not help either."""
    return parse_repairing(text, style, repair=True)


def parse_repairing(text: str, style: str, repair: bool) -> tuple[str, list[ToolCall], str | None, list[bool]]:
    if style == "llama3":
        content, calls, err = _parse_llama3(text)
        if err is not None and repair:
            fixed = _parse_llama3(repair_json(_unfence(text.strip())))
            if fixed[2] is None and fixed[1]:
                return fixed[0], fixed[1], None, [True]
        return content, calls, err, [False] * len(calls)
    start = text.find(TOOL_CALL_START)
    if start < 0:
        if TOOL_CALL_END in text:
            return text, [], f"found {TOOL_CALL_END} without an opening {TOOL_CALL_START}", []
        return text, [], None, []
    calls: list[ToolCall] = []
    repaired: list[bool] = []
    i = start
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return text[:start], calls, None, repaired
        n = len(calls) + 1
        if not text.startswith(TOOL_CALL_START, i):
            return text, [], f"text after tool call {n - 1}: {text[i : i + 30]!r}; write text before the calls", []
        end = text.find(TOOL_CALL_END, i)
        if end < 0:
            return text, [], f"tool call {n}: {TOOL_CALL_START} without a closing {TOOL_CALL_END}", []
        body = text[i + len(TOOL_CALL_START) : end]
        call, err = _parse_call(body)
        fixed = False
        if err is not None and repair:
            call, again = _parse_call(repair_json(_unfence(body)), args_as_text=True)
            fixed = again is None
        if not fixed and err is not None:
            return text, [], f"tool call {n}: {err}", []
        assert call is not None
        calls.append(call)
        repaired.append(fixed)
        i = end + len(TOOL_CALL_END)


def _loads(text: str) -> tuple[Any, str | None]:
    """JSON a model wrote, or the reason it is none; never raises on what a policy can write."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"invalid JSON ({e.msg} at char {e.pos})"
    except ValueError:  # an integer literal past Python's int-from-string limit (4300 digits)
        return None, f"invalid JSON (an integer of more than {sys.get_int_max_str_digits()} digits)"


def _parse_call(body: str, args_as_text: bool = False) -> tuple[ToolCall, None] | tuple[None, str]:
    """`args_as_text` (a repair): "arguments" given as a string holding a JSON object is that object."""
    obj, err = _loads(body)
    if err is not None:
        return None, err
    if args_as_text and isinstance(obj, dict) and isinstance(obj.get("arguments"), str):
        args, err = _loads(obj["arguments"])
        if err is None:  # otherwise left as it is: the check below reports it
            obj["arguments"] = args
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
    obj, err = _loads(body)
    if err is not None:
        return text, [], f"tool call: {err}"
    if not isinstance(obj, dict) or set(obj) != {"name", "parameters"}:
        return text, [], 'tool call: expected exactly {"name": ..., "parameters": {...}}'
    if not isinstance(obj["name"], str) or not obj["name"] or not isinstance(obj["parameters"], dict):
        return text, [], "tool call: 'name' must be a non-empty string and 'parameters' a JSON object"
    return "", [ToolCall(obj["name"], obj["parameters"])], None


def _unfence(body: str) -> str:
    """A call's JSON wrapped in a markdown code fence (```json ... ```), unwrapped."""
    b = body.strip()
    if b.startswith("```") and b.endswith("```") and len(b) >= 6:
        b = b[3:-3]
        newline = b.find("\n")
        if newline >= 0 and b[:newline].strip().isalnum():  # a language tag such as json
            b = b[newline + 1 :]
    return b.strip()


def repair_json(text: str) -> str:
    """The common near-JSON of a sampled call made JSON, deterministically: single-quoted strings become
    double-quoted, a comma before a closing bracket is dropped, a bare identifier in a key's place (after `{`
    or `,`, before `:`) is quoted. Text inside double-quoted strings is kept; anything else is left for the
    JSON parser to reject."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isalpha() or c == "_":  # outside strings: a bare word; quoted where it stands as a key
            j = i + 1
            while j < n and (text[j].isalnum() or text[j] == "_"):
                j += 1
            k = j
            while k < n and text[k].isspace():
                k += 1
            word = text[i:j]
            out.append(f'"{word}"' if _last_char(out) in ("{", ",") and k < n and text[k] == ":" else word)
            i = j
            continue
        if c == '"' or c == "'":  # a string: copied (re-quoted when single-quoted) up to its closing quote
            j, chars = i + 1, []
            while j < n and text[j] != c:
                if text[j] == "\\" and j + 1 < n:
                    chars.append(text[j : j + 2] if text[j + 1] != "'" else "'")
                    j += 2
                    continue
                chars.append('\\"' if text[j] == '"' else text[j])
                j += 1
            if j >= n:  # an unterminated string is not guessed at
                return text
            out.append('"' + "".join(chars) + '"')
            i = j + 1
            continue
        if c == ",":
            k = i + 1
            while k < n and text[k].isspace():
                k += 1
            if k < n and text[k] in "}]":
                i += 1
                continue
        out.append(c)
        i += 1
    return "".join(out)


def _last_char(pieces: list[str]) -> str:
    """The last character of the pieces joined, whitespace aside ("" if none)."""
    for piece in reversed(pieces):
        if stripped := piece.rstrip():
            return stripped[-1]
    return ""
