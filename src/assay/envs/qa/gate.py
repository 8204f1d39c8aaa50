"""The QA gate: an environment trains nothing until all of these hold, level by level.

1. reference   the reference solution reaches full reward on every run: enough runs to see a verifier
               that fails `flake_rate` of the time with probability `flake_power`, idle and again with
               every CPU kept busy by a sibling process (a verifier that fails only under load)
2. null        empty, whitespace and echoed answers score zero; another task's well-formed answer
               passes no more often than chance
3. cheaters    every cheater of the environment's kind fails (one that may pass by chance: not
               significantly more often than its tolerance); cheaters attack classes of loophole
               (the verifier's parser and trust, the tools' contracts by argument and order, the
               tests' strength, other tasks' identifiers, state across calls, episodes and tasks),
               and a failure names the one that won, its class and tolerance
4. determinism the same trajectory gets the same reward in fresh episodes (fresh sandboxes)
5. no leak     no hidden value (the env's `secrets(task)`, else the reference's answer lines) appears in
               the prompt, in any observation (the reference's or a cheater's), or anywhere the policy
               can read in the sandbox the gate starts the reference in (workspace files, dotfiles and
               subdirectories included, /tmp, environment variables), after start and after each step;
               for answer-kind environments the reference's bare answer value is not among the prompt's
               values significantly more often than another task's answer is
6. calibration the pass rate of a noisy reference (or of a given policy) does not rise with level
An infrastructure failure is reported as such and fails the gate: it is never a reward.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from assay.core.types import OK, Reward, Task
from assay.envs.base import Environment, hooks
from assay.envs.qa.loopholes import Sibling
from assay.envs.qa.play import Played, Strategy, play, reference_policy
from assay.envs.qa.strategies import (
    NULL_POLICIES,
    RANDOM_ANSWER_TOLERANCE,
    Scripted,
    answer_value,
    cheaters_for,
    does_kind,
    kind_of,
    kind_problem,
    noise_for,
    noisy_reference,
    other_reference,
    shows_value,
)
from assay.envs.registry import env_hash, env_parts, env_spec
from assay.envs.split import draw_task
from assay.sandbox import Limits, isolation_problem, open_sandbox

GATES = ("reference", "null", "cheaters", "determinism", "no leak", "calibration", "infrastructure")
# Bump whenever a gate changes: a record from an older gate is not a pass until re-checked.
# 2: secrets searched in the reference's sandbox and in cheaters' observations; the bare answer value
#    in the prompt; positional copy cheaters; flake runs sized by rate and power, idle and under load.
# 3: another task's answer is a binomial test against its chance tolerance, as the cheaters are (a share
#    threshold failed a correct verifier on one coincidence in three tasks); answer-kind environments
#    try every other task's answer of the level, which costs no sandbox, for the power that test needs.
# 4: the kind follows what an environment does; every chance test sized for its stated power (tasks
#    raised where too few), terminal environments included; new cheater classes (see strategies).
# 5: cheaters by class of loophole (parser, trust, tools' contracts, tests' strength, state; issue 44), each
#    failure naming the class and tolerance of the strategy that won; state cheaters play after a solve and
#    retry in fresh episodes; a cheater's infrastructure failures and a no-work program's passes within
#    tolerance are warnings.
# 6: tools called out of order (a submitting or grading tool first, each twice, all again after the others) and
#    at their schema's edges; other tasks' identifiers (another task's solve naming it, or under this task's
#    ids); state across tasks (another task's answer, or no work, right after that task was solved) and a
#    wrong answer after a solve of the same task for every kind.
# 7: other tasks' identifiers on code and terminal environments too (naming the task in programs and commands;
#    an identifier every task shows names none); each cheater tried as often as its own chance test needs, one
#    that needs another task with several others per task.
GATE_VERSION = 7
# Significance of the chance tests (a cheater's pass rate against its tolerance, the bare answer value
# against another task's): a built-in environment runs about ten of them per check, so a correct
# environment fails one by chance about once in a hundred checks.
ALPHA = 0.001
# How much more often than another task's answer the reference's answer value may stand in the prompt
# (an answer can coincide with an operand: 8-4=4).
BARE_VALUE_TOLERANCE = 0.1


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
    repeats: int = 2  # reference runs per task (more, round-robin, until flake_runs are reached)
    cheat_tasks_per_level: int = 2  # tasks each cheater is tried on, per level (answer kinds: every task)
    noise: float | None = None  # per-character error rate of the noisy reference; None: set so it
    # solves the easiest level's tasks 70% of the time
    noisy_samples: int = 8  # noisy-reference plays per task (calibration)
    max_turns: int = 8
    calibration_margin: float = 0.1  # allowed rise of the pass rate from one level to the next, beyond noise
    # every chance test (a cheater, another task's answer) gets the tries to catch a strategy that wins
    # `loophole_rate` of them with probability `loophole_power`; too few tasks are raised, and said
    loophole_rate: float = 0.75
    loophole_power: float = 0.95
    flake_rate: float = 0.05  # the smallest rate of failing reference runs the gate is sized to see ...
    flake_power: float = 0.95  # ... with this probability, idle and again under load


def flake_runs(rate: float, power: float) -> int:
    """Runs that see at least one failure of a verifier failing with probability `rate`, with
    probability `power`: 1 - (1 - rate) ** n >= power."""
    return math.ceil(math.log(1 - power) / math.log(1 - rate))


@dataclass
class GateReport:
    env: str
    hash: str
    parts: dict[str, str]
    kind: str
    config: dict[str, Any]
    gate_version: int = GATE_VERSION
    levels: dict[int, dict[str, float]] = field(default_factory=dict)
    cheaters: dict[str, dict[str, Any]] = field(default_factory=dict)
    flakiness: dict[str, Any] = field(default_factory=dict)
    leaks: dict[str, Any] = field(default_factory=dict)  # the bare answer value test (answer kinds)
    power: dict[str, Any] = field(default_factory=dict)  # how the chance tests were sized (`_sized`)
    failures: list[Failure] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # gates that could not run here, and why
    warnings: list[str] = field(default_factory=list)  # what passed but checked less than it should

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
    own = hooks(env).secrets
    if own is not None:
        return [s for s in own(task) if s]
    final = [m for m in env.reference_solution(task) if m.role == "assistant" and not m.tool_calls]
    # a code fence (```python) is the answer's format, which a prompt may state; what it fences is the secret
    return [line.strip() for m in final for line in m.content.splitlines()
            if len(line.strip()) >= 6 and not line.strip().startswith("```")]


def leaked(hidden: list[str], text: str) -> list[str]:
    """The secrets `text` holds, also with its whitespace changed (a re-indented JSON file)."""
    squashed = "".join(text.split())
    return [s for s in hidden if s in text or (len(flat := "".join(s.split())) >= 6 and flat in squashed)]


@dataclass
class _Runs:
    """Reference runs of one condition (idle or loaded) and how many failed."""

    runs: int = 0
    failed: int = 0
    infra: int = 0
    first: Failure | None = None

    def add(self, level: int, task: Task, got: Played) -> None:
        self.runs += 1
        if _full(got.reward):
            return
        self.infra += got.reward.status != OK
        self.failed += got.reward.status == OK
        if self.first is None:
            self.first = Failure("reference", level, task.seed, _why(got))


@dataclass
class CheatTally:
    """A chance test's record (a cheater's, or other tasks' answers'): passes over the tasks it was tried on."""

    passed: int = 0
    tried: int = 0
    infra: int = 0  # infrastructure failures: neither a pass nor a fail
    won: list[str] = field(default_factory=list)  # "level L seed S" of each pass


def run_gate(env: Environment, cfg: QAConfig | None = None,
             policy_rates: Callable[[dict[int, list[Task]]], dict[int, list[float]]] | None = None) -> GateReport:
    """Run every gate on `tasks_per_level` generated tasks per level. `policy_rates`, when given,
    measures a real policy's pass rate on each task for the calibration gate instead of the noisy
    reference."""
    cfg = cfg or QAConfig()
    spec = env_spec(env)

    def draw(level: int, i: int) -> Task:
        return draw_task(env, random.Random(f"qa/{spec}/{level}/{i}"), level, "train")

    first = draw(min(env.difficulties), 0)
    report = GateReport(spec, env_hash(env), env_parts(env), kind_of(env, first), asdict(cfg))
    problem, note = kind_problem(env, first)  # never checked as a weaker kind than it is, silently
    if problem:  # and it is checked as what it does
        report.failures.append(Failure("cheaters", first.difficulty, first.seed, problem))
        report.kind = does_kind(env, first)[0]
    if note:
        report.warnings.append(note)
    cheaters = cheaters_for(env, report.kind)
    per_level, plan = _sized(report, cfg, cheaters, len(env.difficulties))
    tasks = {level: [draw(level, i) for i in range(per_level)] for level in env.difficulties}
    isolated = isolation_problem() is None
    if report.kind != "answer" and not isolated:
        # Cheaters are hostile programs (they write outside their workspace on purpose): without
        # isolation they would run on this host. The gate says so instead of running them.
        report.skipped.append(f"cheaters: this host cannot isolate code ({isolation_problem()})")
        report.skipped.append("no leak: the workspace the policy reads cannot be searched without a sandbox")
        cheaters = []
    elif report.kind != "answer" and cfg.cheat_tasks_per_level == 0:
        report.skipped.append("cheaters: cheat_tasks_per_level is 0")
    if report.kind == "terminal" and hooks(env).secrets is None:
        report.warnings.append("declares no secrets(task): the leak checks then look only for the reference's "
                               "final answer lines, which in a terminal task are almost nothing; return the hidden "
                               "tests and expected values from secrets(task)")
    noise = cfg.noise if cfg.noise is not None else noise_for(env, tasks[min(tasks)])
    report.config["noise"] = noise
    cheat_counts = {c.name: CheatTally() for c in cheaters}
    noisy: dict[int, list[float]] = {}  # per task: the noisy reference's pass rate
    random_answers: dict[int, CheatTally] = {}  # per level: another task's answer, passed of tried
    idle = _Runs()
    any_secret = False
    for level, level_tasks in tasks.items():
        stats = dict.fromkeys(["reference", "flaky", "noisy", "random well-formed", *(p.name for p in NULL_POLICIES)],
                              0.0)
        noisy[level] = []
        random_answers[level] = CheatTally()
        for i, task in enumerate(level_tasks):
            fail = _failer(report, level, task)
            hidden = secrets(env, task)
            any_secret = any_secret or bool(hidden)
            siblings = [t for t in level_tasks[i + 1:] + level_tasks[:i] if t.task_id != task.task_id]
            # answer kinds: every other task's answer (no sandbox); else as many as the chance test needs
            others = siblings if report.kind == "answer" else siblings[:report.power["others per task"]]
            noisy[level].append(_check_task(env, task, others, cfg, noise, stats, fail,
                                            hidden, isolated, idle, random_answers[level]))
            # the tasks after this one in the level are the other tasks cheaters may know
            _try_cheaters(env, task, [c for c in cheaters if i < plan[c.name].tasks], cheat_counts, cfg, fail,
                          hidden, siblings, plan)
        report.levels[level] = {k: v / len(level_tasks) for k, v in stats.items()}
        tally = random_answers[level]
        report.levels[level]["random well-formed"] = tally.passed / tally.tried if tally.tried else 0.0
        report.levels[level]["random answer tries"] = tally.tried
        if tally.tried < report.power["random answer tries"]:  # too few distinct tasks at this level
            report.warnings.append(f"another task's answer: {tally.tried} tries at level {level}, fewer than the "
                                   f"{report.power['random answer tries']} its stated power needs (the level has few "
                                   "distinct tasks)")
    if not any_secret:
        report.warnings.append("no task has a secret to look for: the leak checks check nothing")
    if report.kind == "answer":
        _bare_answer(report, env, tasks)
    _flakiness(report, env, tasks, cfg, idle)
    _chance_checks(report, tasks, cheaters, cheat_counts, random_answers)
    per_task = policy_rates(tasks) if policy_rates else noisy
    for level, rates in per_task.items():
        report.levels[level]["calibration pass rate"] = sum(rates) / max(len(rates), 1)
    _calibration(report, per_task, cfg, samples=4 if policy_rates else cfg.noisy_samples)
    return report


def _check_task(env: Environment, task: Task, others: list[Task], cfg: QAConfig, noise: float,
                stats: dict[str, float], fail: Callable[[str, str], None], hidden: list[str], isolated: bool,
                idle: _Runs, random_answers: CheatTally) -> float:
    """Reference, leaks, null policies, determinism, `others`' answers and the noisy reference on one
    task; adds to the level's `stats` and `random_answers` and returns the noisy reference's pass rate."""
    first = _searched_reference(env, task, cfg, fail, hidden) if isolated else \
        play(env, task, reference_policy(env, task), cfg.max_turns)
    ref = [first, *(play(env, task, reference_policy(env, task), cfg.max_turns) for _ in range(cfg.repeats - 1))]
    for r in ref:
        idle.add(task.difficulty, task, r)
    if any(r.reward.status != OK for r in ref):
        fail("infrastructure", f"the reference run failed: {_why(next(r for r in ref if r.reward.status != OK))}")
    elif not all(_full(r.reward) for r in ref):
        fail("reference", f"the reference scored {[r.reward.score for r in ref]}, not full reward: "
                          f"{_why(next(r for r in ref if not _full(r.reward)))}")
    stats["reference"] += all(_full(r.reward) for r in ref)
    stats["flaky"] += len({(r.reward.score, r.reward.status) for r in ref}) > 1
    found = leaked(hidden, "\n".join([m.content for m in task.prompt] + [o for r in ref for o in r.observations]))
    if found:
        fail("no leak", f"the policy is shown the hidden {found[0][:60]!r}")
    for null in NULL_POLICIES:
        got = play(env, task, null, cfg.max_turns)
        stats[null.name] += got.reward.passed
        if got.reward.status == OK and (got.reward.passed or got.reward.score > 0):
            fail("null", f"the {null.about} policy scored {got.reward.score}")
    for k, other in enumerate(others):  # random well-formed answers: other tasks' references
        probe = other_reference(env, other)
        got = play(env, task, probe, cfg.max_turns)
        random_answers.passed += got.reward.passed
        random_answers.tried += 1
        if k == 0:
            _replay_same(env, task, probe, got, cfg, fail)
    wins = 0.0
    for k in range(cfg.noisy_samples):
        # the k-th sample succeeds below the same evenly spaced number on every task (common, stratified
        # numbers): a task needing more work fails on a superset of the samples a task needing less
        # fails on, so the level means order as the work does, not as sampling noise does (independent
        # draws, 8 tasks x 8 samples, failed codegen@5 on noise alone: 0.50 at level 1, 0.78 at 2)
        probe = noisy_reference(env, task, noise, random.Random(f"{task.seed}/{k}"), (k + 0.5) / cfg.noisy_samples)
        got = play(env, task, probe, cfg.max_turns)
        wins += got.reward.passed
        if k == 0:
            _replay_same(env, task, probe, got, cfg, fail)
    rate = wins / max(cfg.noisy_samples, 1)
    stats["noisy"] += rate
    return rate


# Looks for the secrets (JSON on stdin; they never touch a file) in everything a policy can read in
# the sandbox: file contents and names under the workspace, its home and /tmp (dotfiles and
# subdirectories included), and the environment. Prints {index: where} for each one found.
_SEARCH = r"""
import json, os, stat, sys
secrets = json.load(sys.stdin)
needles = [(s.encode(), b"".join(s.encode().split())) for s in secrets]
found = {}
def look(where, data):
    flat = None
    for i, (raw, squashed) in enumerate(needles):
        if i in found:
            continue
        if raw in data:
            found[i] = where
        elif len(squashed) >= 6:
            flat = b"".join(data.split()) if flat is None else flat
            if squashed in flat:
                found[i] = where
look("in the environment variables", "\n".join(k + "=" + v for k, v in os.environ.items()).encode())
seen = set()
for root in (os.getcwd(), os.path.expanduser("~"), "/tmp"):
    for here, dirs, names in os.walk(root):
        for name in dirs + names:
            path = os.path.join(here, name)
            shown = os.path.relpath(path) if path.startswith(os.getcwd()) else path
            look("in the name " + shown, path.encode())
            if name in dirs or path in seen:
                continue
            seen.add(path)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    data = b"".join(iter(lambda: os.read(fd, 1 << 20), b""))
                    look("in the file " + shown, data)
            finally:
                os.close(fd)
print(json.dumps(found))
"""


def _searched_reference(env: Environment, task: Task, cfg: QAConfig, fail: Callable[[str, str], None],
                        hidden: list[str]) -> Played:
    """The reference, started in a sandbox the gate opens and searched for the secrets after start and
    after every step: what an environment leaves where the policy can read it is shown to the policy."""
    limits = hooks(env).sandbox_limits
    try:
        box = open_sandbox(limits if isinstance(limits, Limits) else Limits())
    except OSError as e:
        fail("infrastructure", f"the gate's sandbox did not open: {e}")
        return play(env, task, reference_policy(env, task), cfg.max_turns)
    found: dict[str, str] = {}
    broken: list[str] = []

    def search(when: str) -> None:
        if broken:
            return
        try:
            res = box.exec(["python3", "-I", "-c", _SEARCH], stdin=json.dumps(hidden))
            where = json.loads(res.stdout.strip().splitlines()[-1]) if res.ok else None
        except (OSError, ValueError, IndexError) as e:
            res, where = None, f"{type(e).__name__}: {e}"  # type: ignore[assignment]
        if not isinstance(where, dict):
            broken.append(str(where) if res is None else f"{res.status}, exit {res.exit_code}: {res.stderr[-200:]}")
            return
        for i, place in where.items():
            found.setdefault(hidden[int(i)], f"{place} {when}")

    try:
        got = play(env, task, reference_policy(env, task), cfg.max_turns, sandbox=box,
                   watch=search if hidden else None)
    finally:
        box.close()
    if broken:
        fail("infrastructure", f"the gate's search of the sandbox failed: {broken[0]}")
    for secret, place in found.items():
        fail("no leak", f"the policy can read the hidden {secret[:60]!r} {place}")
    return got


def _try_cheaters(env: Environment, task: Task, cheaters: list[Scripted], counts: dict[str, CheatTally],
                  cfg: QAConfig, fail: Callable[[str, str], None], hidden: list[str], others: list[Task],
                  plan: dict[str, Tries] | None = None) -> None:
    """Each cheater on `task`. One that needs another task (`Scripted.needs_sibling`) plays once per other
    task it is given, the first `plan[name].siblings` of `others` (default one; none: a level of one distinct
    task, nothing to know): it knows that task (its prompt and reference, as a policy trained on it knows
    them) and/or the gate solves that task first."""
    for cheater in cheaters:
        if not cheater.needs_sibling:
            _cheat(env, task, cheater, None, counts[cheater.name], cfg, fail, hidden)
            continue
        for other in others[:plan[cheater.name].siblings if plan else 1]:
            _cheat(env, task, cheater, other, counts[cheater.name], cfg, fail, hidden)


def _cheat(env: Environment, task: Task, cheater: Scripted, other: Task | None, c: CheatTally, cfg: QAConfig,
           fail: Callable[[str, str], None], hidden: list[str]) -> None:
    """One try of `cheater` on `task` (knowing, or after, `other`), added to its tally."""
    policy = cheater if other is None else cheater.given(
        Sibling(other, tuple(m for m in env.reference_solution(other) if m.role == "assistant")))
    if cheater.after_sibling and other is not None:  # another task solved just before, on the same environment object
        play(env, other, reference_policy(env, other), cfg.max_turns)
    if cheater.after_reference:  # a sibling episode that solved the task, on the same environment object
        play(env, task, reference_policy(env, task), cfg.max_turns)
    runs = [play(env, task, policy, cfg.max_turns)]
    while len(runs) < cheater.attempts and not _won(runs[-1]):  # the same policy again, in a fresh episode
        runs.append(play(env, task, policy, cfg.max_turns))
    got = runs[-1]
    c.tried += 1
    c.infra += got.reward.status != OK
    if _won(got):
        c.passed += 1
        c.won.append(f"level {task.difficulty} seed {task.seed}")
        if cheater.tolerance == 0:
            attempt = f" on attempt {len(runs)}" if len(runs) > 1 else ""
            fail("cheaters", f"{cheater_line(cheater)} passed{attempt}")
    found = leaked(hidden, "\n".join(o for r in runs for o in r.observations))
    if found:  # what a cheater is shown, a policy can be shown
        fail("no leak", f"the cheater {cheater.name!r} is shown the hidden {found[0][:60]!r}")


def cheater_line(cheater: Scripted) -> str:
    """Which strategy won, what it does, the class of loophole it attacks and the chance it is allowed."""
    return (f"the cheater {cheater.name!r} ({cheater.about}; class {cheater.klass or 'none'}, "
            f"tolerance {cheater.tolerance:.0%})")


def _won(got: Played) -> bool:
    return got.reward.status == OK and got.reward.passed


def _bare_answer(report: GateReport, env: Environment, tasks: dict[int, list[Task]]) -> None:
    """How often the reference's answer value stands among the prompt's values, against how often
    another task's answer of the same level does (chance: an answer may equal an operand). Fails when
    the first exceeds chance plus BARE_VALUE_TOLERANCE at significance ALPHA (one-sided binomial)."""
    hits, chance, n = 0, 0.0, 0
    first: Task | None = None
    for level, level_tasks in tasks.items():
        values = [answer_value(env, t) for t in level_tasks]
        level_hits, level_chance, level_n = 0, 0.0, 0
        for i, (task, value) in enumerate(zip(level_tasks, values, strict=True)):
            text = "\n".join(m.content for m in task.prompt)
            others = [v for j, v in enumerate(values) if j != i and v is not None
                      and level_tasks[j].task_id != task.task_id]
            if value is None or not others:
                continue
            level_n += 1
            hit = shows_value(text, value)
            level_hits += hit
            level_chance += sum(shows_value(text, v) for v in others) / len(others)
            first = first or (task if hit else None)
        if level_n:
            report.levels[level]["answer in prompt"] = level_hits / level_n
            report.levels[level]["another answer in prompt"] = level_chance / level_n
        hits, chance, n = hits + level_hits, chance + level_chance, n + level_n
    if not n:
        return
    allowed = min(1.0, chance / n + BARE_VALUE_TOLERANCE)
    p = binomial_tail(hits, n, allowed)
    report.leaks = {"answer in prompt": hits / n, "another answer in prompt": chance / n, "tasks": n, "p": p}
    if p < ALPHA and first is not None:
        report.failures.append(Failure("no leak", first.difficulty, first.seed, (
            f"the answer's bare value stands in {hits / n:.0%} of prompts, another task's in {chance / n:.0%} "
            f"(allowed: chance + {BARE_VALUE_TOLERANCE:.0%}; p = {p:.1e} < {ALPHA}): the prompt gives the answer away")))


@contextmanager
def cpu_contention() -> Iterator[int]:
    """Every CPU this process may use kept busy, while the block runs, by a sibling process spinning
    pinned to it (pinned: no CPU is left to the gate alone); yields how many. A spinner stops by
    itself if the gate dies without stopping it."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    spin = ("import os, sys, time\nparent, cpu = int(sys.argv[1]), int(sys.argv[2])\n"
            "if hasattr(os, 'sched_setaffinity'):\n    os.sched_setaffinity(0, {cpu})\n"
            "sys.stdout.write('.'); sys.stdout.flush()\nend = time.monotonic() + 3600\n"
            "while os.getppid() == parent and time.monotonic() < end:\n    sum(range(100000))\n")
    spinners: list[subprocess.Popen[bytes]] = []
    try:
        for cpu in cpus:
            spinners.append(subprocess.Popen([sys.executable, "-S", "-c", spin, str(os.getpid()), str(cpu)],
                                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE))
        for p in spinners:
            assert p.stdout is not None
            p.stdout.read(1)  # spinning before the first loaded run
        yield len(cpus)
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()


def _flakiness(report: GateReport, env: Environment, tasks: dict[int, list[Task]], cfg: QAConfig,
               idle: _Runs) -> None:
    """Enough reference runs to see a `flake_rate` verifier fail with probability `flake_power`: idle
    (the per-task repeats, topped up round-robin over the tasks) and again with every CPU busy."""
    need = flake_runs(cfg.flake_rate, cfg.flake_power)
    order = [(level, t) for level, level_tasks in tasks.items() for t in level_tasks]
    for k in range(need - idle.runs):
        level, task = order[k % len(order)]
        idle.add(level, task, play(env, task, reference_policy(env, task), cfg.max_turns))
    loaded = _Runs()
    with cpu_contention() as busy:
        for k in range(need):
            level, task = order[k % len(order)]
            loaded.add(level, task, play(env, task, reference_policy(env, task), cfg.max_turns))
    report.flakiness = {"rate": cfg.flake_rate, "power": cfg.flake_power, "runs needed": need, "busy cpus": busy,
                        "idle runs": idle.runs, "idle failed": idle.failed + idle.infra,
                        "loaded runs": loaded.runs, "loaded failed": loaded.failed + loaded.infra}
    sized = f"{need} runs see a {cfg.flake_rate:.0%} flake rate with probability {cfg.flake_power}"
    for runs, where in ((idle, "idle"), (loaded, f"with {busy} CPUs kept busy")):
        if runs.first is not None:
            gate = "reference" if runs.failed else "infrastructure"
            report.failures.append(Failure(gate, runs.first.difficulty, runs.first.seed, (
                f"the reference failed {runs.failed + runs.infra} of {runs.runs} runs {where} ({sized}); "
                f"first: {runs.first.reason}")))


def chance_tries(tolerance: float, rate: float, power: float) -> int:
    """Tries at which a strategy winning `rate` of them fails its chance test (tolerance 0: any win;
    else a one-sided binomial test against `tolerance` at ALPHA) with probability `power`."""
    if tolerance <= 0:
        return math.ceil(math.log(1 - power) / math.log(1 - rate)) if rate < 1 else 1
    for n in range(1, 10_000):
        k = next(k for k in range(n + 2) if k > n or binomial_tail(k, n, tolerance) < ALPHA)
        if k <= n and binomial_tail(k, n, rate) >= power:
            return n
    raise ValueError(f"no number of tries separates a rate of {rate} from a tolerance of {tolerance}")


@dataclass(frozen=True)
class Tries:
    """Where a cheater is tried: on the first `tasks` tasks of each level, a cheater that needs another task
    once per other task, the next `siblings` of the level."""

    tasks: int
    siblings: int = 1


def _sized(report: GateReport, cfg: QAConfig, cheaters: list[Scripted], levels: int) -> tuple[int, dict[str, Tries]]:
    """(tasks per level, where each cheater is tried) that give every chance test the tries its stated power
    needs, the tasks raised from the configured ones where those are too few (said in `report.warnings`);
    fills `report.power`. Answer kinds try every cheater on every task (no sandbox); code and terminal ones
    try each on the configured tasks, or as many as its own test needs (a 20% tolerance needs 17 tries, none
    3), one that needs another task on fewer tasks each with several others, as other tasks' answers are."""
    def need(tolerance: float) -> int:
        return chance_tries(tolerance, cfg.loophole_rate, cfg.loophole_power)

    need_random = need(RANDOM_ANSWER_TOLERANCE)
    needs = {c.name: need(c.tolerance) for c in cheaters}
    need_cheat = max(needs.values(), default=0)
    answer, configured = report.kind == "answer", cfg.cheat_tasks_per_level  # configured 0: cheaters off
    # tries per level where each task tries at most every other task of its level: other tasks' answers, and
    # (code, terminal) the cheaters that need another task
    pairs = [need_random, *(math.ceil(needs[c.name] / levels) for c in cheaters
                            if c.needs_sibling and configured and not answer)]
    tasks = max(cfg.tasks_per_level, 1)
    while tasks * (tasks - 1) < max(pairs):
        tasks += 1
    if answer:
        tasks = max(tasks, math.ceil(need_cheat / levels))
        plan = {name: Tries(tasks) for name in needs}
    else:
        plan = {}
        for c in cheaters:
            per_level = math.ceil(needs[c.name] / levels)
            on = max(configured, per_level) if configured else 0
            if c.needs_sibling and on:  # on the tasks there are, each with as many others of the level as it takes
                on = min(on, tasks)
                plan[c.name] = Tries(on, math.ceil(per_level / on))
            else:
                plan[c.name] = Tries(on)
        tasks = max([tasks, *(t.tasks for t in plan.values())])
    report.power = {"loophole rate": cfg.loophole_rate, "power": cfg.loophole_power, "alpha": ALPHA,
                    "random answer tries": need_random, "others per task": min(tasks - 1, math.ceil(need_random / tasks)),
                    "cheater tries": need_cheat, "tasks per level": tasks}
    if tasks > cfg.tasks_per_level:
        report.warnings.append(f"tasks per level raised from {cfg.tasks_per_level} to {tasks}: the chance tests need "
                               f"{need_random} tries of another task's answer a level and up to {need_cheat} of a "
                               f"cheater to catch one winning {cfg.loophole_rate:.0%} of tries with probability "
                               f"{cfg.loophole_power}")
    return tasks, plan


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return min(1.0, sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1)))


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
    why = d.get("reason") or d.get("error") or {k: v for k, v in d.items() if k != "expected"}
    return str(why or f"scored {p.reward.score} ({p.reward.status})")[:160]


def _chance_checks(report: GateReport, tasks: dict[int, list[Task]], cheaters: list[Scripted],
                   counts: dict[str, CheatTally], random_answers: dict[int, CheatTally]) -> None:
    first = min(tasks)
    seed = tasks[first][0].seed
    for level, tally in random_answers.items():
        if tally.tried and binomial_tail(tally.passed, tally.tried, RANDOM_ANSWER_TOLERANCE) < ALPHA:
            report.failures.append(Failure("null", level, tasks[level][0].seed, (
                f"another task's answer passed {tally.passed} of {tally.tried} tries (chance allows "
                f"{RANDOM_ANSWER_TOLERANCE:.0%}, p = {binomial_tail(tally.passed, tally.tried, RANDOM_ANSWER_TOLERANCE):.1g}):"
                " the verifier accepts answers that do not fit the task")))
    for c in cheaters:
        passed, tried, infra = counts[c.name].passed, counts[c.name].tried, counts[c.name].infra
        p = binomial_tail(passed, tried, c.tolerance) if tried else 1.0
        report.cheaters[c.name] = {"about": c.about, "class": c.klass, "passed": passed, "tried": tried,
                                   "infra": infra, "tolerance": c.tolerance}
        if c.tolerance > 0 and p < ALPHA:
            report.failures.append(Failure("cheaters", first, seed, (
                f"{cheater_line(c)} passed {passed} of {tried} tasks (chance allows {c.tolerance:.0%}; "
                f"p = {p:.1e} < {ALPHA})")))
        elif c.tolerance > 0 and passed and c.klass == "tests":
            # within chance for the environment, but each such task is one a program doing no work passes: said
            report.warnings.append(f"{cheater_line(c)} passed {passed} of {tried} tasks, within its tolerance: "
                                   f"{', '.join(counts[c.name].won)} have hidden tests that hold without the work")
        if infra:  # no pass, but no reward either: training drops the episode as the infrastructure's fault
            report.warnings.append(f"{cheater_line(c)} got an infrastructure failure, not a reward, on {infra} of "
                                   f"{tried} tasks: a policy that writes it escapes its zero")


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
