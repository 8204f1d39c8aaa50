from __future__ import annotations

import random

import pytest

from assay.core.errors import AssayError
from assay.core.types import Message
from assay.envs import env_hash, get_env
from assay.envs.builtin.jsonl import JsonlEnv


def _grade(env: JsonlEnv, answer: str, difficulty: int = 1) -> bool:
    task = env.generate(random.Random(0), difficulty)
    return env.start(task, None).verify(task.prompt + [Message("assistant", answer)]).passed


def test_exact(jsonl_file):
    env = JsonlEnv(jsonl_file([{"prompt": "Capital of France?", "answer": "Paris"}]))
    task = env.generate(random.Random(0), 1)
    assert task.env == "jsonl@4" and env.category == "custom" and task.prompt == [Message("user", "Capital of France?")]
    assert env.reference_solution(task) == [Message("assistant", "Answer: Paris")]
    assert _grade(env, "Answer: Paris") and _grade(env, "Paris") and _grade(env, "  Paris\n")
    assert not _grade(env, "Answer: paris") and not _grade(env, "") and not _grade(env, "Capital of France?")
    assert not _grade(env, "Answer: Paris, France")


def test_numeric(jsonl_file):
    env = JsonlEnv(jsonl_file([{"prompt": "pi?", "answer": 3.14159}]), matcher="numeric")
    assert _grade(env, "Answer: 3.14159") and _grade(env, "Answer: 3.141592")  # within 1e-6 relative
    assert not _grade(env, "Answer: 3.1416") and not _grade(env, "Answer: pi") and not _grade(env, "")
    zero = JsonlEnv(jsonl_file([{"prompt": "0?", "answer": "0"}], name="zero.jsonl"), matcher="numeric")
    assert _grade(zero, "Answer: 0.0") and _grade(zero, "-0") and not _grade(zero, "Answer: 0.001")


def test_regex(jsonl_file):
    env = JsonlEnv(jsonl_file([{"prompt": "A color?", "answer": "(red|green)", "reference": "green"}]),
                   matcher="regex")
    task = env.generate(random.Random(0), 1)
    assert env.reference_solution(task) == [Message("assistant", "Answer: green")]
    assert _grade(env, "Answer: red") and _grade(env, "green")
    assert not _grade(env, "Answer: redd") and not _grade(env, "Answer: blue") and not _grade(env, "")
    # A pattern that matches itself needs no reference.
    plain = JsonlEnv(jsonl_file([{"prompt": "Say hi", "answer": "hi"}], name="p.jsonl"), matcher="regex")
    assert plain.reference_solution(plain.generate(random.Random(0), 1))[0].content == "Answer: hi"


def test_difficulty_falls_back_to_the_nearest_level(jsonl_file):
    env = JsonlEnv(jsonl_file([{"prompt": "easy", "answer": "1"}, {"prompt": "hard", "answer": "3", "difficulty": 3}]))
    assert env.levels == (1, 3) and env.difficulties == (1, 2, 3, 4)
    picks = {d: env.generate(random.Random(d), d) for d in (1, 2, 3, 4)}
    assert [picks[d].prompt[0].content for d in (1, 2, 3, 4)] == ["easy", "easy", "hard", "hard"]  # 2: tie -> lower
    assert [picks[d].difficulty for d in (1, 2, 3, 4)] == [1, 2, 3, 4]
    assert [picks[d].payload["level"] for d in (1, 2, 3, 4)] == [1, 1, 3, 3]
    with pytest.raises(AssayError, match="difficulty must be >= 1"):
        env.generate(random.Random(0), 0)


def test_generate_draws_every_record(jsonl_file):
    env = JsonlEnv(jsonl_file([{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]))
    rng = random.Random(0)
    seen = {env.generate(rng, 1).prompt[0].content for _ in range(100)}
    assert seen == {f"q{i}" for i in range(5)}


@pytest.mark.parametrize("records, matcher, message", [
    (['{"prompt": "a", "answer": "b"}', "{not json"], "exact", r"data.jsonl:2: not valid JSON"),
    (['{"prompt": "a"}'], "exact", r"data.jsonl:1: record is missing 'answer'"),
    (['{"answer": "a"}'], "exact", r"missing 'prompt'"),
    (["[1, 2]"], "exact", r":1: a list, not an object"),
    ([{"prompt": "", "answer": "a"}], "exact", "prompt must be a non-empty string"),
    ([{"prompt": "a", "answer": "b", "difficulty": 0}], "exact", "difficulty must be an integer >= 1"),
    ([{"prompt": "a", "answer": "x"}], "numeric", "is not a number"),
    ([{"prompt": "a", "answer": "(red"}], "regex", "not a valid regex"),
    ([{"prompt": "a", "answer": "\\d+"}], "regex", 'add a "reference"'),
    ([{"prompt": "a", "answer": "\\d+", "reference": "x"}], "regex", "fix the reference"),
    ([""], "exact", "has no records"),
])
def test_bad_files_are_named_errors(jsonl_file, records, matcher, message):
    with pytest.raises(AssayError, match=message):
        JsonlEnv(jsonl_file(records), matcher=matcher)


def test_missing_file_and_bad_matcher(tmp_path, jsonl_file):
    with pytest.raises(AssayError, match="no file .*nope.jsonl.*env_args.path"):
        JsonlEnv(str(tmp_path / "nope.jsonl"))
    with pytest.raises(AssayError, match="unknown matcher 'fuzzy'; use one of exact, numeric, regex"):
        JsonlEnv(jsonl_file([{"prompt": "a", "answer": "b"}]), matcher="fuzzy")


def test_registry_args_category_and_data_in_the_hash(jsonl_file):
    path = jsonl_file([{"prompt": "a", "answer": "b"}])
    env = get_env("jsonl", path=path, category="trivia")
    task = env.generate(random.Random(0), 1)
    assert env.category == "trivia" and task.domain == "" and task.env_hash == env_hash(env)  # the run names domains
    changed = get_env("jsonl@4", path=jsonl_file([{"prompt": "a", "answer": "c"}], name="other.jsonl"),
                      category="trivia")
    assert env_hash(changed) != env_hash(env)  # same code, different data
    with pytest.raises(AssayError, match="it takes path: str, matcher: str, category: str"):
        get_env("jsonl")
