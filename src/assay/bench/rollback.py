"""`assay bench rollback`: error accumulation on `repo`, measured with scripted policies.

Every policy first runs the visible tests, then plays the task's reference patch. `wrong edit, continue` makes a
wrong early edit before that (an operator flipped across the whole package with sed, as an agent that
misread the bug might) and carries on as if it had not; `wrong edit, rollback` takes a checkpoint first,
sees the tests fail worse after the edit, and rolls back before the patch. The reference is the baseline.
Scripted, so the numbers measure the environment's mechanics (how often one early mistake sinks an episode
that then does everything right, what a rollback costs in rounds), not a model's judgement.

`assay bench rollback` plays them at the level of messages (envs.qa.play) and reports the milestones;
`WRONG_EDIT` is the same scripts through the agent loop, the "wrong early edit" rows of
`assay bench agent --scripted` (bench/countermeasures.py)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from assay.bench.scripted import Failure, Replayed, Setting
from assay.core.types import Message, Task, ToolCall
from assay.envs.base import hooks
from assay.envs.builtin.repo import RepoEnv
from assay.envs.milestones import reached
from assay.envs.qa.play import Replay, play, reference_policy
from assay.eval.evaluate import eval_tasks

POLICIES = ("reference", "wrong edit, continue", "wrong edit, rollback")


def wrong_edit(task: Task) -> ToolCall:
    """One bash call that flips comparisons and arithmetic across every module of the package (not the tests)."""
    pkg = task.payload["pkg"]
    return ToolCall("bash", {"command": f"sed -i -e 's/ < / <= /g' -e 's/ + / - /g' -e 's/ == / != /g' {pkg}/*.py"})


def scripted(env: RepoEnv, task: Task, policy: str) -> Replay:
    ref = [m for m in env.reference_solution(task) if m.role == "assistant"]  # starts with run_tests
    if policy == "reference":
        return reference_policy(env, task)
    first, rest = ref[:1], ref[1:]
    tests = Message("assistant", "", [ToolCall("run_tests", {})])
    if policy == "wrong edit, continue":
        turns = [*first, Message("assistant", "", [wrong_edit(task)]), tests, *rest]
    elif policy == "wrong edit, rollback":
        turns = [*first, Message("assistant", "", [ToolCall("checkpoint", {})]),
                 Message("assistant", "", [wrong_edit(task)]), tests,
                 Message("assistant", "", [ToolCall("rollback", {"id": "cp1"})]), *rest]
    else:
        raise ValueError(f"unknown policy {policy!r}; one of {POLICIES}")
    return Replay(policy, turns)


def wrong_edit_script(env: RepoEnv, task: Task, setting: Setting) -> Replayed:
    return Replayed(scripted(env, task, setting.policy).turns)


WRONG_EDIT = Failure("wrong early edit", [Setting("off (carry on)", policy="wrong edit, continue"),
                                          Setting("checkpoint + rollback", policy="wrong edit, rollback")],
                     wrong_edit_script)


@dataclass
class RollbackRow:
    policy: str
    passed: list[bool] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)  # assistant turns
    tool_errors: list[int] = field(default_factory=list)
    milestones: dict[str, list[bool]] = field(default_factory=dict)


def run_rollback_bench(tasks_per_level: int, seed: int = 0, levels: tuple[int, ...] = (1, 2, 3, 4),
                       max_turns: int = 40) -> list[RollbackRow]:
    env = RepoEnv()
    tasks = eval_tasks(env, "repo", tasks_per_level * len(levels), seed, levels)
    rows = {p: RollbackRow(p) for p in POLICIES}
    for task in tasks:
        for policy in POLICIES:
            played = play(env, task, scripted(env, task, policy), max_turns)
            row = rows[policy]
            row.passed.append(played.reward.passed)
            row.rounds.append(sum(m.role == "assistant" for m in played.messages[len(task.prompt):]))
            row.tool_errors.append(int(played.reward.details.get("tool_errors", 0)))
            for name, hit in reached(hooks(env).milestones, task, played.messages, played.reward).items():
                row.milestones.setdefault(name, []).append(hit)
    return list(rows.values())


def table(rows: list[RollbackRow]) -> str:
    names = list(rows[0].milestones)
    lines = ["| policy | tasks | pass rate | rounds (mean) | tool errors (mean) | " + " | ".join(names) + " |",
             "|---|---|---|---|---|" + "---|" * len(names)]
    for r in rows:
        hits = " | ".join(f"{statistics.mean(r.milestones[n]):.2f}" for n in names)
        lines.append(f"| {r.policy} | {len(r.passed)} | {statistics.mean(r.passed):.2f} | "
                     f"{statistics.mean(r.rounds):.1f} | {statistics.mean(r.tool_errors):.2f} | {hits} |")
    return "\n".join(lines)
