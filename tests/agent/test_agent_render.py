import pytest
from agent_fakes import calc_task, reference
from transformers import AutoTokenizer

from assay.agent import render
from assay.agent.render import observation_ids, prompt_ids, sft_example
from assay.core.errors import AssayError
from assay.core.tokenizer import render_messages
from assay.core.types import Message, ToolCall


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def test_sft_example_layout_hand_checked(tok):
    task = calc_task(12, 30)
    ids, mask = sft_example(tok, task, reference(task))
    assert len(ids) == len(mask)
    (v0, _, p), (v1, _, a1), (v2, _, o), (v3, _, end) = runs(mask)
    assert (v0, v1, v2, v3) == (0, 1, 0, 1) and end == len(ids)
    dec = lambda a, b: tok.decode(ids[a:b], skip_special_tokens=False)  # noqa: E731
    assert dec(0, p) == (
        "<|im_start|>system\nUse the calc tool.\n\nTools:\n"
        '{"name":"calc","description":"Add two numbers.","parameters":{"type":"object","properties":'
        '{"expression":{"type":"string"}},"required":["expression"],"additionalProperties":false}}<|im_end|>\n'
        "<|im_start|>user\nWhat is 12+30?<|im_end|>\n<|im_start|>assistant\n"
    )
    call = '<tool_call>{"name":"calc","arguments":{"expression":"12+30"}}</tool_call>'
    assert dec(p, a1) == f"Let me add.{call}<|im_end|>"
    assert dec(a1, o) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert dec(o, end) == "Answer: 42<|im_end|>"
    assert p == len(prompt_ids(tok, task))


def test_sft_example_equals_tokenizing_the_rendered_conversation(tok):
    task = calc_task(5, 9)
    ids, _ = sft_example(tok, task, reference(task))
    full = tok.encode(render_messages(task.prompt + reference(task), task.tools), add_special_tokens=False)
    assert ids == full[:-1]  # the rendered text ends with the "\n" after the last <|im_end|>
    assert sft_example(tok, task, task.prompt + reference(task))[0] == ids  # a leading prompt copy is dropped


def test_observation_ids_keep_control_tokens_in_tool_output_as_text(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = observation_ids(tok, ["x<|im_end|>y", "7"])
    want = "\n<|im_start|>tool\nx<|im_end|>y<|im_end|>\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids) == want
    assert ids.count(im_end) == 2  # only the two real turn ends are the special token


def test_episode_ending_on_a_tool_adds_no_trailing_tokens(tok):
    task = calc_task(1, 2)
    ref = reference(task)[:2]  # assistant call, tool result (e.g. done=True): no answer turn
    ids, mask = sft_example(tok, task, ref)
    assert mask[-1] == 1 and tok.decode(ids[-1:], skip_special_tokens=False) == "<|im_end|>"


@pytest.mark.parametrize(
    "ref,match",
    [
        ([], "no assistant message"),
        ([Message("user", "hi")], "message 0 is 'user'"),
        ([Message("assistant", "a"), Message("assistant", "b")], "only the last assistant message"),
        ([Message("assistant", "a"), Message("tool", "t")], "tool results follow an answer"),
        ([Message("assistant", "", [ToolCall("calc", {})]), Message("assistant", "b")], "no tool results"),
    ],
)
def test_bad_reference(tok, ref, match):
    with pytest.raises(AssayError, match=match):
        sft_example(tok, calc_task(1, 2), ref)


def test_prompt_control_tokens_in_messages_are_text(tok, tmp_path, monkeypatch):
    task = calc_task(1, 2)
    task.prompt[1] = Message("user", "Say <tool_call> or <|im_end|> literally.")
    tok.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    if not render._SANITIZES:  # an older transformers cannot keep them text: the prompt is refused
        with pytest.raises(AssayError, match="spells the control token"):
            prompt_ids(tok, task)
        return
    with monkeypatch.context() as m:  # and so would it be where the template cannot sanitize
        m.setattr(render, "_SANITIZES", False)
        with pytest.raises(AssayError, match="install transformers>=5.20"):
            prompt_ids(tok, task)
    for t in (tok, reloaded):
        ids = prompt_ids(t, task)
        assert t.decode(ids) == render_messages(task.prompt, task.tools, add_generation_prompt=True)
        assert ids.count(t.convert_tokens_to_ids("<tool_call>")) == 0
        assert ids.count(t.convert_tokens_to_ids("<|im_end|>")) == 2  # system and user turn ends only


def test_without_template_sanitizing_a_control_token_in_a_tool_spec_is_refused_too(tok, monkeypatch):
    from dataclasses import replace

    task = calc_task(1, 2)
    task.tools = [replace(task.tools[0], description="Adds. <|im_end|>")]
    monkeypatch.setattr(render, "_SANITIZES", False)
    with pytest.raises(AssayError, match=r"spells the control token '<\|im_end\|>'"):
        prompt_ids(tok, task)
