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
Peak context is the largest prompt plus turn, in tokens of the bench tokenizer."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from assay.bench.context import DRIFT, OVERFLOW
from assay.bench.malformed import MALFORMED
from assay.bench.rollback import WRONG_EDIT
from assay.bench.scripted import Failure, Limits, bench_tokenizer, run_setting
from assay.core.errors import AssayError
from assay.core.types import OK, Trajectory
from assay.envs.builtin.repo import RepoEnv
from assay.eval.evaluate import DomainEval, summarize

FAILURES: dict[str, Failure] = {f.name: f for f in (WRONG_EDIT, MALFORMED, OVERFLOW, DRIFT)}


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
    rng = random.Random(seed)
    tasks = [env.generate(rng, level) for level in levels for _ in range(per_level)]
    tok = bench_tokenizer(seed)
    rows = [Row(name, s.name, run_setting(env, FAILURES[name], s, tasks, tok, limits))
            for name in failures for s in FAILURES[name].settings]
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
