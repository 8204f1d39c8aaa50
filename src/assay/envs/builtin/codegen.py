"""codegen: write a one-line Python function `f` from a spec in words and one example.

A handful of regular template families per level, so a tiny model can learn the word -> code
mapping: level 1 `x plus/minus/times k`; level 2 `%`, `//`, two arguments; level 3 one list or
string operation; level 4 two composed operations. Graded by hidden unit tests (inputs and
expected outputs in the payload) run in a sandbox by `_pyjudge`; score = fraction passed."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from assay.core.types import Message, Observation, Reward, Task, ToolCall, ToolSpec
from assay.envs.builtin._common import check_difficulty, draw_seed, last_assistant, task_id, task_rng
from assay.envs.builtin._pyjudge import Candidate, extract_code, judge_joined
from assay.envs.registry import env_hash, register
from assay.sandbox import Limits
from assay.sandbox.base import Sandbox

Inputs = Callable[[random.Random], list[Any]]


def _int(rng: random.Random) -> list[Any]:
    return [rng.randint(0, 30)]


def _two_ints(rng: random.Random) -> list[Any]:
    return [rng.randint(0, 20), rng.randint(0, 20)]


def _list(rng: random.Random, min_len: int = 0) -> list[Any]:
    return [[rng.randint(0, 9) for _ in range(rng.randint(min_len, 5))]]


def _nonempty_list(rng: random.Random) -> list[Any]:
    return _list(rng, 1)


def _str(rng: random.Random) -> list[Any]:
    return ["".join(rng.choice("abcde") for _ in range(rng.randint(1, 6)))]


def _k(lo: int, hi: int) -> Callable[[random.Random], dict[str, Any]]:
    return lambda rng: {"k": rng.randint(lo, hi)}


def _km(rng: random.Random) -> dict[str, Any]:
    return {"k": rng.randint(2, 9), "m": rng.randint(2, 9)}


def _char(rng: random.Random) -> dict[str, Any]:
    return {"c": rng.choice("abcde")}


def _k_char(rng: random.Random) -> dict[str, Any]:
    return {"k": rng.randint(2, 9), "c": rng.choice("abcde")}


def _two_chars(rng: random.Random) -> dict[str, Any]:
    c, d = rng.sample("abcdexyz", 2)
    return {"c": c, "d": d}


@dataclass(frozen=True)
class Family:
    args: str  # the parameter list of f
    says: str  # what f returns, in words; {k} {m} {c} {d} are the family's parameters
    body: str  # the return expression, same placeholders
    params: Callable[[random.Random], dict[str, Any]]
    inputs: Inputs


FAMILIES: dict[int, dict[str, Family]] = {
    1: {
        "plus": Family("x", "x plus {k}", "x + {k}", _k(1, 9), _int),
        "minus": Family("x", "x minus {k}", "x - {k}", _k(1, 9), _int),
        "times": Family("x", "x times {k}", "x * {k}", _k(2, 9), _int),
        "affine": Family("x", "x times {k} plus {m}", "x * {k} + {m}", _km, _int),
    },
    2: {
        "mod": Family("x", "the remainder of x divided by {k}", "x % {k}", _k(2, 9), _int),
        "floordiv": Family("x", "x divided by {k}, rounded down", "x // {k}", _k(2, 9), _int),
        "max": Family("a, b", "the larger of a and b", "max(a, b)", lambda rng: {}, _two_ints),
        "absdiff": Family("a, b", "the absolute difference of a and b", "abs(a - b)", lambda rng: {}, _two_ints),
        "mul_add": Family("a, b", "a times b plus {k}", "a * b + {k}", _k(1, 9), _two_ints),
    },
    3: {
        "sum_gt": Family("xs", "the sum of the items of xs greater than {k}", "sum(x for x in xs if x > {k})",
                         _k(1, 7), _list),
        "count": Family("xs", "how many items of xs equal {k}", "xs.count({k})", _k(0, 9), _list),
        "scale": Family("xs", "xs with every item times {k}", "[x * {k} for x in xs]", _k(2, 9), _list),
        "reverse": Family("s", "s reversed", "s[::-1]", lambda rng: {}, _str),
        "count_char": Family("s", "how many times '{c}' occurs in s", "s.count('{c}')", _char, _str),
        "prefix": Family("s", "the first {k} characters of s", "s[:{k}]", _k(1, 4), _str),
    },
    4: {
        "sum_scale": Family("xs", "the sum of xs times {k}", "sum(xs) * {k}", _k(2, 9), _list),
        "filter_scale": Family("xs", "the items of xs greater than {k}, each times {m}",
                               "[x * {m} for x in xs if x > {k}]", lambda rng: {"k": rng.randint(1, 6),
                                                                                 "m": rng.randint(2, 9)}, _list),
        "max_plus": Family("xs", "the largest item of xs plus {k}", "max(xs) + {k}", _k(1, 9), _nonempty_list),
        "reverse_upper": Family("s", "s reversed, in upper case", "s[::-1].upper()", lambda rng: {}, _str),
        "prefix_repeat": Family("s", "the first {k} characters of s, repeated {m} times", "s[:{k}] * {m}",
                                lambda rng: {"k": rng.randint(1, 4), "m": rng.randint(2, 3)}, _str),
        "count_char_plus": Family("s", "how many times '{c}' occurs in s, plus {k}", "s.count('{c}') + {k}",
                                  _k_char, _str),
        "replace": Family("s", "s with '{c}' replaced by '{d}'", "s.replace('{c}', '{d}')", _two_chars, _str),
    },
}

N_TESTS = 6
# What the verifier parses (`_pyjudge.extract_code`): the last fenced block that defines something, else
# unfenced code from its first line that starts code; `f` is then called on the hidden inputs.
FORMAT = "Answer with the function f in a ```python code block."


def reference_code(family: Family, params: dict[str, Any]) -> str:
    return f"def f({family.args}):\n    return {family.body.format(**params)}"


def _call(code: str, args: list[Any]) -> Any:
    ns: dict[str, Any] = {}
    exec(code, ns)  # our own reference, never model output: the expected values come from it
    return ns["f"](*args)


def _draw_inputs(rng: random.Random, family: Family, code: str, count: int) -> tuple[list[Any], list[Any]]:
    """`count` distinct inputs whose outputs are not all equal (so a constant cannot pass)."""
    while True:
        inputs: list[list[Any]] = []
        for _ in range(200):
            args = family.inputs(rng)
            if args not in inputs:
                inputs.append(args)
            if len(inputs) == count:
                break
        outputs = [_call(code, a) for a in inputs]
        if any(o != outputs[0] for o in outputs):
            return inputs, outputs


def _show(args: list[Any]) -> str:
    return ", ".join(repr(a) for a in args)


@dataclass
class CodegenEpisode:
    task: Task
    sandbox: Sandbox | None
    limits: Limits
    tool_errors: int = 0

    def step(self, call: ToolCall) -> Observation:
        self.tool_errors += 1
        return Observation(f"error: this task has no tools (called {call.name!r}); answer with code", is_error=True)

    def verify(self, final: list[Message]) -> Reward:
        msg = last_assistant(final)
        tests = self.task.payload["tests"]
        candidate = Candidate(extract_code(msg.content) if msg is not None else "", [t[0] for t in tests],
                              [t[1] for t in tests])
        # Graded with what other threads verify meanwhile, in one sandboxed run; without a sandbox of its own,
        # in one opened for it (nothing carries over between candidates either way).
        return judge_joined(candidate, self.sandbox, self.limits)


@register
class CodegenEnv:
    name = "codegen"
    version = "7"  # 7: only the shared _common changed (the answer line's integer bound); 6: the prompt states the
    # answer format; 5: a result counts only from a child the harness saw end; 4: graded in batches; 3's tasks
    task_stream = "codegen@3"  # the version whose draws (tasks, ids, partition) this one repeats
    category = "code"
    qa_kind = "code"
    difficulties = (1, 2, 3, 4)
    tools: tuple[ToolSpec, ...] = ()
    hash_deps = ("assay.envs.builtin._common", "assay.envs.builtin._pyjudge")

    def __init__(self, timeout_s: float = 3.0, memory_mb: int = 256) -> None:
        # Declared, the framework hands each episode a warm pooled sandbox, restored between episodes.
        self.sandbox_limits = Limits(timeout_s=timeout_s, cpu_s=max(1, math.ceil(timeout_s)), memory_mb=memory_mb,
                             max_procs=16, file_size_mb=1, output_bytes=64 * 1024)

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        check_difficulty(self.name, difficulty, self.difficulties)
        spec = f"{self.name}@{self.version}"
        seed = draw_seed(rng)
        local = task_rng(self.task_stream, difficulty, seed)
        key = local.choice(sorted(FAMILIES[difficulty]))
        family = FAMILIES[difficulty][key]
        params = family.params(local)
        code = reference_code(family, params)
        inputs, outputs = _draw_inputs(local, family, code, N_TESTS + 1)
        # Show one input-output pair that says something (not 0 or empty); the hidden tests are the others.
        shown = next((i for i, o in enumerate(outputs) if o not in (0, "", [])), 0)
        inputs.insert(0, inputs.pop(shown))
        outputs.insert(0, outputs.pop(shown))
        example = f"f({_show(inputs[0])}) == {outputs[0]!r}"
        spec_text = f"Write a Python function f({family.args}) that returns {family.says.format(**params)}.\n" \
                    f"Example: {example}"
        tests = [[a, o] for a, o in zip(inputs[1:], outputs[1:], strict=True)]
        payload = {"family": key, "params": params, "code": code, "tests": tests}
        # the id hashes the spec alone, so version 6's format line keeps version 3's tasks and partition
        return Task(env=spec, task_id=task_id(self.task_stream, difficulty, [spec_text, tests]),
                    difficulty=difficulty, prompt=[Message("user", f"{spec_text}\n{FORMAT}")], payload=payload,
                    seed=seed,
                    env_hash=env_hash(self))

    def reference_solution(self, task: Task) -> list[Message]:
        return [Message("assistant", f"```python\n{task.payload['code']}\n```")]

    def start(self, task: Task, sandbox: Sandbox | None) -> CodegenEpisode:
        return CodegenEpisode(task, sandbox, self.sandbox_limits)
