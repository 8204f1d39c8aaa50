from assay.core.config import DifficultyRange, DomainConfig, MixerConfig
from assay.envs import get_env
from assay.mixer.mixer import DomainMixer


def test_review_draws_a_share_of_tasks_from_the_levels_below_the_current_one():
    dom = DomainConfig(name="arith", env="arith", difficulty=DifficultyRange(min=1, max=4, start=3, review=0.5))
    mixer = DomainMixer([dom], MixerConfig(), {"arith": get_env("arith")}, seed=0)
    levels = [t.difficulty for t in mixer.sample(400)]
    assert set(levels) == {1, 2, 3}
    assert 0.4 < levels.count(3) / len(levels) < 0.6
