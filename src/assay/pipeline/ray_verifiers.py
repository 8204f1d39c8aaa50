"""The verifier pool as Ray actors of their own (`pipeline.ray.verifier_workers`), beside the rollout actors.

Each actor holds the run's environments and verifies a fresh episode of a task on the messages it is
sent (`envs.verifiers.verify_fresh`), with its own warm sandboxes, wherever the cluster places it
(`pipeline.ray.verifier_cpus` each). The rollout actors send there the episodes whose verdict reads only
the task and the messages (`verifies_anywhere`); the others verify where they were acted. Ray restarts
an actor that dies; a call it held is issued again (a verdict is a function of its inputs), to another
actor, or in the rollout actor itself, when it is not running again within RESTART_WAIT_S (its node
lost); between rollouts the driver drops actors that do not answer. A call past the domain's
`verify_timeout_s` has its actor killed, and restarted, and raises TimeoutError."""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Any

from assay.core.errors import AssayError
from assay.core.types import Message, Reward, Task
from assay.envs.base import Environment
from assay.envs.verifiers import verify_fresh

RESTART_WAIT_S = 30.0  # for Ray to start a dead verifier actor again; past it the actor counts as lost
START_WAIT_S = 120.0  # for verifier actors to start: placed, imported, environments unpickled
PING_S = 5.0  # a verifier actor that does not answer the driver within this, between rollouts, is dropped


class _VerifierActor:
    def __init__(self, envs: dict[str, Environment]) -> None:
        self.envs = envs
        self.calls = 0

    def served(self) -> int:
        """Verifications answered since this actor (re)started."""
        return self.calls

    def pid(self) -> int:
        return os.getpid()

    def verify(self, task: Task, messages: list[Message]) -> Reward:
        self.calls += 1
        return verify_fresh(self.envs, task, messages)


class RayVerifiers:
    """Handles on the verifier actors, with `VerifierProcesses`' `verify`. It travels to the rollout actors
    (Ray pickles the handles); each copy spreads its calls over the actors, least busy first."""

    def __init__(self, envs: dict[str, Environment], cpus: float, resources: dict[str, float], restarts: int) -> None:
        """No actors yet: `resize` starts them (the driver's copy; the rollout actors get copies)."""
        import ray

        self.actor_class = ray.remote(num_cpus=cpus, resources=resources or None, max_restarts=-1,
                                      max_task_retries=0)(_VerifierActor)
        self.envs_ref = ray.put(envs)  # held while the pool lives: Ray restarts an actor from it
        self.actors: list[Any] = []
        self.pids: list[int] = []  # a new pid is a restart
        self.restarts = restarts
        self._local()

    def resize(self, n: int) -> None:
        """Start actors up to `n` or stop the last ones; 0 leaves verification to the rollout actors."""
        import ray

        added = [self.actor_class.remote(self.envs_ref) for _ in range(n - len(self.actors))]
        try:
            pids = ray.get([a.pid.remote() for a in added], timeout=START_WAIT_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            for a in added:
                ray.kill(a, no_restart=True)
            raise AssayError(f"verifiers (Ray actors) could not start: {e}\ndefine the environments in an "
                             "importable module, free resources (pipeline.ray.verifier_cpus), or set "
                             "pipeline.ray.verifier_workers: 0") from None
        for a in self.actors[n:]:
            ray.kill(a, no_restart=True)
        self.actors, self.pids = self.actors[:n] + added, self.pids[:n] + pids
        self._local()

    def _local(self) -> None:
        self.busy = [0] * len(self.actors)
        self.lost: set[int] = set()  # actors this copy gave up on (not running again within RESTART_WAIT_S)
        self.replaced = 0
        self.lock = threading.Lock()
        self.order = itertools.count()
        self.fallback: dict[str, Environment] | None = None

    def falling_back_to(self, envs: dict[str, Environment]) -> RayVerifiers:
        """Verify here, with these environments, once no actor of this copy is left (a rollout actor's copy)."""
        self.fallback = envs
        return self

    def prune(self) -> int:
        """Drop the actors that do not answer within PING_S (their node lost and nowhere to start them
        again): the run goes on with the others, or verifies in the rollout actors once none is left.
        The driver calls it before each rollout; returns how many were dropped."""
        import ray

        refs = [a.pid.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PING_S)
        kept: list[tuple[Any, int]] = []
        for actor, ref in zip(self.actors, refs, strict=True):
            try:
                if ref in ready:
                    kept.append((actor, ray.get(ref)))
                    continue
            except ray.exceptions.RayError:
                pass
            ray.kill(actor, no_restart=True)
        lost = len(self.actors) - len(kept)
        self.actors, self.pids = [a for a, _ in kept], [p for _, p in kept]
        self._local()
        return lost

    def __getstate__(self) -> dict[str, Any]:  # what a rollout actor's copy needs
        return {"actors": self.actors, "restarts": self.restarts, "pids": self.pids}

    def __bool__(self) -> bool:  # a pool of no actors: the rollout actor verifies itself
        return bool(self.actors)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local()

    def verify(self, task: Task, messages: list[Message], timeout_s: float | None = None) -> Reward:
        import ray

        while True:
            with self.lock:  # the least busy actor still running, ties taken in turn
                n, turn = len(self.actors), next(self.order)
                live = [k for k in range(n) if k not in self.lost]
                if live:
                    i = min(live, key=lambda k: (self.busy[k], (k - turn) % n))
                    self.busy[i] += 1
            if not live:
                if self.fallback is None:
                    raise AssayError(f"no verifier (Ray actor) is running to verify {task.task_id}")
                return verify_fresh(self.fallback, task, messages)  # the verdict is the same anywhere
            try:
                return ray.get(self.actors[i].verify.remote(task, messages), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                ray.kill(self.actors[i], no_restart=False)  # Ray starts it again; the calls it held fail over
                raise TimeoutError(f"a verifier (Ray actor) took longer than {timeout_s:g} s (the domain's "
                                   "verify_timeout_s) and was killed; a verifier that hangs is an infrastructure "
                                   "failure, not a wrong answer") from None
            except ray.exceptions.RayActorError:  # died under the call: Ray restarts it, the call goes again
                self._restarted(i, task)
            except ray.exceptions.RayTaskError as e:
                raise AssayError(f"in a verifier (Ray actor): {type(e.cause).__name__}: {e.cause}") from None
            finally:
                with self.lock:
                    self.busy[i] -= 1

    def _restarted(self, i: int, task: Task) -> None:
        """Wait until Ray has started actor `i` again; each new process counts once against `restarts`,
        however many calls its death failed."""
        import ray

        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            try:
                pid = ray.get(self.actors[i].pid.remote(), timeout=max(deadline - time.monotonic(), 0.1))
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # still restarting
                if time.monotonic() >= deadline:  # nowhere to run (its node lost): the call goes elsewhere
                    with self.lock:
                        self.lost.add(i)
                    return
                time.sleep(0.2)
        with self.lock:
            if pid != self.pids[i]:
                self.pids[i] = pid
                self.replaced += 1
            if self.replaced > self.restarts:
                raise AssayError(f"verifiers (Ray actors) were restarted {self.replaced} times "
                                 "(pipeline.worker_restarts); the last had died verifying "
                                 f"{task.task_id} (domain {task.domain})")

    def close(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
