"""Deliberately broken environments: each must be caught by the QA gate, for the right reason."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, replace

from assay.core.types import Message, Observation, Reward, Task, ToolCall
from assay.envs.builtin._common import extract_int, last_assistant
from assay.envs.builtin._pyjudge import extract_code
from assay.envs.builtin.arith import ArithEnv
from assay.envs.builtin.codegen import CodegenEnv, CodegenEpisode
from assay.envs.builtin.terminal import TerminalEnv, populate
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


class AcceptsAnyNumberOfTheRightParity(ArithEnv):
    """Refuses empty and malformed answers, so only other tasks' answers can catch it."""

    name = "broken-parity"

    def start(self, task, sandbox):
        def grade(final):
            got = extract_int(last_assistant(final).content)
            ok = got is not None and got % 2 == int(task.payload["answer"]) % 2
            return Reward(float(ok), ok)
        return _Verdict(grade)


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


# -- secrets the workspace holds (issue 14, class 1) ---------------------------------------------------


def _hidden_files(check: dict) -> dict[str, str]:
    """What a careless environment leaves beside the task: the expected value and the whole hidden check."""
    expected = check.get("answer", check.get("expected"))
    return {".expected": expected if isinstance(expected, str) else json.dumps(expected),
            "tests/.hidden.json": json.dumps(check)}


class ChecksInTheWorkspace(TerminalEnv):
    """start() writes the hidden check and its expected value into the agent's workspace (a dotfile
    and a dotfile in a subdirectory): nothing in the prompt or in the reference's observations shows
    them, but `cat .expected > answer.txt` scores full reward."""

    name = "broken-checks-in-workspace"
    version = "1"  # pinned: the gate's draws (seeded by name@version) then hold a find task at level 1

    def start(self, task, sandbox):
        episode = super().start(task, sandbox)
        if episode.setup_error is None:
            episode.setup_error = populate(episode.sandbox, _hidden_files(task.payload["check"]), [])
        return episode


class DeclaresNoSecrets(TerminalEnv):
    """A terminal environment without `secrets(task)`: the leak checks then look for the reference's
    final message only (`Done.`-like), i.e. for almost nothing."""

    name = "broken-declares-no-secrets"
    secrets = None


class _ClosingEpisode(CodegenEpisode):
    owned: bool = False

    def verify(self, final):
        try:
            return super().verify(final)
        finally:
            if self.owned and self.sandbox is not None:
                self.sandbox.close()


class HiddenTestsInTheWorkspace(CodegenEnv):
    """start() writes the hidden tests (inputs and expected outputs) into the workspace the candidate
    runs in; a candidate that reads them answers every test without computing anything."""

    name = "broken-tests-in-workspace"

    def secrets(self, task):
        return [json.dumps(task.payload["tests"])]

    def start(self, task, sandbox):
        box = sandbox if sandbox is not None else open_sandbox(self.sandbox_limits)
        box.write_file(".hidden_tests.json", json.dumps(task.payload["tests"]))
        episode = _ClosingEpisode(task, box, self.sandbox_limits)
        episode.owned = sandbox is None
        return episode


# -- the answer as a bare value (class 2) ---------------------------------------------------------------


class WorkedExample(ArithEnv):
    """The prompt opens with a "worked example" whose result is this task's answer: the whole answer
    line never appears, the bare value always does."""

    name = "broken-worked-example"

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        task = super().generate(rng, difficulty)
        answer = int(task.payload["answer"])
        a = random.Random(task.seed).randint(0, answer)
        example = f"Worked example: {a}+{answer - a}={answer}."
        return replace(task, prompt=[Message("user", f"{example}\n{task.prompt[-1].content}")])


# -- rare and load-dependent flakiness (class 3) --------------------------------------------------------


class RarelyFlaky(ArithEnv):
    """The verifier fails about one run in ten, at random (seeded here, so the test is deterministic)."""

    name = "broken-rarely-flaky"

    def __init__(self) -> None:
        self._rng = random.Random(14)

    def start(self, task, sandbox):
        inner = super().start(task, sandbox)
        return _Verdict(lambda final: inner.verify(final) if self._rng.random() >= 0.1 else Reward(0.0, False))


def _descheduled(work_s: float = 0.005) -> float:
    """Wall time over CPU time of a short busy loop: about 1 on an idle CPU, more when others share it."""
    wall, cpu = time.perf_counter(), time.process_time()
    while time.process_time() - cpu < work_s:
        pass
    return (time.perf_counter() - wall) / max(time.process_time() - cpu, 1e-9)


class FailsUnderLoad(ArithEnv):
    """The verifier has a deadline tuned on an idle machine: when it is descheduled for a fifth of its
    run (another process wants the same CPU), it fails. On an idle machine it looks deterministic."""

    name = "broken-fails-under-load"

    def start(self, task, sandbox):
        inner = super().start(task, sandbox)
        return _Verdict(lambda final: inner.verify(final) if _descheduled() < 1.25 else Reward(0.0, False))
