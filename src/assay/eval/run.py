"""`assay eval`'s body: what an evaluation runs (a `Plan`: a pinned suite's tasks, or those the command's --env
options draw) and one policy's evaluation of it, its tables printed and its record written. `assay serve --golden
SUITE.yaml` evaluates the served policies through these same functions, so its records are `assay eval`'s."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from assay.core.config import DomainConfig, RolloutConfig

if TYPE_CHECKING:
    from assay.agent.approvals import Approvals
    from assay.core.types import Task
    from assay.envs.base import Environment
    from assay.eval.endpoint import Endpoint

console = Console()


@dataclass(frozen=True)
class Plan:
    """The environments (by domain), their domains' settings, the tasks, samples per task and temperature, and
    the settings every record of the evaluation states."""

    envs: dict[str, Environment]
    domains: dict[str, DomainConfig]
    tasks: list[Task]
    n: int
    temperature: float
    settings: dict[str, Any]


def make_plan(envs: dict[str, Environment], domains: dict[str, DomainConfig], tasks: list[Task], n: int,
              temperature: float, settings: dict[str, Any], allow_unchecked: Collection[str] = ()) -> Plan:
    """A plan, refused for an environment with no passing QA record that `allow_unchecked` does not name (those it
    names are recorded in the settings' qa_unchecked)."""
    from assay.envs.qa.enforce import require_checked

    unchecked = require_checked(envs, allow_unchecked, env_args={d: c.env_args for d, c in domains.items()})
    return Plan(envs, domains, tasks, n, temperature,
                {**settings, "temperature": temperature, "qa_unchecked": unchecked})


def suite_plan(path: Path, settings: dict[str, Any], allow_unchecked: Collection[str] = ()) -> Plan:
    """A pinned suite's plan; `settings`: the run's own (backend, seed, weights). Refused, naming the fix, when the
    file is missing or does not load, or an environment changed under its pin, before anything is evaluated."""
    from assay.eval.suite import load_suite, resolve_entries, suite_domains, suite_tasks

    suite, sha = load_suite(path)
    envs = resolve_entries(suite)
    return make_plan(envs, suite_domains(suite, envs), suite_tasks(suite, envs), suite.samples,
                     suite.limits.temperature,
                     {**settings, "suite": suite.name, "suite_file": str(path), "suite_sha256": sha,
                      "suite_config": suite.model_dump(), "n": suite.samples}, allow_unchecked)


def evaluate_plan(policy: Path | Endpoint, plan: Plan, seed: int, out: Path, *, kv_cache_mb: int = 0,
                    run: Path | None = None, prices: tuple[float, float] = (0.0, 0.0), html: bool = False,
                    approvals: Approvals | None = None) -> Path:
    """Evaluate one policy (a checkpoint or an endpoint) on the plan's tasks with the settings' backend and
    weights, sampling from `seed`; print its tables and write its record to `out` (returned). `kv_cache_mb`: the
    engine's cache (0: room for every episode at once); `run`: the run that trained the policy, whose training
    tasks are checked against the plan's; `approvals` gates its tool calls."""
    from assay.agent.groups import collect
    from assay.core.modeling import apply_threads, load_model
    from assay.envs.qa.enforce import mark_unchecked
    from assay.eval.endpoint import Endpoint, run_endpoint_episodes
    from assay.eval.evaluate import summarize_domains
    from assay.eval.record import policy_identity, write_record
    from assay.eval.tables import dimensions_table, horizon_table, pass_table
    from assay.pipeline.overlap import check_overlap, training_task_ids
    from assay.rollout.factory import make_backend

    envs, domains, tasks, n, settings = plan.envs, plan.domains, plan.tasks, plan.n, {**plan.settings, "seed": seed}
    trained = training_task_ids(run) if run is not None else None
    name = policy if isinstance(policy, Path) else f"{policy.model} at {policy.url}"
    if approvals is not None:
        approvals = replace(approvals, actor=str(name))
    if isinstance(policy, Endpoint):
        identity = policy.identity()
        trajs = run_endpoint_episodes(policy, envs, domains, tasks, n, plan.temperature, seed, approvals)
    else:
        identity = policy_identity(policy)
        model, tokenizer = load_model(policy)
        apply_threads(0, model)
        rollout = RolloutConfig(backend=settings["backend"], weights=settings["weights"],
                                **({"kv_cache_mb": kv_cache_mb} if kv_cache_mb else {}))
        if rollout.backend == "engine" and not kv_cache_mb:  # every episode at once
            from assay.agent.render import prompt_ids
            from assay.rollout.engine.model import PagedModel

            def turns(t: Task) -> int:  # a tool-less episode answers once
                return domains[t.domain].max_turns if envs[t.domain].tools else 1

            longest = max(len(prompt_ids(tokenizer, t)) + domains[t.domain].max_new_tokens * turns(t) for t in tasks)
            rollout = rollout.model_copy(update={"kv_cache_mb": PagedModel.cache_mb_for(model, longest * n * len(tasks))})
        trajs = collect(make_backend(rollout, model, tokenizer), tokenizer, envs, domains, tasks, samples=n,
                        temperature=plan.temperature, seed=seed, approvals=approvals)
    mark_unchecked(trajs, settings.get("qa_unchecked", {}))
    ks = sorted({1, *(k for k in (2, 4, 8, 16) if k <= n)})
    results = summarize_domains(tasks, trajs, ks, overall=len(domains) > 1)
    overlap = check_overlap(run, [t.task_id for t in tasks], trained) if run is not None else None
    where = ("evaluation partition, held out from " + str(run) if overlap and overlap.held_out
             else "NOT held out" if overlap else "evaluation partition; pass --run runs/NAME to check it is held out")
    console.print(pass_table(results, ks, title=f"{name}: {len(tasks)} tasks × {n} samples, 95% bootstrap CIs "
                                                f"({where})"))
    console.print(dimensions_table(results, ks, prices))
    if (horizon := horizon_table(results)) is not None:
        console.print(horizon)
    if overlap is not None:
        console.print(overlap.describe())
    if approvals is not None:
        approved, denied = sum(t.approved_calls for t in trajs), sum(t.denied_calls for t in trajs)
        refused = sum(t.refused_calls for t in trajs)
        console.print(f"approvals: {approved} calls approved, {denied} denied (by a person, a timeout or a failed "
                      f"channel), {refused} refused (outside the allowlist); every decision is in "
                      f"{approvals.policy.audit}")
    record = write_record(out, results, identity, envs, {**settings, "held_out": overlap and overlap.describe()}, prices)
    console.print(f"record: {record}")
    if html:
        from assay.eval.html import write_eval_html

        console.print(f"report: {write_eval_html(out)}")
    return record
