import pytest

from assay.core.config import DifficultyRange, DomainConfig
from assay.core.errors import AssayError, CheckpointError
from assay.mixer.curriculum import Curriculum


def make(level: int = 1, lo: int = 1, hi: int = 3, window: int = 4) -> Curriculum:
    return Curriculum(lo, hi, level, window, acceptance=0.75, regression=0.25)


def test_promotes_only_when_window_full_and_resets():
    c = make()
    assert [c.record(True) for _ in range(3)] == [0, 0, 0]  # 3/3 passed but the window is not full yet
    assert c.level == 1 and c.pass_rate == 1.0
    assert c.record(False) == 1  # 3/4 = 0.75 >= acceptance
    assert c.level == 2 and c.window == [] and c.pass_rate is None


def test_demotes_on_regression_and_resets():
    c = make(level=2)
    assert [c.record(False) for _ in range(4)] == [0, 0, 0, -1]  # 0/4 < 0.25
    assert c.level == 1 and c.window == []


def test_window_rolls_at_the_bounds():
    c = make(level=1)
    for _ in range(4):
        assert c.record(False) == 0  # already at min: no demotion, the window stays full
    assert c.window == [False] * 4
    # the oldest results fall out one by one: 1/4, 2/4, then 3/4 promotes
    assert [c.record(True) for _ in range(3)] == [0, 0, 1]
    assert c.level == 2


def test_saturated_at_max():
    c = make(level=3)
    for _ in range(4):
        assert c.record(True) == 0
    assert c.level == 3 and c.saturated(c.pass_rate)
    assert not make(level=2).saturated(1.0) and not c.saturated(None) and not c.saturated(0.5)


def test_between_thresholds_stays():
    c = make(level=2)
    changes = [c.record(x) for x in (True, False, True, False, True, False)]
    assert changes == [0] * 6 and c.level == 2 and c.pass_rate == 0.5


def test_from_config_and_state_round_trip():
    d = DomainConfig(
        name="m", env="m", difficulty=DifficultyRange(min=1, max=4, start=2, acceptance=0.9, regression=0.2, window=8)
    )
    c = Curriculum.from_config(d)
    assert (c.min_level, c.max_level, c.level, c.window_size, c.acceptance, c.regression) == (1, 4, 2, 8, 0.9, 0.2)
    c.record(True)
    c.record(False)
    c2 = Curriculum.from_config(d)
    c2.load_state_dict(c.state_dict())
    assert c2 == c


def test_bad_inputs_raise():
    with pytest.raises(AssayError, match="regression"):
        Curriculum(1, 3, 1, 4, acceptance=0.3, regression=0.5)
    with pytest.raises(AssayError, match="outside"):
        Curriculum(1, 3, 4, 4, acceptance=0.8, regression=0.3)
    with pytest.raises(CheckpointError, match="outside"):
        make().load_state_dict({"level": 9, "window": []})
