"""Evaluate a policy on pinned, held-out tasks: n samples per task, pass@k with 95% CIs."""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from assay.agent.approvals import Approvals
from assay.agent.groups import collect
from assay.core.config import DomainConfig
from assay.core.errors import AssayError
from assay.core.types import OK, Task, Trajectory
from assay.envs.base import Environment
from assay.envs.split import draw_distinct
from assay.eval.passk import Estimate, pass_at_k_ci, pass_hat_k_ci
from assay.mixer.stats import hit_rates, mean_of
from assay.rollout.base import RolloutBackend

log = logging.getLogger(__name__)


def eval_tasks(env: Environment, domain: str, count: int, seed: int, difficulties: Sequence[int]) -> list[Task]:
    """Distinct tasks of the evaluation partition, a pure function of (seed, domain, count, levels): the
    same suite every time, whatever ran before. Levels share the count equally (interleaved); a level
    whose partition holds fewer tasks gives what it has, and a warning names it."""
    per_level = [count // len(difficulties) + (i < count % len(difficulties)) for i in range(len(difficulties))]
    drawn = []
    for level, want in zip(difficulties, per_level, strict=True):
        try:
            got = draw_distinct(env, random.Random(f"eval:{seed}:{domain}:{level}"), level, "eval", want)
        except AssayError as e:  # an empty partition (a tiny data file): the other levels are still measured
            log.warning("%s level %d: no evaluation tasks (%s)", domain, level, e)
            got = []
        if 0 < len(got) < want:
            log.warning("%s level %d: only %d distinct evaluation tasks (asked for %d); the level's task space is "
                        "small (assay env show %s)", domain, level, len(got), want, env.name)
        drawn.append(got)
    tasks = [level[i] for i in range(max(per_level, default=0)) for level in drawn if i < len(level)]
    for task in tasks:
        task.domain = domain
    return tasks


@dataclass
class DomainEval:
    """One environment's evaluation in many dimensions. Pass rates count only episodes whose
    infrastructure worked; infrastructure errors are counted apart, never as failures."""

    domain: str
    passes: list[list[bool]]  # per task, per sample; infrastructure failures left out
    task_ids: list[str] = field(default_factory=list)  # the task of each row of `passes`
    pass_at: dict[int, Estimate] = field(default_factory=dict)  # at least one of k samples passes
    pass_hat: dict[int, Estimate] = field(default_factory=dict)  # all k samples pass (reliability)
    infra_errors: int = 0
    mean_reward: float = 0.0
    by_difficulty: dict[int, float] = field(default_factory=dict)
    rounds: dict[int, int] = field(default_factory=dict)  # assistant turns -> episodes
    tool_calls: int = 0  # tool results the episodes received (an error observation counts)
    tool_errors: int = 0
    recovered: int = 0  # episodes with a failed tool call that still passed
    with_tool_error: int = 0
    call_turns: int = 0  # assistant turns that called a tool (Trajectory.call_turns)
    malformed: int = 0  # of them, malformed: unparsable, unknown tool, schema violation
    retries: int = 0  # retry prompts shown (domain tool_retries)
    retry_successes: int = 0  # answered by a well-formed turn
    degraded_calls: int = 0  # calls acted on after a repair or a fallback routing (domain repair_tool_calls, agent)
    fallback_calls: int = 0  # of them, routed to a declared fallback tool (agent.fallback_tools)
    approved_calls: int = 0  # approvals (agent.approvals): critical calls a person approved
    denied_calls: int = 0  # denied by a person, a timeout or a failed channel: not run
    refused_calls: int = 0  # outside the deployment's allowlist: not run
    # long horizons, where the entry's tasks offer tools (tool use: None elsewhere), as the training steps log them
    # (mixer.stats): the largest context a turn saw (mean and max over episodes; None without token ids, as from
    # an endpoint), and per episode compactions, memory-tool calls and planning turns
    tools: bool = False
    peak_context: float | None = None
    peak_context_max: int | None = None
    compactions: float | None = None
    memory_calls: float | None = None
    plan_turns: float | None = None
    milestones: dict[str, float] = field(default_factory=dict)  # each declared milestone's hit rate (envs.milestones)
    prompt_tokens: float = 0.0  # mean per episode: prompt and observations
    completion_tokens: float = 0.0  # mean per episode (sampled tokens)
    latency_p50: float = 0.0  # seconds per episode: generation + tools + verification
    latency_p95: float = 0.0
    trajectories: list[Trajectory] = field(default_factory=list, repr=False)

    @property
    def n(self) -> int:
        return max((len(p) for p in self.passes), default=0)

    @property
    def mean_rounds(self) -> float:
        return sum(k * v for k, v in self.rounds.items()) / max(sum(self.rounds.values()), 1)

    @property
    def tool_error_rate(self) -> float | None:
        return self.tool_errors / self.tool_calls if self.tool_calls else None

    @property
    def recovery_rate(self) -> float | None:
        return self.recovered / self.with_tool_error if self.with_tool_error else None

    @property
    def malformed_rate(self) -> float | None:
        return self.malformed / self.call_turns if self.call_turns else None

    @property
    def retry_success_rate(self) -> float | None:
        return self.retry_successes / self.retries if self.retries else None

    def cost(self, prompt_price: float, completion_price: float) -> float:
        """Per episode, at these prices per million prompt and completion tokens."""
        return (self.prompt_tokens * prompt_price + self.completion_tokens * completion_price) / 1e6


def paired(before: DomainEval, after: DomainEval) -> tuple[list[list[bool]], list[list[bool]]]:
    """Two evaluations' per-task passes on the tasks both measured, paired by task_id (never by position:
    a task whose every sample failed on infrastructure is missing from one side)."""
    b, a = dict(zip(before.task_ids, before.passes, strict=True)), dict(zip(after.task_ids, after.passes, strict=True))
    shared = [t for t in before.task_ids if t in a]
    return [b[t] for t in shared], [a[t] for t in shared]


def summarize(domain: str, trajs: Sequence[Trajectory], ks: Sequence[int]) -> DomainEval:
    by_group: dict[str, list[Trajectory]] = {}
    for t in trajs:
        by_group.setdefault(t.group_id, []).append(t)
    rows = [(g[0].task.task_id, [t.passed for t in g if t.status == OK]) for g in by_group.values()]
    rows = [(task_id, p) for task_id, p in rows if p]
    passes = [p for _, p in rows]
    result = DomainEval(domain, passes, [task_id for task_id, _ in rows], infra_errors=sum(t.status != OK for t in trajs),
                        trajectories=list(trajs))
    if passes:
        n = min(len(p) for p in passes)
        result.pass_at = {k: pass_at_k_ci(passes, k) for k in ks if k <= n}
        result.pass_hat = {k: pass_hat_k_ci(passes, k) for k in ks if k <= n}
    ok = [t for t in trajs if t.status == OK]
    if not ok:
        return result
    result.mean_reward = sum(t.reward for t in ok) / len(ok)
    for level in sorted({t.task.difficulty for t in ok}):
        at = [t.passed for t in ok if t.task.difficulty == level]
        result.by_difficulty[level] = sum(at) / len(at)
    result.rounds = dict(sorted(Counter(t.turns for t in ok).items()))
    result.tool_calls = sum(m.role == "tool" for t in ok for m in t.messages)
    result.tool_errors = sum(t.tool_errors for t in ok)
    erred = [t for t in ok if t.tool_errors]
    result.with_tool_error, result.recovered = len(erred), sum(t.passed for t in erred)
    result.call_turns = sum(t.call_turns for t in ok)
    result.malformed = sum(t.malformed_calls for t in ok)
    result.retries = sum(t.retries for t in ok)
    result.retry_successes = sum(t.retry_successes for t in ok)
    result.degraded_calls = sum(t.degraded_calls for t in ok)
    result.fallback_calls = sum(t.fallback_calls for t in ok)
    result.milestones = hit_rates(ok)
    agentic = [t for t in ok if t.task.tools]
    if agentic:
        result.tools = True
        result.compactions, result.memory_calls, result.plan_turns = (
            mean_of(agentic, c) for c in ("compactions", "memory_calls", "plan_turns"))
        if any(t.peak_context for t in agentic):
            result.peak_context, result.peak_context_max = mean_of(agentic, "peak_context"), max(
                t.peak_context for t in agentic)
    result.approved_calls = sum(t.approved_calls for t in ok)
    result.denied_calls = sum(t.denied_calls for t in ok)
    result.refused_calls = sum(t.refused_calls for t in ok)
    result.prompt_tokens = sum(t.prompt_tokens for t in ok) / len(ok)
    result.completion_tokens = sum(t.completion_tokens for t in ok) / len(ok)
    latency = np.array([sum(t.timings.values()) for t in ok])
    result.latency_p50, result.latency_p95 = (float(x) for x in np.percentile(latency, [50, 95]))
    return result


def evaluate_tasks(backend: RolloutBackend, tokenizer: Any, envs: dict[str, Environment],
                   domains: dict[str, DomainConfig], tasks: Sequence[Task], n: int, seed: int, temperature: float = 1.0,
                   ks: Sequence[int] = (1, 4, 8), overall: bool = False, *, allow_unchecked: Collection[str] = (),
                   stores: Sequence[Path] | None = None, approvals: Approvals | None = None) -> dict[str, DomainEval]:
    """n samples of every task (task.domain names its entry in `envs` and `domains`), summarized per
    domain and, with `overall`, over all of them as "overall". Refuses an environment without a passing
    QA record (in `stores`, default `record_stores()`) that `allow_unchecked` does not name; the
    trajectories of one it names carry reward_info["qa_unchecked"]. `approvals` gates the episodes'
    tool calls (agent/approvals.py: `open_approvals(ApprovalPolicy(...))`)."""
    from assay.envs.qa.enforce import mark_unchecked, require_checked

    used = {t.domain for t in tasks}
    unchecked = require_checked({d: e for d, e in envs.items() if d in used}, allow_unchecked, stores,
                                {d: c.env_args for d, c in domains.items()})
    trajs = collect(backend, tokenizer, envs, domains, tasks, samples=n, temperature=temperature, seed=seed,
                    approvals=approvals)
    mark_unchecked(trajs, unchecked)
    return summarize_domains(tasks, trajs, ks, overall)


def summarize_domains(tasks: Sequence[Task], trajs: Sequence[Trajectory], ks: Sequence[int],
                      overall: bool = False) -> dict[str, DomainEval]:
    by_domain: dict[str, list[Trajectory]] = {name: [] for name in dict.fromkeys(t.domain for t in tasks)}
    for t in trajs:
        by_domain[t.task.domain].append(t)
    results = {name: summarize(name, ts, ks) for name, ts in by_domain.items()}
    if overall:
        results["overall"] = summarize("overall", trajs, ks)
    return results


def evaluate(backend: RolloutBackend, tokenizer: Any, envs: dict[str, Environment], domains: dict[str, DomainConfig],
             tasks_per_domain: int, n: int, seed: int, temperature: float = 1.0,
             ks: Sequence[int] = (1, 4, 8), overall: bool = False, *, allow_unchecked: Collection[str] = (),
             stores: Sequence[Path] | None = None, approvals: Approvals | None = None) -> dict[str, DomainEval]:
    """Each domain's evaluation-partition suite (`eval_tasks`); refused, as `evaluate_tasks` says, for an
    environment with no passing QA record that `allow_unchecked` does not name; `approvals` as there."""
    tasks = [t for name, dom in domains.items()
             for t in eval_tasks(envs[name], name, tasks_per_domain, seed, dom.difficulty.levels(envs[name].difficulties))]
    return evaluate_tasks(backend, tokenizer, envs, domains, tasks, n, seed, temperature, ks, overall,
                          allow_unchecked=allow_unchecked, stores=stores, approvals=approvals)
