"""The pipeline's rollout seam: where a step's tasks become scored trajectories, whatever runs them.

`Rollout` is what the pipelines hold: tasks in, trajectories out (`rollout`), the trainer's weights in
by version (`update_weights`), engine counters out (`take_stats`), and `close`. `pipeline.workers` picks
its implementation from `ROLLOUTS`: `ThreadRollout` (a backend in this process, on the caller's thread),
`RolloutWorker` (a worker process, worker.py) or `RayRollout` (Ray actors, ray_workers.py). Each samples
through `rollout_tasks`, so where a rollout runs cannot change what it samples, and the pipeline calls
all of them the same way."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torch import Tensor

from assay.core.config import Config
from assay.core.errors import AssayError
from assay.core.types import Task, Trajectory
from assay.envs.base import Environment
from assay.pipeline.ray_workers import RayRollout
from assay.pipeline.worker import RolloutWorker, rollout_tasks
from assay.rollout.base import RolloutBackend

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# how long closing waits for a rollout in flight on a thread, which cannot be stopped mid-rollout
THREAD_CLOSE_WAIT_S = 60.0


@runtime_checkable
class Rollout(Protocol):
    """Where the pipeline's rollouts run. Calls come from one thread at a time (the pipeline's rollout
    thread, or its only thread); `close` may come from another while a rollout is in flight."""

    def rollout(self, tasks: Sequence[Task], step: int, attempt: int) -> list[Trajectory]:
        """The scored GRPO groups of `tasks` for step `step` (attempt 0, or refill round `attempt`), sampled
        with the last weights received."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """The trainer's weights of `version`, for the next rollout (none: the weights it has, renumbered)."""
        ...

    def take_stats(self) -> dict[str, float]:
        """The engine's counters since the last call (logged as rollout/NAME each step), then reset."""
        ...

    def close(self, wait_s: float = 30) -> None:
        """Release what it holds; a rollout in flight is waited for up to `wait_s` (a thread's, which
        cannot be stopped, up to THREAD_CLOSE_WAIT_S), and a rollout asked after raises."""
        ...


class ThreadRollout:
    """A rollout backend in this process, run on the caller's thread: the synchronous pipeline's on the
    trainer's own weights, the asynchronous one's (`pipeline.workers: thread`) on a copy of its own."""

    def __init__(self, cfg: Config, backend: RolloutBackend, tokenizer: PreTrainedTokenizerBase,
                 envs: dict[str, Environment]) -> None:
        self.cfg, self.backend, self.tokenizer, self.envs = cfg, backend, tokenizer, envs
        self._busy = threading.Lock()  # held while the backend is in use: close waits for it
        self._closed = False

    def rollout(self, tasks: Sequence[Task], step: int, attempt: int) -> list[Trajectory]:
        with self._busy:
            self._check_open()
            return rollout_tasks(self.cfg, self.backend, self.tokenizer, self.envs, tasks, step, attempt)

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        with self._busy:
            self._check_open()
            self.backend.update_weights(named_tensors, version=version)

    def take_stats(self) -> dict[str, float]:
        with self._busy:
            self._check_open()
            return self.backend.take_stats()

    def close(self, wait_s: float = 30) -> None:
        """Close the backend once the rollout in flight, if any, is done: a thread cannot be stopped
        mid-rollout, and its backend must not be freed under it (after THREAD_CLOSE_WAIT_S it is anyway)."""
        held = self._busy.acquire(timeout=max(wait_s, THREAD_CLOSE_WAIT_S))
        try:
            if not self._closed:
                self._closed = True
                self.backend.close()
        finally:
            if held:
                self._busy.release()

    def _check_open(self) -> None:
        if self._closed:
            raise AssayError("the rollout was closed while the rollout thread still used it")


@dataclass(frozen=True)
class RolloutSite:
    """What every kind of Rollout is built from: the run's config, the policy as a plain Hugging Face
    model (each kind takes a copy of its own: the trainer steps these tensors), its tokenizer, the
    environments, the run directory, and how this process makes a backend (the configured one, or the
    factory a Python caller gave)."""

    cfg: Config
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    envs: dict[str, Environment]
    run_dir: Path
    make_backend: Callable[[PreTrainedModel], RolloutBackend]


def _thread(site: RolloutSite) -> Rollout:
    own = copy.deepcopy(site.model).eval().requires_grad_(False)
    return ThreadRollout(site.cfg, site.make_backend(own), site.tokenizer, site.envs)


def _process(site: RolloutSite) -> Rollout:
    p = site.cfg.pipeline
    return RolloutWorker(site.cfg, site.model, site.tokenizer, site.envs, p.worker_restarts, p.worker_timeout_s)


def _ray(site: RolloutSite) -> Rollout:
    return RayRollout(site.cfg, site.model, site.tokenizer, site.envs, site.run_dir)


# `pipeline.workers` -> how that kind is built; the config admits exactly these names
ROLLOUTS: dict[str, Callable[[RolloutSite], Rollout]] = {"thread": _thread, "process": _process, "ray": _ray}


def make_rollout(site: RolloutSite) -> Rollout:
    """The Rollout `pipeline.workers` names, for the asynchronous pipeline: beside the trainer, with a copy
    of the weights of its own."""
    return ROLLOUTS[site.cfg.pipeline.workers](site)
