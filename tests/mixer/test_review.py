from assay.core.config import DifficultyRange, DomainConfig, MixerConfig
from assay.envs import get_env
from assay.mixer.mixer import DomainMixer


def test_review_draws_a_share_of_tasks_from_the_levels_below_the_current_one():
    dom = DomainConfig(name="arith", env="arith", difficulty=DifficultyRange(min=1, max=4, start=3, review=0.5))
    mixer = DomainMixer([dom], MixerConfig(), {"arith": get_env("arith")}, seed=0)
    levels = [t.difficulty for t in mixer.sample(400)]
    assert set(levels) == {1, 2, 3}
    assert 0.4 < levels.count(3) / len(levels) < 0.6


def test_uniform_schedule_draws_every_level_in_equal_parts_and_never_moves():
    dom = DomainConfig(name="arith", env="arith", difficulty=DifficultyRange(min=1, max=4, schedule="uniform"))
    mixer = DomainMixer([dom], MixerConfig(), {"arith": get_env("arith")}, seed=0)
    tasks = mixer.sample(800)
    levels = [t.difficulty for t in tasks]
    for lv in (1, 2, 3, 4):
        assert 0.2 < levels.count(lv) / len(levels) < 0.3, lv
    mixer.update([_passed(t) for t in tasks])  # everything passes: a curriculum would promote
    assert mixer.curricula["arith"].level == 1 and not mixer.curricula["arith"].window


def _passed(task):
    from assay.core.types import Trajectory

    return Trajectory(task=task, messages=[], token_ids=[], loss_mask=[], logprobs=[], prompt_len=0, reward=1.0, passed=True)


def test_stratified_schedule_gives_every_batch_each_level_in_equal_parts_and_resumes_exactly():
    import json

    dom = DomainConfig(name="codegen", env="codegen", difficulty=DifficultyRange(min=1, max=4, schedule="stratified"))
    envs = {"codegen": get_env("codegen")}
    mixer = DomainMixer([dom], MixerConfig(strategy="static"), envs, seed=0)
    for _ in range(5):  # a batch of as many groups as levels: one group a level, every time
        assert sorted(t.difficulty for t in mixer.sample(4)) == [1, 2, 3, 4]
    assert sorted(t.difficulty for t in mixer.sample(8)) == [1, 1, 2, 2, 3, 3, 4, 4]
    odd = [t.difficulty for _ in range(4) for t in mixer.sample(3)]  # remainders come from one deck: balanced
    assert sorted(odd) == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]
    single = [t.difficulty for _ in range(8) for t in mixer.sample(1)]  # a refill a group at a time, too
    assert sorted(single[:4]) == sorted(single[4:]) == [1, 2, 3, 4]
    mixer.update([_passed(t) for t in mixer.sample(4)])  # everything passes: a curriculum would promote
    assert mixer.curricula["codegen"].level == 1 and not mixer.curricula["codegen"].window
    mixer.sample(2)  # half a deck left undealt: the resume must deal the rest
    resumed = DomainMixer([dom], MixerConfig(strategy="static"), envs, seed=1)
    resumed.load_state_dict(json.loads(json.dumps(mixer.state_dict())))
    assert [(t.task_id, t.difficulty) for t in resumed.sample(6)] == [(t.task_id, t.difficulty) for t in mixer.sample(6)]
