"""Held out means disjoint content: every task belongs to the training or the evaluation partition
of its environment by a stable hash of its `task_id` (which is content-addressed), so no seed, run
or machine can draw an evaluation task for training. An environment declares its evaluation share
(`eval_share`, default `DEFAULT_EVAL_SHARE`); drawing from one partition rejects the other's tasks.

The task_id of a built-in includes its `name@version`, so a version bump draws a new partition:
compare policies on one version, and check a run for overlap (`assay eval --run`)."""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from dataclasses import dataclass
from typing import Literal

from assay.core.errors import AssayError
from assay.core.types import Task
from assay.envs.base import DEFAULT_EVAL_SHARE, Environment, hooks  # noqa: F401 (DEFAULT_EVAL_SHARE: its old home)
from assay.envs.registry import stamped

Split = Literal["train", "eval"]
# Draws per task before a partition is declared empty at a level: with a share of 0.2 a non-empty
# partition is missed by chance with probability 0.8**1000.
MAX_DRAWS = 1000
# A level whose evaluation partition holds fewer distinct tasks than this is too small to split
# usefully: an evaluation of it measures a handful of items many times over.
SMALL_PARTITION = 50
SPACE_DRAWS = 2000  # draws per level behind a space estimate


def eval_share(env: Environment) -> float:
    share = hooks(env).eval_share
    if not isinstance(share, (int, float)) or not 0 < share < 1:
        raise AssayError(f"environment {env.name!r}: eval_share must be a number strictly between 0 and 1, "
                         f"got {share!r}")
    return float(share)


def split_of(task_id: str, share: float) -> Split:
    """The partition a task belongs to: a uniform number in [0, 1) from its id, below `share` = eval."""
    u = int(hashlib.sha256(f"assay-split/{task_id}".encode()).hexdigest()[:13], 16) / 16**13
    return "eval" if u < share else "train"


def draw_task(env: Environment, rng: random.Random, difficulty: int, split: Split) -> Task:
    """A task of `split`: `env.generate(Random(seed), difficulty)` for fresh seeds from `rng` until one
    lies in it. The task's `seed` is the one that made it, so `Random(task.seed)` regenerates it."""
    share = eval_share(env)
    for _ in range(MAX_DRAWS):
        seed = rng.getrandbits(63)  # fits a signed int64 column in the trajectory store
        task = env.generate(random.Random(seed), difficulty)
        if split_of(task.task_id, share) == split:  # stamped once accepted: the content hash is not free
            task = stamped(env, task, difficulty)
            task.seed = seed
            return task
    raise AssayError(f"environment {env.name}@{env.version}: no {split}-partition task at difficulty {difficulty} in "
                     f"{MAX_DRAWS} draws; the level's task space is too small to split (see `assay env show "
                     f"{env.name}`): widen the level or change eval_share")


def draw_distinct(env: Environment, rng: random.Random, difficulty: int, split: Split, count: int,
                  patience: int = 200) -> list[Task]:
    """Up to `count` distinct tasks of `split`; fewer when `patience` draws in a row bring nothing new
    (the partition is exhausted), so a small level is measured on what it has, never on repeats."""
    tasks: dict[str, Task] = {}
    misses = 0
    while len(tasks) < count and misses < patience:
        task = draw_task(env, rng, difficulty, split)
        if task.task_id in tasks:
            misses += 1
        else:
            tasks[task.task_id] = task
            misses = 0
    return list(tasks.values())


@dataclass(frozen=True)
class SpaceEstimate:
    level: int
    draws: int
    distinct: int
    size: float  # estimated number of distinct tasks (Chao1; equals `distinct` when every task recurred)
    eval_distinct: int  # distinct drawn tasks in the evaluation partition

    @property
    def eval_size(self) -> float:
        return self.size * self.eval_distinct / max(self.distinct, 1)

    @property
    def too_small(self) -> bool:
        return self.eval_size < SMALL_PARTITION


def estimate_space(env: Environment, difficulty: int, draws: int = SPACE_DRAWS, seed: int = 0) -> SpaceEstimate:
    """How many distinct tasks a level has, from `draws` seeded draws: Chao1 (distinct + f1²/2f2, with
    f1, f2 the tasks seen once and twice) is a lower-bound estimate that is exact once the space is
    exhausted and grows with the singletons while it is not."""
    rng = random.Random(f"space:{seed}:{env.name}:{difficulty}")
    counts = Counter(env.generate(rng, difficulty).task_id for _ in range(draws))
    f1 = sum(1 for c in counts.values() if c == 1)
    f2 = sum(1 for c in counts.values() if c == 2)
    size = len(counts) + (f1 * f1 / (2 * f2) if f2 else f1 * (f1 - 1) / 2)
    share = eval_share(env)
    eval_distinct = sum(1 for t in counts if split_of(t, share) == "eval")
    return SpaceEstimate(difficulty, draws, len(counts), size, eval_distinct)
