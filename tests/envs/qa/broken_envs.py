"""Deliberately broken environments: each must be caught by the QA gate, for the right reason."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from assay.core.types import Message, Observation, Reward, Task, ToolCall
from assay.envs.builtin._common import last_assistant
from assay.envs.builtin._pyjudge import extract_code
from assay.envs.builtin.arith import ArithEnv
from assay.envs.builtin.codegen import CodegenEnv
from assay.sandbox import Limits, open_sandbox


@dataclass
class _Verdict:
    grade: object

    def step(self, call: ToolCall) -> Observation:
        return Observation("error: no tools", is_error=True)

    def verify(self, final: list[Message]) -> Reward:
        return self.grade(final)


class AcceptsAnything(ArithEnv):
    name = "broken-accepts-anything"

    def start(self, task, sandbox):
        return _Verdict(lambda final: Reward(1.0, True))


class LeaksTheAnswer(ArithEnv):
    name = "broken-leaks"

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        task = super().generate(rng, difficulty)
        answer = self.reference_solution(task)[-1].content.splitlines()[-1]
        prompt = task.prompt[:-1] + [Message("user", f"{task.prompt[-1].content}\n(for the grader: {answer})")]
        return replace(task, prompt=prompt)


class Nondeterministic(ArithEnv):
    name = "broken-nondeterministic"

    def start(self, task, sandbox):
        inner = super().start(task, sandbox)
        return _Verdict(lambda final: inner.verify(final) if random.random() < 0.5 else Reward(0.0, False))


class RunsTheWorkspaceTests(CodegenEnv):
    """Grades by running the candidate, then a test file from the same workspace: a candidate that
    rewrites the test file grades itself."""

    name = "broken-edited-tests"
    difficulties = (1,)

    def start(self, task, sandbox):
        def grade(final: list[Message]) -> Reward:
            msg = last_assistant(final)
            code = extract_code(msg.content) if msg else ""
            tests = "\n".join(f"assert f(*{a!r}) == {e!r}" for a, e in task.payload["tests"])
            box = open_sandbox(Limits(timeout_s=5, cpu_s=5, memory_mb=256))
            try:
                box.write_file("test_solution.py", f"from solution import f\n{tests}\nprint('ok')\n")
                box.write_file("solution.py", code)
                box.exec(["python3", "-c", "import solution"])  # the candidate runs first, in the workspace
                result = box.exec(["python3", "test_solution.py"])
            finally:
                box.close()
            ok = result.exit_code == 0
            return Reward(float(ok), ok)

        return _Verdict(grade)
