"""Pieces the built-in environments share: seeding, task ids, the answer line, single-turn episodes."""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from assay.core.errors import AssayError
from assay.core.types import Message, Observation, Reward, ToolCall

# The one learnable form every built-in environment's final answer takes: a line `Answer: <value>`.
ANSWER_PREFIX = "Answer:"
# What a prompt says of it, so that a general instruct model knows the format it is graded on.
ANSWER_FORMAT = "End your reply with a line 'Answer: N', where N is the integer result."
_INT = re.compile(r"-?\d+")
# The most digits an integer answer may have: a longer one is no answer (a wrong answer, scored 0), not a
# verifier error. Python's int() refuses more than 4300 digits, and an episode whose verifier raises is
# dropped from training as an infrastructure failure, so the policy that wrote it would escape its zero.
MAX_DIGITS = 1000
_NO_ANSWER = "no 'Answer: <integer>' line"
_EMPHASIS = "*_`"  # markdown a chat model puts around a label or a value: "**Answer:** 42", "Answer: `42`."


def draw_seed(rng: random.Random) -> int:
    """The one draw `generate` takes from the caller's rng: the task is a function of it alone."""
    return rng.getrandbits(32)


def task_rng(spec: str, difficulty: int, seed: int) -> random.Random:
    return random.Random(f"{spec}/{difficulty}/{seed}")  # str seeds hash deterministically across runs


def task_id(spec: str, difficulty: int, content: Any) -> str:
    """Content-addressed: the same task drawn from two seeds has one id (overlap checks rely on it)."""
    blob = json.dumps([spec, difficulty, content], sort_keys=True, default=str)
    return f"{spec.split('@')[0]}-{difficulty}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def check_difficulty(name: str, difficulty: int, levels: Sequence[int]) -> None:
    if difficulty not in levels:
        raise AssayError(f"environment {name!r}: no difficulty {difficulty}; levels are {list(levels)}")


def extract_answer(text: str) -> str | None:
    """The text after the last `Answer:` up to the end of its line, stripped; None if there is none."""
    at = text.rfind(ANSWER_PREFIX)
    if at < 0:
        return None
    return text[at + len(ANSWER_PREFIX):].split("\n", 1)[0].strip()


def extract_int(text: str) -> int | None:
    """The integer of the last `Answer:` line. Markdown emphasis around it and one trailing period are
    ignored ("**Answer:** 42.", "Answer: `42`"); anything else on the line (a second number, words, a
    unit) makes it no answer, so a list of candidates cannot pass; so does an integer of more than
    MAX_DIGITS digits."""
    return read_int(text)[0]


def read_int(text: str) -> tuple[int | None, str]:
    """`extract_int`'s integer, and why there is none ("" when there is)."""
    answer = extract_answer(text)
    if answer is None:
        return None, _NO_ANSWER
    answer = answer.strip(_EMPHASIS + " ").removesuffix(".").strip(_EMPHASIS + " ")
    if not _INT.fullmatch(answer):
        return None, _NO_ANSWER
    digits = len(answer.lstrip("-"))
    if digits > MAX_DIGITS:
        return None, f"the answer has {digits} digits, more than the {MAX_DIGITS} an answer may have"
    return int(answer), ""


def last_assistant(messages: Sequence[Message]) -> Message | None:
    return next((m for m in reversed(messages) if m.role == "assistant"), None)


def grade_int(final: Sequence[Message], expected: int) -> Reward:
    """Exact integer match of the final assistant message's `Answer:` line."""
    msg = last_assistant(final)
    got, why = read_int(msg.content) if msg is not None else (None, _NO_ANSWER)
    if got is None:
        return Reward(0.0, False, details={"reason": why, "expected": expected})
    ok = got == expected
    return Reward(float(ok), ok, details={"got": got, "expected": expected})


@dataclass
class SingleTurnEpisode:
    """An episode without tools: a call is answered with an error; `grade` scores the final answer."""

    grade: Callable[[Sequence[Message]], Reward]
    tool_errors: int = 0

    def step(self, call: ToolCall) -> Observation:
        self.tool_errors += 1
        return Observation(f"error: this task has no tools (called {call.name!r}); answer directly", is_error=True)

    def verify(self, final: list[Message]) -> Reward:
        return self.grade(final)
