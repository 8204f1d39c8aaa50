"""Rollout workers as Ray actors: the same rollout as the worker process, placed by Ray on this
machine or across a cluster, a step's tasks split over `pipeline.ray.rollout_workers` actors.

Weights go into Ray's object store once per version and every actor reads them from there. Each actor
gets a contiguous part of the step's tasks (with distinct group ids and random streams: `first`), and
the parts come back in order. An actor that dies (its process killed, its node lost) or runs a part
past `pipeline.worker_timeout_s` is replaced by a new actor started from the last weights, and the
part it held is issued again, up to `pipeline.worker_restarts` times over the run. With one actor a
run samples exactly what the worker process samples. The number of actors can change while the run
goes on (`assay scale runs/NAME N`, read before each rollout)."""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from assay.core.config import Config
from assay.core.errors import AssayError
from assay.core.types import Task, Trajectory
from assay.envs.base import Environment
from assay.pipeline.worker import POLL_S, add_counts, copies, rollout_tasks, take_counts

# Ray's session directory holds Unix sockets, whose paths the kernel caps at 107 bytes
MAX_TEMP_DIR = 60
SCALE_FILE = "rollout_workers"  # in the run directory: the number of rollout actors wanted now
RESIZE_WAIT_S = 120.0  # actors added mid-run that have not started by then cannot be placed


def request_scale(run_dir: Path, n: int) -> None:
    """Ask a running run to use `n` rollout actors from its next rollout on."""
    from assay.core.atomic import atomic_write

    if n < 1:
        raise AssayError(f"assay scale: need at least one rollout worker, got {n}")
    if not (run_dir / "config.yaml").is_file():
        raise AssayError(f"{run_dir} is not a run directory (no config.yaml); pass runs/NAME of a running run")
    from assay.core.config import load_config

    workers = load_config(run_dir / "config.yaml", []).pipeline.workers
    if workers != "ray":
        raise AssayError(f"{run_dir} runs its rollout with pipeline.workers: {workers}; only a run with "
                         "pipeline.workers: ray can change its number of rollout workers")
    atomic_write(run_dir / SCALE_FILE, f"{n}\n")


class _RolloutActor:
    """One rollout worker inside a Ray actor: a copy of the policy, the environments and a backend."""

    def __init__(self, cfg: Config, model: Any, tokenizer: Any, envs: dict[str, Environment],
                 weights: list[tuple[str, Tensor]], version: int) -> None:
        from assay.core.modeling import set_threads
        from assay.rollout.factory import make_backend
        from assay.rollout.weights import copy_weights

        set_threads(cfg.threads)
        model = copy.deepcopy(model).eval().requires_grad_(False)  # its own, writable tensors
        copy_weights(model, weights)
        self.cfg, self.tokenizer, self.envs = cfg, tokenizer, envs
        self.backend = make_backend(cfg.rollout, model, tokenizer)
        self.backend.update_weights([], version=version)

    def pid(self) -> int:
        return os.getpid()

    def update_weights(self, weights: list[tuple[str, Tensor]], version: int) -> None:
        self.backend.update_weights(weights, version=version)

    def rollout(self, tasks: list[Task], step: int, attempt: int, first: int) -> tuple[list[Trajectory], dict]:
        trajs = rollout_tasks(self.cfg, self.backend, self.tokenizer, self.envs, tasks, step, attempt, first)
        take = getattr(self.backend, "take_stats", None)
        return trajs, take() if callable(take) else {}


def start_ray(cfg: Config, run_dir: Path) -> tuple[bool, Path | None]:
    """Join `pipeline.ray.address`, or start a local cluster whose files live under the run directory
    (or, when that path is too long for Ray's sockets, a temporary directory), with no dashboard.
    Returns whether it started Ray (False when the caller had, and then shuts it down) and the
    temporary directory to remove after shutdown, if one was made."""
    import ray

    if ray.is_initialized():
        return False, None
    r = cfg.pipeline.ray
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local cluster for one run, on this machine only
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # Ray would otherwise report usage over the network
    if r.address:
        ray.init(address=r.address, log_to_driver=False, configure_logging=False)
        return True, None
    temp, made = run_dir.resolve() / "ray", None
    if len(str(temp)) > MAX_TEMP_DIR:
        temp = made = Path(tempfile.mkdtemp(prefix="assay-ray-"))
    temp.mkdir(parents=True, exist_ok=True)
    ray.init(num_cpus=r.num_cpus, include_dashboard=False, _temp_dir=str(temp), log_to_driver=False,
             configure_logging=False)
    return True, made


class RayRollout:
    """The trainer's handle on the rollout actors, with the worker process's interface."""

    def __init__(self, cfg: Config, model: Any, tokenizer: Any, envs: dict[str, Environment], run_dir: Path) -> None:
        try:
            import ray
        except ImportError:
            raise AssayError("pipeline.workers: ray needs Ray: pip install -e '.[ray]'") from None
        (run_dir / SCALE_FILE).unlink(missing_ok=True)  # a width asked of an earlier attempt is not this one's
        self.started, self.temp = start_ray(cfg, run_dir)
        self.ray, self.cfg, self.run_dir = ray, cfg, run_dir
        self.actors: list[Any] = []
        self.closed = False
        self.updates: list[tuple[Any, int]] = []  # weight loads not yet checked, with their versions
        r = cfg.pipeline.ray
        self.restarts, self.timeout_s = cfg.pipeline.worker_restarts, cfg.pipeline.worker_timeout_s
        self.version = 0
        self.totals: Counter[str] = Counter()
        try:
            self.actor_class = ray.remote(num_cpus=r.rollout_cpus, num_gpus=r.rollout_gpus)(_RolloutActor)
            self.refs = (ray.put(copy.deepcopy(model)), ray.put(tokenizer), ray.put(envs))
            self.weights = ray.put(copies(model.state_dict().items()))  # what a replacement starts from
            self.actors = [self._new_actor() for _ in range(r.rollout_workers)]
            self._started(self.actors)
        except BaseException:
            self.close()
            raise

    def _new_actor(self) -> Any:
        model, tokenizer, envs = self.refs
        return self.actor_class.remote(self.cfg, model, tokenizer, envs, self.weights, self.version)

    def _started(self, actors: list[Any], timeout_s: float | None = None) -> None:
        """Wait until the actors serve; one that could not start is an error now, not a death later."""
        try:
            self.ray.get([a.pid.remote() for a in actors], timeout=timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise AssayError(f"rollout workers (Ray actors) did not start within {timeout_s:.0f} s: the cluster "
                             "cannot place them (pipeline.ray.rollout_cpus, rollout_gpus)") from None
        except self.ray.exceptions.RayError as e:
            raise AssayError(f"a rollout worker (Ray actor) could not start: {e}\ndefine the environments in an "
                             "importable module, or set pipeline.workers: process") from None

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """One copy into the object store per version; every actor loads it before its next part."""
        named = copies(named_tensors)
        t0 = time.perf_counter()
        ref = self.ray.put(named)
        self.totals["weight_put_s"] += time.perf_counter() - t0
        self.totals["weight_put_gb"] += sum(t.numel() * t.element_size() for _, t in named) / 2**30
        if named:
            self.weights = ref
        self.version = version
        self.updates += [(actor.update_weights.remote(ref, version), version) for actor in self.actors]

    def _check_updates(self) -> None:
        """A weight load that failed in an actor is an error; one whose actor died is left to the rollout,
        which replaces the actor (from the last weights) when its part fails."""
        for ref, version in self.updates:
            try:
                self.ray.get(ref)
            except self.ray.exceptions.RayActorError:
                pass
            except self.ray.exceptions.RayTaskError as e:
                raise AssayError(f"a rollout worker could not load the weights of version {version}:\n{e}") from None
        self.updates = []

    def resize(self, n: int) -> None:
        """Add actors (started from the last weights) or stop the last ones, between two rollouts: the
        run goes on at the new width without restarting the trainer."""
        if n < 1:
            raise AssayError(f"rollout workers: need at least one, got {n}")
        if n > len(self.actors):
            added = [self._new_actor() for _ in range(n - len(self.actors))]
            try:
                self._started(added, timeout_s=RESIZE_WAIT_S)
            except AssayError:
                for actor in added:
                    self.ray.kill(actor, no_restart=True)
                raise
            self.actors += added
        for actor in self.actors[n:]:
            self.ray.kill(actor, no_restart=True)
        del self.actors[n:]

    def _follow_scale_file(self) -> None:
        """`assay scale runs/NAME N` writes the width the run should have; it is read before each rollout."""
        try:
            text = (self.run_dir / SCALE_FILE).read_text().strip()
        except FileNotFoundError:
            return
        if not text.isdigit() or int(text) < 1:
            return  # a file being written, or nonsense: the width stays (assay scale checks what it writes)
        if int(text) != len(self.actors):
            try:
                self.resize(int(text))
            except AssayError:  # more than the cluster can place: the run goes on at the width it has
                self.totals["resize_refused"] = int(text)
            self.totals["resized_to"] = len(self.actors)

    def rollout(self, tasks: Sequence[Task], step: int, attempt: int) -> list[Trajectory]:
        self._follow_scale_file()
        self._check_updates()
        n = len(self.actors)
        bounds = [len(tasks) * i // n for i in range(n + 1)]
        parts = {i: (bounds[i], list(tasks[bounds[i]:bounds[i + 1]])) for i in range(n) if bounds[i + 1] > bounds[i]}
        pending = {i: self._issue(i, part, step, attempt) for i, part in parts.items()}
        done: dict[int, list[Trajectory]] = {}
        while pending:
            if self.closed:
                raise AssayError("the rollout workers were closed while a rollout waited for them")
            ready, _ = self.ray.wait([ref for ref, _ in pending.values()], num_returns=1, timeout=POLL_S)
            for i, (ref, asked) in list(pending.items()):
                if ref in ready:
                    try:
                        trajs, stats = self.ray.get(ref)
                    except self.ray.exceptions.RayActorError:  # died: a new actor takes its part
                        self._replace(i)
                        pending[i] = self._issue(i, parts[i], step, attempt)
                        continue
                    except self.ray.exceptions.RayTaskError as e:
                        raise AssayError(f"rollout worker {i} failed:\n{e}") from None
                    add_counts(self.totals, stats)
                    done[i] = trajs
                    del pending[i]
                elif self.timeout_s and time.monotonic() - asked > self.timeout_s:
                    self.ray.kill(self.actors[i], no_restart=True)  # hung: its result raises RayActorError
                    pending[i] = (ref, float("inf"))
        return [t for i in sorted(done) for t in done[i]]

    def _issue(self, i: int, part: tuple[int, list[Task]], step: int, attempt: int) -> tuple[Any, float]:
        first, tasks = part
        return self.actors[i].rollout.remote(tasks, step, attempt, first), time.monotonic()

    def _replace(self, i: int) -> None:
        if self.closed:
            raise AssayError("the rollout workers were closed while a rollout waited for them")
        if self.restarts <= 0:
            raise AssayError(f"rollout worker {i} (a Ray actor) died and pipeline.worker_restarts allows no more "
                             "replacements; `assay train --resume runs/NAME` continues from the last checkpoint")
        self.restarts -= 1
        self.totals["worker_restarts"] += 1
        self.ray.kill(self.actors[i], no_restart=True)  # one merely unreachable must not linger
        self.actors[i] = self._new_actor()
        self._started([self.actors[i]])

    def pids(self) -> list[int]:
        return self.ray.get([a.pid.remote() for a in self.actors])

    def take_stats(self) -> dict[str, float]:
        t, self.totals = take_counts(self.totals), Counter()
        return t

    def close(self, wait_s: float = 30) -> None:
        self.closed = True
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        if self.started:
            self.ray.shutdown()
            if self.temp:
                shutil.rmtree(self.temp, ignore_errors=True)
