from __future__ import annotations

import random

from assay.core.types import Message, Task, ToolCall
from assay.envs.builtin._common import ANSWER_FORMAT
from assay.envs.builtin.toolcalc import LOOKUP, SYSTEM, ToolcalcEnv
from assay.envs.tools import parse_call


def _task(difficulty: int, table: dict[str, int], signs: str, answer: int) -> Task:
    return Task(env="toolcalc@2", task_id="t", domain="agent", difficulty=difficulty, prompt=[],
                tools=[LOOKUP], payload={"table": table, "keys": list(table), "signs": signs, "answer": answer})


def test_reference_trajectory_for_a_hand_built_task():
    env = ToolcalcEnv()
    task = _task(4, {"kiwi": 14, "plum": 9, "fig": 5}, "++-", 18)
    ref = env.reference_solution(task)
    assert [m.role for m in ref] == ["assistant", "tool"] * 3 + ["assistant"]
    assert ref[0].tool_calls == [ToolCall("lookup", {"key": "kiwi"}, id="call_0")] and ref[0].content == ""
    assert [m.content for m in ref if m.role == "tool"] == ["14", "9", "5"]
    assert ref[-1] == Message("assistant", "14+9=23, 23-5=18\nAnswer: 18")
    assert env.reference_solution(_task(1, {"kiwi": 77}, "+", 77))[-1].content == "Answer: 77"


def test_prompts_by_level():
    env, rng = ToolcalcEnv(), random.Random(3)
    for difficulty, signs in [(1, "+"), (2, "++"), (3, "+-"), (4, "++-")]:
        task = env.generate(rng, difficulty)
        keys, table = task.payload["keys"], task.payload["table"]
        assert task.payload["signs"] == signs and len(set(keys)) == len(keys) == len(signs)
        question = keys[0] + "".join(f" {s} {k}" for s, k in zip(signs[1:], keys[1:], strict=True))
        assert task.prompt == [Message("system", SYSTEM), Message("user", f"What is {question}? {ANSWER_FORMAT}")]
        total = table[keys[0]] + sum(table[k] if s == "+" else -table[k] for s, k in zip(signs[1:], keys[1:],
                                                                                         strict=True))
        assert total == task.payload["answer"] >= 0
        assert task.tools == [LOOKUP]


def test_invalid_calls_are_error_observations_and_counted():
    env = ToolcalcEnv()
    task = _task(2, {"kiwi": 14, "plum": 9}, "++", 23)
    episode = env.start(task, None)
    bad = [
        (ToolCall("search", {"key": "kiwi"}), "unknown tool 'search'; known tools: lookup"),
        (ToolCall("lookup", {"key": 5}), "lookup: invalid key: 5 is not of type 'string'"),
        (ToolCall("lookup", {}), "lookup: invalid arguments: 'key' is a required property"),
        (ToolCall("lookup", {"key": "kiwi", "n": 1}), "Additional properties are not allowed ('n' was unexpected)"),
        (parse_call('{"name": "lookup", "arguments": {"key": "kiwi"'), "unparsable tool call: not valid JSON"),
        (ToolCall("lookup", {"key": "banana"}), "no entry 'banana'"),
    ]
    for n, (call, message) in enumerate(bad, start=1):
        obs = episode.step(call)
        assert obs.is_error and message in obs.content and not obs.done, obs
        assert episode.tool_errors == n
    # The agent may retry: valid calls then a right answer still pass; the errors stay recorded.
    assert episode.step(ToolCall("lookup", {"key": "kiwi"})).content == "14"
    assert episode.step(ToolCall("lookup", {"key": "plum"})).content == "9"
    reward = episode.verify([Message("assistant", "14+9=23\nAnswer: 23")])
    assert reward.passed and reward.details["tool_errors"] == 6 and reward.details["lookups"] == 2


def test_wrong_answers_fail(play):
    env = ToolcalcEnv()
    task = env.generate(random.Random(11), 2)
    calls = env.reference_solution(task)[:-1]
    answer = task.payload["answer"]
    for final in [f"Answer: {answer + 1}", f"Answer: {answer - 1}", "", str(answer), task.prompt[1].content]:
        reward, _, _ = play(env, task, calls + [Message("assistant", final)])
        assert not reward.passed and reward.score == 0.0, final
    assert play(env, task, calls + [Message("assistant", f"Answer: {answer}")])[0].passed


def test_full_reference_trajectory_replays_exactly(play):
    env, rng = ToolcalcEnv(), random.Random(8)
    for difficulty in (1, 2, 3, 4):
        for _ in range(10):
            task = env.generate(rng, difficulty)
            ref = env.reference_solution(task)
            reward, observations, episode = play(env, task, ref)
            assert [o.content for o in observations] == [m.content for m in ref if m.role == "tool"]
            assert reward.passed and episode.tool_errors == 0 and episode.lookups == task.payload["keys"]
