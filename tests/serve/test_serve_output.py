"""Reading sampled text: a stream shows, for every prefix of the tokens, a prefix of what the whole shows."""

import random

from assay.serve.output import Reading, read

THINK = ("<think>", "</think>")
PIECES = ["Let", " me", " add", ".", "\n", " ", "<think>", "</think>", "<tool_call>", "</tool_call>", '{"name":"calc",',
          '"arguments":{"x":1}}', "{", "}", "END", "EN", "D", "é", "\ufffd", "Answer: 4"]


def prefixes_grow(text: str, how: Reading, stopped: bool) -> None:
    final = read(text, how, final=True, stopped=stopped)
    shown_content, shown_reasoning = "", ""
    for end in range(len(text) + 1):
        v = read(text[:end], how, final=False)
        assert v.content.startswith(shown_content), (text, end)
        assert (v.reasoning or "").startswith(shown_reasoning), (text, end)
        shown_content, shown_reasoning = v.content, v.reasoning or ""
        assert final.content.startswith(shown_content), (text[:end], final)
        assert (final.reasoning or "").startswith(shown_reasoning), (text[:end], final)


def test_partial_views_are_prefixes_of_the_final_one():
    rng = random.Random(0)
    readings = [Reading(), Reading(("END",)), Reading((), THINK, "assay"), Reading(("END", "\n\n"), THINK, "hermes"),
                Reading((), None, "llama3")]
    for _ in range(500):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))
        for how in readings:
            prefixes_grow(text, how, stopped=rng.random() < 0.7)


def test_a_stop_string_ends_the_text_and_a_call_is_parsed_only_from_a_finished_turn():
    how = Reading(("END",), THINK, "assay")
    call = '<tool_call>{"name":"calc","arguments":{"x":1}}</tool_call>'
    assert read("<think>\nhm\n</think>\n\nok END more", how, final=True).content == "ok "
    done = read(f"<think>\nhm\n</think>\n\nLet me add.{call}", how, final=True, stopped=True)
    assert (done.reasoning, done.content, [c.name for c in done.calls]) == ("hm", "Let me add.", ["calc"])
    cut = read(f"Let me add.{call}", how, final=True, stopped=False)  # ran out of tokens: not acted on
    assert (cut.content, cut.calls) == (f"Let me add.{call}", [])
    assert read("Let me add.<tool", how, final=False).content == "Let me add."
    assert read("Let me add.<tool_call>{", how, final=False).content == "Let me add."
    assert read("Let me add.<tool_call>{oops</tool_call>", how, final=True, stopped=True).content == \
        "Let me add.<tool_call>{oops</tool_call>"  # a malformed call stays text, as the agent loop records it
