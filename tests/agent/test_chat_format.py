"""Tokenizers of other model families: the layout comes from the tokenizer's own chat template.

The tokenizer below is built here in Qwen2.5's format (ChatML turns, consecutive tool results in one
user turn inside <tool_response> tags, Hermes-style <tool_call> JSON as added tokens); its template is
written for this test. Rendering turn by turn, as the agent loop and SFT do, must give exactly the
tokens the template gives for the whole conversation."""

import json
from dataclasses import replace

import pytest
from agent_fakes import FakeEpisode, ScriptedBackend, calc_task, reference, turn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from assay.agent import render
from assay.agent.loop import run_episodes
from assay.agent.parse import parse_assistant
from assay.agent.render import assistant_ids, observation_ids, prompt_ids, sft_example
from assay.core.chat_format import CALL_EXAMPLE, chat_format, with_tools_block
from assay.core.errors import AssayError
from assay.core.tokenizer import stop_token_ids
from assay.core.types import Message, ToolCall
from assay.rollout.base import SamplingParams

QWEN_STYLE_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif message.role == 'assistant' and message.tool_calls -%}"
    "{{- '<|im_start|>assistant' -}}{%- if message.content -%}{{- '\\n' + message.content -}}{%- endif -%}"
    "{%- for tool_call in message.tool_calls -%}"
    "{%- set f = tool_call.function if tool_call.function is defined else tool_call -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _bpe(specials: list[str], words: str, **kwargs) -> PreTrainedTokenizerFast:
    """A small byte-level BPE with these special tokens, wrapped with `kwargs` (tokens, chat template)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([f"user What is {a}+{a * 7}? {words} Answer:" for a in range(50)], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **kwargs)


@pytest.fixture(scope="module")
def qwen_tok():
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    t = _bpe(specials, "Let me add. calc expression", eos_token="<|endoftext|>", pad_token="<|endoftext|>",
             extra_special_tokens=specials[1:], chat_template=QWEN_STYLE_TEMPLATE)
    t.add_tokens(["<tool_call>", "</tool_call>"])  # added, not special, as in Qwen2.5
    return t


def _wire(messages):
    out = []
    for m in messages:
        d = {"role": m.role, "content": m.content}
        if m.reasoning is not None:  # where Qwen3's template reads it
            d["reasoning_content"] = m.reasoning
        if m.tool_calls:
            d["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in m.tool_calls]
        out.append(d)
    return out


def test_the_layout_is_read_from_the_template(qwen_tok):
    fmt = chat_format(qwen_tok)
    assert (fmt.turn_end, fmt.tool_calls) == ("<|im_end|>", "hermes")
    assert fmt.first == "\n<|im_start|>user\n<tool_response>\n"
    assert fmt.between == "\n</tool_response>\n<tool_response>\n"
    assert fmt.last == "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert stop_token_ids(qwen_tok) == [qwen_tok.convert_tokens_to_ids("<|im_end|>"), qwen_tok.eos_token_id]


@pytest.mark.parametrize("outputs", [["8"], ["8", "error: expected a+b"]])
def test_turn_by_turn_tokens_equal_the_templates_whole_conversation(qwen_tok, outputs):
    task = calc_task(3, 5)
    calls = [ToolCall("calc", {"expression": "3+5"}) for _ in outputs]
    turns = [Message("assistant", "Let me add." if len(calls) == 1 else "", calls),
             *[Message("tool", o, name="calc") for o in outputs], Message("assistant", "Answer: 8")]
    ids = prompt_ids(qwen_tok, task) + assistant_ids(qwen_tok, turns[0]) + observation_ids(qwen_tok, outputs) \
        + assistant_ids(qwen_tok, turns[-1])
    prompt = with_tools_block(task.prompt, task.tools, "hermes")  # this template renders no tools: Assay's block
    # whose <tool_call> example is message text, spelled out, not the added token
    whole = qwen_tok.apply_chat_template(_wire(prompt + turns), tokenize=True, return_dict=False,
                                         **({"sanitize_control_tokens": True} if render._SANITIZES else {}))
    assert ids + qwen_tok.encode("\n", add_special_tokens=False) == list(whole)
    text = qwen_tok.decode(assistant_ids(qwen_tok, turns[0])[:-1])  # what a policy would sample, turn end cut
    content, parsed, err = parse_assistant(text)
    assert (content.rstrip("\n"), parsed, err) == (turns[0].content, calls, None)  # the layout's newline stays
    example, mask = sft_example(qwen_tok, task, turns)
    assert example == ids and sum(mask) == len(assistant_ids(qwen_tok, turns[0])) + len(assistant_ids(qwen_tok,
                                                                                                     turns[-1]))


def test_the_agent_loop_runs_on_it(qwen_tok):
    task = calc_task(3, 5)
    script = [turn(qwen_tok, m) for m in reference(task) if m.role == "assistant"]
    backend = ScriptedBackend({tuple(prompt_ids(qwen_tok, task)): script})
    ep = FakeEpisode(task)
    [traj] = run_episodes(backend, [(task, ep)], qwen_tok, SamplingParams(max_tokens=64), max_turns=4, max_context=1024)
    assert traj.passed and traj.turns == 2
    example, mask = sft_example(qwen_tok, task, reference(task))
    assert traj.token_ids == example and traj.loss_mask == mask  # the loop's tokens are the template's


def test_a_tokenizer_without_a_chat_template_gets_the_fix(qwen_tok):
    import copy

    bare = copy.deepcopy(qwen_tok)
    bare.chat_template = None
    with pytest.raises(AssayError, match="no chat template.*chat \\(instruct\\) variant"):
        chat_format(bare)


def test_loading_a_model_whose_tokenizer_has_no_template_names_the_fix(qwen_tok, tmp_path):
    import copy

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from assay.core.modeling import load_model

    bare = copy.deepcopy(qwen_tok)
    bare.chat_template = None
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(bare), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, intermediate_size=32)).save_pretrained(tmp_path)
    bare.save_pretrained(tmp_path)
    with pytest.raises(AssayError, match="no chat template"):
        load_model(tmp_path)


LLAMA_STYLE_TEMPLATE = (  # Llama 3.x's layout: header ids, <|eot_id|>, JSON calls, ipython results
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'tool' -%}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' -}}"
    "{%- elif message.role == 'assistant' and message.tool_calls -%}"
    "{%- set f = message.tool_calls[0].function -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{{- '{\"name\": \"' + f.name + '\", \"parameters\": ' + (f.arguments | tojson) + '}' + '<|eot_id|>' -}}"
    "{%- else -%}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def llama_tok():
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    return _bpe(specials, "name parameters calc expression", bos_token="<|begin_of_text|>",
                eos_token="<|end_of_text|>", extra_special_tokens=specials[2:], chat_template=LLAMA_STYLE_TEMPLATE)


def test_llama_style_layout_is_token_exact_and_its_json_calls_parse(llama_tok):
    fmt = chat_format(llama_tok)
    assert (fmt.turn_end, fmt.tool_calls) == ("<|eot_id|>", "llama3")
    assert fmt.first == "<|start_header_id|>ipython<|end_header_id|>\n\n"
    task = calc_task(3, 5)
    call = Message("assistant", "", [ToolCall("calc", {"expression": "3+5"})])
    final = Message("assistant", "Answer: 8")
    ids = prompt_ids(llama_tok, task) + assistant_ids(llama_tok, call) + observation_ids(llama_tok, ["8"]) \
        + assistant_ids(llama_tok, final)
    prompt = with_tools_block(task.prompt, task.tools, "llama3")
    whole = llama_tok.apply_chat_template(_wire(prompt + [call, Message("tool", "8", name="calc"), final]),
                                          tokenize=True, return_dict=False)
    assert ids == list(whole)
    text = llama_tok.decode(assistant_ids(llama_tok, call)[:-1])
    assert parse_assistant(text, "llama3") == ("", call.tool_calls, None)
    assert parse_assistant("Answer: 8", "llama3") == ("Answer: 8", [], None)
    assert parse_assistant('{"name": "calc", "arguments": {}}', "llama3")[2].startswith("tool call: expected")
    backend = ScriptedBackend({tuple(prompt_ids(llama_tok, task)): [turn(llama_tok, call), turn(llama_tok, final)]})
    [traj] = run_episodes(backend, [(task, FakeEpisode(task))], llama_tok, SamplingParams(max_tokens=64), max_turns=4,
                          max_context=1024)
    assert traj.passed and traj.token_ids == ids


def test_a_template_that_renders_no_tools_gets_assays_declared_tools_block(qwen_tok, tok):
    """SmolLM2's template drops `tools=`: without a block the model would never see the tools it must call."""
    assert not chat_format(qwen_tok).renders_tools and chat_format(tok).renders_tools
    task = calc_task(3, 5)
    text = qwen_tok.decode(prompt_ids(qwen_tok, task))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nUse the calc tool.\n\n")  # the task's own system text first
    assert json.dumps(task.tools[0].to_json()) in system and CALL_EXAMPLE["hermes"] in system
    bare = replace(task, prompt=task.prompt[1:])  # no system message: the block is one
    assert qwen_tok.decode(prompt_ids(qwen_tok, bare)).startswith("<|im_start|>system\nYou can call these tools")
    no_tools = replace(task, tools=[])
    assert "You can call" not in qwen_tok.decode(prompt_ids(qwen_tok, no_tools))
    assert "You can call" not in tok.decode(prompt_ids(tok, task))  # a template that renders tools gets no block


@pytest.mark.parametrize("style", ["assay", "hermes", "llama3"])
def test_the_blocks_call_example_is_a_call_in_its_style(style):
    assert parse_assistant(CALL_EXAMPLE[style], style) == ("", [ToolCall("TOOL_NAME", {"ARGUMENT": "VALUE"})], None)
