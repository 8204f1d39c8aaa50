"""The environment seam: a versioned, procedurally generated source of tasks with a verifier."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from assay.core.types import Message, Observation, Reward, Task, ToolCall, ToolSpec
from assay.sandbox.base import Sandbox


class Episode(Protocol):
    """One task being acted on."""

    def step(self, call: ToolCall) -> Observation: ...

    def verify(self, final: list[Message]) -> Reward: ...  # runs after acting, isolated


class Environment(Protocol):
    name: str
    version: str
    domain: str
    difficulties: Sequence[int]
    tools: Sequence[ToolSpec]

    def generate(self, rng: random.Random, difficulty: int) -> Task: ...

    def reference_solution(self, task: Task) -> list[Message]: ...

    def start(self, task: Task, sandbox: Sandbox | None) -> Episode: ...
