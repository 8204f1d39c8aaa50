"""Requests to prompt token ids: chat messages through the model's own chat template, as the agent loop
renders a task's prompt (`agent.render.prompt_ids`), tools included; completion prompts as text or ids."""

from __future__ import annotations

import json
from typing import Any

from transformers import PreTrainedTokenizerBase

from assay.agent.render import prompt_ids
from assay.core.errors import AssayError
from assay.core.types import Message, Task, ToolCall, ToolSpec
from assay.serve.protocol import ApiError, ChatCompletionRequest, ChatMessage


def tool_specs(req: ChatCompletionRequest) -> list[ToolSpec]:
    """The request's tools, unless tool_choice is none (then the model is not shown them)."""
    if req.tool_choice == "none":
        return []
    return [ToolSpec(t.function.name, t.function.description, t.function.parameters) for t in req.tools or []]


def chat_messages(messages: list[ChatMessage]) -> list[Message]:
    """OpenAI messages as Assay's: a tool call's JSON arguments parsed, a tool result named after the call
    its tool_call_id answers, `developer` read as `system`."""
    out: list[Message] = []
    names: dict[str, str] = {}
    for i, m in enumerate(messages):
        if m.role == "tool":
            out.append(Message("tool", m.text(), name=names.get(m.tool_call_id or "")))
            continue
        if m.tool_calls and m.role != "assistant":
            raise ApiError(400, f"messages.{i}: only an assistant message has tool_calls", param=f"messages.{i}")
        calls = []
        for j, c in enumerate(m.tool_calls or []):
            try:
                args = json.loads(c.function.arguments or "{}")
            except ValueError as e:  # JSONDecodeError, or an integer past Python's 4300-digit limit
                raise ApiError(400, f"messages.{i}.tool_calls.{j}.function.arguments is not JSON ({e}); send the "
                                    "arguments as a JSON object in a string", param=f"messages.{i}.tool_calls") from None
            if not isinstance(args, dict):
                raise ApiError(400, f"messages.{i}.tool_calls.{j}.function.arguments must be a JSON object",
                               param=f"messages.{i}.tool_calls")
            calls.append(ToolCall(c.function.name, args, c.id))
            names[c.id] = c.function.name
        role = "system" if m.role == "developer" else m.role
        reasoning = m.reasoning_content if m.role == "assistant" else None
        out.append(Message(role, m.text(), calls, reasoning=reasoning))
    return out


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, req: ChatCompletionRequest) -> list[int]:
    """The conversation through the tokenizer's chat template (its template kwargs bound, as in training),
    ending with the assistant generation prompt."""
    task = Task(env="serve", task_id="request", difficulty=0, prompt=chat_messages(req.messages), tools=tool_specs(req))
    try:
        return prompt_ids(tokenizer, task)
    except AssayError as e:
        raise ApiError(400, str(e), param="messages") from None
    except Exception as e:  # a template refusing a conversation raises its own exception types (jinja's, ...)
        raise ApiError(400, f"the model's chat template cannot render these messages: {e}", param="messages") from None


def completion_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str | list[int], vocab: int) -> list[int]:
    """A completion prompt's ids: text as the tokenizer encodes it, ids checked against the vocabulary."""
    if isinstance(prompt, str):
        ids: list[Any] = tokenizer.encode(prompt)
    else:
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"prompt: token id {bad[0]} is outside the model's vocabulary of {vocab}",
                           param="prompt")
        ids = list(prompt)
    if not ids:
        raise ApiError(400, "prompt: it encodes to no tokens; give a non-empty prompt", param="prompt")
    return ids
