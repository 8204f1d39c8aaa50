"""Reward shaping: a domain's training reward as weighted terms, each recorded; `passed` untouched."""

import pytest

from assay.core.config import DomainConfig, RewardTerm
from assay.core.errors import ConfigError
from assay.core.types import Message, Task, Trajectory
from assay.envs.rewards import check_rewards, shape_rewards


def bonus(traj, dom):  # a user's term, imported by path
    return 2.0 if "please" in traj.messages[-1].content else 0.0


def _traj(passed: bool, tokens: int, finish: str = "stop", content: str = "Answer: 1") -> Trajectory:
    task = Task("x@1", "t", 1, [Message("user", "q")], domain="d")
    return Trajectory(task, [Message("assistant", content)], [0] * (tokens + 1), [0] + [1] * tokens,
                      [0.0] * (tokens + 1), 1, finish_reason=finish, reward=float(passed), passed=passed)


def test_terms_are_weighted_recorded_and_leave_passed_alone():
    dom = DomainConfig(name="d", env="arith", max_new_tokens=10, max_turns=2,
                       rewards=[RewardTerm(fn="verifier"), RewardTerm(fn="length", weight=0.5),
                                RewardTerm(fn="format", weight=0.1), RewardTerm(fn="tests.envs.test_rewards:bonus")])
    good, cut, polite = _traj(True, 5), _traj(False, 20, finish="length"), _traj(False, 2, content="please")
    shape_rewards([good, cut, polite], {"d": dom})
    assert good.reward == pytest.approx(1.0 - 0.5 * 5 / 20 + 0.1) and good.passed
    assert cut.reward == pytest.approx(-0.5) and not cut.passed
    assert polite.reward == pytest.approx(-0.5 * 2 / 20 + 0.1 + 2.0)
    assert good.reward_info["terms"] == {"verifier": 1.0, "length": -0.25, "format": 1.0,
                                         "tests.envs.test_rewards:bonus": 0.0}


def test_without_terms_the_verifier_reward_is_untouched():
    t = _traj(True, 5)
    shape_rewards([t], {"d": DomainConfig(name="d", env="arith")})
    assert t.reward == 1.0 and "terms" not in t.reward_info


@pytest.mark.parametrize("fn, match", [("lenght", "not one of"), ("no.such.module:f", "could not be imported"),
                                       ("tests.envs.test_rewards:nothing", "could not be imported")])
def test_a_bad_term_is_named_before_anything_runs(fn, match):
    with pytest.raises(ConfigError, match=match):
        check_rewards([DomainConfig(name="d", env="arith", rewards=[RewardTerm(fn=fn)])])
