"""Sampled tokens to what a client reads: the text (cut at a stop string), reasoning apart from content,
and tool calls parsed in the model's own format, as the agent loop reads a turn (`agent.parse`).

A stream must send only what the finished choice will still show, so `read` has a partial mode that
holds back what may yet change: an incomplete UTF-8 character, a tail that may be the start of a stop
string, of a tool call or of the reasoning's closing tag, and content that may turn out to precede a call.
What it shows for any prefix of the tokens is a prefix of what it shows for the whole (tested), so the
stream's deltas concatenate to the non-streamed response."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from assay.agent.parse import parse_assistant, split_reasoning
from assay.core.chat_format import TOOL_CALL_START, ToolCallStyle
from assay.core.types import ToolCall
from assay.rollout.base import GenResult


@dataclass(frozen=True)
class Reading:
    """How a choice's text is read."""

    stops: tuple[str, ...] = ()  # stop strings: the text ends before the first
    think: tuple[str, str] | None = None  # reasoning tags of the chat format (chat only)
    calls: ToolCallStyle | None = None  # the chat format's tool-call style, where the request has tools


@dataclass
class View:
    content: str
    reasoning: str | None = None
    calls: list[ToolCall] = field(default_factory=list)


def _hold(text: str, marks: tuple[str, ...]) -> str:
    """`text` less its longest tail that is a proper start of one of `marks`."""
    for k in range(min(len(text), max((len(m) for m in marks), default=0)), 0, -1):
        if any(len(m) > k and m.startswith(text[-k:]) for m in marks):
            return text[:-k]
    return text


def read(text: str, how: Reading, final: bool, stopped: bool = False) -> View:
    """The view of a choice's decoded text. `final`: the choice has finished; `stopped`: it ended at a stop
    (token or string) rather than at its token limit, so its calls are complete and parsed (a turn cut at
    max_tokens is not acted on, as in the agent loop)."""
    if not final:
        text = text.rstrip("\ufffd")  # a character whose bytes have not all been sampled yet
    cut = [i for i in (text.find(s) for s in how.stops) if i >= 0]
    if cut:
        text = text[:min(cut)]
    elif not final:
        text = _hold(text, how.stops)
    reasoning, rest = None, text
    if how.think is not None:
        opening, closing = how.think
        if final:
            reasoning, rest = split_reasoning(text, how.think)
        elif opening.startswith(text):
            return View("")  # the reasoning tag may be under way
        elif text.startswith(opening):
            body, closed, after = text[len(opening):].partition(closing)
            if not closed:
                return View("", _hold(body, (closing,)).strip("\n"))
            reasoning, rest = body.strip("\n"), after.lstrip("\n")
    if how.calls is None:
        return View(rest, reasoning)
    if final:
        if not stopped:
            return View(rest, reasoning)
        content, calls, err = parse_assistant(rest, how.calls)
        if err is not None or not calls:
            return View(rest, reasoning)
        return View(content.rstrip(), reasoning, calls)
    if how.calls == "llama3":  # a call is the whole turn, one JSON object: nothing shows until it is known
        return View("" if rest.lstrip()[:1] in ("", "{") else rest, reasoning)
    start = rest.find(TOOL_CALL_START)
    shown = rest[:start] if start >= 0 else _hold(rest, (TOOL_CALL_START,))
    return View(shown.rstrip(), reasoning)  # whitespace before a call is the template's, not content


def text_tokens(result: GenResult, stop_ids: frozenset[int]) -> list[int]:
    """The tokens that spell the choice's text: a final turn-end or end-of-text token is not text."""
    ids = result.token_ids
    if ids and result.finish_reason == "stop" and ids[-1] in stop_ids:
        return ids[:-1]
    return ids


def decode(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False) if ids else ""


def token_entries(tokenizer: PreTrainedTokenizerBase, ids: list[int], logprobs: list[float]
                  ) -> list[tuple[str, float, list[int] | None]]:
    """(token text, logprob, UTF-8 bytes) per token; bytes None where a token holds part of a character."""
    out = []
    for t, lp in zip(ids, logprobs, strict=False):
        s = tokenizer.decode([t], skip_special_tokens=False)
        out.append((s, lp, None if "\ufffd" in s else list(s.encode())))
    return out


def call_json(call: ToolCall) -> str:
    return json.dumps(call.arguments, ensure_ascii=False)


def delta(sent: str, now: str) -> str:
    """What to send after `sent` so the client holds `now` (views only grow; see the module doc)."""
    return now[len(sent):] if now.startswith(sent) else ""
