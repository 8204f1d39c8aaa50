"""The rollout worker as a process of its own: generation, tool calls and verification run beside the
trainer instead of sharing its interpreter, so each can have cores of its own.

The worker holds its own copy of the policy, the run's environments and a rollout backend. The
trainer's process talks to it through two queues: weights under a version number (tensors travel
through shared memory), and rollout requests answered with scored trajectories. The worker samples
exactly what the in-process rollout would (same tasks, seeds and thread count), so the pipeline's
schedule, not the placement, decides the run; and because a rollout is a function of its request
and weights, a worker that dies or hangs is replaced and the request issued again (RolloutWorker).
`rollout_tasks` is the one rollout every placement calls: the pipeline's own thread too."""

from __future__ import annotations

import copy
import gc
import os
import queue
import time
import traceback
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch.multiprocessing as mp
from torch import Tensor

from assay.core.config import Config
from assay.core.errors import AssayError
from assay.core.types import Task, Trajectory
from assay.envs.base import Environment
from assay.envs.verifiers import VerifierPool, shared_verifiers
from assay.rollout.base import RolloutBackend, with_prefix_hit_rate

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

    from transformers import PreTrainedModel, PreTrainedTokenizerBase


POLL_S = 0.5  # how often a waiting trainer checks that the worker is still alive

# what the trainer sends a worker: ("weights", named tensors, version) or ("rollout", tasks, step, attempt);
# None stops it. What it answers: ("ready",), ("ok", trajectories, stats) or ("error", traceback)
Request = tuple[Any, ...]
Reply = tuple[Any, ...]


def rollout_tasks(cfg: Config, backend: RolloutBackend, tokenizer: PreTrainedTokenizerBase, envs: dict[str, Environment],
                  tasks: Sequence[Task], step: int, attempt: int, first: int = 0,
                  verifier_pool: VerifierPool | None = None) -> list[Trajectory]:
    """One rollout of a step's tasks (attempt 0, or a refill): the GRPO groups, verified and shaped.
    The pipeline and the workers all call this, so where it runs cannot change what it samples.
    `first`: the position of `tasks` in the step's batch when it is split over several workers.
    `verifier_pool`: verifier actors (none: this process's `rollout.verifier_processes`, if any)."""
    from assay.agent.groups import collect
    from assay.envs.rewards import shape_rewards

    r, domains = cfg.rollout, {d.name: d for d in cfg.domains}
    trajs = collect(backend, tokenizer, envs, domains, tasks, samples=None, temperature=r.temperature, top_p=r.top_p,
                    top_k=r.top_k, policy_version=step - 1, seed=sampling_seed(cfg, step, attempt, first),
                    group_prefix=f"s{step}a{attempt}/", online=cfg.pipeline.online, first=first,
                    verifiers=r.verifiers, verifier_pool=verifier_pool or shared_verifiers(envs, r.verifier_processes))
    shape_rewards(trajs, domains)
    return trajs


def sampling_seed(cfg: Config, step: int, attempt: int, first: int = 0) -> int:
    """The seed of a step's rollout; each part of a step split over workers (`first` > 0) has its own,
    so that no two parts draw the same random numbers."""
    seed = (cfg.seed * 1_000_003 + step * 101 + attempt) % 2**31
    return seed if not first else (seed * 7_919 + first * 104_729) % 2**31


def _serve(requests: Queue[Request | None], results: Queue[Reply], cfg: Config, model: PreTrainedModel,
           tokenizer: PreTrainedTokenizerBase, envs: dict[str, Environment]) -> None:
    """The worker process: answer requests until None arrives. An exception is sent back, not raised,
    so the trainer's process names it."""
    from assay.core.modeling import set_threads
    from assay.rollout.factory import make_backend

    try:
        set_threads(cfg.threads)
        backend = make_backend(cfg.rollout, model, tokenizer)
    except BaseException:
        results.put(("error", traceback.format_exc()))
        return
    results.put(("ready",))
    parent = os.getppid()
    while (msg := _next(requests, parent)) is not None:
        kind, *args = msg
        try:
            if kind == "weights":
                named, version = args
                backend.update_weights(named, version=version)
            else:
                tasks, step, attempt = args
                trajs = rollout_tasks(cfg, backend, tokenizer, envs, tasks, step, attempt)
                results.put(("ok", trajs, backend.take_stats()))
        except BaseException:
            results.put(("error", traceback.format_exc()))
    # The interpreter's teardown would then collect every object of torch and the engine (~0.8 s of the
    # trainer's wait in close()); frozen, they are left for the exit to free. Exit handlers still run.
    gc.freeze()


def _next(requests: Queue[Request | None], parent: int) -> Request | None:
    """The next request, or None once the trainer's process is gone (killed: nobody would read the answer)."""
    while os.getppid() == parent:
        try:
            return requests.get(timeout=1.0)
        except queue.Empty:
            continue
    return None


class RolloutWorker:
    """The trainer's handle on a worker process: `update_weights` and `take_stats` as a backend has
    them, and `rollout` for a step's tasks. Requests are answered in order.

    A worker that dies (killed, out of memory) or takes longer than `timeout_s` over one request is
    replaced, up to `restarts` times: the new process starts from the last weights sent, and the
    request it held is issued again. A rollout is a function of its tasks, seeds and weights, so
    nothing is lost or sampled twice; the replacements are counted as `worker_restarts`. A worker
    that cannot start (its environments do not import in a new process, say) is an error at once."""

    def __init__(self, cfg: Config, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 envs: dict[str, Environment], restarts: int = 0,
                 timeout_s: float | None = None) -> None:
        self.ctx = mp.get_context("spawn")  # fork would copy the trainer's thread pools mid-use
        self.cfg, self.model, self.tokenizer, self.envs = cfg, model, tokenizer, envs
        self.restarts, self.timeout_s = restarts, timeout_s
        # the weights a replacement must start from: the first version's, then the last ones sent
        self.weights: list[tuple[str, Tensor]] = copies(model.state_dict().items())
        self.version = 0
        self.totals: Counter[str] = Counter()
        self.closed = False
        self._spawn()

    def _spawn(self) -> None:
        self.requests, self.results = self.ctx.Queue(), self.ctx.Queue()
        # a copy: sending a tensor moves its storage to shared memory, and the trainer's must stay its own
        # (its values are overwritten by `self.weights` below: the trainer may be stepping them right now)
        own = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.proc = self.ctx.Process(target=_serve, name="assay-rollout-worker", daemon=True,
                                     args=(self.requests, self.results, self.cfg, own, self.tokenizer, self.envs))
        try:
            self.proc.start()
            self._receive(started=False)  # "ready", or the reason it could not start
        except Exception as e:  # pickling, or the worker failed before it could serve
            self.close(wait_s=0)
            raise AssayError(f"the rollout worker process could not start ({type(e).__name__}: {e}); a new "
                             "process imports the environments and the script that started the run, so define "
                             "environments in an importable module and start a run from a script under "
                             "`if __name__ == \"__main__\":`, or set pipeline.workers: thread") from e
        self.requests.put(("weights", self.weights, self.version))

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Queue a weight update; the worker applies it before the next rollout request."""
        named = copies(named_tensors)
        if named:  # none: the weights it has, under a new version
            self.weights = named
        self.version = version
        self.requests.put(("weights", named, version))

    def rollout(self, tasks: Sequence[Task], step: int, attempt: int) -> list[Trajectory]:
        request = ("rollout", list(tasks), step, attempt)
        self.requests.put(request)
        asked = time.monotonic()
        while True:
            try:
                _, trajs, stats = self._receive(started=True, asked=asked)
                break
            except _Died:
                self._replace()
                self.requests.put(request)
                asked = time.monotonic()
        add_counts(self.totals, stats)
        return trajs

    def take_stats(self) -> dict[str, float]:
        """The worker's engine counters summed since the last call, with the prefix hit rate over them."""
        t, self.totals = take_counts(self.totals), Counter()
        return t

    def _receive(self, started: bool, asked: float = 0.0) -> Reply:
        """The worker's next message. Raises _Died when a started worker died or hung past the timeout."""
        while True:
            try:
                msg = self.results.get(timeout=POLL_S)
            except queue.Empty:
                if self.closed:
                    raise AssayError("the rollout worker was closed while a rollout waited for it") from None
                hung = started and self.timeout_s and time.monotonic() - asked > self.timeout_s
                if hung and self.proc.is_alive():
                    self.proc.kill()
                    self.proc.join()
                if self.proc.is_alive():
                    continue
                if not started:
                    raise AssayError(f"it exited with code {self.proc.exitcode} (its error is printed above)") from None
                raise _Died from None
            if msg[0] == "error":
                raise AssayError(f"the rollout worker failed:\n{msg[1]}")
            return msg

    def _replace(self) -> None:
        code = self.proc.exitcode
        if self.restarts <= 0:
            raise AssayError(f"the rollout worker process died (exit code {code}) and pipeline.worker_restarts "
                             "allows no more replacements; `assay train --resume runs/NAME` continues from the "
                             "last checkpoint (`--supervise N` does it by itself)")
        self.restarts -= 1
        self.totals["worker_restarts"] += 1
        self._spawn()

    def close(self, wait_s: float = 30) -> None:
        """Stop the worker: it ends after the request it is on (killed if that takes over `wait_s`)."""
        self.closed = True
        if self.proc.is_alive():
            self.requests.put(None)
            self.proc.join(timeout=wait_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


class _Died(Exception):
    """The worker process is gone (or was killed as hung) while a request waited."""


def add_counts(totals: Counter[str], stats: dict[str, float]) -> None:
    """Add one request's engine counters to a worker's sums (a rate is not summed: take_counts recomputes it)."""
    totals.update({k: v for k, v in stats.items() if k != "prefix_hit_rate"})


def take_counts(totals: Counter[str]) -> dict[str, float]:
    """A worker's summed counters, with the prefix hit rate over them when its backend counts (hf does not)."""
    return with_prefix_hit_rate(totals) if "prompt_tokens" in totals else dict(totals)


def copies(named_tensors: Iterable[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    return [(n, t.detach().clone()) for n, t in named_tensors]
