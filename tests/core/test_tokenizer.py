import pytest
import torch
from transformers import AutoTokenizer

from assay.core.errors import AssayError
from assay.core.tokenizer import SPECIAL_TOKENS, render_messages, tool_call_text, train_tokenizer
from assay.core.types import Message, ToolCall, ToolSpec

torch.set_num_threads(1)

CALC = ToolSpec(
    "calc",
    "Evaluate an arithmetic expression.",
    {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
)
NOTE = ToolSpec("note", "Write a note.", {"type": "object", "properties": {"text": {"type": "string"}}})


def conversation(a: int, b: int) -> list[Message]:
    return [
        Message("system", "You are a calculator agent."),
        Message("user", f"What is {a}+{b}?"),
        Message("assistant", "Let me compute.", [ToolCall("calc", {"expression": f"{a}+{b}"})]),
        Message("tool", str(a + b), name="calc"),
        Message("assistant", f"Answer: {a + b}"),
    ]


@pytest.fixture(scope="module")
def tok():
    corpus = [render_messages(conversation(a, 12345), [CALC]) for a in range(200)]
    return train_tokenizer(corpus, 400)


def dicts(tools):
    return [t.to_json() for t in tools]


def test_tool_call_text_is_compact_json():
    call = ToolCall("calc", {"expression": "3+4", "n": [1, 2]})
    assert tool_call_text(call) == '<tool_call>{"name":"calc","arguments":{"expression":"3+4","n":[1,2]}}</tool_call>'


def test_render_messages_hand_written():
    msgs = conversation(3, 4)[1:]  # no system message
    got = render_messages(msgs, [CALC], add_generation_prompt=True)
    want = (
        "<|im_start|>system\nTools:\n"
        '{"name":"calc","description":"Evaluate an arithmetic expression.","parameters":{"type":"object",'
        '"properties":{"expression":{"type":"string"}},"required":["expression"]}}<|im_end|>\n'
        "<|im_start|>user\nWhat is 3+4?<|im_end|>\n"
        '<|im_start|>assistant\nLet me compute.<tool_call>{"name":"calc","arguments":{"expression":"3+4"}}'
        "</tool_call><|im_end|>\n"
        "<|im_start|>tool\n7<|im_end|>\n"
        "<|im_start|>assistant\nAnswer: 7<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert got == want
    assert render_messages([Message("user", "hi")], []) == "<|im_start|>user\nhi<|im_end|>\n"
    sys_tools = render_messages([Message("system", "S"), Message("user", "u")], [CALC, NOTE])
    assert sys_tools.startswith("<|im_start|>system\nS\n\nTools:\n{")
    assert '"required":["expression"]}}\n{"name":"note"' in sys_tools


@pytest.mark.parametrize(
    "msgs,tools",
    [
        (conversation(3, 4), [CALC]),
        (conversation(3, 4)[1:], [CALC]),
        (conversation(3, 4), []),
        (conversation(3, 4)[1:2], []),
        ([Message("system", "")], []),
        (
            [
                Message("user", "x"),
                Message("assistant", "", [ToolCall("calc", {"expression": "é"}), ToolCall("note", {})]),
            ],
            [CALC, NOTE],
        ),
    ],
)
@pytest.mark.parametrize("gen", [False, True])
def test_chat_template_equals_render_messages(tok, msgs, tools, gen):
    text = tok.apply_chat_template(msgs, tools=dicts(tools) or None, add_generation_prompt=gen, tokenize=False)
    assert text == render_messages(msgs, tools, add_generation_prompt=gen)


def test_chat_template_tokenizes_like_encode(tok):
    msgs = conversation(5, 6)[:2]
    out = tok.apply_chat_template(msgs, tools=dicts([CALC]), add_generation_prompt=True)
    ids = out if isinstance(out, list) else out["input_ids"]  # transformers 5 returns a BatchEncoding
    assert ids == tok.encode(render_messages(msgs, [CALC], add_generation_prompt=True), add_special_tokens=False)


def test_special_tokens_pad_eos_and_round_trip(tok):
    assert 256 + len(SPECIAL_TOKENS) < len(tok) <= 400  # bytes + specials + merges (the small corpus may run out)
    assert tok.pad_token == tok.eos_token == "<|endoftext|>"
    for s in SPECIAL_TOKENS:
        assert len(tok.encode(s, add_special_tokens=False)) == 1
    text = render_messages(conversation(77, 8), [CALC])
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.encode("a b", add_special_tokens=True) == tok.encode("a b", add_special_tokens=False)  # no BOS


def test_digits_split_individually(tok):
    # "12345" is in every corpus line, so BPE would have merged it had digits not been split first.
    ids = tok.encode("12345", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["1", "2", "3", "4", "5"]
    assert [tok.decode([i]) for i in tok.encode("x=907", add_special_tokens=False)][-3:] == ["9", "0", "7"]


def test_save_and_reload_with_autotokenizer(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = render_messages(conversation(1, 2), [CALC])
    assert back.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    msgs = conversation(1, 2)
    assert back.apply_chat_template(msgs, tools=dicts([CALC]), tokenize=False) == text
    assert back.pad_token_id == back.eos_token_id == tok.pad_token_id
    assert back.decode(back.encode(text, add_special_tokens=False)) == text


def test_vocab_too_small():
    with pytest.raises(AssayError, match="too small"):
        train_tokenizer(["abc"], 100)
