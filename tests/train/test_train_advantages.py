import math

import pytest
from train_helpers import traj

from assay.core.errors import AssayError
from assay.core.types import SANDBOX_ERROR
from assay.train.advantages import filter_zero_variance, group_advantages, paying_domains


def batch():
    return [
        traj([0, 1], [0, 1], 1.0, "g1", "a"),
        traj([0, 1], [0, 1], 0.0, "g1", "a"),
        traj([0, 1], [0, 1], 0.0, "g1", "a"),
        traj([0, 1], [0, 1], 0.0, "g1", "a"),
        traj([0, 1], [0, 1], 20.0, "g2", "b"),
        traj([0, 1], [0, 1], 40.0, "g2", "b"),
        traj([0, 1], [0, 1], 100.0, "g2", "b", status=SANDBOX_ERROR),  # no reward signal: no baseline either
        traj([0, 1], [0, 1], 0.3, "g3", "a"),
        traj([0, 1], [0, 1], 0.3, "g3", "a"),
        traj([0, 1], [0, 1], 0.3, "g3", "a"),
    ]


def test_grpo_mean_centred():
    assert group_advantages(batch(), "grpo") == [0.75, -0.25, -0.25, -0.25, -10.0, 10.0, None, 0.0, 0.0, 0.0]


def test_grpo_std_normalized():
    std1 = math.sqrt(0.75 * 0.25)  # population std of (1, 0, 0, 0)
    got = group_advantages(batch(), "grpo", std_normalize=True)
    want = [0.75 / (std1 + 1e-6)] + [-0.25 / (std1 + 1e-6)] * 3 + [-10 / (10 + 1e-6), 10 / (10 + 1e-6), None, 0, 0, 0]
    assert got == pytest.approx(want, abs=1e-12)


def test_dr_grpo_ignores_std():
    assert group_advantages(batch(), "dr_grpo", std_normalize=True) == group_advantages(batch(), "grpo")


def test_rloo_leave_one_out():
    got = group_advantages(batch(), "rloo")
    assert got == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3, -20.0, 20.0, None, 0.0, 0.0, 0.0], abs=1e-12)
    assert group_advantages([traj([0, 1], [0, 1], 5.0, "solo")], "rloo") == [0.0]


def test_constant_group_is_exactly_zero():
    # 0.1 * 3 / 3 != 0.1 in floating point: the centred value must still be exactly 0
    trajs = [traj([0, 1], [0, 1], 0.1, "g") for _ in range(3)]
    assert group_advantages(trajs, "grpo", std_normalize=True) == [0.0, 0.0, 0.0]


def test_per_domain_normalize():
    got = group_advantages(batch(), "grpo", per_domain_normalize=True)
    # domain a: (.75, -.25, -.25, -.25, 0, 0, 0), mean 0, population std sqrt(.75 / 7); domain b: (-10, 10), std 10
    std_a = math.sqrt(0.75 / 7)
    want = [0.75 / std_a] + [-0.25 / std_a] * 3 + [-1.0, 1.0, None] + [0.0] * 3
    assert got == pytest.approx(want, abs=1e-12)


def test_missing_group_id_and_bad_kind():
    with pytest.raises(AssayError, match="group_id"):
        group_advantages([traj([0, 1], [0, 1], 1.0, "")])
    with pytest.raises(AssayError, match="unknown advantage kind"):
        group_advantages(batch(), "ppo")  # type: ignore[arg-type]


def test_filter_zero_variance():
    trajs = batch() + [
        traj([0, 1], [0, 1], 1.0, "g4"),
        traj([0, 1], [0, 1], 0.0, "g4", status=SANDBOX_ERROR),  # only one ok member: no variance
    ]
    kept, dropped = filter_zero_variance(trajs)
    assert dropped == 2  # g3 (constant) and g4
    assert [t.group_id for t in kept] == ["g1"] * 4 + ["g2"] * 3


def test_refills_pay_in_the_domains_where_enough_groups_had_variance():
    trajs = batch() + [traj([0, 1], [0, 1], r, "g5", "c") for r in (1.0, 1.0)]  # c: its one group constant
    kept, _ = filter_zero_variance(trajs)  # a: g1 kept, g3 dropped (1 of 2); b: g2 kept (1 of 1)
    assert paying_domains(trajs, kept, 0.5) == {"a", "b"}
    assert paying_domains(trajs, kept, 0.75) == {"b"}
    assert paying_domains(trajs, kept, 0.0) is None  # no limit: every domain, by the mixer's ratios
