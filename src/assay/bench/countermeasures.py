"""`assay bench agent --scripted`: the four long-horizon failures, each countermeasure off and on, in one table.

- wrong early edit (bench/rollback.py): a bad `sed` across the package before the reference patch; carried
  on, or undone by checkpoint + rollback.
- malformed calls (bench/malformed.py): a share of the reference's calls written wrong; retry, repair,
  declared fallback tools.
- overflow and drift (bench/context.py): a history larger than the window, a policy that loses its goal;
  compaction, memory, plan_execute.

The same `repo` tasks, limits and tokenizer for all, through the real agent loop, sandboxes and verifier
(bench/scripted.py). The columns are those `assay eval` reports (eval/evaluate.py): rounds are assistant turns
(retried and planning turns included); the tool error rate is the share of tool results that were errors
(a retry prompt is one); the recovery rate is the share of episodes that hit a tool error and still passed.
Peak context is the largest prompt plus turn, in tokens of the bench tokenizer.

`assay bench agent POLICY --countermeasures`: a real model on the same tasks, nothing injected (its failures are
its own), under each countermeasure setting (`MODEL_SETTINGS`), through the engine and the same loop.
Peak context is then in the model's tokens."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from assay.bench.context import DRIFT, OVERFLOW
from assay.bench.malformed import FALLBACK, MALFORMED, REPAIR, RETRY
from assay.bench.rollback import WRONG_EDIT
from assay.bench.scripted import Failure, Limits, Setting, bench_tokenizer, run_setting
from assay.core.config import AgentConfig, DifficultyRange, DomainConfig, RolloutConfig
from assay.core.errors import AssayError
from assay.core.types import OK, Task, Trajectory
from assay.envs.builtin.repo import RepoEnv
from assay.eval.evaluate import DomainEval, summarize

FAILURES: dict[str, Failure] = {f.name: f for f in (WRONG_EDIT, MALFORMED, OVERFLOW, DRIFT)}
# A real model's rows: each countermeasure the loop applies, alone and the tool-call ones together (checkpoint and
# rollback are tools every repo task offers: the model's own choice, so no switch of the loop).
MODEL_SETTINGS = [
    Setting("off"),
    Setting("retry", tool_retries=RETRY),
    Setting("repair", repair_tool_calls=REPAIR),
    Setting("retry + repair + fallback", FALLBACK, tool_retries=RETRY, repair_tool_calls=REPAIR),
    Setting("compaction", AgentConfig(compaction="elide_observations")),
    Setting("compaction + memory", AgentConfig(compaction="elide_observations", memory=True)),
    Setting("plan_execute", AgentConfig(mode="plan_execute")),
]
# A real model's episodes: shorter than the scripted ones' (a small model's turns are mostly its own prose), and a
# window that fits a small model's positions.
MODEL_LIMITS = Limits(max_context=4096, max_turns=16, max_tokens=256)


@dataclass
class Row:
    failure: str
    setting: str
    trajs: list[Trajectory]

    def line(self) -> str:
        t = [x for x in self.trajs if x.status == OK]
        infra = f" ({len(self.trajs) - len(t)} infra errors)" if len(t) < len(self.trajs) else ""
        if not t:
            return f"| {self.failure} | {self.setting} | -{infra} |" + " |" * 9
        ev: DomainEval = summarize(self.failure, t, ks=())
        mean = statistics.mean
        cells = [self.failure, self.setting, f"{mean(x.passed for x in t):.2f}{infra}", f"{ev.mean_rounds:.1f}",
                 f"{mean(x.peak_context for x in t):.0f} / {max(x.peak_context for x in t)}",
                 _rate(ev.tool_error_rate), _rate(ev.recovery_rate), f"{mean(x.retries for x in t):.1f}",
                 f"{mean(x.degraded_calls for x in t):.1f} ({mean(x.fallback_calls for x in t):.1f})",
                 f"{mean(x.compactions for x in t):.1f}", f"{mean(x.memory_calls for x in t):.1f}",
                 ", ".join(statistics.multimode(x.finish_reason for x in t))]
        return "| " + " | ".join(cells) + " |"


def _rate(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}"


def run_countermeasures(failures: Sequence[str] = tuple(FAILURES), per_level: int = 4, levels: tuple[int, ...] = (2, 4),
                        seed: int = 0, limits: Limits | None = None) -> tuple[list[Row], dict[str, Any]]:
    """Every setting of each named failure on the same tasks; the rows and the setup they ran in."""
    if unknown := [f for f in failures if f not in FAILURES]:
        raise AssayError(f"unknown failure {', '.join(map(repr, unknown))}; the failures are {', '.join(FAILURES)}")
    limits = limits or Limits()
    env = RepoEnv()
    tasks = _tasks(env, per_level, levels, seed)
    tok = bench_tokenizer(seed)
    rows = [Row(name, s.name, run_setting(env, FAILURES[name], s, tasks, tok, limits))
            for name in failures for s in FAILURES[name].settings]
    setup = {"tasks": len(tasks), "levels": levels, "seed": seed, "limits": limits, "vocab": len(tok)}
    return rows, setup


def _tasks(env: RepoEnv, per_level: int, levels: tuple[int, ...], seed: int) -> list[Task]:
    rng = random.Random(seed)
    return [env.generate(rng, level) for level in levels for _ in range(per_level)]


def run_model_countermeasures(policy: Path, per_level: int = 4, levels: tuple[int, ...] = (2, 4), seed: int = 0,
                              limits: Limits = MODEL_LIMITS, threads: int = 0) -> tuple[list[Row], dict[str, Any]]:
    """A policy's own episodes on the scripted bench's tasks, one sample each, under every `MODEL_SETTINGS`
    setting: the engine at temperature 1.0, each setting's episodes in one batch of the lockstep loop."""
    from assay.agent.groups import collect
    from assay.core.modeling import apply_threads, load_model
    from assay.envs.registry import env_spec
    from assay.rollout.engine.model import PagedModel
    from assay.rollout.factory import make_backend

    env = RepoEnv()
    tasks = [replace(t, domain=env.name) for t in _tasks(env, per_level, levels, seed)]
    model, tok = load_model(policy)
    apply_threads(threads, model)
    backend = make_backend(RolloutConfig(kv_cache_mb=PagedModel.cache_mb_for(model, limits.max_context * len(tasks))),
                           model, tok)
    rows = []
    for s in MODEL_SETTINGS:
        domain = DomainConfig(name=env.name, env=env_spec(env), max_turns=limits.max_turns,
                              max_new_tokens=limits.max_tokens, max_context=limits.max_context,
                              difficulty=DifficultyRange(min=min(levels), max=max(levels), start=min(levels)),
                              tool_retries=s.tool_retries, repair_tool_calls=s.repair_tool_calls, agent=s.agent)
        trajs = collect(backend, tok, {env.name: env}, {env.name: domain}, tasks, samples=1, temperature=1.0, seed=seed)
        rows.append(Row(f"none injected ({policy.name})", s.name, trajs))
    setup = {"tasks": len(tasks), "levels": levels, "seed": seed, "limits": limits, "vocab": len(tok)}
    return rows, setup


def table(rows: list[Row], setup: dict[str, Any]) -> str:
    lim: Limits = setup["limits"]
    head = (f"repo tasks: {setup['tasks']} (levels {', '.join(map(str, setup['levels']))}, seed {setup['seed']}), "
            f"max_context {lim.max_context} tokens (vocab {setup['vocab']}), max_turns {lim.max_turns}\n")
    lines = ["| failure | countermeasure | pass rate | rounds | peak context (mean / max) | tool error rate "
             "| recovery rate | retries | degraded (fallback) | compactions | memory calls | finish |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    return head + "\n".join(lines + [r.line() for r in rows])
