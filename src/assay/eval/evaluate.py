"""Evaluate a policy on pinned, held-out tasks: n samples per task, pass@k with 95% CIs."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from assay.agent.groups import collect
from assay.core.config import DomainConfig
from assay.core.types import OK, Task, Trajectory
from assay.envs.base import Environment
from assay.eval.passk import Estimate, pass_at_k_ci
from assay.rollout.base import RolloutBackend


def eval_tasks(env: Environment, domain: str, count: int, seed: int, difficulties: Sequence[int]) -> list[Task]:
    """Task i is a pure function of (seed, domain, i): the same suite every time, whatever ran before.
    Difficulties cycle so every level is represented equally."""
    tasks = []
    for i in range(count):
        task = env.generate(random.Random(f"eval:{seed}:{domain}:{i}"), difficulties[i % len(difficulties)])
        task.domain = domain
        tasks.append(task)
    return tasks


@dataclass
class DomainEval:
    domain: str
    passes: list[list[bool]]  # per task, per sample; infrastructure failures left out
    pass_at: dict[int, Estimate] = field(default_factory=dict)
    infra_errors: int = 0
    mean_reward: float = 0.0
    by_difficulty: dict[int, float] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return max((len(p) for p in self.passes), default=0)


def summarize(domain: str, tasks: Sequence[Task], trajs: Sequence[Trajectory], ks: Sequence[int]) -> DomainEval:
    by_group: dict[str, list[Trajectory]] = {}
    for t in trajs:
        by_group.setdefault(t.group_id, []).append(t)
    passes = [[t.passed for t in g if t.status == OK] for g in by_group.values()]
    passes = [p for p in passes if p]
    result = DomainEval(domain, passes, infra_errors=sum(t.status != OK for t in trajs))
    if passes:
        n = min(len(p) for p in passes)
        result.pass_at = {k: pass_at_k_ci(passes, k) for k in ks if k <= n}
    ok = [t for t in trajs if t.status == OK]
    result.mean_reward = sum(t.reward for t in ok) / max(len(ok), 1)
    levels = sorted({t.task.difficulty for t in ok})
    for level in levels:
        at = [t.passed for t in ok if t.task.difficulty == level]
        result.by_difficulty[level] = sum(at) / len(at)
    return result


def evaluate(backend: RolloutBackend, tokenizer: Any, envs: dict[str, Environment], domains: dict[str, DomainConfig],
             tasks_per_domain: int, n: int, seed: int, temperature: float = 1.0,
             ks: Sequence[int] = (1, 4, 8)) -> dict[str, DomainEval]:
    results = {}
    for name, dom in domains.items():
        env = envs[name]
        levels = dom.difficulty.levels(env.difficulties)
        tasks = eval_tasks(env, name, tasks_per_domain, seed, levels)
        trajs = collect(backend, tokenizer, envs, domains, tasks, samples=n, temperature=temperature, seed=seed)
        results[name] = summarize(name, tasks, trajs, ks)
    return results
