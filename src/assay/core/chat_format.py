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
`assay.agent.parse.parse_assistant(text, style)`.

Reasoning (Qwen3's `<think>...</think>`): a template that renders an assistant message's `reasoning_content`
gives the text around it (`<think>\\n`, `\\n</think>\\n\\n`). A sampled turn that opens with it is split by
`assay.agent.parse.split_reasoning`, and reasoning is rendered back in the same place.

A template that ignores `tools=` (SmolLM2's renders no tool schema) would leave the model blind to the tools it
is asked to use: Assay then adds its own declared block (`tools_block`), the schemas and the call syntax of the
template's style, to the system message (`with_tools_block`). `ChatFormat.renders_tools` says which case holds.

Template keyword arguments (`model.chat_template_kwargs`, e.g. Qwen3's `enable_thinking: false`) are bound to
the tokenizer (`set_template_kwargs`), so the prompt, this layout and SFT are all rendered with the same ones."""

from __future__ import annotations

import inspect
import json
import re
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from assay.core.errors import AssayError
from assay.core.types import Message, ToolCall, ToolSpec

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_USER, _ANSWER, _OUT1, _OUT2 = "\x01user\x01", "\x01answer\x01", "\x01out-one\x01", "\x01out-two\x01"
_REASON = "\x01reasoning\x01"
_PROBE_TOOL = "assay_probe_tool"  # a tool name no template prints unless it renders the tools it is given
_KWARGS_ATTR = "assay_chat_template_kwargs"  # an attribute: it travels with the tokenizer to worker processes

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
    # template text before and after an assistant turn's reasoning, e.g. ("<think>\n", "\n</think>\n\n");
    # None: the template renders no reasoning
    think: tuple[str, str] | None = None
    renders_tools: bool = True  # the template prints the schemas passed as `tools=`; False: Assay adds its block

    @property
    def think_tags(self) -> tuple[str, str] | None:
        """The tags that open and close the reasoning of a sampled turn, e.g. ("<think>", "</think>")."""
        return None if self.think is None else (self.think[0].strip(), self.think[1].strip())

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

    def assistant_text(self, content: str, calls: list[ToolCall], reasoning: str | None = None
                       ) -> list[tuple[str, bool]]:
        """An assistant turn as (text, is_template) pieces: reasoning in its block (when not None), content,
        the calls in this style, turn end."""
        pieces: list[tuple[str, bool]] = []
        if reasoning is not None:
            if self.think is None:
                raise AssayError("an assistant message has reasoning, but the tokenizer's chat template renders "
                                 "none; drop the reasoning or use the model's thinking chat template")
            pieces = [(self.think[0], True), (reasoning, False), (self.think[1], True)]
        if self.tool_calls == "llama3" and calls:
            if len(calls) > 1 or content:
                raise AssayError("a Llama 3 tool-call turn is one JSON call and nothing else; split the turn")
            body = json.dumps({"name": calls[0].name, "parameters": calls[0].arguments}, ensure_ascii=False)
            return pieces + [(body, False), (self.turn_end, True)]
        pieces.append((content, False))
        for i, c in enumerate(calls):
            if self.tool_calls == "assay":
                body = json.dumps({"name": c.name, "arguments": c.arguments}, separators=(",", ":"))
                pieces += [(TOOL_CALL_START, True), (body, False), (TOOL_CALL_END, True)]
            else:
                body = json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
                pieces += [("\n" if i or content else "", True), (TOOL_CALL_START, True), (f"\n{body}\n", False),
                           (TOOL_CALL_END, True)]
        return pieces + [(self.turn_end, True)]


_cache: weakref.WeakKeyDictionary[Any, dict[str, ChatFormat]] = weakref.WeakKeyDictionary()


def set_template_kwargs(tokenizer: Any, kwargs: Mapping[str, Any]) -> None:
    """Render the tokenizer's chat template with these keyword arguments from now on (`model.chat_template_kwargs`).
    They are bound to the tokenizer rather than passed along, so no caller can render with other ones."""
    taken = sorted(set(kwargs) & set(inspect.signature(tokenizer.apply_chat_template).parameters))
    if taken:
        raise AssayError(f"model.chat_template_kwargs: {', '.join(taken)} is set by Assay itself, not a template "
                         "variable; remove it")
    setattr(tokenizer, _KWARGS_ATTR, dict(kwargs))


def template_kwargs(tokenizer: Any) -> dict[str, Any]:
    """The keyword arguments the tokenizer's chat template is rendered with (none unless set)."""
    return dict(getattr(tokenizer, _KWARGS_ATTR, None) or {})


def chat_format(tokenizer: Any) -> ChatFormat:
    """The tokenizer's layout, read from its chat template (cached per tokenizer and template kwargs)."""
    kwargs = template_kwargs(tokenizer)
    formats = _cache.setdefault(tokenizer, {})
    key = json.dumps(kwargs, sort_keys=True, default=repr)
    if key not in formats:
        formats[key] = _read(tokenizer, kwargs)
    return formats[key]


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool, kwargs: dict[str, Any]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs)


def _read(tokenizer: Any, kwargs: dict[str, Any]) -> ChatFormat:
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if not getattr(tokenizer, "chat_template", None):
        raise AssayError(f"tokenizer {name!r} has no chat template, so Assay cannot lay out turns and tool results; "
                         "use the chat (instruct) variant of the model, or add a chat_template to its "
                         "tokenizer_config.json")
    user = {"role": "user", "content": _USER}
    answer = {"role": "assistant", "content": _ANSWER}
    try:
        prompt = _render(tokenizer, [user], True, kwargs)
        one = _render(tokenizer, [user, answer, {"role": "tool", "content": _OUT1}], True, kwargs)
        two = _render(tokenizer, [user, answer, {"role": "tool", "content": _OUT1}, {"role": "tool", "content": _OUT2}],
                      True, kwargs)
    except Exception as e:  # a template that rejects tool messages raises its own exception type
        raise AssayError(f"tokenizer {name!r}: its chat template cannot render a tool result ({e}); multi-turn tool "
                         "use needs a template with a tool role") from e
    head = one.partition(_ANSWER)[0]  # the conversation up to a past assistant turn's text
    think = _read_think(tokenizer, user, head, kwargs)
    # A generation prompt may add an empty reasoning block that a past turn lacks (Qwen3 with enable_thinking
    # false): the policy samples after it, so it stays in the episode's tokens.
    added = prompt[len(head):] if prompt.startswith(head) else None
    empty_think = think[0] + think[1] if think else ""
    if _ANSWER not in one or added not in ("", empty_think):
        raise AssayError(f"tokenizer {name!r}: its chat template renders a past assistant turn differently from its "
                         "generation prompt, so sampled turns cannot be appended token for token; use a template "
                         "whose assistant turns start with the generation prompt")
    after = one[len(head) + len(_ANSWER):]
    # longest first, so the splitter's alternation prefers the longest match
    specials = sorted({*getattr(tokenizer, "all_special_tokens", []), *tokenizer.get_added_vocab()} - {""}, key=len,
                      reverse=True)
    turn_end = next((s for s in specials if after.startswith(s)), None)
    if turn_end is None:
        raise AssayError(f"tokenizer {name!r}: its chat template ends an assistant turn with {after[:20]!r}, not a "
                         "special token, so generation would have no turn end to stop at")
    first, _, last = after[len(turn_end):].partition(_OUT1)
    between = two[len(head) + len(_ANSWER) + len(turn_end) + len(first) + len(_OUT1):].partition(_OUT2)[0]
    if not two.endswith(_OUT2 + last):
        raise AssayError(f"tokenizer {name!r}: its chat template lays out two tool results in a way Assay cannot "
                         "append turn by turn")
    call = _render_call(tokenizer, user, kwargs)
    style: ToolCallStyle = ("assay" if f"{TOOL_CALL_START}{{" in call else
                            "llama3" if '"parameters"' in call and TOOL_CALL_START not in call else "hermes")
    splitter = re.compile("(" + "|".join(re.escape(s) for s in specials) + ")") if specials else None
    return ChatFormat(turn_end, first, between, last, style, frozenset(specials), splitter, think,
                      _renders_tools(tokenizer, user, kwargs))


def _renders_tools(tokenizer: Any, user: dict[str, Any], kwargs: dict[str, Any]) -> bool:
    probe = {"type": "function", "function": {"name": _PROBE_TOOL, "description": "",
                                              "parameters": {"type": "object", "properties": {}}}}
    try:
        return _PROBE_TOOL in tokenizer.apply_chat_template([user], tools=[probe], tokenize=False,
                                                            add_generation_prompt=True, **kwargs)
    except Exception:  # a template that rejects tools renders none
        return False


CALL_EXAMPLE: dict[ToolCallStyle, str] = {
    "assay": f'{TOOL_CALL_START}{{"name":"TOOL_NAME","arguments":{{"ARGUMENT":"VALUE"}}}}{TOOL_CALL_END}',
    "hermes": f'{TOOL_CALL_START}\n{{"name": "TOOL_NAME", "arguments": {{"ARGUMENT": "VALUE"}}}}\n{TOOL_CALL_END}',
    "llama3": '{"name": "TOOL_NAME", "parameters": {"ARGUMENT": "VALUE"}}',
}
_CALL_RULE: dict[ToolCallStyle, str] = {
    "assay": "after any text, one block per call",
    "hermes": "after any text, one block per call",
    "llama3": "as the whole reply, nothing else",
}


def tools_block(tools: list[ToolSpec], style: ToolCallStyle) -> str:
    """Assay's declaration of the tools, for a template that renders none: each schema as one JSON line, then the
    call syntax that `assay.agent.parse.parse_assistant` reads in this style."""
    schemas = "\n".join(json.dumps(t.to_json(), ensure_ascii=False) for t in tools)
    return (f"You can call these tools (one JSON schema a line):\n{schemas}\n\n"
            f"To call a tool, write ({_CALL_RULE[style]}):\n{CALL_EXAMPLE[style]}\n"
            "Its result comes back in the next message.")


def with_tools_block(prompt: list[Message], tools: list[ToolSpec], style: ToolCallStyle) -> list[Message]:
    """The prompt with `tools_block` at the end of its system message (a system message of its own if it has none).
    The block is message text, so a tokenizer's control tokens in it (e.g. `<tool_call>`) are spelled out, never forged."""
    block = tools_block(tools, style)
    if prompt and prompt[0].role == "system":
        head = prompt[0]
        return [Message("system", f"{head.content}\n\n{block}" if head.content else block), *prompt[1:]]
    return [Message("system", block), *prompt]


def _read_think(tokenizer: Any, user: dict[str, Any], head: str, kwargs: dict[str, Any]) -> tuple[str, str] | None:
    """The template text before and after an assistant turn's reasoning, if the template renders
    `reasoning_content` (on the last turn, where Qwen3's always does)."""
    turn = {"role": "assistant", "content": _ANSWER, "reasoning_content": _REASON}
    try:
        text = _render(tokenizer, [user, turn], False, kwargs)
    except Exception:
        return None
    opening, _, rest = text.removeprefix(head).partition(_REASON)
    closing, found, _ = rest.partition(_ANSWER)
    if not (text.startswith(head) and found and opening.strip() and closing.strip()):
        return None
    return opening, closing


def _render_call(tokenizer: Any, user: dict[str, Any], kwargs: dict[str, Any]) -> str:
    """A turn with one tool call as the template renders it: tells the three styles apart."""
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    try:
        return _render(tokenizer, [user, call], False, kwargs)
    except Exception:
        return ""

