"""`assay bench agent --scripted`, malformed calls: each botched call is malformed as it claims, and the
countermeasures (retry, repair, a declared fallback tool) each rescue the episodes off loses."""

import json

from assay.agent.loop import RETRY_PROMPT
from assay.agent.parse import parse_assistant, parse_assistant_repaired
from assay.bench.countermeasures import run_countermeasures, table
from assay.bench.malformed import ALIASES, KINDS, MalformedScript, botch
from assay.core.tokenizer import TOOL_CALL_END, TOOL_CALL_START
from assay.core.types import ToolCall
from assay.envs.builtin.repo import TOOLS
from assay.envs.tools import validate_call

PATCH = ToolCall("patch", {"path": "pkg/a.py", "search": "    return 'a' + \"b\"\n", "replace": "    return x\\n"})


def test_each_kind_is_malformed_as_named_and_only_the_syntax_ones_repair():
    for kind in KINDS:
        text = f"{TOOL_CALL_START}{botch(PATCH, kind)}{TOOL_CALL_END}"
        _, calls, err = parse_assistant(text)
        _, fixed, after, _ = parse_assistant_repaired(text)
        if kind in ("trailing comma", "single quotes", "bare keys", "code fence"):
            assert err is not None and after is None and fixed == [PATCH], kind
        elif kind == "other tool name":
            assert calls == [ToolCall(ALIASES["patch"], PATCH.arguments)]
            assert validate_call(calls[0], TOOLS).startswith("unknown tool 'edit_file'")
        else:  # parses, and breaks the schema: only a retry helps
            assert err is None and validate_call(calls[0], TOOLS) is not None, kind
    assert botch(ToolCall("submit", {}), "missing argument") is None  # nothing to leave out
    assert json.loads(botch(ToolCall("submit", {}), "code fence")[8:-4]) == {"name": "submit", "arguments": {}}


def test_the_policy_answers_a_retry_prompt_with_the_call_well_formed_and_a_plain_error_by_moving_on():
    read = ToolCall("read", {"path": "pkg/a.py"})
    script = MalformedScript([read, PATCH], ["wrong type", None])
    assert script.decide("", "").content.startswith(TOOL_CALL_START)
    assert script.decide(f"<|im_start|>tool\nerror: ...\n{RETRY_PROMPT}<|im_end|>", "").tool_calls == [read]
    assert script.decide("<|im_start|>tool\n1  x<|im_end|>", "").tool_calls == [PATCH]
    script = MalformedScript([read, PATCH], ["wrong type", None])
    script.decide("", "")
    assert script.decide("<|im_start|>tool\nerror: read: invalid path<|im_end|>", "").tool_calls == [PATCH]


def test_retry_repair_and_fallback_each_rescue_what_off_loses():
    rows, setup = run_countermeasures(("malformed calls",), per_level=1)  # a level-2 and a level-4 task
    by = {r.setting: r.trajs for r in rows}
    passed = {s: sum(t.passed for t in trajs) for s, trajs in by.items()}
    assert passed["off"] < passed["retry"] == 2  # a botched patch is lost without a retry
    retried = by["retry"]
    assert sum(t.retries for t in retried) > 0 and all(t.retry_successes == t.retries for t in retried)
    assert sum(t.degraded_calls for t in by["repair"]) > 0 and not any(t.fallback_calls for t in by["repair"])
    fell_back = by["repair + fallback"]
    assert sum(t.fallback_calls for t in fell_back) > 0
    assert sum(t.tool_errors for t in fell_back) < sum(t.tool_errors for t in by["repair"])
    # repairs cost no turn (off can take one more: a botched submit does not end its episode)
    assert all(t.turns <= o.turns < t.turns + 2 for t, o in zip(by["repair"], by["off"], strict=True))
    assert all(t.turns < r.turns for t, r in zip(by["repair"], by["retry"], strict=True))  # a retry is a turn
    text = table(rows, setup)
    assert f"| malformed calls | off | {passed['off'] / 2:.2f} |" in text and "| malformed calls | retry | 1.00 |" in text
