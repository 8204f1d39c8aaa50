"""The asynchronous pipeline: sampling runs ahead of training, on its own thread with its own copy of
the weights, by at most `pipeline.max_staleness` policy versions.

The schedule is fixed, so a run is a function of its seed like the synchronous one: the batch of step
s is sampled with the weights of version max(start, s - 1 - k) (k = max_staleness), its tasks are
drawn after the mixer has seen step s - 1 - k and before it sees step s - k. With k = 0 this is the
synchronous pipeline exactly; with k >= 1 the rollout of step s + k overlaps the training of step s.
Dynamic sampling refills dropped groups as the synchronous pipeline does; a refill for step s is
drawn after the mixer has seen step s - k (with k >= 1 it waits for that update) and before it sees
step s - k + 1, so refills keep the run a function of its seed. A checkpoint after step s waits for
the batches of steps s+1 .. s+k and holds them (the rollout may not draw step s+k+1 before it is
written), so a resumed run trains exactly those and continues as the run would have."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from assay.core.config import Config, build_config, load_config
from assay.core.errors import ConfigError
from assay.core.storage import (
    TrajectoryWriter,
    prepare_run_dir,
    release_run_dir,
    trajectory_from_plain,
    trajectory_plain,
)
from assay.core.types import Task, Trajectory
from assay.envs.base import Environment
from assay.envs.qa.enforce import mark_unchecked
from assay.pipeline.policy import Given, GivenBackend, Policy
from assay.pipeline.rollout import Rollout, RolloutSite, make_rollout
from assay.pipeline.sync import SyncPipeline
from assay.pipeline.ui import RunView
from assay.rollout.base import RolloutBackend


class _Stopped(Exception):
    """The trainer failed while the rollout thread waited: it ends quietly (the trainer raises)."""


Batch = tuple[int, list[Trajectory], list[Trajectory], int, dict[str, float]]  # version, all, kept, dropped, stats


def batch_plain(batch: Batch) -> dict[str, Any]:
    """A batch as plain data for a checkpoint (which loads with weights_only=True); the kept
    trajectories as indices into all of them, so that they stay the same objects after a resume."""
    version, everything, kept, dropped, stats = batch
    index = {id(t): i for i, t in enumerate(everything)}
    return {"version": version, "everything": [trajectory_plain(t) for t in everything],
            "kept": [index[id(t)] for t in kept], "dropped": dropped, "stats": dict(stats)}


def batch_from_plain(d: dict[str, Any]) -> Batch:
    everything = [trajectory_from_plain(t) for t in d["everything"]]
    return d["version"], everything, [everything[i] for i in d["kept"]], d["dropped"], dict(d["stats"])


class AsyncPipeline(SyncPipeline):
    def __init__(self, cfg: Config, run_dir: Path, resume: bool = False, given: Given | None = None) -> None:
        super().__init__(cfg, run_dir, resume, given)
        self._weights: dict[int, list[tuple[str, Tensor]]] = {}
        self._eval_backend: RolloutBackend | None = None  # made at the first evaluation; closed with the rollout
        self._lock = threading.Condition()  # guards the mixer, the step counters and the ready batches
        # steps whose batch the trainer has trained / the mixer has seen / whose tasks are drawn
        self._trained = self._seen = self._sampled = self.start_step
        # sampled batches not yet trained, by step; a checkpoint holds those sampled ahead of it
        buffer = (self.resumed or {}).get("buffer") or {}
        self._ready: dict[int, Batch] = {int(s): batch_from_plain(b) for s, b in buffer.items()}
        ahead = list(self._ahead(self.start_step))
        if sorted(self._ready) != ahead[:len(self._ready)]:  # a prefix: a finished run resumed for more steps
            self.close_rollout()
            self.close_ranks()
            raise ConfigError(f"the checkpoint of step {self.start_step} holds the batches sampled ahead of it for "
                              f"steps {sorted(self._ready)}, which pipeline.max_staleness "
                              f"{cfg.pipeline.max_staleness} and train.steps {cfg.train.steps} do not continue; "
                              "resume with the run's own max_staleness (or train.steps past those steps)")
        self._sampled = max(self._ready, default=self._sampled)
        self._failed = threading.Event()  # set when either thread fails: the other stops waiting
        self._error: BaseException | None = None  # the rollout thread's, raised by the trainer

    def make_rollout(self) -> Rollout:
        """The `pipeline.workers` kind, with a copy of the weights of its own: the trainer steps its tensors
        while the rollout samples. With `process` the copy lives in a worker process (with `ray`, in Ray
        actors), which also runs the tools and verifiers; this thread then only hands it tasks and weights."""
        return make_rollout(RolloutSite(self.cfg, self.plain, self.tokenizer, self.envs, self.run_dir,
                                        self.make_backend))

    def save(self, step: int) -> Path:
        """The checkpoint also holds the batches sampled ahead of `step` (steps step+1 .. step+k), so a
        resume trains exactly what this run would have. Called after the mixer has seen `step` and
        before the rollout may draw step+k+1, so the mixer's state is the one those batches left."""
        ahead = self._ahead(step)
        self._wait(lambda: all(s in self._ready for s in ahead), self._failed)
        if self._failed.is_set():
            raise _Stopped
        with self._lock:
            buffer = {s: batch_plain(self._ready[s]) for s in ahead}
            return self._save(step, buffer)

    def _ahead(self, step: int) -> range:
        """The steps whose batches are sampled ahead of `step` once it is trained: step+1 .. step+k."""
        return range(step + 1, min(step + self.cfg.pipeline.max_staleness, self.cfg.train.steps) + 1)

    def eval_backend(self) -> RolloutBackend:
        """Evaluations run on the trainer's weights with a backend of their own (the rollout thread's is busy)."""
        model = self.policy_model()  # with LoRA, the adapters folded in as they are now
        if self._eval_backend is None:
            self._eval_backend = self.make_backend(model)
        # the step just trained (published after); a backend with its own copy (vLLM) takes the weights
        self._eval_backend.update_weights(model.named_parameters(), version=self._seen)
        return self._eval_backend

    def close_rollout(self, wait_s: float = 0) -> None:
        """The rollout, and the evaluations' backend (its engine's memory and, with vLLM, its process)."""
        super().close_rollout(wait_s=wait_s)
        if self._eval_backend is not None:
            self._eval_backend.close()
            self._eval_backend = None

    def _wait(self, ready: Callable[[], bool], failed: threading.Event) -> None:
        with self._lock:
            while not ready() and not failed.is_set():
                self._lock.wait(timeout=1.0)

    def refill_tasks(self, n: int, step: int, domains: set[str] | None = None) -> list[Task]:
        k = self.cfg.pipeline.max_staleness
        if k:  # after the mixer has seen step - k: the trainer updates it only once this step is drawn
            self._wait(lambda: self._seen >= step - k, self._failed)
        if self._failed.is_set():
            raise _Stopped
        with self._lock:
            return self.mixer.sample(n, domains)

    def _rollout_loop(self) -> None:
        cfg, k, failed = self.cfg, self.cfg.pipeline.max_staleness, self._failed
        try:
            for step in range(self._sampled + 1, cfg.train.steps + 1):
                version = max(self.start_step, step - 1 - k)
                self._wait(lambda v=version: self._trained >= v, failed)
                if failed.is_set():
                    return
                with self._lock:
                    tasks = self.mixer.sample(cfg.train.groups_per_step)
                    self._sampled = step
                    weights = self._weights.pop(version, None)
                    self._lock.notify_all()
                if weights is not None:
                    self.rollout.update_weights(weights, version=version)
                t0, c0 = time.time(), time.perf_counter()
                everything, kept, dropped = self.collect_batch(step, tasks)
                stats = {f"rollout/{k}": v for k, v in self.rollout.take_stats().items()}
                stats.update(rollout_start_s=t0, rollout_s=time.perf_counter() - c0)
                with self._lock:
                    self._ready[step] = (version, everything, kept, dropped, stats)
                    self._lock.notify_all()
            with self._lock:  # every draw is done, refills of the last step included
                self._sampled = cfg.train.steps + 1
                self._lock.notify_all()
        except _Stopped:
            return
        except BaseException as e:  # handed to the trainer thread, which raises it
            with self._lock:
                self._error = e
                failed.set()
                self._lock.notify_all()

    def _take(self, step: int) -> Batch:
        self._wait(lambda: step in self._ready, self._failed)
        with self._lock:
            if step not in self._ready:
                raise self._error or _Stopped()
            return self._ready.pop(step)

    def run(self, view: RunView | None = None) -> None:
        cfg, k = self.cfg, self.cfg.pipeline.max_staleness
        sampler = threading.Thread(target=self._rollout_loop, name="assay-rollout", daemon=True)
        completed = False
        metrics = None
        try:
            writer = TrajectoryWriter(self.run_dir / "trajectories", self.start_step)
            metrics = self.open_metrics(writer.attempt)
            sampler.start()
            for step in range(self.start_step + 1, cfg.train.steps + 1):
                version, everything, kept, dropped, rollout_stats = self._take(step)
                mark_unchecked(everything, self.unchecked)
                writer.write(everything, step)
                # every draw before the mixer sees this step: up to step + k's, or all (refills included)
                self._wait(lambda s=step: self._sampled >= min(s + k, cfg.train.steps + 1), self._failed)
                with self._lock:
                    stats = self.mixer.update(everything)
                    self._seen = step
                    self._lock.notify_all()
                t0, c0 = time.time(), time.perf_counter()
                train_metrics = self.train_step(kept, step - 1)
                rollout_stats.update(train_start_s=t0, train_s=time.perf_counter() - c0)
                self.monitor(step, everything, stats, metrics, view)
                record = {**train_metrics, "groups_dropped": dropped,
                          "sampled": len(everything), "staleness": step - 1 - version, **stats.metrics(),
                          **rollout_stats}
                self.end_step(step, record, stats, train_metrics, metrics, view)  # may checkpoint: see save
                snapshot = [(n, t.clone()) for n, t in self.trainer.named_weights()]
                with self._lock:
                    self._weights[step] = snapshot
                    self._trained = step
                    self._lock.notify_all()
            completed = True
        except _Stopped:
            if self._error is None:
                raise
            raise self._error from None
        finally:
            with self._lock:
                self._failed.set()  # a failed trainer stops the rollout thread at its next wait
                self._lock.notify_all()
            if metrics is not None:
                metrics.close()
            # after a failure, mid-rollout work is not waited for (on a thread it must be: see ThreadRollout)
            self.close_rollout(wait_s=30 if completed else 0)
            self.close_ranks()
        if sampler.is_alive():
            sampler.join(timeout=60)


def make_pipeline(cfg: Config, run_dir: Path, resume: bool = False, given: Given | None = None) -> SyncPipeline:
    """The pipeline `pipeline.mode` names."""
    return (AsyncPipeline if cfg.pipeline.mode == "async" else SyncPipeline)(cfg, run_dir, resume, given)


def run_training(config: Config | dict[str, Any] | str | Path, overrides: Sequence[str] = (), *,
                 envs: Mapping[str, Environment] | None = None, policy: Policy | None = None,
                 backend: GivenBackend | None = None) -> Path:
    """`assay train` from Python: a Config, a dict in the config's shape or a YAML path (plus
    key=value overrides); RL runs to the end in RUN_DIR/NAME, which is returned. Objects may stand in
    for names: `envs` maps domain names to environment objects, `policy` is a (model, tokenizer) pair to
    start from, `backend(model, tokenizer)` makes the rollout backend (see `pipeline.policy.Given`)."""
    if isinstance(config, Config):
        cfg = build_config(config.model_dump(mode="json"), list(overrides))
    elif isinstance(config, dict):
        cfg = build_config(config, list(overrides))
    else:
        cfg = load_config(config, list(overrides))
    run_dir = prepare_run_dir(cfg.run_dir, cfg.name, existing="refuse")
    try:
        make_pipeline(cfg, run_dir, given=Given(envs or {}, policy, backend)).run()
    finally:
        release_run_dir(run_dir)
    return run_dir
