"""A byte-level BPE tokenizer trained locally, and the shared chat format it renders.

The chat format (ChatML-like) is defined twice, once as the Jinja `chat_template` that
`apply_chat_template` uses and once as `render_messages` in plain Python; tests keep them equal.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from assay.core.chat_format import TOOL_CALL_END, TOOL_CALL_START, chat_format
from assay.core.errors import AssayError
from assay.core.types import Message, ToolCall, ToolSpec

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"  # also the pad token
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, TOOL_CALL_START, TOOL_CALL_END]
_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))



def special_token_id(tokenizer: Any, token: str) -> int | None:
    """The id of `token` when the tokenizer has it as a token of its own (not the unknown token)."""
    i = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(i, int) or i == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(i) != token:
        return None
    return i


def stop_token_ids(tokenizer: Any) -> list[int]:
    """Where generation stops, for every backend and the agent loop: the end of an assistant turn (as
    the tokenizer's chat template spells it) and the end of text, those of the two the tokenizer has."""
    turn_end = chat_format(tokenizer).turn_end if getattr(tokenizer, "chat_template", None) else IM_END
    stops = [special_token_id(tokenizer, turn_end), tokenizer.eos_token_id]
    ids = list(dict.fromkeys(i for i in stops if isinstance(i, int)))
    if not ids:
        raise AssayError(f"the tokenizer has neither a turn-end token ({turn_end}) nor an eos token, so generation "
                         "could never stop; use the tokenizer of a chat (instruct) model")
    return ids


# json.dumps(obj, separators=(",", ":")) in the template: compact, ASCII-escaped, keys in insertion order.
_J = "tojson(separators=(',', ':'), ensure_ascii=True)"
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system=none, start=0) -%}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{%- set ns.system = messages[0].content if messages[0].content is defined else '' -%}"
    "{%- set ns.start = 1 -%}"
    "{%- endif -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if ns.system -%}{{- ns.system ~ '\\n\\n' -}}{%- endif -%}"
    "{{- 'Tools:' -}}"
    "{%- for tool in tools -%}"
    "{{- '\\n' ~ ((tool.function if tool.function is defined else tool) | " + _J + ") -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif ns.system is not none -%}"
    "{{- '<|im_start|>system\\n' ~ ns.system ~ '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages[ns.start:] -%}"
    "{{- '<|im_start|>' ~ message.role ~ '\\n' -}}"
    "{%- if message.content is defined and message.content is not none -%}{{- message.content -}}{%- endif -%}"
    "{%- if message.tool_calls is defined and message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{{- '<tool_call>' ~ ({'name': fn.name, 'arguments': fn.arguments} | " + _J + ") ~ '</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def tool_call_text(call: ToolCall) -> str:
    """`<tool_call>{"name":...,"arguments":{...}}</tool_call>`: the exact text of one call in an assistant turn."""
    return f"{TOOL_CALL_START}{_compact({'name': call.name, 'arguments': call.arguments})}{TOOL_CALL_END}"


def system_text(system: str | None, tools: list[ToolSpec]) -> str | None:
    """The system message's content, with one compact JSON tool spec per line; None: no system message."""
    if not tools:
        return system
    head = f"{system}\n\n" if system else ""
    return head + "Tools:" + "".join("\n" + _compact(t.to_json()) for t in tools)


def render_message(message: Message) -> str:
    calls = "".join(tool_call_text(c) for c in message.tool_calls)
    return f"{IM_START}{message.role}\n{message.content}{calls}{IM_END}\n"


def render_messages(messages: list[Message], tools: list[ToolSpec], add_generation_prompt: bool = False) -> str:
    """The shared chat format in plain Python; equal to the tokenizer's chat template."""
    system = None
    rest = messages
    if messages and messages[0].role == "system":
        system, rest = messages[0].content, messages[1:]
    out = []
    sys_content = system_text(system, tools)
    if sys_content is not None:
        out.append(f"{IM_START}system\n{sys_content}{IM_END}\n")
    out.extend(render_message(m) for m in rest)
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` (rendered conversations) with the chat format's special tokens.

    Digits are split one per token before byte-level BPE: a tiny model learns arithmetic far more
    easily on single digits than on arbitrary BPE chunks of numbers."""
    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise AssayError(f"vocab_size {vocab_size} is too small: a byte-level BPE needs at least {min_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The corpus is cut at special tokens first: they are single tokens, never merged with text.
    tok.train_from_iterator((piece for t in texts for piece in _SPECIAL_RE.split(t) if piece), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        extra_special_tokens=SPECIAL_TOKENS[1:],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # decode must give back exactly the text
    )
