"""Evaluate a policy on pinned, held-out tasks: n samples per task, pass@k with 95% CIs."""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from assay.agent.groups import collect
from assay.core.config import DomainConfig
from assay.core.types import OK, Task, Trajectory
from assay.envs.base import Environment
from assay.envs.split import draw_distinct
from assay.eval.passk import Estimate, pass_at_k_ci
from assay.rollout.base import RolloutBackend

log = logging.getLogger(__name__)


def eval_tasks(env: Environment, domain: str, count: int, seed: int, difficulties: Sequence[int]) -> list[Task]:
    """Distinct tasks of the evaluation partition, a pure function of (seed, domain, count, levels): the
    same suite every time, whatever ran before. Levels share the count equally (interleaved); a level
    whose partition holds fewer tasks gives what it has, and a warning names it."""
    per_level = [count // len(difficulties) + (i < count % len(difficulties)) for i in range(len(difficulties))]
    drawn = []
    for level, want in zip(difficulties, per_level, strict=True):
        got = draw_distinct(env, random.Random(f"eval:{seed}:{domain}:{level}"), level, "eval", want)
        if len(got) < want:
            log.warning("%s level %d: only %d distinct evaluation tasks (asked for %d); the level's task space is "
                        "small (assay env show %s)", domain, level, len(got), want, env.name)
        drawn.append(got)
    tasks = [level[i] for i in range(max(per_level, default=0)) for level in drawn if i < len(level)]
    for task in tasks:
        task.domain = domain
    return tasks


@dataclass
class DomainEval:
    domain: str
    passes: list[list[bool]]  # per task, per sample; infrastructure failures left out
    task_ids: list[str] = field(default_factory=list)  # the task of each row of `passes`
    pass_at: dict[int, Estimate] = field(default_factory=dict)
    infra_errors: int = 0
    mean_reward: float = 0.0
    by_difficulty: dict[int, float] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return max((len(p) for p in self.passes), default=0)


def summarize(domain: str, trajs: Sequence[Trajectory], ks: Sequence[int]) -> DomainEval:
    by_group: dict[str, list[Trajectory]] = {}
    for t in trajs:
        by_group.setdefault(t.group_id, []).append(t)
    rows = [(g[0].task.task_id, [t.passed for t in g if t.status == OK]) for g in by_group.values()]
    rows = [(task_id, p) for task_id, p in rows if p]
    passes = [p for _, p in rows]
    result = DomainEval(domain, passes, [task_id for task_id, _ in rows], infra_errors=sum(t.status != OK for t in trajs))
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
        results[name] = summarize(name, trajs, ks)
    return results
