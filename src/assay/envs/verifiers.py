"""Verification in processes of its own (`rollout.verifier_processes`).

The rollout hands a finished episode's task and messages to a verifier process, which verifies them on
a fresh episode of the same environment (with its own warm sandboxes) and answers with the reward. The
rollout's interpreter then only waits; a verifier past its time is killed, which a thread cannot be;
and one that dies is replaced and its request issued again (a verdict is a function of the task and
the messages). Only episodes whose verdict can read nothing but the task and the messages go there
(`verifies_anywhere`); the others verify in the rollout, as before."""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any, Protocol

from assay.core.errors import AssayError
from assay.core.types import Message, Observation, Reward, Task, ToolCall
from assay.envs.base import Environment, Episode, hooks
from assay.envs.episode import close_episode, start_episode

READY_WAIT_S = 120.0  # a verifier process's start-up: imports and its environments unpickled


class VerifierPool(Protocol):
    """Where episodes are verified away from the rollout: `VerifierProcesses`, or Ray's verifier actors."""

    def verify(self, task: Task, messages: list[Message], timeout_s: float | None = None) -> Reward: ...


def verifies_anywhere(env: Environment) -> bool:
    """Whether a fresh episode verifies the messages as the acting one would: `stateless_verify` where the
    environment declares it, else whether it has no tools (then no call ever reaches `episode.step`,
    which validation refuses first, so the acting episode is still as `start` made it)."""
    declared = hooks(env).stateless_verify
    return bool(not env.tools if declared is None else declared)


class VerifiedElsewhere:
    """The acting side of a tool-less episode that a verifier process verifies: nothing can step it
    (validation refuses every call first), so nothing is started here and no sandbox is leased; the
    verifier starts the episode it verifies."""

    def step(self, call: ToolCall) -> Observation:
        raise AssayError("a tool-less episode has no tools to step")

    def verify(self, final: list[Message]) -> Reward:
        raise AssayError("this episode is verified in a verifier process")


def acting_episode(env: Environment, task: Task, pool: VerifierPool | None) -> Episode:
    """The episode the rollout acts on: the environment's own, except for a tool-less one whose
    verification goes to `pool`, which needs none here."""
    return VerifiedElsewhere() if pool is not None and not env.tools else start_episode(env, task)


def verify_fresh(envs: dict[str, Environment], task: Task, messages: list[Message]) -> Reward:
    """What a verifier does with a request: a fresh episode of the task's domain verifies the messages."""
    episode = start_episode(envs[task.domain], task)
    try:
        return episode.verify(messages)
    finally:
        close_episode(episode)


def _serve(conn: Any, envs: dict[str, Environment]) -> None:
    """A verifier process: answer (task, messages) with ("ok", Reward) or ("error", text) until None
    arrives or the process that started it is gone (nobody would read the answer)."""
    parent = os.getppid()
    conn.send(("ready", None))
    while os.getppid() == parent:
        if not conn.poll(1.0):
            continue
        msg = conn.recv()
        if msg is None:
            return
        try:
            conn.send(("ok", verify_fresh(envs, *msg)))
        except Exception as e:  # the environment's failure, reported where the episode is recorded
            conn.send(("error", f"{type(e).__name__}: {e}"))


@dataclass(eq=False)  # one process each: compared by identity
class _Verifier:
    process: Any
    conn: Any


class VerifierProcesses:
    """`n` spawned verifier processes holding the run's environments. `verify` is thread-safe: each call
    takes an idle process (waiting for one when all are busy) and gives it back after. A process that
    dies mid-request is replaced and the request issued again, once (a request that kills its second
    process too is an error of that request alone); one past `timeout_s` is killed and replaced, and
    the call raises TimeoutError (the episode gets an infrastructure status, not a reward). The pool
    keeps its `n` processes throughout; `replaced` counts the replacements."""

    def __init__(self, envs: dict[str, Environment], n: int) -> None:
        if n < 1:
            raise AssayError(f"rollout.verifier_processes: a pool needs at least one process, got {n} "
                             "(0 verifies on the rollout's own threads)")
        # spawn: fork would copy the rollout's thread pools mid-use. The child imports only this module's
        # package and the environments' modules (no torch): a verifier starts in well under a second
        self.ctx = mp.get_context("spawn")
        self.envs, self.n = envs, n
        self.replaced = 0
        self.idle: queue.Queue[_Verifier] = queue.Queue()
        self.all: list[_Verifier] = []
        self.lock = threading.Lock()
        self.closed = False
        for _ in range(n):  # started together; each start is waited on below
            self._add(self._spawn())
        for v in list(self.all):
            self._ready(v)

    def _spawn(self) -> _Verifier:
        ours, theirs = self.ctx.Pipe()
        process = self.ctx.Process(target=_serve, args=(theirs, self.envs), daemon=True, name="assay-verifier")
        process.start()
        theirs.close()
        return _Verifier(process, ours)

    def _add(self, v: _Verifier) -> None:
        with self.lock:
            self.all.append(v)

    def _ready(self, v: _Verifier) -> None:
        try:
            started = v.conn.poll(READY_WAIT_S) and v.conn.recv()[0] == "ready"
        except (EOFError, OSError):  # it exited while starting
            started = False
        if not started:
            self.close()
            raise AssayError("rollout.verifier_processes: a verifier process did not start (its environments must "
                             "import and unpickle in a fresh process); set rollout.verifier_processes: 0 to verify "
                             "on the rollout's threads")
        self.idle.put(v)

    def _replace(self, v: _Verifier) -> None:
        """Kill `v` (it may be hung) and put a fresh process in its place."""
        v.process.kill()
        v.process.join()
        v.conn.close()
        with self.lock:
            self.all.remove(v)
            self.replaced += 1
        fresh = self._spawn()
        self._add(fresh)
        self._ready(fresh)

    def _take(self) -> _Verifier:
        while not self.closed:
            try:
                return self.idle.get(timeout=1.0)
            except queue.Empty:
                continue
        raise AssayError("the verifier pool is closed")

    def verify(self, task: Task, messages: list[Message], timeout_s: float | None = None) -> Reward:
        for _ in range(2):  # the request, and once more if its process died under it
            v = self._take()
            try:
                v.conn.send((task, messages))
                answered = v.conn.poll(timeout_s)
                if answered:
                    kind, value = v.conn.recv()
            except (EOFError, OSError):  # it died under the request: a verdict is a function of its inputs
                self._replace(v)
                continue
            if not answered:
                self._replace(v)
                raise TimeoutError(f"a verifier process took longer than {timeout_s:g} s (the domain's "
                                   "verify_timeout_s) and was killed; a verifier that hangs is an infrastructure "
                                   "failure, not a wrong answer")
            self.idle.put(v)
            if kind == "error":
                raise AssayError(f"in a verifier process: {value}")
            return value
        raise AssayError(f"two verifier processes died verifying {task.task_id} (domain {task.domain})")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for v in self.all:
            try:
                v.conn.send(None)
            except OSError:
                pass
        for v in self.all:
            v.process.join(timeout=5)
            if v.process.is_alive():
                v.process.kill()
                v.process.join()
            v.conn.close()


_pools: dict[int, VerifierProcesses] = {}  # by id of the environments' dict, which the pool holds (the id stays unique)
_pools_lock = threading.Lock()


def shared_verifiers(envs: dict[str, Environment], n: int) -> VerifierProcesses | None:
    """This process's verifier pool for these environments (None when `n` is 0, or when no environment's
    episodes verify anywhere), started on first use and closed at exit: a rollout's steps share it."""
    if n == 0 or not any(verifies_anywhere(e) for e in envs.values()):
        return None
    with _pools_lock:
        pool = _pools.get(id(envs))
        if pool is None or pool.closed or pool.n != n:
            if pool is not None:
                pool.close()
            pool = _pools[id(envs)] = VerifierProcesses(envs, n)
        return pool


def close_shared_verifiers(envs: dict[str, Environment] | None = None) -> None:
    """Close the pool for these environments (a run that ends), or every pool (at exit)."""
    with _pools_lock:
        for key in [id(envs)] if envs is not None else list(_pools):
            pool = _pools.pop(key, None)
            if pool is not None:
                pool.close()


atexit.register(close_shared_verifiers)
