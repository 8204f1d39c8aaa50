"""The QA gate: an environment trains nothing until all of these hold, level by level.

1. reference   the reference solution reaches full reward, every time (flakiness reported)
2. null        empty, whitespace and echoed answers score zero; another task's well-formed answer
               passes no more often than chance
3. cheaters    every cheater of the environment's kind fails (within its chance tolerance)
4. determinism the same trajectory gets the same reward in fresh episodes (fresh sandboxes)
5. no leak     no hidden value (the env's `secrets(task)`, else the reference's answer lines)
               appears in the prompt or in any observation
6. calibration the pass rate of a noisy reference (or of a given policy) does not rise with level
An infrastructure failure is reported as such and fails the gate: it is never a reward.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from assay.core.types import OK, Reward, Task
from assay.envs.base import Environment
from assay.envs.qa.play import Played, Strategy, play, reference_policy
from assay.envs.qa.strategies import (
    NULL_POLICIES,
    RANDOM_ANSWER_TOLERANCE,
    Scripted,
    cheaters_for,
    kind_of,
    noise_for,
    noisy_reference,
    other_reference,
)
from assay.envs.registry import env_hash, env_parts, env_spec
from assay.envs.split import draw_task
from assay.sandbox import isolation_problem

GATES = ("reference", "null", "cheaters", "determinism", "no leak", "calibration", "infrastructure")


@dataclass
class Failure:
    gate: str
    difficulty: int
    seed: int
    reason: str

    def line(self) -> str:
        return f"{self.gate}: level {self.difficulty} seed {self.seed}: {self.reason}"


@dataclass
class QAConfig:
    tasks_per_level: int = 8
    repeats: int = 2  # reference runs per task
    cheat_tasks_per_level: int = 2  # tasks each cheater is tried on, per level
    noise: float | None = None  # per-character error rate of the noisy reference; None: set so it
    # solves the easiest level's tasks 70% of the time
    noisy_samples: int = 8  # noisy-reference plays per task (calibration)
    max_turns: int = 8
    calibration_margin: float = 0.1  # allowed rise of the pass rate from one level to the next, beyond noise


@dataclass
class GateReport:
    env: str
    hash: str
    parts: dict[str, str]
    kind: str
    config: dict[str, Any]
    levels: dict[int, dict[str, float]] = field(default_factory=dict)
    cheaters: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # gates that could not run here, and why

    @property
    def passed(self) -> bool:
        """Every gate ran and held (a skipped gate is not a pass)."""
        return not self.failures and not self.skipped

    def gate_status(self) -> dict[str, str]:
        failed = {f.gate for f in self.failures}
        skipped = {s.split(":", 1)[0] for s in self.skipped}
        return {g: "fail" if g in failed else "skipped" if g in skipped else "pass" for g in GATES}

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["levels"] = {str(k): v for k, v in self.levels.items()}
        out["passed"], out["gates"] = self.passed, self.gate_status()
        return out


def secrets(env: Environment, task: Task) -> list[str]:
    own = getattr(env, "secrets", None)
    if callable(own):
        return [s for s in own(task) if s]
    final = [m for m in env.reference_solution(task) if m.role == "assistant" and not m.tool_calls]
    return [line.strip() for m in final for line in m.content.splitlines() if len(line.strip()) >= 6]


def run_gate(env: Environment, cfg: QAConfig | None = None,
             policy_rates: Callable[[dict[int, list[Task]]], dict[int, list[float]]] | None = None) -> GateReport:
    """Run every gate on `tasks_per_level` generated tasks per level. `policy_rates`, when given,
    measures a real policy's pass rate on each task for the calibration gate instead of the noisy
    reference."""
    cfg = cfg or QAConfig()
    spec = env_spec(env)
    report = GateReport(spec, env_hash(env), env_parts(env), kind_of(env), asdict(cfg))
    tasks = {level: [draw_task(env, random.Random(f"qa/{spec}/{level}/{i}"), level, "train")
                     for i in range(cfg.tasks_per_level)]
             for level in env.difficulties}
    cheaters = cheaters_for(env)
    if report.kind != "answer" and isolation_problem() is not None:
        # Cheaters are hostile programs (they write outside their workspace on purpose): without
        # isolation they would run on this host. The gate says so instead of running them.
        report.skipped.append(f"cheaters: this host cannot isolate code ({isolation_problem()})")
        cheaters = []
    noise = cfg.noise if cfg.noise is not None else noise_for(env, tasks[min(tasks)])
    report.config["noise"] = noise
    # A terminal reference is a program over the workspace: another task's may solve this one.
    gate_random = report.kind != "terminal"
    cheat_counts = {c.name: [0, 0, 0] for c in cheaters}  # passed, tried, infrastructure failures
    noisy: dict[int, list[float]] = {}  # per task: the noisy reference's pass rate
    for level, level_tasks in tasks.items():
        stats = dict.fromkeys(["reference", "flaky", "noisy", "random well-formed", *(p.name for p in NULL_POLICIES)],
                              0.0)
        noisy[level] = []
        for i, task in enumerate(level_tasks):
            fail = _failer(report, level, task)
            others = [t for t in level_tasks[i + 1:] + level_tasks[:i] if t.task_id != task.task_id]
            noisy[level].append(_check_task(env, task, others[0] if others else None, cfg, noise, stats, fail))
            if i < cfg.cheat_tasks_per_level:
                _try_cheaters(env, task, cheaters, cheat_counts, cfg, fail)
        report.levels[level] = {k: v / len(level_tasks) for k, v in stats.items()}
    _chance_checks(report, tasks, cheaters, cheat_counts, gate_random)
    per_task = policy_rates(tasks) if policy_rates else noisy
    for level, rates in per_task.items():
        report.levels[level]["calibration pass rate"] = sum(rates) / max(len(rates), 1)
    _calibration(report, per_task, cfg, samples=4 if policy_rates else cfg.noisy_samples)
    return report


def _check_task(env: Environment, task: Task, other: Task | None, cfg: QAConfig, noise: float,
                stats: dict[str, float], fail: Callable[[str, str], None]) -> float:
    """Reference, leaks, null policies, determinism and the noisy reference on one task; adds to
    the level's `stats` and returns the noisy reference's pass rate on it."""
    ref = [play(env, task, reference_policy(env, task), cfg.max_turns) for _ in range(cfg.repeats)]
    if any(r.reward.status != OK for r in ref):
        fail("infrastructure", f"the reference run failed: {_why(next(r for r in ref if r.reward.status != OK))}")
    elif not all(_full(r.reward) for r in ref):
        fail("reference", f"the reference scored {[r.reward.score for r in ref]}, not full reward: "
                          f"{_why(next(r for r in ref if not _full(r.reward)))}")
    stats["reference"] += all(_full(r.reward) for r in ref)
    stats["flaky"] += len({(r.reward.score, r.reward.status) for r in ref}) > 1
    seen = "\n".join([m.content for m in task.prompt] + [o for r in ref for o in r.observations])
    leaked = [s for s in secrets(env, task) if s in seen]
    if leaked:
        fail("no leak", f"the policy is shown the hidden {leaked[0][:60]!r}")
    for null in NULL_POLICIES:
        got = play(env, task, null, cfg.max_turns)
        stats[null.name] += got.reward.passed
        if got.reward.status == OK and (got.reward.passed or got.reward.score > 0):
            fail("null", f"the {null.about} policy scored {got.reward.score}")
    if other is not None:  # a random well-formed answer: a different task's reference
        probe = other_reference(env, other)
        got = play(env, task, probe, cfg.max_turns)
        stats["random well-formed"] += got.reward.passed
        _replay_same(env, task, probe, got, cfg, fail)
    wins = 0.0
    for k in range(cfg.noisy_samples):
        probe = noisy_reference(env, task, noise, random.Random(f"{task.seed}/{k}"))
        got = play(env, task, probe, cfg.max_turns)
        wins += got.reward.passed
        if k == 0:
            _replay_same(env, task, probe, got, cfg, fail)
    rate = wins / max(cfg.noisy_samples, 1)
    stats["noisy"] += rate
    return rate


def _try_cheaters(env: Environment, task: Task, cheaters: list[Scripted], counts: dict[str, list[int]],
                  cfg: QAConfig, fail: Callable[[str, str], None]) -> None:
    for cheater in cheaters:
        got = play(env, task, cheater, cfg.max_turns)
        c = counts[cheater.name]
        c[1] += 1
        c[2] += got.reward.status != OK
        if got.reward.status == OK and got.reward.passed:
            c[0] += 1
            if cheater.tolerance == 0:
                fail("cheaters", f"the cheater {cheater.name!r} ({cheater.about}) passed")


def _replay_same(env: Environment, task: Task, probe: Strategy, first: Played, cfg: QAConfig,
                 fail: Callable[[str, str], None]) -> None:
    """The same trajectory again, in a fresh episode: it must get the same reward."""
    again = play(env, task, probe, cfg.max_turns)
    a, b = first.reward, again.reward
    if (a.score, a.passed, a.status) != (b.score, b.passed, b.status):
        fail("determinism", f"the {probe.name} trajectory scored {a.score} then {b.score}")


def _failer(report: GateReport, level: int, task: Task) -> Callable[[str, str], None]:
    return lambda gate, reason: report.failures.append(Failure(gate, level, task.seed, reason))


def _full(r: Reward) -> bool:
    return r.status == OK and r.passed and r.score >= 1.0


def _why(p: Played) -> str:
    d = p.reward.details
    return str(d.get("reason") or d.get("error") or {k: v for k, v in d.items() if k != "expected"} or p.reward.status)[:160]


def _chance_checks(report: GateReport, tasks: dict[int, list[Task]], cheaters: list[Scripted],
                   counts: dict[str, list[int]], gate_random: bool) -> None:
    first = min(tasks)
    seed = tasks[first][0].seed
    for level, stats in report.levels.items():
        if gate_random and stats["random well-formed"] > RANDOM_ANSWER_TOLERANCE:
            report.failures.append(Failure("null", level, tasks[level][0].seed,
                                           f"another task's answer passes {stats['random well-formed']:.0%} of tasks "
                                           f"(chance allows {RANDOM_ANSWER_TOLERANCE:.0%}): the verifier accepts "
                                           "answers that do not fit the task"))
    for c in cheaters:
        passed, tried, infra = counts[c.name]
        rate = passed / tried if tried else 0.0
        report.cheaters[c.name] = {"about": c.about, "passed": passed, "tried": tried, "infra": infra,
                                   "tolerance": c.tolerance}
        if c.tolerance > 0 and rate > c.tolerance:
            report.failures.append(Failure("cheaters", first, seed, f"the cheater {c.name!r} ({c.about}) passed "
                                                                     f"{rate:.0%} of tasks (chance allows {c.tolerance:.0%})"))


def _calibration(report: GateReport, per_task: dict[int, list[float]], cfg: QAConfig, samples: int) -> None:
    """Fail when the pass rate rises from one level to the next by more than the margin and twice
    the standard error of the difference. Tasks are the unit (their rates vary more than the
    samples of one task do); a task's rate is at least as uncertain as its `samples` draws allow."""
    def mean_se(rates: list[float]) -> tuple[float, float]:
        n = len(rates)
        m = sum(rates) / n
        between = sum((r - m) ** 2 for r in rates) / (n - 1) if n > 1 else 0.25
        return m, math.sqrt(max(between, m * (1 - m) / samples) / n)

    levels = sorted(lv for lv, r in per_task.items() if r)
    for lo, hi in zip(levels, levels[1:], strict=False):
        (m_lo, se_lo), (m_hi, se_hi) = mean_se(per_task[lo]), mean_se(per_task[hi])
        df = min(len(per_task[lo]), len(per_task[hi])) - 1  # few tasks: Student's t, conservatively
        if m_hi > m_lo + max(cfg.calibration_margin, _t975(df) * math.hypot(se_lo, se_hi)):
            report.failures.append(Failure("calibration", hi, -1, f"the pass rate rises from {m_lo:.2f} at level "
                                                                  f"{lo} to {m_hi:.2f} at level {hi}"))


def _t975(df: int) -> float:
    """The two-sided 95% critical value of Student's t with `df` degrees of freedom."""
    table = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 15: 2.13,
             20: 2.09, 30: 2.04}
    if df < 1:
        return table[1]
    return table.get(df) or table[max(k for k in table if k <= df)] if df <= 30 else 1.96
