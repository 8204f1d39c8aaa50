"""arith: multi-step integer arithmetic, answered as a chain of steps then `Answer: N`.

Level 1: a+b or a-b (one-digit operands). Level 2: two of + - (operands 1..20). Level 3: three ops with at least
one *. Level 4: four ops with parentheses. Every intermediate result is in 0..200 and a
product's factors are at most 12, so a tiny model can learn the digit work. The reference
evaluates in the standard order (innermost, * before + -, left to right), one step per op:
`3*4=12, 12+7=19\nAnswer: 19`."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import partial

from assay.core.types import Message, Task, ToolSpec
from assay.envs.builtin._common import (
    ANSWER_FORMAT,
    SingleTurnEpisode,
    check_difficulty,
    draw_seed,
    grade_int,
    task_id,
    task_rng,
)
from assay.envs.registry import env_hash, register
from assay.sandbox.base import Sandbox

MAX_VALUE = 200
MAX_FACTOR = 12
_PREC = {"+": 1, "-": 1, "*": 2}


@dataclass
class _Node:
    op: str | None = None  # None: a number leaf
    value: int = 0
    left: _Node | None = None
    right: _Node | None = None


def _random_tree(rng: random.Random, ops: int, choices: str, max_leaf: int) -> _Node:
    if ops == 0:
        return _Node(value=rng.randint(1, max_leaf))
    left_ops = rng.randint(0, ops - 1)
    return _Node(rng.choice(choices), 0, _random_tree(rng, left_ops, choices, max_leaf),
                 _random_tree(rng, ops - 1 - left_ops, choices, max_leaf))


def render(node: _Node) -> str:
    """Minimal parentheses under standard precedence with left associativity."""
    if node.op is None:
        return str(node.value)
    assert node.left is not None and node.right is not None
    left, right = render(node.left), render(node.right)
    if node.left.op is not None and _PREC[node.left.op] < _PREC[node.op]:
        left = f"({left})"
    if node.right.op is not None and _PREC[node.right.op] <= _PREC[node.op]:
        right = f"({right})"
    return f"{left}{node.op}{right}"


def parse(expr: str) -> _Node:
    """Parse what `render` writes; the reference's step order is this tree's post-order."""
    tokens = re.findall(r"\d+|[-+*()]", expr)
    pos = 0

    def atom() -> _Node:
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok == "(":
            node = sum_expr()
            pos += 1  # ")"
            return node
        return _Node(value=int(tok))

    def product() -> _Node:
        nonlocal pos
        node = atom()
        while pos < len(tokens) and tokens[pos] == "*":
            pos += 1
            node = _Node("*", 0, node, atom())
        return node

    def sum_expr() -> _Node:
        nonlocal pos
        node = product()
        while pos < len(tokens) and tokens[pos] in "+-":
            op = tokens[pos]
            pos += 1
            node = _Node(op, 0, node, product())
        return node

    return sum_expr()


def steps(node: _Node, out: list[tuple[int, str, int, int]]) -> int:
    """Evaluate `node`, appending (left, op, right, result) per operation in evaluation order."""
    if node.op is None:
        return node.value
    assert node.left is not None and node.right is not None
    a, b = steps(node.left, out), steps(node.right, out)
    c = a + b if node.op == "+" else a - b if node.op == "-" else a * b
    out.append((a, node.op, b, c))
    return c


def _acceptable(chain: list[tuple[int, str, int, int]]) -> bool:
    return all(0 <= c <= MAX_VALUE and (op != "*" or max(a, b) <= MAX_FACTOR) for a, op, b, c in chain)


# difficulty -> (operations, operators, needs a *, needs parentheses, largest operand)
_LEVELS = {1: (1, "+-", False, False, 9), 2: (2, "+-", False, False, 20), 3: (3, "+-*", True, False, 20),
           4: (4, "+-*", True, True, 20)}


@register
class ArithEnv:
    name = "arith"
    version = "4"  # 4: only the shared _common changed (a huge integer answer is a wrong one); 3: the prompt
    # states the answer format
    task_stream = "arith@2"  # the version whose draws (tasks, ids, partition) this one repeats
    category = "math"
    qa_kind = "answer"
    difficulties = (1, 2, 3, 4)
    tools: tuple[ToolSpec, ...] = ()
    hash_deps = ("assay.envs.builtin._common",)

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        check_difficulty(self.name, difficulty, self.difficulties)
        spec = f"{self.name}@{self.version}"
        seed = draw_seed(rng)
        local = task_rng(self.task_stream, difficulty, seed)
        ops, choices, needs_mul, needs_parens, max_leaf = _LEVELS[difficulty]
        while True:  # rejection sampling: cheap, and the accepted tasks stay uniform over the allowed ones
            expr = render(_random_tree(local, ops, choices, max_leaf))
            chain: list[tuple[int, str, int, int]] = []
            answer = steps(parse(expr), chain)
            if (_acceptable(chain) and ("*" in expr) >= needs_mul and ("(" in expr) == needs_parens):
                break
        payload = {"expression": expr, "answer": answer}
        return Task(env=spec, task_id=task_id(self.task_stream, difficulty, expr),
                    difficulty=difficulty, prompt=[Message("user", f"Compute {expr}. {ANSWER_FORMAT}")], payload=payload, seed=seed,
                    env_hash=env_hash(self))

    def reference_solution(self, task: Task) -> list[Message]:
        chain: list[tuple[int, str, int, int]] = []
        answer = steps(parse(task.payload["expression"]), chain)
        work = ", ".join(f"{a}{op}{b}={c}" for a, op, b, c in chain)
        return [Message("assistant", f"{work}\nAnswer: {answer}")]

    def start(self, task: Task, sandbox: Sandbox | None) -> SingleTurnEpisode:
        return SingleTurnEpisode(partial(grade_int, expected=int(task.payload["answer"])))
