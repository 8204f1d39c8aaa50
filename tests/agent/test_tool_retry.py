"""Tool-call reliability in the agent loop: bounded retries of a malformed turn, repaired calls as a counted
degraded path; the tokens stay those sampled, the retry prompt is an observation (masked)."""

from dataclasses import fields

from agent_fakes import FakeEpisode, OnlineScripted, ScriptedBackend, calc_task, turn

from assay.agent.loop import RETRY_PROMPT, EpisodeJob, run_episodes, run_episodes_online
from assay.agent.render import observation_ids, prompt_ids
from assay.core.types import Message, ToolCall, Trajectory
from assay.rollout.base import SamplingParams

PARAMS = SamplingParams(max_tokens=64)
GOOD = Message("assistant", "", [ToolCall("calc", {"expression": "2+3"})])
ANSWER = Message("assistant", "Answer: 5")
# a turn with a valid call and one to an unknown tool: malformed as a whole
MIXED = Message("assistant", "", [ToolCall("calc", {"expression": "1+1"}), ToolCall("sum", {"a": 2})])
COUNTERS = ("turns", "tool_errors", "call_turns", "malformed_calls", "retries", "retry_successes", "degraded_calls")


def raw(tok, text: str) -> tuple[list[int], str]:
    """A turn the model wrote as this text (not a rendering of a well-formed message)."""
    return tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")], "stop"


def counters(t: Trajectory) -> tuple[int, ...]:
    return tuple(getattr(t, k) for k in COUNTERS)


def play(tok, turns, max_turns=2, **kw) -> tuple[Trajectory, FakeEpisode, list[tuple[list[int], str]]]:
    task = calc_task(2, 3)
    script = [t if isinstance(t, tuple) else turn(tok, t) for t in turns]
    ep = FakeEpisode(task)
    [traj] = run_episodes(ScriptedBackend({tuple(prompt_ids(tok, task)): list(script)}), [(task, ep)], tok, PARAMS,
                          max_turns=max_turns, max_context=2048, **kw)
    return traj, ep, script


def test_without_retries_a_malformed_turn_counts_and_runs_its_valid_calls(tok):
    traj, ep, _ = play(tok, [MIXED, GOOD, ANSWER])
    assert (traj.finish_reason, traj.passed) == ("max_turns", False)  # the malformed turn used up a turn
    assert ep.calls == [ToolCall("calc", {"expression": "1+1"}), ToolCall("calc", {"expression": "2+3"})]
    assert [m.content for m in traj.messages if m.role == "tool"] == [
        "2", "error: unknown tool 'sum'; known tools: calc", "5"]
    assert counters(traj) == (2, 1, 2, 1, 0, 0, 0)


def test_a_retry_runs_nothing_shows_the_validators_message_and_costs_no_turn(tok):
    traj, ep, script = play(tok, [MIXED, GOOD, ANSWER], tool_retries=1)
    assert (traj.finish_reason, traj.passed) == ("stop", True)
    assert ep.calls == [ToolCall("calc", {"expression": "2+3"})]  # the malformed turn's valid call never ran
    retry = f"error: unknown tool 'sum'; known tools: calc\n{RETRY_PROMPT}"
    assert [m.content for m in traj.messages if m.role == "tool"] == [retry, "5"]
    assert counters(traj) == (3, 1, 2, 1, 1, 1, 0)
    # token in, token out: both calls as sampled (mask 1), the validator's message an observation (mask 0)
    task = calc_task(2, 3)
    p, bad, good, ans = prompt_ids(tok, task), script[0][0], script[1][0], script[2][0]
    o1, o2 = observation_ids(tok, [retry]), observation_ids(tok, ["5"])
    assert traj.token_ids == p + bad + o1 + good + o2 + ans
    assert traj.loss_mask == [0] * len(p) + [1] * len(bad) + [0] * len(o1) + [1] * len(good) + [0] * len(o2) + [
        1] * len(ans)


def test_retries_in_a_row_are_bounded_then_a_malformed_turn_counts(tok):
    unknown = Message("assistant", "", [ToolCall("sum", {"a": 2})])
    for retries in (1, 2):
        traj, ep, _ = play(tok, [unknown] * 8, max_turns=2, tool_retries=retries)
        # each turn counted against max_turns follows at most `retries` free ones
        assert traj.finish_reason == "max_turns" and traj.turns == 2 * (retries + 1)
        assert (traj.malformed_calls, traj.retries, traj.retry_successes) == (traj.turns, 2 * retries, 0)
        assert ep.calls == []
        tools = [m.content for m in traj.messages if m.role == "tool"]
        assert sum(RETRY_PROMPT in c for c in tools) == 2 * retries


def test_a_retry_that_is_malformed_again_is_no_success(tok):
    traj, _, _ = play(tok, [raw(tok, '<tool_call>{"name": "calc"}</tool_call>'), MIXED, GOOD, ANSWER],
                      max_turns=3, tool_retries=1)
    # turn 1 retried; turn 2 malformed again with the retry spent: it counts, its valid call runs and the
    # unknown one gets a plain error; turn 3 (well-formed) runs, turn 4 answers
    assert traj.passed and traj.turns == 4
    assert (traj.malformed_calls, traj.retries, traj.retry_successes) == (2, 1, 0)


def test_repair_fixes_a_trailing_comma_as_a_counted_degraded_call(tok):
    comma = raw(tok, '<tool_call>\n{"name": "calc", "arguments": {"expression": "2+3",},}\n</tool_call>')
    traj, ep, script = play(tok, [comma, ANSWER], repair_tool_calls=True)
    assert traj.passed and ep.calls == [ToolCall("calc", {"expression": "2+3"})]
    assert counters(traj) == (2, 0, 1, 0, 0, 0, 1)
    assert traj.token_ids[traj.prompt_len:traj.prompt_len + len(script[0][0])] == script[0][0]  # as sampled
    off, _, _ = play(tok, [comma, ANSWER])  # repair off: a parse error, as before
    assert counters(off) == (2, 1, 1, 1, 0, 0, 0)


def test_a_repaired_call_must_still_pass_its_schema(tok):
    quoted = raw(tok, "<tool_call>{'name': 'calc', 'arguments': {'expression': 5}}</tool_call>")
    traj, ep, _ = play(tok, [quoted, GOOD, ANSWER], repair_tool_calls=True, tool_retries=1)
    assert ep.calls == [ToolCall("calc", {"expression": "2+3"})] and traj.passed
    tools = [m.content for m in traj.messages if m.role == "tool"]
    assert tools[0] == f"error: calc: invalid expression: 5 is not of type 'string'\n{RETRY_PROMPT}"
    assert counters(traj) == (3, 1, 2, 1, 1, 1, 0)  # parsed after repair, yet malformed: not degraded


def test_lockstep_and_online_loops_agree(tok):
    comma = raw(tok, '<tool_call>{"name": "calc", "arguments": {"expression": "2+3",}}</tool_call>')
    scripts_of = {(2, 3): [MIXED, GOOD, ANSWER], (4, 1): [comma, ANSWER], (1, 4): [MIXED, MIXED, comma, ANSWER]}
    tasks = [calc_task(a, b) for a, b in scripts_of]

    def scripts():
        return {tuple(prompt_ids(tok, t)): [s if isinstance(s, tuple) else turn(tok, s) for s in scripts_of[k]]
                for t, k in zip(tasks, scripts_of, strict=True)}

    lockstep = run_episodes(ScriptedBackend(scripts()), [(t, FakeEpisode(t)) for t in tasks], tok, PARAMS,
                            max_turns=3, max_context=2048, tool_retries=1, repair_tool_calls=True)
    jobs = [EpisodeJob(t, FakeEpisode(t), PARAMS, 3, 2048, i, tool_retries=1, repair_tool_calls=True)
            for i, t in enumerate(tasks)]
    online = run_episodes_online(OnlineScripted(scripts()), jobs, tok)
    assert [counters(t) for t in lockstep] == [counters(t) for t in online]
    assert [t.passed for t in lockstep] == [True, True, True]
    skip = {"task", "timings"}
    for a, b in zip(lockstep, online, strict=True):
        assert {f.name: getattr(a, f.name) for f in fields(a) if f.name not in skip} == \
               {f.name: getattr(b, f.name) for f in fields(b) if f.name not in skip}


def test_step_metrics_and_evaluation_report_the_rates(tok):
    from assay.eval.evaluate import summarize as eval_summary
    from assay.eval.record import metrics
    from assay.mixer.stats import summarize as step_summary

    comma = raw(tok, '<tool_call>{"name": "calc", "arguments": {"expression": "2+3",}}</tool_call>')
    unknown = Message("assistant", "", [ToolCall("sum", {"a": 2})])
    kw = dict(tool_retries=1, repair_tool_calls=True)
    trajs = [play(tok, [MIXED, GOOD, ANSWER], **kw)[0],  # 2 call turns, 1 malformed, retried with success
             play(tok, [comma, ANSWER], **kw)[0],  # 1 call turn, degraded
             play(tok, [unknown] * 4, max_turns=1, **kw)[0]]  # 2 malformed call turns, 1 retry, no success
    for i, t in enumerate(trajs):
        t.group_id = f"g{i}"
    step = step_summary(trajs, difficulty=1, ratio=1.0)
    assert (step.malformed_rate, step.retry_success_rate, step.degraded_calls) == (3 / 5, 1 / 2, 1 / 3)
    ev = eval_summary("math", trajs, ks=(1,))
    assert (ev.malformed_rate, ev.retry_success_rate, ev.degraded_calls) == (3 / 5, 1 / 2, 1)
    m = metrics(ev)
    assert (m["malformed_rate"], m["retry_success_rate"], m["degraded_calls"]) == (3 / 5, 1 / 2, 1)
    from rich.console import Console

    from assay.eval.tables import dimensions_table

    console = Console(width=300, record=True)
    console.print(dimensions_table({"math": ev}, (1,), (0.0, 0.0)))
    row = next(line for line in console.export_text().splitlines() if "│ math" in line)
    cells = [c.strip() for c in row.split("│")[1:-1]]
    assert cells[6:9] == ["0.600 of 5", "0.500 of 2", "1 (0)"]  # malformed calls, retries ok, degraded (fallback)


def test_a_declared_fallback_tool_takes_a_hallucinated_call_whose_arguments_fit(tok):
    import pytest
    from pydantic import ValidationError

    from assay.core.config import AgentConfig
    from assay.core.errors import AssayError
    from assay.mixer.stats import summarize as step_summary

    agent = AgentConfig(fallback_tools={"calculator": "calc"})
    fits = Message("assistant", "", [ToolCall("calculator", {"expression": "2+3"})])
    traj, ep, _ = play(tok, [fits, ANSWER], agent=agent)
    assert traj.passed and ep.calls == [ToolCall("calc", {"expression": "2+3"})]
    assert traj.messages[2].tool_calls == ep.calls  # recorded as routed, the sampled tokens as sampled
    assert counters(traj) == (2, 0, 1, 0, 0, 0, 1) and traj.fallback_calls == 1
    assert step_summary([traj], difficulty=1, ratio=1.0).fallback_calls == 1.0

    misfit = Message("assistant", "", [ToolCall("calculator", {"expr": "2+3"})])  # breaks calc's schema
    traj, ep, _ = play(tok, [misfit, ANSWER], agent=agent)
    assert ep.calls == [] and traj.fallback_calls == 0
    assert [m.content for m in traj.messages if m.role == "tool"] == [
        "error: unknown tool 'calculator'; known tools: calc"]
    assert counters(traj) == (2, 1, 1, 1, 0, 0, 0)
    undeclared, _, _ = play(tok, [fits, ANSWER])  # no declaration: the usual unknown-tool error
    assert counters(undeclared) == counters(traj) and undeclared.fallback_calls == 0

    with pytest.raises(AssayError, match="'sum', which task 2\\+3 does not offer"):
        play(tok, [fits, ANSWER], agent=AgentConfig(fallback_tools={"calculator": "sum"}))
    with pytest.raises(AssayError, match="'calc' is a tool task 2\\+3 offers"):
        play(tok, [fits, ANSWER], agent=AgentConfig(fallback_tools={"calc": "calculator"}))
    with pytest.raises(ValidationError, match="falls back to itself"):
        AgentConfig(fallback_tools={"calc": "calc"})
