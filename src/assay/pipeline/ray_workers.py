"""Rollout workers as Ray actors: the same rollout as the worker process, placed by Ray on this
machine or across a cluster, a step's tasks split over `pipeline.ray.rollout_workers` actors.

Weights go into Ray's object store once per version and every actor reads them from there. Each actor
gets a contiguous part of the step's tasks (with distinct group ids and random streams: `first`), and
the parts come back in order. Each actor sits in a bundle of a Ray placement group (its CPUs and
GPUs, laid out by `pipeline.ray.placement`): one group for the actors the run starts with, one more
for each batch added by a scale-up. An actor that dies (its process killed, its node lost) or runs a
part past `pipeline.worker_timeout_s` is replaced by a new actor in the same bundle, started from the
last weights, and the part it held is issued again, up to `pipeline.worker_restarts` times over the
run; when the cluster cannot place the replacement (its node gone, no room elsewhere) within
`RESIZE_WAIT_S` the run goes on with one actor fewer. With one actor a run samples exactly what the
worker process samples. The number of actors can change while the run goes on (`assay scale
runs/NAME N`, read before each rollout). With `pipeline.ray.verifier_workers` the rollout actors send the
episodes that verify anywhere to verifier actors of their own (ray_verifiers.py)."""

from __future__ import annotations

import copy
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from torch import Tensor

from assay.core.config import Config
from assay.core.errors import AssayError
from assay.core.types import Task, Trajectory
from assay.envs.base import Environment
from assay.pipeline.ray_verifiers import RayVerifiers
from assay.pipeline.worker import POLL_S, add_counts, copies, rollout_tasks, take_counts

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


# Ray's session directory holds Unix sockets, whose paths the kernel caps at 107 bytes: the temp dir,
# then /session_2026-12-02_02-01-18_255973_4194304/sockets/plasma_store (64 bytes with a 7-digit pid)
MAX_TEMP_DIR = 40
SCALE_FILE = "rollout_workers"  # in the run directory: the number of rollout actors wanted now
VERIFIER_SCALE_FILE = "verifier_workers"  # and of verifier actors (0: the rollout actors verify)
RESIZE_WAIT_S = 120.0  # a placement group, or an actor added or replaced mid-run, not placed by then is refused


def placement_wait(cfg: Config) -> float:
    """`pipeline.ray.placement_wait_s`, else RESIZE_WAIT_S: on an autoscaling cluster a placement group
    Ray cannot place yet is the autoscaler's demand for nodes, so the wait must cover their start-up."""
    return cfg.pipeline.ray.placement_wait_s or RESIZE_WAIT_S

log = logging.getLogger(__name__)

Slot = tuple["PlacementGroup", int]  # an actor's bundle: its placement group and the bundle's index there
# a part of a step in flight: its result, when its actor began it, the actor
Pending = tuple["ObjectRef[tuple[list[Trajectory], dict[str, float]]]", float, "ActorHandle"]


class _Unplaced(AssayError):
    """The cluster did not place an actor (or its bundle) within the wait."""


class _Died(AssayError):
    """An actor died before it served, not by its own error: its process or its node went away."""


def request_scale(run_dir: Path, n: int, verifiers: bool = False) -> None:
    """Ask a running run to use `n` rollout actors (with `verifiers`: verifier actors) from its next rollout on."""
    from assay.core.atomic import atomic_write

    if n < (0 if verifiers else 1):
        raise AssayError(f"assay scale: need at least one rollout worker, got {n}" if not verifiers else
                         f"assay scale: a number of verifier workers is 0 or more, got {n}")
    if not (run_dir / "config.yaml").is_file():
        raise AssayError(f"{run_dir} is not a run directory (no config.yaml); pass runs/NAME of a running run")
    from assay.core.config import load_config

    workers = load_config(run_dir / "config.yaml", []).pipeline.workers
    if workers != "ray":
        raise AssayError(f"{run_dir} runs its rollout with pipeline.workers: {workers}; only a run with "
                         "pipeline.workers: ray can change its number of rollout workers")
    atomic_write(run_dir / (VERIFIER_SCALE_FILE if verifiers else SCALE_FILE), f"{n}\n")


class _RolloutActor:
    """One rollout worker inside a Ray actor: a copy of the policy, the environments and a backend."""

    def __init__(self, cfg: Config, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 envs: dict[str, Environment], weights: list[tuple[str, Tensor]], version: int) -> None:
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

    def rollout(self, tasks: list[Task], step: int, attempt: int, first: int,
                verifiers: RayVerifiers | None) -> tuple[list[Trajectory], dict[str, float]]:
        """`verifiers`: the verifier actors as the driver has them now (they can change between rollouts)."""
        trajs = rollout_tasks(self.cfg, self.backend, self.tokenizer, self.envs, tasks, step, attempt, first,
                              verifiers.falling_back_to(self.envs) if verifiers else None)
        return trajs, self.backend.take_stats()


def require_token_auth() -> None:
    """Ray's gRPC servers (GCS, raylet, every worker) listen on all interfaces whatever the node IP, so a
    local cluster is reachable from the network, and whoever reaches it can run code as this user: keep
    Ray's token authentication on, with a fresh 256-bit token for this process (in its environment,
    which Ray's processes inherit; nothing written to ~/.ray) unless the user configured one."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if os.environ["RAY_AUTH_MODE"].lower() == "token" and not (
            os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")  # Ray reads both once per process, as its own default-on path refreshes them
    AuthenticationTokenLoader.instance().reset_cache()


def start_ray(cfg: Config, run_dir: Path) -> tuple[bool, Path | None]:
    """Join `pipeline.ray.address`, or start a local cluster whose files live under the run directory
    (or, when that path is too long for Ray's sockets, a temporary directory), with no dashboard.
    Returns whether it started Ray (False when the caller had, and then shuts it down) and the
    temporary directory to remove after shutdown, if one was made."""
    import ray

    if ray.is_initialized():
        return False, None
    r = cfg.pipeline.ray
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # Ray would otherwise report usage over the network
    if r.address:  # the cluster's own authentication applies (RAY_AUTH_MODE, its token)
        ray.init(address=r.address, log_to_driver=False, configure_logging=False)
        return True, None
    require_token_auth()
    temp, made = run_dir.resolve() / "ray", None
    if len(str(temp)) > MAX_TEMP_DIR:
        temp = made = Path(tempfile.mkdtemp(prefix="assay-ray-"))
    temp.mkdir(parents=True, exist_ok=True)
    ray.init(num_cpus=r.num_cpus, include_dashboard=False, _temp_dir=str(temp), log_to_driver=False,
             configure_logging=False)
    return True, made


def stop_ray(started: bool, temp: Path | None) -> None:
    """Undo `start_ray`: shut Ray down if it was started here, and remove its temporary directory."""
    if started:
        import ray

        ray.shutdown()
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


class RayRollout:
    """The trainer's handle on the rollout actors, with the worker process's interface."""

    def __init__(self, cfg: Config, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 envs: dict[str, Environment], run_dir: Path) -> None:
        try:
            import ray
        except ImportError:
            raise AssayError("pipeline.workers: ray needs Ray: pip install -e '.[ray]'") from None
        for name in (SCALE_FILE, VERIFIER_SCALE_FILE):  # a width asked of an earlier attempt is not this one's
            (run_dir / name).unlink(missing_ok=True)
        self.started, self.temp = start_ray(cfg, run_dir)
        self.ray, self.cfg, self.run_dir = ray, cfg, run_dir
        self.wait_s = placement_wait(cfg)
        self.actors: list[ActorHandle] = []
        self.slots: list[Slot] = []  # each actor's bundle: (placement group, index)
        self.vacant: list[Slot] = []  # bundles reserved in a group that holds no actor now
        self.groups: list[PlacementGroup] = []  # the placement groups made, each removed once none of its bundles holds an actor
        self.refused: dict[str, tuple[str, int]] = {}  # scale file -> its (text, mtime) whose width could not be placed
        self.closed = False
        self.updates: list[tuple[ObjectRef[None], int, ActorHandle]] = []  # weight loads not yet checked: (result, version, actor)
        self.verifiers: RayVerifiers | None = None
        r = cfg.pipeline.ray
        self.restarts, self.timeout_s = cfg.pipeline.worker_restarts, cfg.pipeline.worker_timeout_s
        self.version = 0
        self.totals: Counter[str] = Counter()
        self.bundle = {**{k: v for k, v in (("CPU", r.rollout_cpus), ("GPU", r.rollout_gpus)) if v},
                       **r.rollout_resources}
        self.strategy = r.placement.upper()  # Ray's PACK, SPREAD, STRICT_PACK, STRICT_SPREAD
        try:
            self.actor_class = ray.remote(num_cpus=r.rollout_cpus, num_gpus=r.rollout_gpus,
                                          resources=r.rollout_resources or None)(_RolloutActor)
            self.refs = (ray.put(copy.deepcopy(model)), ray.put(tokenizer), ray.put(envs))
            self.weights = ray.put(copies(model.state_dict().items()))  # what a replacement starts from
            self.verifiers = RayVerifiers(envs, r.verifier_cpus, r.verifier_resources, cfg.pipeline.worker_restarts)
            self.verifiers.resize(r.verifier_workers)
            self.slots = self._reserve(r.rollout_workers)
            self.actors = [self._new_actor(slot) for slot in self.slots]
            self._started(self.actors)
            self._placed()
        except BaseException:
            self.close()
            raise

    def _reserve(self, n: int) -> list[Slot]:
        """Bundles for `n` new actors: those reserved and vacant first, then a new placement group of the
        rest (one bundle per actor, `pipeline.ray.placement`), placed within the placement wait or refused."""
        from ray.util.placement_group import placement_group, remove_placement_group

        taken, self.vacant = self.vacant[:n], self.vacant[n:]
        if len(taken) == n:
            return taken
        group = placement_group([dict(self.bundle) for _ in range(n - len(taken))], strategy=self.strategy)
        if not group.wait(self.wait_s):
            remove_placement_group(group)
            self.vacant = taken + self.vacant
            raise _Unplaced(f"the cluster cannot place a placement group of {n - len(taken)} bundles of "
                            f"{self.bundle} ({self.strategy}) within {self.wait_s:.0f} s: free resources, or ask "
                            "for fewer (pipeline.ray.rollout_workers, rollout_cpus, rollout_gpus) or a looser "
                            "pipeline.ray.placement")
        self.groups.append(group)
        return taken + [(group, i) for i in range(n - len(taken))]

    def _release(self, slots: list[Slot]) -> None:
        """Bundles whose actors are gone stay reserved for the next scale-up; a group none of whose
        bundles holds an actor any more is removed (its resources go back to the cluster)."""
        from ray.util.placement_group import remove_placement_group

        self.vacant += slots
        for group in [g for g in self.groups if not any(g is s[0] for s in self.slots)]:
            remove_placement_group(group)
            self.groups.remove(group)
            self.vacant = [s for s in self.vacant if s[0] is not group]

    def _placed(self) -> None:
        """Log where the actors are: their bundles, groups and nodes (`rollout/placement_*`)."""
        from ray.util.placement_group import placement_group_table

        tables = {id(g): placement_group_table(g) for g in self.groups}
        nodes = {tables[id(g)].get("bundles_to_node_id", {}).get(i) for g, i in self.slots} - {None, ""}
        self.totals["placement_bundles"] = len(self.slots) + len(self.vacant)
        self.totals["placement_nodes"] = len(nodes)
        log.info("rollout placement: %d actors in bundles of %s (%s; %d groups, %d bundles vacant) on %d nodes",
                 len(self.actors), self.bundle, self.strategy, len(self.groups), len(self.vacant), len(nodes))

    def _new_actor(self, slot: Slot) -> ActorHandle:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        model, tokenizer, envs = self.refs
        group, index = slot
        where = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
        return self.actor_class.options(scheduling_strategy=where).remote(self.cfg, model, tokenizer, envs,
                                                                          self.weights, self.version)

    def _started(self, actors: list[ActorHandle], timeout_s: float | None = None) -> None:
        """Wait until the actors serve; one that could not start is an error now, not a death later."""
        try:
            self.ray.get([a.pid.remote() for a in actors], timeout=timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise _Unplaced(f"rollout workers (Ray actors) did not start within {timeout_s:.0f} s: the cluster "
                            "cannot place them (pipeline.ray.rollout_cpus, rollout_gpus)") from None
        except self.ray.exceptions.RayActorError as e:
            if not e.actor_init_failed:
                raise _Died(f"a rollout worker (Ray actor) died before it served: {e}") from None
            raise AssayError(f"a rollout worker (Ray actor) could not start: {e}\ndefine the environments in an "
                             "importable module, or set pipeline.workers: process") from None
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
        self.updates += [(actor.update_weights.remote(ref, version), version, actor) for actor in self.actors]

    def _check_updates(self) -> None:
        """A weight load that failed in an actor is an error; one whose actor died is left to the rollout,
        which replaces the actor (from the last weights) when its part fails. An actor whose load has not
        ended within `pipeline.worker_timeout_s` is hung (stopped, or on a node that went silent): it is
        killed, and its part fails the same way."""
        if self.timeout_s and self.updates:
            _, late = self.ray.wait([ref for ref, _, _ in self.updates], num_returns=len(self.updates),
                                    timeout=self.timeout_s)
            for ref, _, actor in self.updates:
                if ref in late:
                    self.ray.kill(actor, no_restart=True)
        for ref, version, _ in self.updates:
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
            slots = self._reserve(n - len(self.actors))
            added = [self._new_actor(slot) for slot in slots]
            try:
                self._started(added, timeout_s=self.wait_s)
            except AssayError:
                for actor in added:
                    self.ray.kill(actor, no_restart=True)
                self._release(slots)
                raise
            self.actors += added
            self.slots += slots
        for actor in self.actors[n:]:
            self.ray.kill(actor, no_restart=True)
        stopped = self.slots[n:]
        del self.actors[n:], self.slots[n:]
        self._release(stopped)
        self._placed()

    def _follow_scale_file(self) -> None:
        """`assay scale` writes the widths the run should have, read before each rollout: its verifier
        actors (`--verifier-workers`, 0 hands verification back to the rollout actors) and its rollout
        actors (`--rollout-workers`)."""
        if self.verifiers is not None:
            v = self.verifiers
            self._follow(VERIFIER_SCALE_FILE, 0, lambda: len(v.actors), v.resize, "verifier workers",
                         "verifier_resize_refused", "verifiers_resized_to")
        self._follow(SCALE_FILE, 1, lambda: len(self.actors), self.resize, "rollout workers", "resize_refused",
                     "resized_to")

    def _follow(self, name: str, least: int, width: Callable[[], int], resize: Callable[[int], None], what: str,
                refused_key: str, resized_key: str) -> None:
        """Resize to the width in runs/NAME/`name` when it differs from `width()`. A file being written, or
        nonsense, leaves the width as it is (assay scale checks what it writes); a width the cluster cannot
        place is refused and not tried again until the file is rewritten, and the run goes on."""
        path = self.run_dir / name
        try:
            asked = (text := path.read_text().strip()), path.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if not text.isdigit() or int(text) < least or int(text) == width() or asked == self.refused.get(name):
            return
        try:
            resize(int(text))
        except AssayError as e:  # more than the cluster can place
            self.totals[refused_key] = int(text)
            self.refused[name] = asked
            log.warning("%s: %d refused (%s); the run goes on with %d", what, int(text), e, width())
        self.totals[resized_key] = width()

    def rollout(self, tasks: Sequence[Task], step: int, attempt: int) -> list[Trajectory]:
        if self.verifiers and (lost := self.verifiers.prune()):
            self.totals["verifiers_lost"] += lost
            log.warning("%d verifier worker(s) lost (not answering; their node gone?); the run goes on with %d",
                        lost, len(self.verifiers.actors))
        self._follow_scale_file()
        self._check_updates()
        n = len(self.actors)
        bounds = [len(tasks) * i // n for i in range(n + 1)]
        parts = {i: (bounds[i], list(tasks[bounds[i]:bounds[i + 1]])) for i in range(n) if bounds[i + 1] > bounds[i]}
        # part i -> (its result, when its actor began it, the actor); a part's result does not depend on
        # which actor samples it (its seed and group ids come from `first`), so any actor may take it over
        pending = {i: self._issue(self.actors[i], part, step, attempt) for i, part in parts.items()}
        done: dict[int, list[Trajectory]] = {}
        while pending:
            if self.closed:
                raise AssayError("the rollout workers were closed while a rollout waited for them")
            ready, _ = self.ray.wait([ref for ref, _, _ in pending.values()], num_returns=1, timeout=POLL_S)
            for i in list(pending):
                ref, asked, actor = pending[i]  # read afresh: a part done before may have restarted this one's clock
                if ref in ready:
                    try:
                        trajs, stats = self.ray.get(ref)
                    except self.ray.exceptions.RayActorError:  # died: a new actor (or another one) takes its part
                        pending[i] = self._issue(self._successor(actor, pending), parts[i], step, attempt)
                        continue
                    except self.ray.exceptions.RayTaskError as e:
                        raise AssayError(f"rollout worker {i} failed:\n{e}") from None
                    add_counts(self.totals, stats)
                    done[i] = trajs
                    del pending[i]
                    for j, (other, _, by) in pending.items():  # a part queued behind this one begins now
                        if by is actor:
                            pending[j] = (other, time.monotonic(), by)
                elif self.timeout_s and time.monotonic() - asked > self.timeout_s:
                    self.ray.kill(actor, no_restart=True)  # hung: its results raise RayActorError
                    for j, (other, _, by) in pending.items():
                        if by is actor:
                            pending[j] = (other, float("inf"), by)
        return [t for i in sorted(done) for t in done[i]]

    def _issue(self, actor: ActorHandle, part: tuple[int, list[Task]], step: int, attempt: int) -> Pending:
        first, tasks = part
        return actor.rollout.remote(tasks, step, attempt, first, self.verifiers), time.monotonic(), actor

    def _successor(self, dead: ActorHandle, pending: dict[int, Pending]) -> ActorHandle:
        """The actor to take over a part of `dead`: its replacement, or, when the cluster could not place
        one (or another part of `dead` already had it replaced), the actor with the fewest parts."""
        if any(a is dead for a in self.actors):
            new = self._replace(dead)
            if new is not None:
                return new
        return min(self.actors, key=lambda a: sum(by is a for _, _, by in pending.values()))

    def _replace(self, dead: ActorHandle) -> ActorHandle | None:
        """A new actor in the dead one's bundle, or None when the cluster cannot place it within
        the placement wait (its node lost, no room on another): the run then goes on with one actor fewer."""
        i = next(j for j, a in enumerate(self.actors) if a is dead)
        if self.closed:
            raise AssayError("the rollout workers were closed while a rollout waited for them")
        if self.restarts <= 0:
            raise AssayError(f"rollout worker {i} (a Ray actor) died and pipeline.worker_restarts allows no more "
                             "replacements; `assay train --resume runs/NAME` continues from the last checkpoint")
        self.restarts -= 1
        self.totals["worker_restarts"] += 1
        self.ray.kill(dead, no_restart=True)  # one merely unreachable must not linger
        if not self._start_in(i, time.monotonic() + self.wait_s):
            lost = self.slots[i]
            del self.actors[i], self.slots[i]
            if not self.actors:
                raise AssayError(f"rollout worker {i} (a Ray actor) died and the cluster cannot place a replacement "
                                 f"within {self.wait_s:.0f} s (its node lost?), and no other worker is left; "
                                 "`assay train --resume runs/NAME` continues from the last checkpoint")
            self._release([lost])  # its bundle waits for a node; a scale-up reuses it
            self.totals["workers_lost"] += 1
            self.totals["resized_to"] = len(self.actors)
            log.warning("rollout worker %d died and the cluster cannot place a replacement within %.0f s; the run "
                        "goes on with %d", i, self.wait_s, len(self.actors))
            self._placed()
            return None
        self._placed()
        return self.actors[i]

    def _start_in(self, i: int, deadline: float) -> bool:
        """Start actor i anew in its bundle by `deadline`; False (and no actor) when it was not placed. A
        replacement that dies before it serves (a lost node that Ray had not marked dead yet took it
        along) is started again."""
        while True:
            self.actors[i] = self._new_actor(self.slots[i])
            try:
                self._started([self.actors[i]], timeout_s=max(deadline - time.monotonic(), POLL_S))
                return True
            except (_Unplaced, _Died) as e:
                self.ray.kill(self.actors[i], no_restart=True)
                if isinstance(e, _Unplaced) or time.monotonic() + POLL_S >= deadline:
                    return False
                log.info("rollout worker %d's replacement died before it served (its node lost?); starting another", i)
                time.sleep(POLL_S)

    def pids(self) -> list[int]:
        return self.ray.get([a.pid.remote() for a in self.actors])

    def take_stats(self) -> dict[str, float]:
        t, self.totals = take_counts(self.totals), Counter()
        return t

    def close(self, wait_s: float = 30) -> None:
        self.closed = True
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        if self.verifiers is not None:
            self.verifiers.close()
            self.verifiers = None
        if self.groups:
            from ray.util.placement_group import remove_placement_group

            for group in self.groups:
                remove_placement_group(group)
            self.groups = []
        stop_ray(self.started, self.temp)
