from __future__ import annotations

import random

from assay.core.types import OK, Message, Task, ToolCall
from assay.envs.builtin._common import ANSWER_FORMAT, MAX_DIGITS, extract_answer, extract_int
from assay.envs.builtin.arith import MAX_FACTOR, MAX_VALUE, ArithEnv, parse, render, steps


def _chain(expr: str) -> tuple[int, list[tuple[int, str, int, int]]]:
    out: list[tuple[int, str, int, int]] = []
    return steps(parse(expr), out), out


def test_parse_follows_precedence_and_left_associativity():
    assert _chain("3*4+7-5") == (14, [(3, "*", 4, 12), (12, "+", 7, 19), (19, "-", 5, 14)])
    assert _chain("20-3-4") == (13, [(20, "-", 3, 17), (17, "-", 4, 13)])
    assert _chain("2+3*4") == (14, [(3, "*", 4, 12), (2, "+", 12, 14)])
    assert _chain("(7+17-12)*(14-9)")[0] == 60
    assert _chain("19+(12*12+2*3)") == (169, [(12, "*", 12, 144), (2, "*", 3, 6), (144, "+", 6, 150),
                                             (19, "+", 150, 169)])


def test_render_round_trips_with_minimal_parentheses():
    for expr in ["3*4+7-5", "20-(3-4)", "(2+3)*4", "2*(3*4)", "8-(2+1)", "(1+2)*(3-1)"]:
        assert render(parse(expr)) == expr


def test_levels_have_their_shape_and_bounds():
    env, rng = ArithEnv(), random.Random(0)
    for difficulty, n_ops in [(1, 1), (2, 2), (3, 3), (4, 4)]:
        for _ in range(100):
            task = env.generate(rng, difficulty)
            expr = task.payload["expression"]
            value, chain = _chain(expr)
            assert len(chain) == n_ops and value == task.payload["answer"]
            assert all(0 <= c <= MAX_VALUE for _, _, _, c in chain)
            assert all(max(a, b) <= MAX_FACTOR for a, op, b, _ in chain if op == "*")
            assert ("*" in expr) == (difficulty >= 3) and ("(" in expr) == (difficulty == 4)
            assert task.prompt == [Message("user", f"Compute {expr}. {ANSWER_FORMAT}")]


def test_reference_form_is_steps_then_answer():
    task = Task(env="arith@2", task_id="t", domain="math", difficulty=3, prompt=[],
                payload={"expression": "3*4+7-5", "answer": 14})
    assert ArithEnv().reference_solution(task) == [Message("assistant", "3*4=12, 12+7=19, 19-5=14\nAnswer: 14")]


def test_generation_is_pinned_for_a_seed():
    # A change here changes the tasks of arith@2, which arith@3 and @4 repeat (the answer format stated, then a
    # huge answer a wrong one): bump the version instead.
    task = ArithEnv().generate(random.Random(0), 2)
    assert task.prompt[0].content == "Compute 10+13-19. " + ANSWER_FORMAT and task.payload["answer"] == 4
    assert task.task_id == "arith-2-70b866785581"  # arith@2's id: the same task, the same partition


def _grade(answer: str, expected: int = 14) -> bool:
    task = Task(env="arith@2", task_id="t", domain="math", difficulty=1, prompt=[],
                payload={"expression": "3*4+7-5", "answer": expected})
    return ArithEnv().start(task, None).verify([Message("assistant", answer)]).passed


def test_verifier_reads_only_the_answer_line():
    assert _grade("Answer: 14") and _grade("3*4=12\nAnswer: 14") and _grade("Answer:14 ")
    assert _grade("Answer: 13\nAnswer: 14")  # the last answer line counts
    assert not _grade("Answer: 15") and not _grade("Answer: 13")  # off by one
    assert not _grade("14") and not _grade("") and not _grade("Compute 3*4+7-5.")  # no answer line
    assert not _grade("Answer: 14.0") and not _grade("Answer: 14 or 15") and not _grade("Answer: fourteen")
    assert _grade("Answer: -3", expected=-3)


def test_a_huge_number_is_a_wrong_answer_not_a_verifier_error():
    """Python's int() refuses more than 4300 digits: a verifier that raised there would make the episode an
    infrastructure failure, which training drops, and the policy that wrote it would escape its zero."""
    task = Task(env="arith@2", task_id="t", domain="math", difficulty=1, prompt=[],
                payload={"expression": "3*4+7-5", "answer": 14})
    reward = ArithEnv().start(task, None).verify([Message("assistant", "Answer: " + "9" * 5000)])
    assert reward.status == OK and not reward.passed and reward.score == 0
    assert reward.details["reason"] == f"the answer has 5000 digits, more than the {MAX_DIGITS} an answer may have"
    assert extract_int("Answer: -" + "1" * MAX_DIGITS) == -int("1" * MAX_DIGITS)  # the bound itself is read
    assert extract_int("Answer: " + "1" * (MAX_DIGITS + 1)) is None


def test_a_right_answer_in_the_stated_format_passes_with_a_chat_models_markdown():
    """The prompt asks for a line 'Answer: N'; a chat model's emphasis around it is not a wrong answer."""
    assert "'Answer: N'" in ANSWER_FORMAT
    assert _grade("**Answer:** 14") and _grade("Answer: **14**") and _grade("Answer: `14`.") and _grade("Answer: 14.")
    assert not _grade("**Answer:** 14 or 15") and not _grade("Answer: 14, 15") and not _grade("Answer: **15**")


def test_extract_helpers():
    assert extract_answer("x\nAnswer:  42 \nmore") == "42"
    assert extract_answer("no answer") is None
    assert extract_int("Answer: -7") == -7 and extract_int("Answer: 7x") is None


def test_a_tool_call_is_an_error_observation():
    env = ArithEnv()
    task = env.generate(random.Random(1), 1)
    episode = env.start(task, None)
    obs = episode.step(ToolCall("calc", {"expression": "1+1"}))
    assert obs.is_error and "no tools" in obs.content and episode.tool_errors == 1
