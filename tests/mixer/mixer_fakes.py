"""A tiny in-test environment and trajectory builder: the mixer only needs generate() and results."""

from __future__ import annotations

import random

from assay.core.types import OK, Message, Task, Trajectory


class CountingEnv:
    """Tasks 'say the number n'; the number comes from the rng so seeds are checkable."""

    def __init__(self, name: str, difficulties: tuple[int, ...] = (1, 2, 3)) -> None:
        self.name = name
        self.version = "1"
        self.category = name
        self.difficulties = list(difficulties)
        self.tools: list = []

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        n = rng.randint(0, 10**6)
        return Task(
            env=f"{self.name}@1",
            task_id=f"{self.name}-{difficulty}-{n}",
            difficulty=difficulty,
            prompt=[Message("user", f"say {n}")],
            payload={"answer": n},
        )

    def reference_solution(self, task: Task) -> list[Message]:
        return [Message("assistant", str(task.payload["answer"]))]

    def start(self, task: Task, sandbox: object) -> object:
        raise AssertionError("the mixer never starts episodes")


def traj(
    task: Task,
    passed: bool,
    *,
    status: str = OK,
    reward: float | None = None,
    mask: tuple[int, ...] = (0, 0, 1, 1),
    finish: str = "stop",
    tool_errors: int = 0,
    group: str = "",
) -> Trajectory:
    return Trajectory(
        task=task,
        messages=[],
        token_ids=list(range(len(mask))),
        loss_mask=list(mask),
        logprobs=[0.0] * len(mask),
        prompt_len=2,
        finish_reason=finish,
        reward=float(passed) if reward is None else reward,
        passed=passed,
        status=status,
        tool_errors=tool_errors,
        group_id=group or str(task.seed),
    )


def task_of(domain: str, difficulty: int = 1, seed: int = 0) -> Task:
    return Task(
        env=f"{domain}@1", task_id=f"{domain}-{seed}", domain=domain, difficulty=difficulty, prompt=[], seed=seed
    )
