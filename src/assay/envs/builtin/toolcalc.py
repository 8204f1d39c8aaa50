"""toolcalc: look up hidden numbers with a tool, combine them, answer `Answer: N` (multi-turn).

Each task hides a table name -> number; the prompt names the entries but only `lookup` reveals
them, so the tool is needed. Level 1: one lookup. Level 2: a + b. Level 3: a - b (a >= b).
Level 4: a + b - c (>= 0). The reference calls `lookup` once per turn, then writes the
arithmetic like arith does: `14+9=23\nAnswer: 23`. A call that is unparsable, names an unknown
tool, breaks the schema or asks for a missing name gets an error observation and counts as a
tool error; the agent may retry within its turns."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from assay.core.types import Message, Observation, Reward, Task, ToolCall, ToolSpec
from assay.envs.builtin._common import ANSWER_FORMAT, check_difficulty, draw_seed, grade_int, task_id, task_rng
from assay.envs.registry import env_hash, register
from assay.envs.tools import object_schema, validate_call
from assay.sandbox.base import Sandbox

NAMES = ("apple", "pear", "plum", "kiwi", "lime", "fig", "date", "grape", "mango", "peach", "lemon", "melon",
         "berry", "cherry", "olive", "guava", "bean", "corn", "rice", "nut", "oat", "pea", "yam", "leek")

LOOKUP = ToolSpec("lookup", "Get the hidden number for a name.",
                  object_schema({"key": {"type": "string", "description": "the name, e.g. kiwi"}}))
SYSTEM = "Each name stands for a hidden number. Use the lookup tool to get it."

# difficulty -> the signs the looked-up numbers are combined with
_SIGNS = {1: "+", 2: "++", 3: "+-", 4: "++-"}


def _combine(values: list[int], signs: str) -> tuple[int, list[str]]:
    """The result and the arithmetic steps, left to right: ['14+9=23', '23-5=18']."""
    total, work = values[0], []
    for v, s in zip(values[1:], signs[1:], strict=True):
        nxt = total + v if s == "+" else total - v
        work.append(f"{total}{s}{v}={nxt}")
        total = nxt
    return total, work


@dataclass
class ToolcalcEpisode:
    table: dict[str, int]
    expected: int
    tools: list[ToolSpec]
    tool_errors: int = 0
    lookups: list[str] = field(default_factory=list)

    def step(self, call: ToolCall) -> Observation:
        error = validate_call(call, self.tools)
        if error is None and call.arguments["key"] not in self.table:
            error = f"lookup: no entry {call.arguments['key']!r}; the names are in the question"
        if error is not None:
            self.tool_errors += 1
            return Observation(f"error: {error}", is_error=True)
        key = call.arguments["key"]
        self.lookups.append(key)
        return Observation(str(self.table[key]))

    def verify(self, final: list[Message]) -> Reward:
        reward = grade_int(final, self.expected)
        reward.details.update(tool_errors=self.tool_errors, lookups=len(self.lookups))
        return reward


@register
class ToolcalcEnv:
    name = "toolcalc"
    version = "4"  # 4: only the shared _common changed (a huge integer answer is a wrong one); 3: the prompt
    # states the answer format
    task_stream = "toolcalc@2"  # the version whose draws (tasks, ids, partition) this one repeats
    category = "agent"
    qa_kind = "answer"
    difficulties = (1, 2, 3, 4)
    tools: tuple[ToolSpec, ...] = (LOOKUP,)
    hash_deps = ("assay.envs.builtin._common", "assay.envs.tools")

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        check_difficulty(self.name, difficulty, self.difficulties)
        spec = f"{self.name}@{self.version}"
        seed = draw_seed(rng)
        local = task_rng(self.task_stream, difficulty, seed)
        signs = _SIGNS[difficulty]
        keys = local.sample(NAMES, len(signs))
        hi = 99 if difficulty == 1 else 30
        while True:  # the answer and every step stay >= 0
            values = [local.randint(1, hi) for _ in keys]
            answer, work = _combine(values, signs)
            if all(int(w.rsplit("=", 1)[1]) >= 0 for w in work):
                break
        question = keys[0] + "".join(f" {s} {k}" for s, k in zip(signs[1:], keys[1:], strict=True))
        payload = {"table": dict(zip(keys, values, strict=True)), "keys": keys, "signs": signs, "answer": answer}
        prompt = [Message("system", SYSTEM), Message("user", f"What is {question}? {ANSWER_FORMAT}")]
        return Task(env=spec, task_id=task_id(self.task_stream, difficulty, payload), difficulty=difficulty,
                    prompt=prompt, tools=list(self.tools), payload=payload, seed=seed, env_hash=env_hash(self))

    def reference_solution(self, task: Task) -> list[Message]:
        p = task.payload
        out: list[Message] = []
        for i, key in enumerate(p["keys"]):
            call = ToolCall("lookup", {"key": key}, id=f"call_{i}")
            out += [Message("assistant", "", [call]), Message("tool", str(p["table"][key]), name="lookup")]
        answer, work = _combine([p["table"][k] for k in p["keys"]], p["signs"])
        out.append(Message("assistant", "\n".join([", ".join(work), f"Answer: {answer}"] if work
                                                  else [f"Answer: {answer}"])))
        return out

    def start(self, task: Task, sandbox: Sandbox | None) -> ToolcalcEpisode:
        return ToolcalcEpisode(dict(task.payload["table"]), int(task.payload["answer"]), list(task.tools))

