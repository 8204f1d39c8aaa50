"""Held out means disjoint content: training draws and evaluation suites never share a task."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from assay.core.config import DomainConfig, MixerConfig
from assay.core.errors import AssayError
from assay.core.types import Message, Task
from assay.envs import get_env
from assay.envs.split import DEFAULT_EVAL_SHARE, draw_task, estimate_space, eval_share, split_of
from assay.eval.evaluate import eval_tasks
from assay.mixer.mixer import DomainMixer
from assay.pipeline.quickstart import default_config
from assay.pipeline.sft import sft_tasks

BUILTINS = ["arith", "codegen", "toolcalc", "terminal"]


@pytest.mark.parametrize("name", BUILTINS)
def test_training_draws_and_the_evaluation_suite_share_no_task(name):
    env = get_env(name)
    suite = {t.task_id for t in eval_tasks(env, name, 32 * len(env.difficulties), seed=0, difficulties=env.difficulties)}
    assert suite and all(split_of(t, eval_share(env)) == "eval" for t in suite)
    for level in env.difficulties:
        rng = random.Random(f"train/{level}")
        train = {draw_task(env, rng, level, "train").task_id for _ in range(300)}
        assert not train & suite, f"{name} level {level}"


def test_every_training_path_draws_from_the_training_partition():
    cfg = default_config(["sft.examples_per_domain=200"])
    envs = {d.name: get_env(d.env) for d in cfg.domains}
    for tasks in sft_tasks(cfg, envs).values():
        assert all(split_of(t.task_id, DEFAULT_EVAL_SHARE) == "train" for t in tasks)
    mixer = DomainMixer([DomainConfig(name=d.name, env=d.env) for d in cfg.domains], MixerConfig(), envs, seed=0)
    drawn = [t for _ in range(20) for t in mixer.sample(16)]
    assert all(split_of(t.task_id, DEFAULT_EVAL_SHARE) == "train" for t in drawn)


def test_evaluation_tasks_are_distinct_and_fewer_where_a_level_is_small():
    arith = get_env("arith")
    tasks = eval_tasks(arith, "arith", 256, seed=3, difficulties=[1, 2])
    assert len({t.task_id for t in tasks}) == len(tasks)
    level1 = [t for t in tasks if t.difficulty == 1]
    assert 0 < len(level1) < 128 and sum(t.difficulty == 2 for t in tasks) == 128  # level 1 has ~126 tasks in all
    assert tasks == eval_tasks(arith, "arith", 256, seed=3, difficulties=[1, 2])  # a pure function of its arguments


def test_the_partition_is_a_stable_hash_with_the_declared_share():
    ids = [f"x-1-{i:012x}" for i in range(20000)]
    share = sum(split_of(t, 0.2) == "eval" for t in ids) / len(ids)
    assert 0.19 < share < 0.21
    assert [split_of(t, 0.2) for t in ids[:50]] == [split_of(t, 0.2) for t in ids[:50]]
    assert all(split_of(t, 0.3) == "eval" for t in ids if split_of(t, 0.2) == "eval")  # nested in the share


@dataclass
class _TinyEnv:
    """A level with `size` tasks: the smallest possible spaces."""
    size: int
    name: str = "tiny"
    version: str = "1"
    difficulties: tuple[int, ...] = (1,)
    eval_share: float = 0.5

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        i = rng.randrange(self.size)
        return Task(env="tiny@1", task_id=f"tiny-1-{i}", domain="x", difficulty=1, prompt=[Message("user", str(i))])


def test_an_empty_partition_is_a_clear_error_and_the_space_is_estimated():
    one = _TinyEnv(1)
    empty = "eval" if split_of("tiny-1-0", 0.5) == "train" else "train"
    with pytest.raises(AssayError, match="too small to split"):
        draw_task(one, random.Random(0), 1, empty)
    est = estimate_space(_TinyEnv(40), 1, draws=2000)
    assert est.distinct == 40 and est.size == 40 and est.too_small
    assert 0 < est.eval_distinct < 40
    with pytest.raises(AssayError, match="eval_share"):
        eval_share(_TinyEnv(5, eval_share=1.0))
