"""Token layout of a conversation, shared by the agent loop and SFT so both train on the same ids.

prompt (chat template + generation prompt)                         mask 0
assistant turn: content, <tool_call>json</tool_call>..., <|im_end|>  mask 1
observation: "\\n<|im_start|>tool\\n{out}<|im_end|>" per tool result, then
             "\\n<|im_start|>assistant\\n"                           mask 0
... the last assistant turn ends the sequence at its <|im_end|>.

Text is encoded with special-token matching off (`split_special_tokens`): a tool output or
message that contains "<|im_end|>" stays text and cannot forge a turn boundary. The special
tokens of the layout are inserted by id.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from assay.core.errors import AssayError
from assay.core.tokenizer import IM_END, IM_START, TOOL_CALL_END, TOOL_CALL_START, special_token_id, tool_call_text
from assay.core.types import Message, Task


def special_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    i = special_token_id(tokenizer, token)
    if i is None:
        raise AssayError(f"the tokenizer has no {token} token; train it with assay.core.tokenizer.train_tokenizer")
    return i


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []


def prompt_ids(tokenizer: PreTrainedTokenizerBase, task: Task) -> list[int]:
    """The task's prompt through the chat template, ending with the assistant generation prompt."""
    out = tokenizer.apply_chat_template(
        task.prompt,
        tools=[t.to_json() for t in task.tools] or None,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        sanitize_control_tokens=True,  # control tokens inside messages are text, as in encode_text
    )
    if not isinstance(out, list):  # a BatchEncoding / dict in some transformers versions
        out = out["input_ids"]
    return list(out)


def assistant_ids(tokenizer: PreTrainedTokenizerBase, message: Message) -> list[int]:
    """One assistant turn as the policy should emit it, ending with <|im_end|>."""
    ids = encode_text(tokenizer, message.content)
    start, end = special_id(tokenizer, TOOL_CALL_START), special_id(tokenizer, TOOL_CALL_END)
    for call in message.tool_calls:
        body = tool_call_text(call)[len(TOOL_CALL_START) : -len(TOOL_CALL_END)]
        ids += [start, *encode_text(tokenizer, body), end]
    return ids + [special_id(tokenizer, IM_END)]


def observation_ids(tokenizer: PreTrainedTokenizerBase, outputs: list[str]) -> list[int]:
    """Tool results after an assistant turn's <|im_end|>, ending with the next generation prompt."""
    im_start, im_end = special_id(tokenizer, IM_START), special_id(tokenizer, IM_END)
    newline = encode_text(tokenizer, "\n")
    ids = list(newline)
    for out in outputs:
        ids += [im_start, *encode_text(tokenizer, f"tool\n{out}"), im_end, *newline]
    return ids + [im_start, *encode_text(tokenizer, "assistant\n")]


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
