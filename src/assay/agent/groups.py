"""Turn sampled tasks into scored trajectories: expand each task into its GRPO group and run the
agent loop per domain (each domain has its own turn and length limits)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from assay.agent.loop import run_episodes
from assay.core.config import DomainConfig
from assay.core.tokenizer import stop_token_ids
from assay.core.types import Task, Trajectory
from assay.envs.base import Environment
from assay.rollout.base import RolloutBackend, SamplingParams


def collect(backend: RolloutBackend, tokenizer: Any, envs: dict[str, Environment], domains: dict[str, DomainConfig],
            tasks: Sequence[Task], samples: int | None, temperature: float, top_p: float = 1.0, top_k: int = 0,
            policy_version: int = 0, seed: int | None = None, group_prefix: str = "") -> list[Trajectory]:
    """`samples` per task (None: each domain's group_size). Returns trajectories in task order,
    a group's samples together, each group sharing a `group_id`."""
    by_domain: dict[str, list[tuple[int, Task]]] = defaultdict(list)
    for i, task in enumerate(tasks):
        by_domain[task.domain].append((i, task))
    results: dict[int, list[Trajectory]] = {}
    for name, items in by_domain.items():
        dom = domains[name]
        n = samples or dom.group_size
        episodes = [(task, envs[name].start(task, None)) for _, task in items for _ in range(n)]
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=dom.max_new_tokens,
                                stop_token_ids=stop_token_ids(tokenizer), seed=seed)
        trajs = run_episodes(backend, episodes, tokenizer, params, max_turns=dom.max_turns,
                             max_context=dom.max_context, policy_version=policy_version)
        for j, (i, task) in enumerate(items):
            group = trajs[j * n:(j + 1) * n]
            for t in group:
                t.group_id = f"{group_prefix}{i}:{task.task_id}"
            results[i] = group
    return [t for i in range(len(tasks)) for t in results[i]]
