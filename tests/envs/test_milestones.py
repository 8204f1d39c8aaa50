"""Staged verification, framework side: the milestones hook, what a trajectory records, what the shaped reward
pays (process milestones only beside progress), and the hit rates each domain logs."""

from __future__ import annotations

import pytest

from assay.core.config import DomainConfig
from assay.core.errors import AssayError
from assay.core.types import SANDBOX_ERROR, Message, Reward, Task, Trajectory
from assay.envs.base import EnvHooks, hooks
from assay.envs.milestones import Milestone, credit, mark_milestones, reached
from assay.envs.rewards import shape_rewards
from assay.mixer.stats import summarize


def _flag(key: str):
    return lambda task, messages, reward: bool(reward.details.get(key))


RAN = Milestone("ran", "ran the tests", _flag("ran"))
FIXED = Milestone("fixed", "the verifier found the fix", _flag("fixed"), progress=True)
SENT = Milestone("sent", "submitted", _flag("sent"))
DECLARED = (RAN, FIXED, SENT)


class _Env:
    name, version, category, difficulties, tools = "m", "1", "test", (1,), ()
    milestones = DECLARED


def _traj(domain: str = "d", reward: float = 0.0, passed: bool = False, status: str = "ok", **details) -> Trajectory:
    task = Task("m@1", "t", 1, [Message("user", "q")], domain=domain)
    return Trajectory(task, [Message("assistant", "a")], [0, 1], [0, 1], [0.0, 0.0], 1, reward=reward, passed=passed,
                      reward_info=dict(details), status=status)


def test_the_hook_defaults_to_none_and_is_read_as_declared():
    assert EnvHooks().milestones == () and hooks(object()).milestones == ()
    assert hooks(_Env()).milestones == DECLARED


@pytest.mark.parametrize("bad, match", [([RAN], "tuple"), ((RAN, "fixed"), "tuple"), ((RAN, RAN), "distinct"),
                                        ((Milestone("Bad Name", "", _flag("x")),), "lowercase")])
def test_a_malformed_milestones_hook_is_refused_naming_the_fix(bad, match):
    class Bad(_Env):
        milestones = bad

    with pytest.raises(AssayError, match=match):
        hooks(Bad())


def test_process_milestones_pay_only_beside_progress():
    assert credit(DECLARED, {"ran": True, "fixed": False, "sent": True}) == 0  # ran the tests, submitted: nothing
    assert credit(DECLARED, {"ran": False, "fixed": True, "sent": False}) == 1
    assert credit(DECLARED, {"ran": True, "fixed": True, "sent": True}) == 3
    assert credit(DECLARED, {}) == 0


def test_an_infrastructure_failure_reaches_nothing():
    hits = reached(DECLARED, _traj().task, [], Reward(0.0, False, status=SANDBOX_ERROR, details={"ran": True}))
    assert hits == {"ran": False, "fixed": False, "sent": False}


def test_trajectories_record_milestones_and_domains_log_hit_rates():
    full, idle, other = _traj(ran=True, fixed=True, sent=True), _traj(ran=True, sent=True), _traj(domain="plain")
    mark_milestones([full, idle, other], {"d": DECLARED, "plain": ()})
    assert full.milestones == {"ran": True, "fixed": True, "sent": True} and full.reward_info["milestone_credit"] == 3
    assert idle.milestones == {"ran": True, "fixed": False, "sent": True} and idle.reward_info["milestone_credit"] == 0
    assert other.milestones == {} and "milestone_credit" not in other.reward_info
    step = summarize([full, idle], difficulty=1, ratio=1.0)
    assert step.milestones == {"ran": 1.0, "fixed": 0.5, "sent": 1.0}
    from assay.mixer.stats import DomainStats

    metrics = DomainStats(1, {"d": step}).metrics()
    assert metrics["domain/d/milestone_fixed"] == 0.5 and metrics["domain/d/pass_rate"] == 0.0


def test_the_shaped_reward_is_off_by_default_and_never_touches_passed():
    off = [_traj(reward=1.0, passed=True, ran=True, fixed=True, sent=True), _traj(ran=True, sent=True)]
    mark_milestones(off, {"d": DECLARED})
    shape_rewards(off, {"d": DomainConfig(name="d", env="arith")})
    assert [t.reward for t in off] == [1.0, 0.0] and all("terms" not in t.reward_info for t in off)

    on = [_traj(reward=1.0, passed=True, ran=True, fixed=True, sent=True), _traj(ran=True, sent=True),
          _traj(fixed=True)]
    mark_milestones(on, {"d": DECLARED})
    shape_rewards(on, {"d": DomainConfig(name="d", env="arith", milestone_reward=0.1)})
    assert [t.reward for t in on] == pytest.approx([1.3, 0.0, 0.1])
    assert [t.passed for t in on] == [True, False, False]
    assert on[0].reward_info["terms"] == {"verifier": 1.0, "milestones": 3.0}


def test_a_declaration_can_locate_the_turn_a_call_reached_it():
    from dataclasses import replace

    from assay.core.types import ToolCall
    from assay.envs.milestones import first_call

    submit = Message("assistant", "", [ToolCall("submit", {})])
    messages = [Message("user", "q"), Message("assistant", "", [ToolCall("run", {})]), Message("tool", "ok", name="run"),
                submit, Message("tool", "error: not yet", name="submit", is_error=True),  # refused: not reached here
                submit, Message("tool", "submitted", name="submit")]
    t = _traj(ran=True, sent=True)
    t.messages = messages
    mark_milestones([t], {"d": (replace(RAN, turn=first_call("missing")), FIXED, replace(SENT, turn=first_call("submit")))})
    assert t.reward_info["milestone_turns"] == {"sent": 3}  # ran: reached, but no such call; fixed: not reached
