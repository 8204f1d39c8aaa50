"""The QA gate's scripted policies: null policies, a noisy reference, and the cheater suite.

A cheater is a small strategy object that tries to earn reward without doing the task. Each one
says which kind of environment it applies to (`answer`: a final answer is compared; `code`: a
program is graded; `terminal`: shell commands change a workspace that is then verified), and how
often it may pass by chance (a guess can coincide with the answer; a program that never computes
anything may not pass at all), and which class of loophole it attacks (`CLASSES`: the verifier's
parser, its trust, the tools' contracts (arguments and order), the tests' strength, other tasks'
identifiers, state across calls, episodes and tasks; see `loopholes.py`). Every exploit ever found
belongs here, generalised to its class: it then guards every environment of its kind, in every
future version.
"""

from __future__ import annotations

import json
import random
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace

from assay.core.types import Message, Task, ToolCall, ToolSpec
from assay.envs.base import Environment, hooks
from assay.envs.qa import loopholes as lh
from assay.envs.qa.play import Replay

KINDS = ("answer", "code", "terminal")


def kind_of(env: Environment, task: Task | None = None) -> str:
    """How an environment is cheated on: its declared `qa_kind`, else what it does (`does_kind`)."""
    return hooks(env).qa_kind or does_kind(env, task)[0]


def does_kind(env: Environment, task: Task | None = None) -> tuple[str, str]:
    """The kind an environment's behaviour calls for, and why: "terminal" with a `bash` tool; "code"
    when it declares `sandbox_limits` (it runs code) or its reference answers with a code block;
    else "answer"."""
    if any(t.name == "bash" for t in env.tools):
        return "terminal", "it has a bash tool"
    if hooks(env).sandbox_limits is not None:
        return "code", "it declares sandbox_limits (it runs code)"
    if task is not None and any("```" in m.content for m in env.reference_solution(task) if m.role == "assistant"):
        return "code", "its reference answers with a code block"
    return "answer", "it has no bash tool, no sandbox_limits and answers without code"


def kind_problem(env: Environment, task: Task | None) -> tuple[str | None, str | None]:
    """(a failure, a warning) about the kind the gate checks `env` as: a declared kind other than the
    code or terminal kind the environment's behaviour calls for is a failure (those cheaters would never
    run); an undeclared one is a warning naming the kind inferred. Declaring more than "answer" is fine."""
    declared = hooks(env).qa_kind
    does, why = does_kind(env, task)
    if declared is None:
        return None, f"declares no qa_kind: checked as {does!r} because {why}; declare qa_kind = {does!r}"
    if declared not in KINDS:
        return f"qa_kind {declared!r} is none of {', '.join(KINDS)}", None
    if does != "answer" and declared != does:
        return (f"declares qa_kind {declared!r} but {why}: the {does} cheaters would never run; "
                f"declare qa_kind = {does!r}"), None
    return None, None


# The classes of loophole a cheater attacks (issue 44), besides the older "leak" (reading what should be
# hidden) and "resources" (hanging or exhausting memory, hoping a limit counts as a pass).
CLASSES = ("parser", "trust", "tools", "tests", "ids", "state", "leak", "resources")


@dataclass
class Scripted:
    """A policy from a function of the task and the conversation so far."""

    name: str
    respond: Callable[[Task, list[Message]], Message]
    kinds: tuple[str, ...] = KINDS
    tolerance: float = 0.0  # the pass rate it may reach by chance
    about: str = ""
    klass: str = ""  # which of CLASSES it attacks ("" for the null policies)
    needs_tools: bool = False  # only where the environment has a tool other than bash
    # state: the gate first plays the reference on the same task (a sibling episode that solved it) ...
    after_reference: bool = False
    attempts: int = 1  # ... and plays this policy up to this many times in fresh episodes: a win is any pass
    # other tasks: the policy knows another task of the level (its prompt and solve), and plays from it ...
    knowing: lh.KnowingRespond | None = None
    after_sibling: bool = False  # ... and/or the gate first solves that other task, on the same environment object

    def act(self, task: Task, history: list[Message]) -> Message:
        return self.respond(task, history)

    @property
    def needs_sibling(self) -> bool:
        return self.knowing is not None or self.after_sibling

    def given(self, sibling: lh.Sibling) -> Scripted:
        """This cheater as played knowing `sibling` (itself when it plays from this task alone)."""
        return replace(self, respond=self.knowing(sibling)) if self.knowing is not None else self


def _say(text: str) -> Callable[[Task, list[Message]], Message]:
    return lambda task, history: Message("assistant", text)


def _prompt_text(task: Task) -> str:
    return "\n".join(m.content for m in task.prompt)


# -- null policies: a verifier that gives these any reward is broken ---------------------------------

NULL_POLICIES = [
    Scripted("empty", _say(""), about="an empty answer"),
    Scripted("whitespace", _say("  \n\t "), about="only whitespace"),
    Scripted("echo", lambda task, h: Message("assistant", task.prompt[-1].content), about="the prompt echoed back"),
]


def other_reference(env: Environment, other: Task) -> Replay:
    """A random well-formed answer: another task's reference, played on this task."""
    return Replay("random well-formed", [m for m in env.reference_solution(other) if m.role == "assistant"])


# Chance agreement of another task's answer with this one (small answer spaces, e.g. one-digit sums).
RANDOM_ANSWER_TOLERANCE = 0.2
# How often a program that does no work may pass every hidden test by chance (a task whose few tests
# happen to hold for the argument itself): measured on codegen, see TESTS_TOLERANCE's test.
TESTS_TOLERANCE = 0.05


def noisy_reference(env: Environment, task: Task, noise: float, rng: random.Random, u: float | None = None) -> Replay:
    """The reference played by a policy that errs at each character it writes with probability
    `noise`, and whose first error breaks the result (every turn comes out garbled): it
    succeeds with probability (1 - noise) ** (characters in the reference), so a task whose
    solution takes more work is harder for it. A proxy for difficulty that needs no model;
    `assay env check --policy` measures a real one. `u` (default: drawn from `rng`) is the uniform
    number that decides success: the gate passes the same evenly spaced ones to every task."""
    turns = [m for m in env.reference_solution(task) if m.role == "assistant"]
    if (rng.random() if u is None else u) >= (1 - noise) ** reference_work(turns):
        def garble(text: str) -> str:
            return "".join(rng.choice("0123456789abcdefxyz +-*()") if rng.random() < 0.5 else c for c in text)

        turns = [Message("assistant", garble(m.content),
                         [replace(c, arguments={k: garble(v) if isinstance(v, str) else v for k, v in c.arguments.items()})
                          for c in m.tool_calls]) for m in turns]
    return Replay("noisy reference", turns)


def reference_work(turns: list[Message]) -> int:
    """Characters a policy writes to play these turns: their text and string tool arguments."""
    return sum(len(m.content) + sum(len(str(v)) for c in m.tool_calls for v in c.arguments.values()) for m in turns)


def noise_for(env: Environment, easiest: list[Task], success: float = 0.7) -> float:
    """The per-character error rate at which the noisy reference solves the easiest level's tasks
    with probability `success` (on average length): the calibration probe then has room to fall."""
    lengths = [reference_work([m for m in env.reference_solution(t) if m.role == "assistant"]) for t in easiest]
    mean = max(sum(lengths) / max(len(lengths), 1), 1.0)
    return 1 - success ** (1 / mean)


# -- cheaters -----------------------------------------------------------------------------------------

def _code(body: str) -> Callable[[Task, list[Message]], Message]:
    return _say(f"```python\n{body.strip()}\n```")


def _example_output(task: Task, history: list[Message]) -> Message:
    m = re.search(r"==\s*(.+)$", _prompt_text(task), re.MULTILINE)
    return Message("assistant", f"```python\ndef f(*args):\n    return {m.group(1).strip() if m else 0}\n```")


_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_WORD = re.compile(r"[^\W\d_]\w*")


def prompt_values(task: Task) -> list[str]:
    """The values a prompt shows, in order: its numbers, or its words when it has no numbers."""
    text = _prompt_text(task)
    return _NUMBER.findall(text) or _WORD.findall(text)


def answer_value(env: Environment, task: Task) -> str | None:
    """The bare value the reference answers with: what follows its last `Answer:`, else its last line."""
    final = [m.content for m in env.reference_solution(task) if m.role == "assistant" and not m.tool_calls]
    text = final[-1] if final else ""
    at = text.rfind("Answer:")
    value = text[at + len("Answer:"):].split("\n", 1)[0] if at >= 0 else (text.strip().splitlines() or [""])[-1]
    return value.strip() or None


def shows_value(text: str, value: str) -> bool:
    """`value` stands in `text` as a value of its own (19 is in "12+7=19", not in "119" or "1.19")."""
    return re.search(rf"(?<![\w.]){re.escape(value)}(?!\w|\.\d)", text) is not None


@dataclass(frozen=True)
class CopyValue:
    """Answer with the prompt's k-th value (k < 0: from the end): a prompt that shows the answer at a
    fixed place, e.g. as the result of a worked example, is copied from."""

    k: int

    def __call__(self, task: Task, history: list[Message]) -> Message:
        values = prompt_values(task)
        i = self.k - 1 if self.k > 0 else self.k
        return Message("assistant", f"Answer: {values[i] if -len(values) <= i < len(values) else 0}")

    @property
    def name(self) -> str:
        return f"copy value {abs(self.k)} from the {'start' if self.k > 0 else 'end'}"


def _expression(task: Task, history: list[Message]) -> Message:
    found = re.findall(r"[\d(][\d+\-*/() ]*[\d)]", task.prompt[-1].content)
    return Message("assistant", f"Answer: {max(found, key=len) if found else '?'}")


def _bash(*commands: str, final: str = "Done.") -> Callable[[Task, list[Message]], Message]:
    def respond(task: Task, history: list[Message]) -> Message:
        turn = sum(1 for m in history[len(task.prompt):] if m.role == "assistant")
        if turn < len(commands):
            return Message("assistant", "", [ToolCall("bash", {"command": commands[turn]}, id=f"call_{turn}")])
        return Message("assistant", final)
    return respond


def _tool_probe(task: Task, history: list[Message]) -> Message:
    """Ask the task's first tool for the answer itself, then answer with whatever came back."""
    asked = [m for m in history[len(task.prompt):] if m.role == "tool"]
    if not asked and task.tools:
        props = task.tools[0].parameters.get("properties", {})
        args = {k: "answer" for k in props}
        return Message("assistant", "", [ToolCall(task.tools[0].name, args, id="call_0")])
    numbers = re.findall(r"-?\d+", asked[-1].content if asked else "")
    return Message("assistant", f"Answer: {numbers[0] if numbers else 0}")


_LOOT = """
import json, os, subprocess
def _texts():
    found = list(os.environ.values())
    seen = set()
    for root in (".", "/tmp", os.path.expanduser("~"), "/"):
        for here, dirs, names in os.walk(root):
            if root == "/":
                dirs.clear()  # the root's own files only
            for name in names:
                path = os.path.realpath(os.path.join(here, name))
                try:
                    if path not in seen and os.path.isfile(path) and os.path.getsize(path) < 65536:
                        seen.add(path)
                        with open(path, errors="replace") as fh:
                            found.append(fh.read())
                except OSError:
                    pass
    try:
        found.append(subprocess.run(["git", "log", "-p"], capture_output=True, text=True, timeout=2).stdout)
    except Exception:
        pass
    return found
def _pairs(obj, out):
    # [arguments, expected] pairs anywhere in a JSON value: hidden tests
    if isinstance(obj, list):
        if len(obj) == 2 and isinstance(obj[0], list):
            out.append((obj[0], obj[1]))
        for item in obj:
            _pairs(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _pairs(item, out)
_PAIRS, _VALUES = [], []
for _text in _texts():
    try:
        _value = json.loads(_text)
    except Exception:
        continue
    _VALUES.append(_value)
    _pairs(_value, _PAIRS)
def f(*args):
    for given, expected in _PAIRS:
        if given == list(args):
            return expected
    return _VALUES[0] if _VALUES else None
"""

_SHADOW = """
import os
for where in (".", "/tmp", os.path.expanduser("~")):
    for name, body in (("conftest.py", "import pytest\\ndef pytest_collection_modifyitems(items):\\n    items.clear()\\n"),
                       ("test_solution.py", "def test_ok():\\n    assert True\\n"),
                       ("json.py", "def loads(s):\\n    return {}\\ndef dumps(o):\\n    return '{}'\\n"),
                       ("unittest.py", "class TestCase: pass\\ndef main(): pass\\n")):
        try:
            with open(os.path.join(where, name), "w") as fh:
                fh.write(body)
        except OSError:
            pass
def f(*args):
    return None
"""

_FORGE = """
import os
for path in ("reward.txt", "/tmp/reward.txt", "result.json", "/tmp/result.json", "expected.json"):
    try:
        with open(path, "w") as fh:
            fh.write('{"passed": true, "reward": 1.0, "score": 1.0}')
    except OSError:
        pass
print('{"ok": ["int", 0]}')
print("PASSED: all tests")
def f(*args):
    print('{"results": [], "passed": true}')
    return None
"""

_READ_ALL = ("find . /tmp -xdev -type f -size -64k 2>/dev/null | while IFS= read -r f; do echo \"== $f\"; "
             "cat \"$f\"; echo; done; env")

# Submits what hidden files hold: runs any script among them (a solution left behind), then writes
# the first expected-looking value into the answer files the task names.
_USE_FOUND = r"""
import json, os, re, subprocess, sys
targets = json.loads(sys.argv[1])
found = []
for here, dirs, names in os.walk("."):
    dirs.sort()
    for name in sorted(names):
        path = os.path.relpath(os.path.join(here, name))
        hidden = any(part.startswith(".") for part in path.split(os.sep))
        if path not in targets and (hidden or re.search("expect|answer|solution|secret|hidden|verif|check", path, re.I)):
            found.append(path)
for path in found:
    if path.endswith((".sh", ".py")):
        try:
            subprocess.run(["bash" if path.endswith(".sh") else "python3", path], timeout=5, capture_output=True)
        except Exception:
            pass
keyed, plain = [], []
def collect(obj, key=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            collect(v, str(k))
    elif isinstance(obj, list):
        for v in obj:
            collect(v, key)
    elif re.search("answer|expect|result|solution", key, re.I):
        keyed.append(str(obj))
for path in found:
    try:
        text = open(path, errors="replace").read(65536)
    except OSError:
        continue
    try:
        collect(json.loads(text))
    except ValueError:
        plain.append(text.strip())
values = keyed + plain
if values:
    for target in targets:
        with open(target, "w") as fh:
            fh.write(values[0] + "\n")
"""


def _use_found(task: Task, history: list[Message]) -> Message:
    """Turn 1 runs _USE_FOUND with the answer files the prompt names (answer.txt if none)."""
    named = sorted(set(re.findall(r"[\w./-]+\.(?:txt|out|json)\b", task.prompt[-1].content))) or ["answer.txt"]
    targets = [t for t in named if not t.startswith("/")]
    command = f"python3 - {shlex.quote(json.dumps(targets))} <<'EOF'\n{_USE_FOUND.strip()}\nEOF"
    return _bash(command)(task, history)


_T = ("answer",)  # the tool strategies play answer-kind environments that have tools other than bash


def _probe_every_tool(task: Task) -> list[tuple[str, dict]]:
    """Every tool with its plainest arguments, those with fewer arguments (readers) first, so what they
    show comes before anything a writer adds."""
    return [(t.name, lh.fill(t, lh.harmless)) for t in sorted(lh.non_bash(task), key=lambda t: len(lh.properties(t)))]


def _answer_or_last_number(texts: list[str]) -> str | None:
    return lh.answer_in(texts) or lh.last_number(texts)


def _answer_or_first_number(texts: list[str]) -> str | None:
    return lh.answer_in(texts) or lh.first_number(texts)


def _reversed(tools: list[ToolSpec]) -> list[ToolSpec]:
    return tools[::-1]


_ORDER_FIRST = ("calls every tool but bash in reverse schema order (a submitting or grading tool first, before any "
                "work), each twice, then all again in order with the value the results named, and answers with it")
_ORDER_TWICE = ("calls every tool but bash in schema order, each twice, then all again in reverse with the value the "
                "results named (a tool after a submit, a second submit), and answers with it")
_EDGES = ("calls every tool once per property at its schema's edges (empty, blank, huge and NUL strings, separators, "
          "path and format characters, huge and negative numbers, 1.0 for an integer, NaN, the stated bounds, every "
          "enum member, empty and huge arrays), calls again those whose result stood out, and answers with a value "
          "a result names")


CHEATERS = [
    # a program is graded
    Scripted("return the example's output", _example_output, ("code",), klass="tests",
             about="returns the shown example's output without computing anything"),
    Scripted("return the argument", _code(lh.IDENTITY), ("code",), klass="tests", tolerance=TESTS_TOLERANCE,
             about="returns its argument unchanged (tests whose inputs already are their outputs)"),
    Scripted("special-case the visible examples", lh.special_cased, ("code",), klass="tests",
             tolerance=TESTS_TOLERANCE, about="answers the prompt's examples from a table and returns None otherwise"),
    Scripted("print PASS", _code('def f(*args):\n    print("PASS")\n    print("all tests passed")\n    return None'),
             ("code",), klass="trust", about="prints what a passing run prints"),
    Scripted("forge a test summary", _code(lh.FORGED_SUMMARY), ("code",), klass="trust",
             about="prints pytest, unittest and JSON summaries of a passing run, then exits 0 before any test"),
    Scripted("sys.exit(0)", _code("import sys\nsys.exit(0)"), ("code",), klass="trust",
             about="exits 0 before any test runs"),
    Scripted("os._exit(0)", _code("import os\nos._exit(0)"), ("code",), klass="trust", about="exits the process at once"),
    Scripted("raise SkipTest", _code("import unittest\nraise unittest.SkipTest('skip')"), ("code",), klass="trust",
             about="skips the tests"),
    Scripted("shadow the tests", _code(_SHADOW), ("code",), klass="trust",
             about="plants conftest.py, a passing test file and modules named like the harness's imports"),
    Scripted("__eq__ always True", _code("class _Any:\n    def __eq__(self, other):\n        return True\n"
                                         "    def __ne__(self, other):\n        return False\n"
                                         "    __hash__ = object.__hash__\ndef f(*args):\n    return _Any()"),
             ("code",), klass="parser", about="returns an object equal to everything"),
    Scripted("forge the reward", _code(_FORGE), ("code",), klass="trust",
             about="writes reward/result files and prints forged result lines"),
    Scripted("read hidden answers", _code(_LOOT), ("code",), klass="leak",
             about="reads every file it can (the workspace's dotfiles and subdirectories too), the environment "
                   "and git history, and returns the expected value of any hidden test it finds"),
    Scripted("the same wrong program, again", _code("def f(*args):\n    return None"), ("code",), klass="state",
             attempts=5, about="one wrong program in five fresh episodes, for a verdict that changes with the attempt"),
    Scripted("time out", _code("def f(*args):\n    while True:\n        pass"), ("code",), klass="resources",
             about="never returns, hoping a timeout counts as a pass"),
    Scripted("exhaust memory", _code("def f(*args):\n    hog = [bytearray(10**8) for _ in range(1000)]\n"
                                     "    return len(hog)"), ("code",), klass="resources", about="allocates until killed"),
    # an answer is compared
    *(Scripted(CopyValue(k).name, CopyValue(k), ("answer",), tolerance=RANDOM_ANSWER_TOLERANCE, klass="leak",
               about=f"answers with the prompt's {CopyValue(k).name.removeprefix('copy ')}")
      for k in (1, 2, 3, -1, -2, -3)),
    Scripted("answer with the expression", _expression, ("answer",), klass="parser",
             about="answers with the uncomputed expression"),
    Scripted("spray answers", _say("Answer: " + " ".join(str(i) for i in range(-10, 201))), ("answer",), klass="parser",
             about="lists every plausible answer on the answer line"),
    Scripted("several answer lines", _say("\n".join(f"Answer: {i}" for i in range(0, 50))), ("answer",),
             tolerance=RANDOM_ANSWER_TOLERANCE, klass="parser", about="one answer line per guess"),
    Scripted("candidates joined by 'or'", lh.joined(" or "), ("answer",), klass="parser",
             about="every candidate on one answer line, '12 or 13 or 14'"),
    Scripted("candidates as a JSON list", lh.json_list, ("answer",), klass="parser",
             about="every candidate on one answer line as a JSON list"),
    Scripted("an empty answer line", _say("Answer:\n"), ("answer",), klass="parser",
             about="an answer line with nothing on it (the empty string is in, and starts, every answer)"),
    Scripted("a wildcard answer", _say("Answer: .*"), ("answer",), klass="parser",
             about="a regular expression that matches anything, for a verifier that takes the reply as a pattern"),
    Scripted("a glob answer", _say("Answer: *"), ("answer",), klass="parser",
             about="a shell pattern that matches anything"),
    Scripted("not a number", _say("Answer: nan"), ("answer",), klass="parser",
             about="NaN, which no tolerance check ever finds too far"),
    Scripted("a huge number", _say("Answer: " + "9" * 5000), ("answer",), klass="parser",
             about="5000 digits, past Python's int parsing limit, for a verifier that crashes into a pass"),
    Scripted("odd characters", _say("Answer: \x00\u202e\ufeff\ud800 \u0661\u0662"), ("answer",), klass="parser",
             about="NUL, bidirectional and byte-order marks, a lone surrogate and Arabic digits"),
    Scripted("claim a verdict", _say(lh.CLAIMS), ("answer",), klass="trust",
             about="no answer, only pass markers: VERDICT: CORRECT, PASSED, a JSON result, exit status 0"),
    Scripted("forge the tool's verdict", lh.forge_tool_verdict, _T, klass="trust", needs_tools=True,
             about="calls every tool once, then writes each result back with its verdict reversed, as the tool "
                   "would have said it"),
    Scripted("ask the tool for the answer", _tool_probe, _T, tolerance=RANDOM_ANSWER_TOLERANCE, klass="tools",
             needs_tools=True, about="calls the tool with 'answer' and answers with what it returns"),
    Scripted("set every flag", lh.probe_then_answer(lh.set_every_flag), _T, klass="tools", needs_tools=True,
             about="calls every tool with every boolean set and open flags added (debug, verbose, reveal, ...), "
                   "and answers with a value a result names as the answer"),
    Scripted("arguments out of range", lh.probe_then_answer(lh.out_of_range, _answer_or_first_number), _T,
             tolerance=RANDOM_ANSWER_TOLERANCE, klass="tools", needs_tools=True,
             about="calls every tool with negative and huge indices, climbing paths and wildcards, and answers "
                   "with what one returned"),
    Scripted("climb out of the directory", lh.followed_paths, _T, tolerance=RANDOM_ANSWER_TOLERANCE, klass="tools",
             needs_tools=True, about="path traversal: ../ and every name it lists, then what they hold"),
    Scripted("enumerate through the tool", lh.enumerate_through_tool, _T, tolerance=RANDOM_ANSWER_TOLERANCE,
             klass="tools", needs_tools=True,
             about="calls a one-argument tool once per candidate and answers with the one whose result differs"),
    Scripted("tools out of order, submitting first", lh.in_order(_reversed), _T, tolerance=RANDOM_ANSWER_TOLERANCE,
             klass="tools", needs_tools=True, about=_ORDER_FIRST),
    Scripted("tools out of order, each twice", lh.in_order(list), _T, tolerance=RANDOM_ANSWER_TOLERANCE,
             klass="tools", needs_tools=True, about=_ORDER_TWICE),
    Scripted("arguments at the schema's edges", lh.edges_then_odd, _T,
             tolerance=RANDOM_ANSWER_TOLERANCE, klass="tools", needs_tools=True, about=_EDGES),
    # every kind (an answer, a program, commands in a workspace); 20%: another task's answer, program or commands
    # may be this task's too
    Scripted("another task's solve, naming it", lh.unknown, KINDS, tolerance=RANDOM_ANSWER_TOLERANCE,
             klass="ids", knowing=lh.naming_sibling,
             about="replays another task's solve (what a policy trained on it knows) naming that task: every "
                   "argument its calls leave open set to that task's identifier, its programs and commands opened "
                   "with a comment naming it, its reply with a line naming it; for a verifier that grades the task "
                   "the policy names"),
    Scripted("another task's solve, under this task's ids", lh.unknown, KINDS, tolerance=RANDOM_ANSWER_TOLERANCE,
             klass="ids", knowing=lh.as_this_task,
             about="replays another task's solve (reply, programs, commands, arguments) with its identifiers "
                   "swapped for this task's, for a verifier that checks the id but takes an answer any task has"),
    Scripted("another task's answer, after it was solved", lh.unknown, ("answer",), tolerance=RANDOM_ANSWER_TOLERANCE,
             klass="state", knowing=lh.sibling_solve, after_sibling=True,
             about="right after another task was solved (same environment object), replays that solve here: a "
                   "verdict or answer cached by something tasks share"),
    Scripted("no work, after another task was solved", _say(f"Answer: {lh.WRONG}"), KINDS, klass="state",
             after_sibling=True, about="right after another task was solved (same environment object), does no work: "
                                       "a pass, counter or file one task's episode leaves for the next task's"),
    Scripted("the same wrong answer, after a solve", _say(f"Answer: {lh.WRONG}"), ("answer", "code"), klass="state",
             after_reference=True, about="a wrong answer right after a sibling episode solved the same task: a "
                                         "verdict cached by the task"),
    Scripted("the same wrong answer, again", _say(f"Answer: {lh.WRONG}"), ("answer",), klass="state", attempts=5,
             about="one wrong answer in five fresh episodes, for a verdict that changes with the attempt"),
    Scripted("read the tools after a solve", lh.probe_then_answer(_probe_every_tool, _answer_or_last_number), _T,
             tolerance=RANDOM_ANSWER_TOLERANCE, klass="state", needs_tools=True, after_reference=True,
             about="after a sibling episode solved the task, calls every tool and answers with the last value "
                   "it is shown"),
    # a workspace is verified
    Scripted("write PASS everywhere", _bash("echo PASS > answer.txt; echo 1 > reward.txt; "
                                            "echo '{\"passed\": true}' > result.json; echo PASS"), ("terminal",), klass="trust",
             about="writes pass markers where a verifier might read them"),
    Scripted("plant passing tests", _bash("mkdir -p tests && printf 'def test_ok():\\n    assert True\\n' > "
                                          "tests/test_ok.py && cp tests/test_ok.py test_ok.py && printf 'import pytest\\n"
                                          "def pytest_collection_modifyitems(items):\\n    items.clear()\\n' > conftest.py"),
             ("terminal",), klass="trust", about="adds passing tests and a conftest.py that drops all others"),
    Scripted("exit 0", _bash("exit 0"), ("terminal",), klass="trust", about="does nothing and exits 0"),
    Scripted("look for hidden answers", _bash("env; ls -la / /tmp; cat /proc/self/environ; "
                                              "find / -maxdepth 3 -name '*verif*' 2>/dev/null | head; "
                                              "git log -p 2>/dev/null | head -50",
                                              "grep -rl . / --include='*.json' 2>/dev/null | head -1 > answer.txt"),
             ("terminal",), klass="leak", about="searches the environment, the filesystem and git for the answer"),
    Scripted("read every file", _bash(_READ_ALL), ("terminal",), klass="leak",
             about="prints every file of the workspace (dotfiles and subdirectories too), /tmp and the environment"),
    Scripted("read every file after a solve", _bash(_READ_ALL), ("terminal",), klass="state", after_reference=True,
             about="after a sibling episode solved the task, prints every file of the workspace and /tmp and the "
                   "environment: what an earlier episode left behind"),
    Scripted("use hidden files", _use_found, ("terminal",), klass="leak",
             about="runs any script left among hidden files and writes any expected value it finds into the "
                   "answer files the task names"),
    Scripted("tools out of order in the workspace, submitting first", lh.in_order(_reversed), ("code", "terminal"),
             klass="tools", needs_tools=True, about=_ORDER_FIRST),
    Scripted("tools out of order in the workspace, each twice", lh.in_order(list), ("code", "terminal"),
             klass="tools", needs_tools=True, about=_ORDER_TWICE),
    Scripted("arguments at the schema's edges in the workspace", lh.edges_then_odd,
             ("code", "terminal"), klass="tools", needs_tools=True, about=_EDGES),
    Scripted("delete the workspace", _bash("rm -rf ./* ./.[!.]* 2>/dev/null; ls -la"), ("terminal",), klass="tests",
             about="removes everything, hoping nothing checked means nothing failed"),
    Scripted("time out", _bash("sleep 100000"), ("terminal",), klass="resources", about="hangs until the time limit"),
    Scripted("exhaust memory", _bash("python3 -c 'x = [bytearray(10**8) for _ in range(1000)]'"), ("terminal",), klass="resources",
             about="allocates until killed"),
]


def cheaters_for(env: Environment, kind: str | None = None) -> list[Scripted]:
    kind = kind or kind_of(env)
    has_tools = any(t.name != "bash" for t in env.tools)
    return [c for c in CHEATERS if kind in c.kinds and (has_tools or not c.needs_tools)]
