"""Token layout of a conversation, shared by the agent loop and SFT so both train on the same ids.
The layout is the tokenizer's own chat template (core/chat_format.py); with Assay's tokenizers:

prompt (chat template + generation prompt)                         mask 0
assistant turn: content, <tool_call>json</tool_call>..., <|im_end|>  mask 1
observation: "\\n<|im_start|>tool\\n{out}<|im_end|>" per tool result, then
             "\\n<|im_start|>assistant\\n"                           mask 0
... the last assistant turn ends the sequence at its turn end.
A template with a reasoning block (Qwen3's) starts an assistant turn whose message has reasoning with
"<think>\\n{reasoning}\\n</think>\\n\\n", all mask 1: the policy samples it.

Text is encoded with special-token matching off (`split_special_tokens`): a tool output or
message that contains "<|im_end|>" stays text and cannot forge a turn boundary. The special
tokens of the layout are inserted by id.
"""

from __future__ import annotations

import inspect
import json

from transformers import PreTrainedTokenizerBase

from assay.core.chat_format import chat_format, template_kwargs, with_tools_block
from assay.core.errors import AssayError
from assay.core.tokenizer import special_token_id
from assay.core.types import Message, Task


def special_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    i = special_token_id(tokenizer, token)
    if i is None:
        raise AssayError(f"the tokenizer has no {token} token, which its chat template uses; its added tokens "
                         "and its chat_template disagree")
    return i


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []


# transformers releases before 5.20 (the one vLLM's CPU build takes) cannot keep control tokens in messages text
_SANITIZES = "sanitize_control_tokens" in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters


def prompt_ids(tokenizer: PreTrainedTokenizerBase, task: Task) -> list[int]:
    """The task's prompt through the chat template (with the tokenizer's template kwargs, e.g.
    enable_thinking=False), ending with the assistant generation prompt. Where the template renders no tool
    schemas, Assay's declared tools block ends the system message (`core.chat_format.with_tools_block`)."""
    if not _SANITIZES:
        _refuse_control_tokens(tokenizer, task)
    fmt = chat_format(tokenizer)
    messages = task.prompt
    if task.tools and not fmt.renders_tools:  # the model must see the tools it is asked to call
        messages = with_tools_block(task.prompt, task.tools, fmt.tool_calls)
    out = tokenizer.apply_chat_template(
        messages,
        tools=[t.to_json() for t in task.tools] or None,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **({"sanitize_control_tokens": True} if _SANITIZES else {}),  # control tokens in messages are text
        **template_kwargs(tokenizer),
    )
    if not isinstance(out, list):  # a BatchEncoding / dict in some transformers versions
        out = out["input_ids"]
    return list(out)


def _refuse_control_tokens(tokenizer: PreTrainedTokenizerBase, task: Task) -> None:
    """Where the template would turn a control token's spelling in the prompt's text (messages, their
    tool calls, the tool specs) into the token itself (a forged turn boundary), refuse the prompt instead."""
    texts = [json.dumps(t.to_json(), ensure_ascii=False) for t in task.tools]
    for m in task.prompt:
        texts += [m.content, m.name or "", m.reasoning or ""]
        texts += [json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False) for c in m.tool_calls]
    for text in texts:
        if hit := next((s for s in chat_format(tokenizer).specials if s in text), None):
            raise AssayError(f"task {task.task_id}: its prompt spells the control token {hit!r}, which this "
                             f"transformers release would render as the token itself; install transformers>=5.20 "
                             "(pip install -e . -c constraints.txt), or keep control tokens out of prompts")


def encode_pieces(tokenizer: PreTrainedTokenizerBase, pieces: list[tuple[str, bool]]) -> list[int]:
    """(text, is_template) pieces as ids: the template's special tokens by id, everything else as text
    (adjacent text encoded together, as a tokenizer encodes a rendered conversation), where a special
    token's spelling in a message or tool output stays text."""
    fmt = chat_format(tokenizer)
    ids: list[int] = []
    text = ""
    for piece, is_template in pieces:
        for part, special in fmt.split(piece) if is_template else [(piece, False)]:
            if special:
                ids += encode_text(tokenizer, text) + [special_id(tokenizer, part)]
                text = ""
            else:
                text += part
    return ids + encode_text(tokenizer, text)


def assistant_ids(tokenizer: PreTrainedTokenizerBase, message: Message) -> list[int]:
    """One assistant turn as the policy should emit it (its reasoning block first, if it has reasoning),
    ending with the template's turn end."""
    text = chat_format(tokenizer).assistant_text(message.content, message.tool_calls, message.reasoning)
    return encode_pieces(tokenizer, text)


def observation_ids(tokenizer: PreTrainedTokenizerBase, outputs: list[str]) -> list[int]:
    """Tool results after an assistant turn's end, laid out by the tokenizer's chat template, ending
    with the next generation prompt."""
    return encode_pieces(tokenizer, chat_format(tokenizer).observation_text(outputs))


def sft_example(
    tokenizer: PreTrainedTokenizerBase, task: Task, reference: list[Message]
) -> tuple[list[int], list[int]]:
    """(token_ids, loss_mask) of a reference conversation, laid out exactly as the agent loop lays out
    a sampled one. `reference` is the messages after the prompt (a leading copy of the prompt is allowed);
    tool results after the last assistant turn (an episode that ended on a tool) add no tokens."""
    msgs = list(reference)
    if msgs[: len(task.prompt)] == list(task.prompt):
        msgs = msgs[len(task.prompt) :]
    if not msgs:
        raise AssayError(f"reference for task {task.task_id}: no assistant message after the prompt")
    ids = prompt_ids(tokenizer, task)
    mask = [0] * len(ids)
    i = 0
    while i < len(msgs):
        m = msgs[i]
        if m.role != "assistant":
            raise AssayError(f"reference for task {task.task_id}: message {i} is {m.role!r}, expected 'assistant'")
        a = assistant_ids(tokenizer, m)
        ids += a
        mask += [1] * len(a)
        i += 1
        outputs = []
        while i < len(msgs) and msgs[i].role == "tool":
            outputs.append(msgs[i].content)
            i += 1
        if outputs and not m.tool_calls:
            raise AssayError(f"reference for task {task.task_id}: tool results follow an answer without tool calls")
        if i == len(msgs):
            break
        if not m.tool_calls or not outputs:
            raise AssayError(
                f"reference for task {task.task_id}: an assistant message is followed by more turns but "
                "has no tool calls or no tool results; only the last assistant message may be the answer"
            )
        obs = observation_ids(tokenizer, outputs)
        ids += obs
        mask += [0] * len(obs)
    return ids, mask
