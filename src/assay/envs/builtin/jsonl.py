"""jsonl: a user's file of `{"prompt": ..., "answer": ...}` records as an environment.

Optional record fields: `difficulty` (int >= 1, default 1) and, for the regex matcher,
`reference` (a string the answer pattern fullmatches, used as the reference solution; when
absent the pattern itself is the reference, which is refused unless it matches itself, e.g. a
plain word). The model's final answer is the text after its last `Answer:`, or its whole last
message when there is none, stripped. Matchers: exact (string equality), numeric (floats within
1e-6 relative), regex (the answer pattern fullmatches). The reference writes `Answer: <answer>`,
the form every built-in environment shares.

Difficulty: `generate` accepts any level >= 1 and uses the nearest level present in the file
(the lower one on a tie), so a default 1..4 curriculum runs on a file without difficulties;
`difficulties` is therefore 1..4 plus whatever levels the file has, `levels` the ones it has.
A task keeps the requested difficulty; `payload["level"]` is the level its record came from."""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from assay.core.errors import AssayError
from assay.core.types import Message, Reward, Task, ToolSpec
from assay.envs.builtin._common import SingleTurnEpisode, draw_seed, extract_answer, last_assistant, task_id, task_rng
from assay.envs.registry import env_hash, register
from assay.sandbox.base import Sandbox

MATCHERS = ("exact", "numeric", "regex")
REL_TOL = 1e-6


@dataclass(frozen=True)
class Record:
    line: int
    prompt: str
    answer: str
    reference: str
    difficulty: int


def _fail(path: Path, line: int, problem: str) -> AssayError:
    return AssayError(f"jsonl environment: {path}:{line}: {problem}; each line must be a JSON object with "
                      f'"prompt" and "answer" (optional "difficulty", "reference")')


def load_records(path: Path, matcher: str) -> list[Record]:
    if not path.is_file():
        raise AssayError(f"jsonl environment: no file {str(path)!r}; set env_args.path to a JSONL file of "
                         '{"prompt": ..., "answer": ...} records')
    records = []
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise _fail(path, n, f"not valid JSON ({e.msg})") from e
        if not isinstance(obj, dict):
            raise _fail(path, n, f"a {type(obj).__name__}, not an object")
        missing = [k for k in ("prompt", "answer") if k not in obj]
        if missing:
            raise _fail(path, n, f"record is missing {', '.join(map(repr, missing))}")
        records.append(_record(path, n, obj, matcher))
    if not records:
        raise AssayError(f"jsonl environment: {path} has no records; add one JSON object per line")
    return records


def _record(path: Path, n: int, obj: dict[str, Any], matcher: str) -> Record:
    prompt, answer = obj["prompt"], obj["answer"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise _fail(path, n, "prompt must be a non-empty string")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise _fail(path, n, "answer must be a string or a number")
    answer = str(answer).strip()
    difficulty = obj.get("difficulty", 1)
    if isinstance(difficulty, bool) or not isinstance(difficulty, int) or difficulty < 1:
        raise _fail(path, n, f"difficulty must be an integer >= 1, got {difficulty!r}")
    reference = answer
    if matcher == "numeric" and _number(answer) is None:
        raise _fail(path, n, f"answer {answer!r} is not a number (matcher numeric)")
    if matcher == "regex":
        try:
            pattern = re.compile(answer)
        except re.error as e:
            raise _fail(path, n, f"answer {answer!r} is not a valid regex ({e})") from e
        reference = str(obj.get("reference", answer)).strip()
        if not pattern.fullmatch(reference):
            fix = "fix the reference" if "reference" in obj else 'add a "reference" the pattern matches'
            raise _fail(path, n, f"pattern {answer!r} does not match the reference {reference!r}; {fix}")
    return Record(n, prompt, answer, reference, difficulty)


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def matches(matcher: str, answer: str, given: str) -> bool:
    if matcher == "exact":
        return given == answer
    if matcher == "numeric":
        got, want = _number(given), _number(answer)
        return got is not None and want is not None and math.isclose(got, want, rel_tol=REL_TOL, abs_tol=1e-12)
    return re.fullmatch(answer, given) is not None


def grade(final: list[Message], matcher: str, answer: str) -> Reward:
    msg = last_assistant(final)
    if msg is None or not msg.content.strip():
        return Reward(0.0, False, details={"reason": "empty answer"})
    given = extract_answer(msg.content)
    given = msg.content.strip() if given is None else given
    ok = matches(matcher, answer, given)
    return Reward(float(ok), ok, details={"got": given[:200], "matcher": matcher})


@register
class JsonlEnv:
    name = "jsonl"
    version = "4"  # 3, 4: only the shared _common changed (the answer line's parsing, then its integer bound);
    # 2's tasks
    task_stream = "jsonl@2"  # the version whose draws (tasks, ids, partition) this one repeats
    tools: tuple[ToolSpec, ...] = ()
    hash_deps = ("assay.envs.builtin._common",)

    def __init__(self, path: str, matcher: str = "exact", category: str = "custom") -> None:
        if matcher not in MATCHERS:
            raise AssayError(f"jsonl environment: unknown matcher {matcher!r}; use one of {', '.join(MATCHERS)}")
        self.path = Path(path)
        self.matcher = matcher
        self.category = category
        self.records = load_records(self.path, matcher)
        self.by_level: dict[int, list[Record]] = {}
        for r in self.records:
            self.by_level.setdefault(r.difficulty, []).append(r)
        self.levels = tuple(sorted(self.by_level))
        self.difficulties = tuple(sorted(set(self.levels) | {1, 2, 3, 4}))
        self._fingerprint = hashlib.sha256(self.path.read_bytes() + f"\0{matcher}\0{category}".encode()).hexdigest()

    def fingerprint(self) -> str:
        """The data and settings this instance serves: part of its env_hash."""
        return self._fingerprint

    def nearest_level(self, difficulty: int) -> int:
        if difficulty < 1:
            raise AssayError(f"jsonl environment: difficulty must be >= 1, got {difficulty}")
        return min(self.levels, key=lambda level: (abs(level - difficulty), level))

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        spec = f"{self.name}@{self.version}"
        level = self.nearest_level(difficulty)
        seed = draw_seed(rng)
        pool = self.by_level[level]
        record = pool[task_rng(self.task_stream, level, seed).randrange(len(pool))]
        payload = {"answer": record.answer, "reference": record.reference, "matcher": self.matcher,
                   "line": record.line, "level": level}
        # Labelled with the requested difficulty, so a curriculum's per-level accounting sees what it asked for.
        return Task(env=spec, task_id=task_id(self.task_stream, level, [self._fingerprint[:12], record.line, record.prompt]),
                    difficulty=difficulty, prompt=[Message("user", record.prompt)],
                    payload=payload, seed=seed, env_hash=env_hash(self))

    def reference_solution(self, task: Task) -> list[Message]:
        return [Message("assistant", f"Answer: {task.payload['reference']}")]

    def start(self, task: Task, sandbox: Sandbox | None) -> SingleTurnEpisode:
        return SingleTurnEpisode(partial(grade, matcher=task.payload["matcher"], answer=task.payload["answer"]))
