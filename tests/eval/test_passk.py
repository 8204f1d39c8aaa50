from math import comb

import pytest

from assay.eval.passk import paired_difference_ci, pass_at_k, pass_at_k_ci


def test_pass_at_k_matches_definition():
    assert pass_at_k(8, 0, 1) == 0.0
    assert pass_at_k(8, 8, 4) == 1.0
    assert pass_at_k(8, 2, 1) == pytest.approx(2 / 8)
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - comb(6, 4) / comb(8, 4))
    assert pass_at_k(5, 4, 2) == 1.0  # fewer than k failures: some k-subset must hold a pass
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_ci_brackets_mean_and_shrinks_with_more_tasks():
    few = [[True, False]] * 5 + [[False, False]] * 5
    many = few * 20
    e_few, e_many = pass_at_k_ci(few, 1), pass_at_k_ci(many, 1)
    assert e_few.value == pytest.approx(0.25) and e_many.value == pytest.approx(0.25)
    assert e_few.low < 0.25 < e_few.high
    assert (e_many.high - e_many.low) < (e_few.high - e_few.low)


def test_paired_difference_detects_lift_only_when_real():
    before = [[False] * 4] * 30
    after = [[True, True, False, False]] * 30
    lift = paired_difference_ci(before, after)
    assert lift.value == pytest.approx(0.5) and lift.low > 0
    same = paired_difference_ci(after, after)
    assert same.value == 0.0 and same.low <= 0 <= same.high
