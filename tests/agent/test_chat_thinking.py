"""Qwen3's thinking format: reasoning in <think>...</think> at the start of an assistant turn.

The tokenizer below is built here in Qwen3's format (ChatML turns, Hermes <tool_call> JSON, tool results in
<tool_response> tags inside a user turn, <think>/</think> as added tokens); its template is written for this
test after Qwen3's: an assistant turn after the last user query is rendered with its reasoning block when it
has reasoning or is the last message, and `enable_thinking=False` ends the generation prompt with an empty
block. Sampled turns are scripted as the text a Qwen3 model emits, tokenized on their own."""

import copy

import pytest
from agent_fakes import FakeEpisode, ScriptedBackend, calc_task
from test_chat_format import QWEN_STYLE_TEMPLATE, _bpe, _wire

from assay.agent.loop import run_episodes
from assay.agent.render import assistant_ids, prompt_ids, sft_example
from assay.core.chat_format import chat_format, set_template_kwargs
from assay.core.config import ModelConfig
from assay.core.errors import AssayError
from assay.core.types import Message, ToolCall
from assay.rollout.base import SamplingParams

QWEN3_STYLE_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\n<tools>' -}}{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools><|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    # the last real user query: tool results travel in user turns too, wrapped in <tool_response>
    "{%- set ns = namespace(last_query=messages | length - 1, searching=true) -%}"
    "{%- for message in messages[::-1] -%}"
    "{%- if ns.searching and message.role == 'user' and not (message.content.startswith('<tool_response>')"
    " and message.content.endswith('</tool_response>')) -%}"
    "{%- set ns.last_query = messages | length - 1 - loop.index0 -%}{%- set ns.searching = false -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- set content = message.content if message.content is string else '' -%}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- set reasoning = '' -%}"
    "{%- if message.reasoning_content is string -%}{%- set reasoning = message.reasoning_content -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content -}}{%- endif -%}"
    "{%- for tool_call in message.tool_calls or [] -%}"
    "{%- set f = tool_call.function if tool_call.function is defined else tool_call -%}"
    "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' -}}"
    "{{- (f.arguments if f.arguments is string else (f.arguments | tojson)) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def qwen3_tok():
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    t = _bpe(specials, "Let me add. calc expression The tool says so", eos_token="<|endoftext|>",
             pad_token="<|endoftext|>", extra_special_tokens=specials[1:], chat_template=QWEN3_STYLE_TEMPLATE)
    # added, not special, as in Qwen3
    t.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"])
    return t


@pytest.fixture
def no_think_tok(qwen3_tok):
    t = copy.deepcopy(qwen3_tok)
    set_template_kwargs(t, {"enable_thinking": False})
    return t


def calc(expression: str) -> ToolCall:
    return ToolCall("calc", {"expression": expression})


def sampled(tok, text: str) -> tuple[list[int], str]:
    """A turn as a Qwen3 model samples it: its own text's tokens, through the turn end."""
    return tok.encode(text + "<|im_end|>", add_special_tokens=False), "stop"


def whole(tok, task, messages: list[Message], **kwargs) -> list[int]:
    """The template's rendering of the whole conversation, reasoning passed as `reasoning_content`."""
    return list(tok.apply_chat_template(_wire(task.prompt + messages), tools=[t.to_json() for t in task.tools],
                                        tokenize=True, return_dict=False, **kwargs))


def test_the_reasoning_layout_is_read_from_the_template(qwen3_tok):
    fmt = chat_format(qwen3_tok)
    assert (fmt.turn_end, fmt.tool_calls) == ("<|im_end|>", "hermes")
    assert fmt.think == ("<think>\n", "\n</think>\n\n") and fmt.think_tags == ("<think>", "</think>")
    assert fmt.first == "\n<|im_start|>user\n<tool_response>\n"
    assert fmt.between == "\n</tool_response>\n<tool_response>\n"
    assert fmt.last == "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


# What the policy samples: a call and an answer inside the reasoning are no call and no answer.
TURNS = [
    "<think>\nThe tool adds. <tool_call>\n{\"name\": \"calc\", \"arguments\": {\"expression\": \"1+1\"}}\n"
    "</tool_call> is how a call looks.\nAnswer: 9 would be a guess.\n</think>\n\nLet me add.\n<tool_call>\n"
    "{\"name\": \"calc\", \"arguments\": {\"expression\": \"3+5\"}}\n</tool_call>",
    "<think>\nThe tool says 8. Check it once more.\n</think>\n\n<tool_call>\n"
    "{\"name\": \"calc\", \"arguments\": {\"expression\": \"5+3\"}}\n</tool_call>",
    "<think>\nBoth say 8.\n</think>\n\nAnswer: 8",
]
MESSAGES = [  # the same turns as messages, and the tool results in between
    Message("assistant", "Let me add.", [calc("3+5")],
            reasoning="The tool adds. <tool_call>\n{\"name\": \"calc\", \"arguments\": {\"expression\": \"1+1\"}}\n"
                      "</tool_call> is how a call looks.\nAnswer: 9 would be a guess."),
    Message("tool", "8", name="calc"),
    Message("assistant", "", [calc("5+3")], reasoning="The tool says 8. Check it once more."),
    Message("tool", "8", name="calc"),
    Message("assistant", "Answer: 8", reasoning="Both say 8."),
]


def test_a_thinking_episode_is_token_exact_and_parsed_after_the_reasoning(qwen3_tok):
    task = calc_task(3, 5)
    script = [sampled(qwen3_tok, t) for t in TURNS]
    backend = ScriptedBackend({tuple(prompt_ids(qwen3_tok, task)): script})
    ep = FakeEpisode(task)
    [traj] = run_episodes(backend, [(task, ep)], qwen3_tok, SamplingParams(max_tokens=512), max_turns=4,
                          max_context=2048)
    assert traj.passed and traj.turns == 3 and traj.tool_errors == 0
    assert ep.calls == [calc("3+5"), calc("5+3")]  # the call inside the reasoning did not run
    got = traj.messages[len(task.prompt):]
    # Hermes content keeps the newline before its calls (parse_assistant), the template adds its own
    assert [(m.role, m.reasoning, m.content.rstrip("\n"), m.tool_calls) for m in got] == \
        [(m.role, m.reasoning, m.content, m.tool_calls) for m in MESSAGES]
    newline = qwen3_tok.encode("\n", add_special_tokens=False)
    assert traj.token_ids + newline == whole(qwen3_tok, task, MESSAGES)  # as sampled, and as the template renders
    starts = [len(r.prompt_ids) for r in backend.requests]
    assert [i for i, m in enumerate(traj.loss_mask) if m] == \
        [i for s, (ids, _) in zip(starts, script, strict=True) for i in range(s, s + len(ids))]  # sampled, only
    assert traj.token_ids[starts[1]:starts[1] + len(script[1][0])] == script[1][0]  # never re-tokenized


def test_sft_renders_a_demonstration_with_reasoning_as_the_template_does(qwen3_tok):
    task = calc_task(3, 5)
    # SFT encodes a message's text as text, so a control token's spelling in it stays text: none here
    demo = [Message("assistant", "Let me add.", [calc("3+5")], reasoning="The tool adds."), *MESSAGES[1:]]
    ids, mask = sft_example(qwen3_tok, task, demo)
    assert ids + qwen3_tok.encode("\n", add_special_tokens=False) == whole(qwen3_tok, task, demo)
    assert sum(mask) == sum(len(assistant_ids(qwen3_tok, m)) for m in demo if m.role == "assistant")


def test_a_turn_without_its_closing_tag_is_all_reasoning_and_no_answer(qwen3_tok):
    task = calc_task(3, 5)
    thinking = "<think>\nFirst, <tool_call>\n{\"name\": \"calc\", \"arguments\": {\"expression\": \"3+5\"}}\n" \
               "</tool_call> and then Answer: 8 and then more and more"
    ids, _ = sampled(qwen3_tok, thinking)
    for script, finish in (([(ids[:-1], "length")], "length"), ([(ids, "stop")], "stop")):  # cut, or ended
        backend = ScriptedBackend({tuple(prompt_ids(qwen3_tok, task)): script})
        ep = FakeEpisode(task)
        [traj] = run_episodes(backend, [(task, ep)], qwen3_tok, SamplingParams(max_tokens=512), max_turns=4,
                              max_context=2048)
        last = traj.messages[-1]
        assert traj.finish_reason == finish and not traj.passed and ep.calls == []
        assert (last.reasoning, last.content, last.tool_calls) == (thinking.removeprefix("<think>\n"), "", [])


def test_non_thinking_mode_ends_every_generation_prompt_with_the_empty_block(qwen3_tok, no_think_tok):
    fmt, thinking = chat_format(no_think_tok), chat_format(qwen3_tok)
    assert fmt.last == thinking.last + EMPTY_THINK and (fmt.first, fmt.between) == (thinking.first, thinking.between)
    task = calc_task(3, 5)
    call, answer = "Let me add.\n<tool_call>\n{\"name\": \"calc\", \"arguments\": {\"expression\": \"3+5\"}}\n" \
                   "</tool_call>", "Answer: 8"
    script = [sampled(no_think_tok, call), sampled(no_think_tok, answer)]
    backend = ScriptedBackend({tuple(prompt_ids(no_think_tok, task)): script})
    [traj] = run_episodes(backend, [(task, FakeEpisode(task))], no_think_tok, SamplingParams(max_tokens=64),
                          max_turns=4, max_context=2048)
    assert traj.passed and all(m.reasoning is None for m in traj.messages)
    first, second = (r.prompt_ids for r in backend.requests)
    # each turn's prompt is the template's non-thinking generation prompt after what was sampled
    turn1 = Message("assistant", "Let me add.", [calc("3+5")])
    assert first == whole(no_think_tok, task, [], add_generation_prompt=True, enable_thinking=False)
    text = no_think_tok.apply_chat_template(_wire(task.prompt + [turn1, Message("tool", "8", name="calc")]),
                                            tools=[t.to_json() for t in task.tools], tokenize=False,
                                            add_generation_prompt=True, enable_thinking=False)
    observation = text.rpartition("</tool_call><|im_end|>")[2]
    assert observation.endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    assert second == first + script[0][0] + no_think_tok.encode(observation, add_special_tokens=False)
    assert sft_example(no_think_tok, task, [turn1, Message("tool", "8", name="calc"), Message("assistant", answer)]) \
        == (traj.token_ids, traj.loss_mask)


def test_model_chat_template_kwargs_reach_the_loaded_tokenizer(qwen3_tok, tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from assay.core.modeling import load_model

    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(qwen3_tok), hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)
                     ).save_pretrained(tmp_path)
    qwen3_tok.save_pretrained(tmp_path)
    task = calc_task(3, 5)
    empty = qwen3_tok.encode(EMPTY_THINK, add_special_tokens=False)
    _, tok = load_model(tmp_path, ModelConfig(chat_template_kwargs={"enable_thinking": False}))
    assert prompt_ids(tok, task)[-len(empty):] == empty and chat_format(tok).last.endswith(EMPTY_THINK)
    _, tok = load_model(tmp_path)
    assert prompt_ids(tok, task)[-len(empty):] != empty and not chat_format(tok).last.endswith(EMPTY_THINK)
    with pytest.raises(AssayError, match="chat_template_kwargs: add_generation_prompt is set by Assay"):
        load_model(tmp_path, ModelConfig(chat_template_kwargs={"add_generation_prompt": False}))


def test_a_saved_policy_keeps_its_template_kwargs_for_a_bare_load(qwen3_tok, tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from assay.core.chat_format import set_template_kwargs, template_kwargs
    from assay.core.modeling import load_model, save_model

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(qwen3_tok), hidden_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, intermediate_size=32))
    tok = copy.deepcopy(qwen3_tok)
    set_template_kwargs(tok, {"enable_thinking": False})
    save_model(model, tok, tmp_path / "policy")
    _, bare = load_model(tmp_path / "policy")  # `assay eval --policy DIR` has no config
    assert template_kwargs(bare) == {"enable_thinking": False}
    _, told = load_model(tmp_path / "policy", ModelConfig(chat_template_kwargs={"enable_thinking": True}))
    assert template_kwargs(told) == {"enable_thinking": True}  # a config's own kwargs win


def test_reasoning_is_refused_where_the_template_has_no_place_for_it(qwen3_tok):
    plain = copy.deepcopy(qwen3_tok)
    plain.chat_template = QWEN_STYLE_TEMPLATE  # Qwen2.5's layout: no reasoning
    assert chat_format(plain).think is None
    with pytest.raises(AssayError, match="has reasoning, but the tokenizer's chat template renders none"):
        assistant_ids(plain, Message("assistant", "Answer: 8", reasoning="add"))


def test_a_generation_prompt_that_opens_the_reasoning_block_is_still_refused(qwen3_tok):
    opened = copy.deepcopy(qwen3_tok)  # only the empty block of non-thinking mode may follow the generation prompt
    opened.chat_template = QWEN3_STYLE_TEMPLATE.replace("{{- '<|im_start|>assistant\\n' -}}{%- if enable",
                                                        "{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- if enable")
    assert opened.chat_template != QWEN3_STYLE_TEMPLATE
    with pytest.raises(AssayError, match="renders a past assistant turn differently from its generation prompt"):
        chat_format(opened)
