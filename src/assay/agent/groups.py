"""Turn sampled tasks into scored trajectories: expand each task into its GRPO group and run the
agent loop per domain (each domain has its own turn and length limits)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from assay.agent.approvals import Approvals
from assay.agent.loop import VERIFY_WORKERS, EpisodeJob, run_episodes, run_episodes_online
from assay.core.config import DomainConfig
from assay.core.errors import AssayError
from assay.core.tokenizer import stop_token_ids
from assay.core.types import Task, Trajectory
from assay.envs.base import Environment, hooks
from assay.envs.episode import close_episodes
from assay.envs.milestones import mark_milestones
from assay.envs.verifiers import VerifierPool, acting_episode, verifies_anywhere
from assay.rollout.base import OnlineBackend, RolloutBackend, SamplingParams


def collect(backend: RolloutBackend, tokenizer: Any, envs: dict[str, Environment], domains: dict[str, DomainConfig],
            tasks: Sequence[Task], samples: int | None, temperature: float, top_p: float = 1.0, top_k: int = 0,
            policy_version: int = 0, seed: int | None = None, group_prefix: str = "",
            online: bool = False, first: int = 0, verifiers: int = VERIFY_WORKERS,
            verifier_pool: VerifierPool | None = None, approvals: Approvals | None = None) -> list[Trajectory]:
    """`samples` per task (None: each domain's group_size). Returns trajectories in task order,
    a group's samples together, each group sharing a `group_id`. Without `online`, the agent loop runs
    per domain, every episode of a domain taking its turns in lockstep; with it (the engine only),
    the episodes of every domain share one batch and each advances on its own. `first`: where `tasks`
    start in a larger batch split over several workers, so that group ids stay distinct across the
    parts (0: the whole batch, as one worker sees it). `verifiers`: episodes verified at once;
    `verifier_pool`: where the episodes of environments that verify anywhere are verified (None: here);
    `approvals`: the deployment's allowlist and critical tools (evaluation only: RL never waits for a person)."""
    if online and not isinstance(backend, OnlineBackend):
        raise AssayError("pipeline.online needs a backend that admits requests while it runs "
                         "(rollout.backend: engine or vllm)")
    by_domain: dict[str, list[tuple[int, Task]]] = defaultdict(list)
    for i, task in enumerate(tasks):
        by_domain[task.domain].append((i, task))
    jobs: dict[str, list[EpisodeJob]] = {}
    waiting = jobs  # the episodes not yet handed to a loop, which closes those it is given
    try:
        for name, items in by_domain.items():
            dom = domains[name]
            n = samples or dom.group_size
            params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=dom.max_new_tokens,
                                    stop_token_ids=stop_token_ids(tokenizer), seed=seed)
            jobs[name] = []
            pool = verifier_pool if verifier_pool is not None and verifies_anywhere(envs[name]) else None
            for k, task in enumerate(task for _, task in items for _ in range(n)):
                jobs[name].append(EpisodeJob(task, acting_episode(envs[name], task, pool), params, dom.max_turns,
                                             dom.max_context, k, dom.time_limit_s, dom.verify_timeout_s, pool,
                                             dom.tool_retries, dom.repair_tool_calls, dom.agent, approvals))
        if online:
            waiting = {}
            flat = run_episodes_online(backend, [j for js in jobs.values() for j in js], tokenizer, policy_version,
                                       verifiers=verifiers)
            done, start = {}, 0
            for name, js in jobs.items():
                done[name], start = flat[start:start + len(js)], start + len(js)
        else:
            waiting, done = dict(jobs), {}
            for name, js in jobs.items():
                del waiting[name]
                j = js[0]
                done[name] = run_episodes(backend, [(j.task, j.episode) for j in js], tokenizer, j.params, j.max_turns,
                                          j.max_context, policy_version, j.time_limit_s, j.verify_timeout_s, verifiers,
                                          j.verifier, j.tool_retries, j.repair_tool_calls, j.agent, j.approvals)
    except BaseException:
        close_episodes([j.episode for js in waiting.values() for j in js])
        raise
    results: dict[int, list[Trajectory]] = {}
    for name, items in by_domain.items():
        n = len(done[name]) // len(items)
        for j, (i, task) in enumerate(items):
            group = done[name][j * n:(j + 1) * n]
            for t in group:
                t.group_id = f"{group_prefix}{first + i}:{task.task_id}"
            results[i] = group
    out = [t for i in range(len(tasks)) for t in results[i]]
    mark_milestones(out, {name: hooks(envs[name]).milestones for name in by_domain})
    return out
