"""The environment seam: a versioned, procedurally generated source of tasks with a verifier.

The whole contract is here. Required: the attributes and methods of `Environment` and `Episode`.
Optional (found with getattr; each has the default named):

- `Environment.eval_share: float` — the share of the task space held out for evaluation
  (default 0.2); tasks are assigned by a hash of their `task_id`.
- `Environment.hash_deps: tuple[str, ...]` — modules besides the class's own whose source is part
  of the content hash (default none): the helpers its generator or verifier imports.
- `Environment.fingerprint() -> str` — a digest of data or template files the environment loads,
  also hashed (default none).
- `Environment.secrets(task) -> list[str]` — strings that must never be readable from inside the
  episode's sandbox (the answer, hidden tests); the QA gate searches for them (default: the
  reference solution's final answer).
- `Environment.qa_kind: "answer" | "code" | "terminal"` — which cheating strategies the QA gate
  plays. Undeclared, the gate infers it from what the environment does ("terminal" with a `bash`
  tool, "code" with `sandbox_limits` or a code block in the reference's answer, else "answer") and
  warns; a declared kind that contradicts a code or terminal behaviour fails the gate.
- `Environment.sandbox_limits: Limits` — the sandbox each episode needs. Declared, the framework hands
  every episode a warm sandbox from a pool through `start(task, sandbox)` (taken on first use, given
  back restored when the episode closes), so the environment opens none of its own; undeclared (or
  where the host cannot isolate), `start` gets None and the environment opens what it needs.
- `Environment.stateless_verify: bool` — whether a fresh episode of the task verifies the final
  messages as the acting one would, so that verification may run in a verifier process
  (`rollout.verifier_processes`; default: true exactly when the environment has no tools, since then no
  call ever reaches `Episode.step`).
- `Episode.close()` — release what `start` acquired; called once on every path (default: nothing).
  A sandbox the framework handed over is the framework's to give back: leave it.
- `Observation.is_error` on a tool result counts as a tool error in the trajectory.

What the framework stamps itself, after `generate` (`registry.generate_task`): the task's `env`
(name@version) and `env_hash`; and the `seed` that produced it, when drawn for a split. Whoever
draws a task for a run (the mixer, SFT, evaluation, a suite) sets its `domain`: the name the run
gives the domain, which is not the environment's `category`. An environment sets `task_id` (from the task's content: `assay.envs.task_id`), `difficulty` (the one
asked for), `prompt`, `tools` and a hidden `payload`."""

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
    category: str  # free text for people ("math", "code"); a run names its own domains
    difficulties: Sequence[int]
    tools: Sequence[ToolSpec]

    def generate(self, rng: random.Random, difficulty: int) -> Task: ...

    def reference_solution(self, task: Task) -> list[Message]: ...

    def start(self, task: Task, sandbox: Sandbox | None) -> Episode: ...
