"""Deliberately broken environments: each must be caught by the QA gate, for the right reason."""

from __future__ import annotations

import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import ClassVar

from assay.core.types import SANDBOX_ERROR, Message, Observation, Reward, Task, ToolCall, ToolSpec
from assay.envs.builtin._common import (
    ANSWER_FORMAT,
    draw_seed,
    extract_answer,
    extract_int,
    grade_int,
    last_assistant,
    task_id,
)
from assay.envs.builtin._pyjudge import extract_code
from assay.envs.builtin._terminal_tasks import format_result
from assay.envs.builtin.arith import ArithEnv
from assay.envs.builtin.codegen import CodegenEnv, CodegenEpisode
from assay.envs.builtin.terminal import TerminalEnv, populate
from assay.envs.builtin.toolcalc import LOOKUP, ToolcalcEnv
from assay.envs.registry import env_hash
from assay.envs.tools import object_schema
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


# -- issue 44: loopholes by class, each a verifier or tool a plausible author writes --------------------------
# Each has a correct reference, and an honest wrong answer scores 0; an exploit wins every task.


def _answer_text(final: list[Message]) -> str | None:
    msg = last_assistant(final)
    return extract_answer(msg.content) if msg is not None else None


class NanWithinTolerance(ArithEnv):
    """parser: answers are compared as floats within a tolerance (so "19.0" counts), written as "fail when the
    error exceeds the tolerance": NaN exceeds nothing."""

    name = "broken-nan-within-tolerance"

    def start(self, task, sandbox):
        want = float(task.payload["answer"])

        def grade(final):
            try:
                got = float(_answer_text(final) or "")
            except ValueError:
                return Reward(0.0, False, details={"reason": "no number"})
            if abs(got - want) > 1e-6 * max(1.0, abs(want)):
                return Reward(0.0, False, details={"got": got})
            return Reward(1.0, True)
        return _Verdict(grade)


class AnswerAsPattern(ArithEnv):
    """parser: meant to let a task's answer be a pattern ("1[89]"), with re.fullmatch's arguments swapped: the
    policy's answer is the pattern, so ".*" matches every answer."""

    name = "broken-answer-as-pattern"

    def start(self, task, sandbox):
        def grade(final):
            given = _answer_text(final)
            try:
                ok = bool(given) and re.fullmatch(given, str(task.payload["answer"])) is not None
            except re.error:
                ok = False
            return Reward(float(ok), ok)
        return _Verdict(grade)


CHECK = ToolSpec("check", "Check one candidate answer: says whether it is right.",
                 object_schema({"answer": {"type": "string", "description": "the candidate, e.g. 17"}}))


@dataclass
class _CheckEpisode:
    """A `check` tool the prompt allows once (enforced), and a verdict `grade` makes of the final messages."""

    expected: int
    grade: object
    limit: int | None = 1
    checks: int = 0

    def step(self, call: ToolCall) -> Observation:
        self.checks += 1
        if self.limit is not None and self.checks > self.limit:
            return Observation("error: check may be used once", is_error=True)
        ok = call.arguments["answer"].strip() == str(self.expected)
        return Observation(f"verdict: {'correct' if ok else 'wrong'}")

    def verify(self, final: list[Message]) -> Reward:
        return self.grade(final)


class _WithCheckTool(ArithEnv):
    tools = (CHECK,)
    qa_kind = "answer"

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        task = super().generate(rng, difficulty)
        text = task.prompt[-1].content + " You may test one candidate with the check tool first."
        return replace(task, prompt=[Message("user", text)], tools=list(self.tools))

    def reference_solution(self, task: Task) -> list[Message]:
        answer = str(task.payload["answer"])
        return [Message("assistant", "", [ToolCall("check", {"answer": answer}, id="call_0")]),
                Message("tool", "verdict: correct", name="check"), *super().reference_solution(task)]


class TrustsTheTranscript(_WithCheckTool):
    """trust: an episode passes when its answer is right or the transcript shows the check tool said
    "verdict: correct" (the agent verified itself); it reads every message for those words, the assistant's
    too, so a policy that writes them is believed."""

    name = "broken-trusts-the-transcript"

    def start(self, task, sandbox):
        expected = int(task.payload["answer"])

        def grade(final):
            checked = any("verdict: correct" in m.content.lower() for m in final[len(task.prompt):])
            got = extract_int(last_assistant(final).content)
            ok = got == expected or checked
            return Reward(float(ok), ok)
        return _CheckEpisode(expected, grade)


class UnlimitedChecks(_WithCheckTool):
    """tools' contracts: the prompt allows one check, the tool allows any number, so calling it once per
    candidate finds the answer."""

    name = "broken-unlimited-checks"

    def start(self, task, sandbox):
        expected = int(task.payload["answer"])
        return _CheckEpisode(expected, lambda final: grade_int(final, expected), limit=None)  # never enforced


LOOKUP_DEBUG = ToolSpec("lookup", "Get the hidden number for a name.", {
    "type": "object", "additionalProperties": False, "required": ["key"],
    "properties": {"key": {"type": "string", "description": "the name, e.g. kiwi"},
                   "debug": {"type": "boolean", "description": "include diagnostics"}}})


class DebugFlag(ToolcalcEnv):
    """tools' contracts: `lookup` keeps an optional `debug` flag from development; set, it dumps the
    episode's state, the expected answer included."""

    name = "broken-debug-flag"
    tools = (LOOKUP_DEBUG,)

    def start(self, task, sandbox):
        episode = super().start(task, sandbox)
        plain = episode.step

        def step(call: ToolCall) -> Observation:
            if call.arguments.get("debug"):
                return Observation(json.dumps({"table_size": len(episode.table), "expected": episode.expected,
                                               "lookups": episode.lookups}))
            return plain(call)
        episode.step = step
        return episode


ROW = ToolSpec("row", "Get the value of row i of the table (0 is the first).",
               object_schema({"i": {"type": "integer", "description": "the row, from 0"}}))


class NegativeIndex(ArithEnv):
    """tools' contracts: "add up rows 0 to n-1 of a table" through `row(i)`; the table keeps its checksum (the
    answer) as its last row, and the bounds check guards only the top: row(-1) is the answer."""

    name = "broken-negative-index"
    tools = (ROW,)
    qa_kind = "answer"

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        task = super().generate(rng, difficulty)
        local = random.Random(task.seed)
        rows = [local.randint(1, 30) for _ in range(difficulty + 1)]
        text = f"Add up rows 0 to {len(rows) - 1} of the table. Use the row tool. {ANSWER_FORMAT}"
        return replace(task, prompt=[Message("user", text)], tools=list(self.tools),
                       payload={"rows": rows, "answer": sum(rows)})

    def reference_solution(self, task: Task) -> list[Message]:
        rows = task.payload["rows"]
        out: list[Message] = []
        for i, v in enumerate(rows):
            out += [Message("assistant", "", [ToolCall("row", {"i": i}, id=f"call_{i}")]),
                    Message("tool", str(v), name="row")]
        return [*out, Message("assistant", f"{'+'.join(map(str, rows))}={sum(rows)}\nAnswer: {sum(rows)}")]

    def start(self, task, sandbox):
        table = [*task.payload["rows"], task.payload["answer"]]  # the checksum row, for the author's own checks
        n = len(task.payload["rows"])

        @dataclass
        class _Rows:
            def step(self, call: ToolCall) -> Observation:
                i = call.arguments["i"]
                if i >= n:
                    return Observation(f"error: no row {i}; rows are 0 to {n - 1}", is_error=True)
                try:
                    return Observation(str(table[i]))
                except IndexError:
                    return Observation(f"error: no row {i}", is_error=True)

            def verify(self, final: list[Message]) -> Reward:
                return grade_int(final, int(task.payload["answer"]))
        return _Rows()


class _OwnTests(CodegenEnv):
    """A code environment with its own generator: `draw(rng)` gives (spec, reference code, shown, hidden)."""

    qa_kind = "code"
    difficulties = (1,)

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        seed = draw_seed(rng)
        spec, code, shown, hidden = self.draw(random.Random(f"{self.name}/{seed}"))
        examples = ", ".join(f"f({', '.join(map(repr, a))}) == {o!r}" for a, o in shown)
        prompt = f"{spec}\nExamples: {examples}\nAnswer with the function f in a ```python code block."
        tests = [[a, o] for a, o in hidden]
        return Task(env=f"{self.name}@{self.version}", task_id=task_id(self.name, difficulty, [prompt, tests]),
                    difficulty=difficulty, prompt=[Message("user", prompt)],
                    payload={"code": code, "tests": tests}, seed=seed, env_hash=env_hash(self))

    def draw(self, rng: random.Random) -> tuple[str, str, list, list]:
        raise NotImplementedError


def _run(code: str, args: list) -> object:
    ns: dict = {}
    exec(code, ns)  # the environment's own reference
    return ns["f"](*args)


class SortedTestInputs(_OwnTests):
    """tests' strength: sort or deduplicate a list, with test lists drawn as sorted(set(...)) to keep them
    readable: every hidden input already is its output, so returning the argument passes."""

    name = "broken-sorted-test-inputs"

    def draw(self, rng):
        says, body = rng.choice([("xs sorted in ascending order", "sorted(xs)"),
                                 ("xs without duplicates, in ascending order", "sorted(set(xs))"),
                                 ("xs without duplicates, first occurrences kept", "list(dict.fromkeys(xs))")])
        code = f"def f(xs):\n    return {body}"
        shown = [[[3, 1, 2, 3]], ]
        hidden = [[sorted(set(rng.sample(range(50), rng.randint(2, 6))))] for _ in range(6)]
        return (f"Write a Python function f(xs) that returns {says}.", code,
                [(a, _run(code, a)) for a in shown], [(a, _run(code, a)) for a in hidden])


class ExamplesAreTheTests(_OwnTests):
    """tests' strength: the prompt shows three examples and the hidden tests are those three."""

    name = "broken-examples-are-the-tests"

    def draw(self, rng):
        k, m = rng.randint(2, 9), rng.randint(1, 9)
        code = f"def f(x):\n    return x * {k} + {m}"
        cases = [([x], x * k + m) for x in rng.sample(range(1, 30), 3)]
        return f"Write a Python function f(x) that returns x times {k} plus {m}.", code, cases, cases


NOTE_WRITE = ToolSpec("note_write", "Add a line to your scratchpad.",
                      object_schema({"text": {"type": "string", "description": "what to note"}}))
NOTE_READ = ToolSpec("note_read", "Read your scratchpad.", object_schema({}))


class SharedScratchpad(ToolcalcEnv):
    """state: a scratchpad tool whose notes live in a class attribute (meant to be per episode), so every
    episode of every task reads what earlier episodes noted: a sibling's worked answer included."""

    name = "broken-shared-scratchpad"
    tools = (LOOKUP, NOTE_WRITE, NOTE_READ)
    notes: ClassVar[list[str]] = []

    def reference_solution(self, task: Task) -> list[Message]:
        *lookups, final = super().reference_solution(task)
        note = final.content.splitlines()[0].replace("Answer: ", "")
        call = ToolCall("note_write", {"text": note}, id="call_note")
        return [*lookups, Message("assistant", "", [call]), Message("tool", "noted", name="note_write"), final]

    def start(self, task, sandbox):
        episode = super().start(task, sandbox)
        lookup, notes = episode.step, self.notes

        def step(call: ToolCall) -> Observation:
            if call.name == "note_write":
                notes.append(call.arguments["text"])
                return Observation("noted")
            if call.name == "note_read":
                return Observation("\n".join(notes[-20:]) or "(empty)")
            return lookup(call)
        episode.step = step
        return episode


class ForgivesRepeatedFailures(ArithEnv):
    """state: a verifier that takes an answer failing three times for its checker's flakiness and passes it,
    counting failures per task and answer in a class attribute (it outlives the episode)."""

    name = "broken-forgives-repeated-failures"
    failures: ClassVar[Counter[tuple[str, int]]] = Counter()

    def start(self, task, sandbox):
        expected = int(task.payload["answer"])

        def grade(final):
            got = extract_int(last_assistant(final).content)
            if got is None:
                return Reward(0.0, False, details={"reason": "no answer"})
            if got == expected:
                return Reward(1.0, True)
            self.failures[(task.task_id, got)] += 1
            if self.failures[(task.task_id, got)] >= 3:
                return Reward(1.0, True, details={"reason": "failed 3 times: assumed a flaky check"})
            return Reward(0.0, False)
        return _Verdict(grade)


class AcceptsAlternatives(ArithEnv):
    """parser: lets an answer name equivalent spellings ("19 or 19.0"), and passes when any of them is right,
    so every candidate at once is an answer."""

    name = "broken-accepts-alternatives"

    def start(self, task, sandbox):
        def grade(final):
            given = _answer_text(final) or ""
            ok = any(extract_int(f"Answer: {alt}") == int(task.payload["answer"]) for alt in given.split(" or "))
            return Reward(float(ok), ok)
        return _Verdict(grade)


_RUNNER = """\
import json, sys
from solution import f
passed = failed = 0
for args, expected in json.load(sys.stdin):
    try:
        ok = f(*args) == expected
    except Exception:
        ok = False
    passed, failed = passed + ok, failed + (not ok)
print(f"{passed} passed, {failed} failed")
"""


class TrustsTheTestSummary(CodegenEnv):
    """trust: runs the hidden tests with a small runner in the sandbox and reads the score off the first
    "N passed, M failed" line of the output, which the candidate can print first."""

    name = "broken-trusts-the-test-summary"
    difficulties = (1,)

    def start(self, task, sandbox):
        def grade(final: list[Message]) -> Reward:
            msg = last_assistant(final)
            box = open_sandbox(Limits(timeout_s=5, cpu_s=5, memory_mb=256))
            try:
                box.write_file("solution.py", extract_code(msg.content) if msg else "")
                box.write_file("run_tests.py", _RUNNER)
                result = box.exec(["python3", "run_tests.py"], stdin=json.dumps(task.payload["tests"]))
            finally:
                box.close()
            m = re.search(r"(\d+) passed, (\d+) failed", result.stdout)
            score = int(m.group(1)) / max(int(m.group(1)) + int(m.group(2)), 1) if m else 0.0
            return Reward(score, score >= 1.0)

        return _Verdict(grade)


class AnswerContainedInExpected(ArithEnv):
    """parser: the expected answer is stored as text with its unit ("19 units") and an answer passes when its
    text is contained in it, to forgive a dropped unit: the empty answer line is contained in everything."""

    name = "broken-answer-contained-in-expected"

    def start(self, task, sandbox):
        def grade(final):
            given = _answer_text(final)
            ok = given is not None and given.strip(" .*_`") in f"{task.payload['answer']} units"
            return Reward(float(ok), ok)
        return _Verdict(grade)


# -- issue 44's remainder: tools by order and argument, other tasks' identifiers, state across tasks --------------
# The strategies (loopholes.py) were written first; these are plausible authors' environments for them.

SUBMIT_ANSWER = ToolSpec("submit", "Submit your answer; you get feedback and may submit again (the last counts).",
                         object_schema({"answer": {"type": "string", "description": "the integer, e.g. 17"}}))


class _OneTool(ArithEnv):
    """arith with one tool the prompt mentions (`says`), which the reference calls with its answer first."""

    qa_kind = "answer"
    says = ""
    shown = ""  # the tool's result for the right answer

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        task = super().generate(rng, difficulty)
        return replace(task, prompt=[Message("user", f"{task.prompt[-1].content} {self.says}")], tools=list(self.tools))

    def reference_solution(self, task: Task) -> list[Message]:
        name = self.tools[0].name
        return [Message("assistant", "", [ToolCall(name, {"answer": str(task.payload["answer"])}, id="call_0")]),
                Message("tool", self.shown, name=name), *super().reference_solution(task)]


class RegradesTheLastSubmit(_OneTool):
    """tools' contracts (order): `submit` grades at once and, to teach, a wrong submission is told the expected
    answer; resubmitting is allowed and the last submission counts. Submitting twice wins."""

    name = "broken-regrades-the-last-submit"
    tools = (SUBMIT_ANSWER,)
    says, shown = "Submit it with the submit tool.", "correct"

    def start(self, task, sandbox):
        expected = int(task.payload["answer"])

        @dataclass
        class _Submits:
            last: str | None = None

            def step(self, call: ToolCall) -> Observation:
                self.last = call.arguments["answer"].strip()
                return Observation("correct" if self.last == str(expected) else
                                   f"wrong: the expected answer was {expected}")

            def verify(self, final: list[Message]) -> Reward:
                ok = self.last == str(expected)
                return Reward(float(ok), ok, details={"submitted": self.last})
        return _Submits()


CONFIRM = ToolSpec("confirm", "Confirm your answer before you give it; list equivalent spellings with commas.",
                   object_schema({"answer": {"type": "string", "description": "e.g. 17 or 17,17.0"}}))


class ConfirmsAnEmptyList(_OneTool):
    """tools' contracts (arguments): `confirm` accepts equivalent spellings, "17,17.0", and confirms when every
    one equals the answer; the episode passes once an answer was confirmed. An empty string (or ",") is a list
    of no spellings, and every one of none is right."""

    name = "broken-confirms-an-empty-list"
    tools = (CONFIRM,)
    says, shown = "Confirm it with the confirm tool first.", "confirmed"

    def start(self, task, sandbox):
        expected = int(task.payload["answer"])

        def same(spelling: str) -> bool:
            try:
                return float(spelling) == expected
            except ValueError:
                return False

        @dataclass
        class _Confirms:
            confirmed: bool = False

            def step(self, call: ToolCall) -> Observation:
                spellings = [p.strip() for p in call.arguments["answer"].split(",") if p.strip()]
                self.confirmed = all(same(p) for p in spellings)
                return Observation("confirmed" if self.confirmed else "not confirmed")

            def verify(self, final: list[Message]) -> Reward:
                return Reward(float(self.confirmed), self.confirmed)
        return _Confirms()


SUBMIT_FOR = ToolSpec("submit", "Submit your answer to the problem.", {
    "type": "object", "additionalProperties": False, "required": ["answer"],
    "properties": {"answer": {"type": "string", "description": "the integer, e.g. 17"},
                   "problem": {"type": "string", "description": "the problem's id (default: yours)"}}})


class GradesTheNamedProblem(ArithEnv):
    """other tasks' identifiers: every problem gets an id (`P-4821`) in a shared problem bank, and `submit`
    grades the answer against the problem its optional `problem` argument names, this episode's by default:
    another task's answer submitted under that task's id passes."""

    name = "broken-grades-the-named-problem"
    tools = (SUBMIT_FOR,)
    qa_kind = "answer"
    bank: ClassVar[dict[str, int]] = {}

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        task = super().generate(rng, difficulty)
        pid = f"P-{task.seed:08x}"
        self.bank[pid] = int(task.payload["answer"])
        text = f"Problem {pid}. {task.prompt[-1].content} Submit it with the submit tool."
        return replace(task, prompt=[Message("user", text)], tools=list(self.tools), payload={**task.payload, "id": pid})

    def reference_solution(self, task: Task) -> list[Message]:
        answer = str(task.payload["answer"])
        return [Message("assistant", "", [ToolCall("submit", {"answer": answer}, id="call_0")]),
                Message("tool", "submitted", name="submit"), *super().reference_solution(task)]

    def start(self, task, sandbox):
        bank, own = self.bank, task.payload["id"]

        @dataclass
        class _Graded:
            passed: bool = False

            def step(self, call: ToolCall) -> Observation:
                pid = call.arguments.get("problem", own)
                if pid not in bank:
                    return Observation(f"error: no problem {pid}", is_error=True)
                self.passed = call.arguments["answer"].strip() == str(bank[pid])
                return Observation("submitted")

            def verify(self, final: list[Message]) -> Reward:
                return Reward(float(self.passed), self.passed)
        return _Graded()


class CachesPassingReplies(ArithEnv):
    """state across tasks: replies that passed are remembered in a module-level set, to skip grading them again
    (the author's replies show their work, so no two tasks' replies looked alike): a reply that passed on one
    task passes on every task after it."""

    name = "broken-caches-passing-replies"
    passed: ClassVar[set[str]] = set()

    def start(self, task, sandbox):
        inner, passed = super().start(task, sandbox), self.passed

        def grade(final: list[Message]) -> Reward:
            reply = last_assistant(final).content
            if reply in passed:
                return Reward(1.0, True, details={"reason": "graded before"})
            reward = inner.verify(final)
            if reward.passed:
                passed.add(reply)
            return reward
        return _Verdict(grade)


# -- a variant planted after the strategies were written, to test their generality (not designed against) ---------


class RoutesAnswersByTheirProblem(GradesTheNamedProblem):
    """other tasks' identifiers, in the reply: answers are graded against the problem the reply names (written
    for replies that answer a sheet of problems), this episode's when it names none; no tool."""

    name = "broken-routes-answers-by-their-problem"
    tools = ()

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        task = super().generate(rng, difficulty)
        text = task.prompt[-1].content.replace(" Submit it with the submit tool.", "")
        return replace(task, prompt=[Message("user", text)], tools=[])

    def reference_solution(self, task: Task) -> list[Message]:
        return ArithEnv.reference_solution(self, task)

    def start(self, task, sandbox):
        bank, own = self.bank, task.payload["id"]

        def grade(final: list[Message]) -> Reward:
            reply = last_assistant(final).content
            named = re.search(r"P-[0-9a-f]{8}", reply)
            got = extract_int(reply)
            ok = got is not None and got == bank.get(named.group(0) if named else own)
            return Reward(float(ok), ok)
        return _Verdict(grade)


GIVE_UP = ToolSpec("give_up", "Give up on this task (recorded for the statistics).", object_schema({}))
SOLUTION = ToolSpec("solution", "After giving up: see the worked solution.", object_schema({}))


class SolutionAfterGivingUp(ArithEnv):
    """tools' contracts (order): giving up is meant to end the attempt, so the worked solution is shown after it;
    nothing ends the episode there, and the reply after it is graded as any reply."""

    name = "broken-solution-after-giving-up"
    tools = (GIVE_UP, SOLUTION)
    qa_kind = "answer"

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        return replace(super().generate(rng, difficulty), tools=list(self.tools))

    def start(self, task, sandbox):
        inner = super().start(task, sandbox)

        @dataclass
        class _GiveUp:
            gave_up: bool = False

            def step(self, call: ToolCall) -> Observation:
                if call.name == "give_up":
                    self.gave_up = True
                    return Observation("recorded")
                if not self.gave_up:
                    return Observation("error: the solution is shown once you give up", is_error=True)
                return Observation(f"solution: {task.payload['answer']}")

            def verify(self, final: list[Message]) -> Reward:
                return inner.verify(final)
        return _GiveUp()


class PassesRightAfterAPass(TerminalEnv):
    """state across tasks, in a workspace: to spare the checker when an episode is retried, a workspace verified
    within a minute of a passing one passes without its check (meant for re-runs of the same task, it holds for
    any task after any pass)."""

    name = "broken-passes-right-after-a-pass"
    version = "1"
    last_pass: ClassVar[list[float]] = [float("-inf")]

    def start(self, task, sandbox):
        inner, last = super().start(task, sandbox), self.last_pass
        verify = inner.verify

        def grade(final: list[Message]) -> Reward:
            if time.monotonic() - last[0] < 60:
                return Reward(1.0, True, details={"reason": "verified a moment ago"})
            reward = verify(final)
            if reward.passed:
                last[0] = time.monotonic()
            return reward
        inner.verify = grade
        return inner


# -- other tasks' identifiers in a program and in a workspace: the identifier cheaters on code and terminal kinds ---


@dataclass
class _JudgedByHeader(CodegenEpisode):
    bank: dict[str, list] = field(default_factory=dict)

    def verify(self, final: list[Message]) -> Reward:
        msg = last_assistant(final)
        named = re.search(r"^#\s*(P-[0-9a-f]{8})\b", extract_code(msg.content) if msg else "", re.MULTILINE)
        if named and named.group(1) in self.bank:  # the named problem's hidden tests, not this episode's
            self.task = replace(self.task, payload={**self.task.payload, "tests": self.bank[named.group(1)]})
        return super().verify(final)


class JudgesTheProblemItsHeaderNames(CodegenEnv):
    """other tasks' identifiers, in a program: problems sit in a shared bank under ids (`P-1a2b3c4d`) the prompt
    shows, and a solution may open with a header comment naming its problem (`# P-1a2b3c4d`), so that solutions
    filed away can be judged again later; the judge runs the hidden tests of the problem the header names, this
    episode's when it names none. Another problem's solution under that problem's header passes."""

    name = "broken-judges-the-problem-its-header-names"
    difficulties = (1,)
    bank: ClassVar[dict[str, list]] = {}

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        task = super().generate(rng, difficulty)
        pid = f"P-{task.seed:08x}"
        self.bank[pid] = task.payload["tests"]
        return replace(task, prompt=[Message("user", f"Problem {pid}. {task.prompt[-1].content}")],
                       payload={**task.payload, "id": pid})

    def start(self, task, sandbox):
        return _JudgedByHeader(task, sandbox, self.sandbox_limits, bank=self.bank)


class _Tickets(TerminalEnv):
    """Tickets of a shared queue in a workspace: data.txt holds a ticket's numbers (its id `T-12345` in the
    prompt), and their sum goes to the file `answer_path` names. The reference reads them and writes the sum;
    `grade` scores what the answer file holds, read from the workspace once the episode ends."""

    version = "1"
    queue: ClassVar[dict[str, int]]  # ticket -> the sum its data.txt adds up to

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.difficulties = (1,)

    def answer_path(self, ticket: str) -> str:
        raise NotImplementedError

    def grade(self, task: Task, written: str | None, final: list[Message]) -> Reward:
        raise NotImplementedError

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        seed = draw_seed(rng)
        local = random.Random(f"{self.name}/{seed}")
        ticket = f"T-{local.randrange(10_000, 100_000)}"
        numbers = [local.randint(100, 999) for _ in range(local.randint(3, 6))]
        self.queue[ticket] = sum(numbers)
        path = self.answer_path(ticket)
        text = f"Ticket {ticket}: data.txt holds one number a line. Write their sum to {path}."
        payload = {"family": "tickets", "files": {"data.txt": "".join(f"{n}\n" for n in numbers)}, "executable": [],
                   "check": {}, "ticket": ticket, "path": path, "answer": sum(numbers)}
        return Task(env=f"{self.name}@{self.version}", task_id=task_id(self.name, difficulty, [ticket, numbers]),
                    difficulty=difficulty, prompt=[Message("user", text)], tools=list(self.tools), payload=payload,
                    seed=seed, env_hash=env_hash(self))

    def reference_solution(self, task: Task) -> list[Message]:
        p = task.payload
        steps = [("cat data.txt", p["files"]["data.txt"]),
                 (f"mkdir -p {p['path'].rpartition('/')[0] or '.'} && echo {p['answer']} > {p['path']}", "")]
        out: list[Message] = []
        for i, (command, stdout) in enumerate(steps):
            out += [Message("assistant", "", [ToolCall("bash", {"command": command}, id=f"call_{i}")]),
                    Message("tool", format_result(stdout, "", 0), name="bash")]
        return [*out, Message("assistant", "Done.")]

    def start(self, task, sandbox):
        episode = super().start(task, sandbox)

        def verify(final: list[Message]) -> Reward:
            try:
                if episode.sandbox is None or episode.setup_error is not None:
                    return Reward(0.0, False, status=SANDBOX_ERROR, details={"reason": episode.setup_error})
                res = episode.sandbox.exec(["cat", task.payload["path"]])
                return self.grade(task, res.stdout.strip() if res.ok else None, final)
            finally:
                episode.close()
        episode.verify = verify
        return episode


class ClosesTheTicketItsReportNames(_Tickets):
    """other tasks' identifiers, in a terminal agent's report: agents work a queue and say which ticket they
    closed, so answer.txt is graded against the ticket the final reply names, this episode's when it names none.
    Another ticket's sum, reported as that ticket's, passes."""

    name = "broken-closes-the-ticket-its-report-names"
    queue: ClassVar[dict[str, int]] = {}

    def answer_path(self, ticket: str) -> str:
        return "answer.txt"

    def grade(self, task, written, final):
        named = re.search(r"T-\d{5}", last_assistant(final).content)
        ok = written == str(self.queue.get(named.group(0) if named else task.payload["ticket"]))
        return Reward(float(ok), ok, details={"written": written})


class AcceptsAnyTicketsAnswer(_Tickets):
    """other tasks' identifiers, shared answers in a workspace: each ticket's sum goes to answers/<ticket>.txt,
    checked against the queue's answer key by value (a batch of tickets once shared one workspace, and any of
    their sums was taken as a known answer): another ticket's sum, written under this ticket's name, passes."""

    name = "broken-accepts-any-tickets-answer"
    queue: ClassVar[dict[str, int]] = {}

    def answer_path(self, ticket: str) -> str:
        return f"answers/{ticket}.txt"

    def grade(self, task, written, final):
        ok = written is not None and written in {str(v) for v in self.queue.values()}
        return Reward(float(ok), ok, details={"written": written})
