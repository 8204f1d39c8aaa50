"""How a tokenizer lays out a conversation, read once from its own chat template.

Multi-turn rollouts must stay token-exact: each turn's sampled tokens are appended as they are, and
only the template's own text between turns is added, never a re-tokenization of the whole. So the
template is rendered on placeholder messages and cut at the placeholders: what lies between an
assistant turn's end and the next generation prompt, around one or several tool results, is the
observation layout. The same cut gives the token that ends an assistant turn (the stop token).

Three tool-call styles are known: Assay's own (`<tool_call>{compact json}</tool_call>` right after
the content, the layout of the tokenizers Assay trains), Hermes (Qwen2.5 / Qwen3:
`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, one per line after the content) and
Llama 3.x JSON (the whole turn is one `{"name": ..., "parameters": ...}` object). All parse with
`assay.agent.parse.parse_assistant(text, style)`."""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass
from typing import Any, Literal

from assay.core.errors import AssayError
from assay.core.types import ToolCall

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_USER, _ANSWER, _OUT1, _OUT2 = "\x01user\x01", "\x01answer\x01", "\x01out-one\x01", "\x01out-two\x01"

ToolCallStyle = Literal["assay", "hermes", "llama3"]


@dataclass(frozen=True)
class ChatFormat:
    turn_end: str  # the special token that ends an assistant turn
    first: str  # template text after an assistant turn's end, before the first tool result
    between: str  # between two tool results
    last: str  # after the last tool result, through the next assistant generation prompt
    tool_calls: ToolCallStyle
    specials: frozenset[str] = frozenset()  # the tokenizer's special and added tokens
    splitter: re.Pattern[str] | None = None  # matches any of them, the longest first

    def split(self, text: str) -> list[tuple[str, bool]]:
        """Template text cut at the tokenizer's special and added tokens: (piece, is_special_token)."""
        if self.splitter is None:
            return [(text, False)]
        return [(p, p in self.specials) for p in self.splitter.split(text) if p]

    def observation_text(self, outputs: list[str]) -> list[tuple[str, bool]]:
        """The observation after an assistant turn as (text, is_template) pieces."""
        pieces = [(self.first, True)]
        for i, out in enumerate(outputs):
            if i:
                pieces.append((self.between, True))
            pieces.append((out, False))
        return pieces + [(self.last, True)]

    def assistant_text(self, content: str, calls: list[ToolCall]) -> list[tuple[str, bool]]:
        """An assistant turn as (text, is_template) pieces: content, the calls in this style, turn end."""
        if self.tool_calls == "llama3" and calls:
            if len(calls) > 1 or content:
                raise AssayError("a Llama 3 tool-call turn is one JSON call and nothing else; split the turn")
            body = json.dumps({"name": calls[0].name, "parameters": calls[0].arguments}, ensure_ascii=False)
            return [(body, False), (self.turn_end, True)]
        pieces = [(content, False)]
        for i, c in enumerate(calls):
            if self.tool_calls == "assay":
                body = json.dumps({"name": c.name, "arguments": c.arguments}, separators=(",", ":"))
                pieces += [(TOOL_CALL_START, True), (body, False), (TOOL_CALL_END, True)]
            else:
                body = json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
                pieces += [("\n" if i or content else "", True), (TOOL_CALL_START, True), (f"\n{body}\n", False),
                           (TOOL_CALL_END, True)]
        return pieces + [(self.turn_end, True)]


_cache: weakref.WeakKeyDictionary[Any, ChatFormat] = weakref.WeakKeyDictionary()


def chat_format(tokenizer: Any) -> ChatFormat:
    """The tokenizer's layout, read from its chat template (cached per tokenizer)."""
    if tokenizer not in _cache:
        _cache[tokenizer] = _read(tokenizer)
    return _cache[tokenizer]


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _read(tokenizer: Any) -> ChatFormat:
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if not getattr(tokenizer, "chat_template", None):
        raise AssayError(f"tokenizer {name!r} has no chat template, so Assay cannot lay out turns and tool results; "
                         "use the chat (instruct) variant of the model, or add a chat_template to its "
                         "tokenizer_config.json")
    user = {"role": "user", "content": _USER}
    answer = {"role": "assistant", "content": _ANSWER}
    try:
        prompt = _render(tokenizer, [user], True)
        one = _render(tokenizer, [user, answer, {"role": "tool", "content": _OUT1}], True)
        two = _render(tokenizer, [user, answer, {"role": "tool", "content": _OUT1}, {"role": "tool", "content": _OUT2}],
                      True)
    except Exception as e:  # a template that rejects tool messages raises its own exception type
        raise AssayError(f"tokenizer {name!r}: its chat template cannot render a tool result ({e}); multi-turn tool "
                         "use needs a template with a tool role") from e
    if not one.startswith(prompt + _ANSWER):
        raise AssayError(f"tokenizer {name!r}: its chat template renders a past assistant turn differently from its "
                         "generation prompt, so sampled turns cannot be appended token for token; use a template "
                         "whose assistant turns start with the generation prompt")
    after = one[len(prompt) + len(_ANSWER):]
    # longest first, so the splitter's alternation prefers the longest match
    specials = sorted({*getattr(tokenizer, "all_special_tokens", []), *tokenizer.get_added_vocab()} - {""}, key=len,
                      reverse=True)
    turn_end = next((s for s in specials if after.startswith(s)), None)
    if turn_end is None:
        raise AssayError(f"tokenizer {name!r}: its chat template ends an assistant turn with {after[:20]!r}, not a "
                         "special token, so generation would have no turn end to stop at")
    first, _, last = after[len(turn_end):].partition(_OUT1)
    between = two[len(prompt) + len(_ANSWER) + len(turn_end) + len(first) + len(_OUT1):].partition(_OUT2)[0]
    if not two.endswith(_OUT2 + last):
        raise AssayError(f"tokenizer {name!r}: its chat template lays out two tool results in a way Assay cannot "
                         "append turn by turn")
    call = _render_call(tokenizer, user)
    style: ToolCallStyle = ("assay" if f"{TOOL_CALL_START}{{" in call else
                            "llama3" if '"parameters"' in call and TOOL_CALL_START not in call else "hermes")
    splitter = re.compile("(" + "|".join(re.escape(s) for s in specials) + ")") if specials else None
    return ChatFormat(turn_end, first, between, last, style, frozenset(specials), splitter)


def _render_call(tokenizer: Any, user: dict[str, Any]) -> str:
    """A turn with one tool call as the template renders it: tells the three styles apart."""
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    try:
        return _render(tokenizer, [user, call], False)
    except Exception:
        return ""

