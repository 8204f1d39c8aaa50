"""An endpoint's episodes get the agent loop's countermeasures: bounded retries of malformed calls, repaired
arguments, declared fallback tools, the memory tools and compaction, each counted as the loop counts it. The
policy is a scripted chat-completions client (no server needed: `_episode` takes the client); the environment
and its verifier are real (toolcalc, in turns of lookups)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from assay.core.config import AgentConfig, DomainConfig
from assay.core.errors import AssayError
from assay.envs import get_env
from assay.eval.endpoint import Endpoint, _episode, run_endpoint_episodes


def response(content: str = "", calls: list[tuple[str, str]] = (), prompt_tokens: int = 50):
    tool_calls = [SimpleNamespace(id=f"c{i}", function=SimpleNamespace(name=n, arguments=a))
                  for i, (n, a) in enumerate(calls)] or None
    return SimpleNamespace(usage=SimpleNamespace(prompt_tokens=prompt_tokens, completion_tokens=10),
                           choices=[SimpleNamespace(message=SimpleNamespace(content=content, tool_calls=tool_calls),
                                                    finish_reason="tool_calls" if calls else "stop")])


class Scripted:
    """A client that answers with `turns` in order and keeps every request's messages."""

    def __init__(self, turns):
        self.turns, self.sent = list(turns), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, model, messages, **kw):
        self.sent.append(messages)
        return self.turns.pop(0)


@pytest.fixture(scope="module")
def env():
    return get_env("toolcalc")


@pytest.fixture(scope="module")
def task(env):
    t = env.generate(random.Random(0), 1)
    t.domain = "toolcalc"
    return t


def play(env, task, turns, **domain):
    agent = domain.pop("agent", {})
    dom = DomainConfig(name="toolcalc", env="toolcalc", max_turns=domain.pop("max_turns", 6),
                       agent=AgentConfig(**agent), **domain)
    client = Scripted(turns)
    return _episode(client, "m", env, task, dom, 1.0, 0), client


def key_and_answer(env, task) -> tuple[str, str]:
    ref = env.reference_solution(task)
    return ref[0].tool_calls[0].arguments["key"], ref[-1].content


def test_a_malformed_call_is_retried_with_the_validators_message_outside_max_turns(env, task):
    key, answer = key_and_answer(env, task)
    turns = [response(calls=[("lookup", f"{{key: '{key}'}}")]), response(calls=[("lookup", json.dumps({"key": key}))]),
             response(answer)]
    retried, client = play(env, task, list(turns), tool_retries=1, max_turns=2)
    assert retried.passed and retried.turns == 3  # the retry turn is free: two counted turns were enough
    assert (retried.malformed_calls, retried.retries, retried.retry_successes, retried.degraded_calls) == (1, 1, 1, 0)
    retry = client.sent[1][-1]
    assert retry["role"] == "tool" and "not JSON" in retry["content"] and "Nothing was run" in retry["content"]
    plain, _ = play(env, task, list(turns), max_turns=2)  # without retries the error costs a turn
    assert not plain.passed and plain.finish_reason == "max_turns" and plain.retries == 0
    assert plain.malformed_calls == 1 and plain.tool_errors == 1
    repaired, _ = play(env, task, [turns[0], turns[2]], repair_tool_calls=True)
    assert repaired.passed and repaired.degraded_calls == 1 and repaired.malformed_calls == 0 and repaired.turns == 2


def test_a_declared_fallback_runs_a_hallucinated_tool_as_the_real_one(env, task):
    key, answer = key_and_answer(env, task)
    turns = [response(calls=[("get_value", json.dumps({"key": key}))]), response(answer)]
    routed, _ = play(env, task, list(turns), agent={"fallback_tools": {"get_value": "lookup"}})
    assert routed.passed and (routed.fallback_calls, routed.degraded_calls, routed.tool_errors) == (1, 1, 0)
    assert routed.messages[len(task.prompt)].tool_calls[0].name == "lookup"  # recorded as routed
    unknown, _ = play(env, task, list(turns) + [response(answer)])
    assert unknown.tool_errors == 1 and "unknown tool" in unknown.messages[len(task.prompt) + 1].content


def test_memory_tools_are_offered_and_answered_outside_the_environment(env, task):
    key, answer = key_and_answer(env, task)
    turns = [response(calls=[("note_write", json.dumps({"key": "plan", "text": f"look up {key}"}))]),
             response(calls=[("note_read", json.dumps({"key": "plan"})), ("lookup", json.dumps({"key": key}))]),
             response(answer)]
    got, client = play(env, task, turns, agent={"memory": True})
    assert got.passed and got.memory_calls == 2 and got.memory_errors == 0
    assert f"look up {key}" in got.messages[len(task.prompt) + 3].content


def test_compaction_elides_old_results_in_what_the_server_sees_and_keeps_the_record_whole(env, task):
    key, answer = key_and_answer(env, task)
    lookups = [response(calls=[("lookup", json.dumps({"key": key}))], prompt_tokens=p) for p in (100, 200, 900)]
    got, client = play(env, task, [*lookups, response(answer, prompt_tokens=300)], max_context=1000,
                       agent={"compaction": "elide_observations", "keep_last": 1, "compact_at": 0.9})
    assert got.passed and got.compactions == 1 and got.compacted_turns == [4]
    assert got.peak_context == 910
    last = [m for m in client.sent[-1] if m["role"] == "tool"]
    assert [m["content"] for m in last] == ["[lookup output elided: 2 characters]"] * 2 + [last[-1]["content"]]
    assert not last[-1]["content"].startswith("[")
    assert all(not m.content.startswith("[") for m in got.messages if m.role == "tool")  # the record is whole
    dropped, client = play(env, task, [*lookups, response(answer)], max_context=1000,
                           agent={"compaction": "drop_turns", "keep_last": 1})
    assert dropped.passed and len(client.sent[-1]) == len(task.prompt) + 2


def test_what_has_no_endpoint_form_is_refused_before_any_request(env, task):
    dom = {"toolcalc": DomainConfig(name="toolcalc", env="toolcalc", agent=AgentConfig(mode="plan_execute"))}
    with pytest.raises(AssayError, match="agent.mode 'plan_execute'"):
        run_endpoint_episodes(Endpoint("http://127.0.0.1:9/v1", "m"), {"toolcalc": env}, dom, [task], 1, 1.0, 0)
