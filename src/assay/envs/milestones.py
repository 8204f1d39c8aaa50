"""Staged verification: the milestones an environment declares, checked on a finished episode.

A milestone is a point of an episode where the environment can tell that work went right (for `repo`:
the failing tests were reproduced, the visible tests pass, the work was submitted). Each is checked at
its node, on what the policy was shown (the tool results in the messages) and on what the verifier
found (the Reward's details), never on what the policy says about itself. Every trajectory records
which of its environment's milestones it reached (`Trajectory.milestones`), and each domain logs their
hit rates beside, never inside, the pass rate.

The optional shaped reward (`domains[].milestone_reward`, 0 = off) pays for milestones, and a shaped
reward is a new surface for reward hacking: it pays for a behaviour, which a policy can learn without
the result. So a milestone says whether it is `progress` (a state of the work the verifier checked) or
a step of the process (an action any policy can take: run the tests, submit); process milestones pay
only in an episode that also reached a progress milestone. A policy that runs the tests and submits
an untouched workspace reaches two milestones and collects nothing."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from assay.core.errors import AssayError
from assay.core.types import OK, Message, Reward, Task, Trajectory

MilestoneCheck = Callable[[Task, Sequence[Message], Reward], bool]
# (task, the episode's messages) -> the assistant turn (1-based) where a reached milestone was reached; None: unknown
MilestoneTurn = Callable[[Task, Sequence[Message]], int | None]


@dataclass(frozen=True)
class Milestone:
    name: str  # a metric name: lowercase letters, digits and _
    description: str  # what reaching it means, for people
    check: MilestoneCheck  # (task, the episode's messages, the verifier's Reward) -> reached
    progress: bool = False  # a verified state of the work (pays alone), not a step of the process
    turn: MilestoneTurn | None = None  # where it was reached, for people reading the episode (the HTML pages)


def first_call(tool: str) -> MilestoneTurn:
    """A turn locator for a process milestone that a call reaches: the first turn whose `tool` call got a result
    that is not an error."""

    def turn(task: Task, messages: Sequence[Message]) -> int | None:
        k = 0
        for m in messages:  # a turn's results follow its assistant message
            k += m.role == "assistant"
            if k and m.role == "tool" and m.name == tool and not m.is_error:
                return k
        return None

    return turn


def check_milestones(milestones: object, label: str) -> tuple[Milestone, ...]:
    """`milestones` as an environment's hook must be: a tuple of Milestone with distinct metric-safe names."""
    if not isinstance(milestones, tuple) or not all(isinstance(m, Milestone) for m in milestones):
        raise AssayError(f"environment {label}: the hook milestones must be a tuple of "
                         f"assay.envs.milestones.Milestone, got {milestones!r}")
    names = [m.name for m in milestones]
    bad = [n for n in names if not n or not n.replace("_", "").isalnum() or n != n.lower()]
    if bad or len(set(names)) != len(names):
        raise AssayError(f"environment {label}: milestone names must be distinct, lowercase letters, digits and _ "
                         f"(they name metrics), got {names}")
    return milestones


def reached(milestones: Sequence[Milestone], task: Task, messages: Sequence[Message],
            reward: Reward) -> dict[str, bool]:
    """Each declared milestone, in order, and whether the episode reached it. An episode that ended in an
    infrastructure failure reached none: there is no verified state to check."""
    if reward.status != OK:
        return {m.name: False for m in milestones}
    return {m.name: bool(m.check(task, messages, reward)) for m in milestones}


def credit(milestones: Sequence[Milestone], hits: Mapping[str, bool]) -> int:
    """How many reached milestones the shaped reward pays for: every progress milestone reached, and the
    process milestones reached only where some progress milestone was reached too."""
    progress = [m for m in milestones if m.progress and hits.get(m.name)]
    process = [m for m in milestones if not m.progress and hits.get(m.name)]
    return len(progress) + (len(process) if progress else 0)


def reached_turns(milestones: Sequence[Milestone], task: Task, messages: Sequence[Message],
                  hits: Mapping[str, bool]) -> dict[str, int]:
    """The turn of each reached milestone whose declaration can locate it (`Milestone.turn`), in order."""
    turns = {m.name: m.turn(task, messages) for m in milestones if hits.get(m.name) and m.turn is not None}
    return {name: k for name, k in turns.items() if k is not None}


def mark_milestones(trajs: Sequence[Trajectory], milestones_of: Mapping[str, Sequence[Milestone]]) -> None:
    """Record on each trajectory the milestones of its domain's environment (`milestones_of[domain]`) it
    reached, in `reward_info["milestone_credit"]` how many of them the shaped reward would pay for, and in
    `reward_info["milestone_turns"]` the turn of those a declaration locates (where any does)."""
    for t in trajs:
        declared = milestones_of.get(t.task.domain, ())
        if not declared:
            continue
        t.milestones = reached(declared, t.task, t.messages, Reward(t.reward, t.passed, t.status, t.reward_info))
        t.reward_info["milestone_credit"] = credit(declared, t.milestones)
        if turns := reached_turns(declared, t.task, t.messages, t.milestones):
            t.reward_info["milestone_turns"] = turns
