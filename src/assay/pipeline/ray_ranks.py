"""Data-parallel trainer ranks as Ray actors (`train.rank_workers: ray`): ranks 1 .. N-1 are `Rank`s
placed by Ray (each asking for `train.rank_cpus`) on the run's cluster, the same one its rollout
actors use (`pipeline.ray`), and joined to rank 0 by a gloo process group over TCP. Each step takes
the same path as with spawned ranks, so the two step alike (tested to the bit). The ranks meet through an
authenticated rendezvous (pipeline/rendezvous.py) whose secret reaches them through Ray. On the CPU only:
Ray does not know which GPU rank 0 (the driver) holds, so it could hand that one to an actor."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from assay.core.config import Config
from assay.core.errors import AssayError
from assay.core.types import Trajectory
from assay.pipeline.ray_workers import placement_wait, start_ray, stop_ray
from assay.pipeline.rendezvous import join, open_rendezvous, pin_gloo_to_loopback
from assay.pipeline.train_ranks import GROUP_TIMEOUT, Rank, check_can_start, cpu_copy, state_bytes
from assay.train.sharding import leave_process_group

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle
    from torch.distributed import TCPStore
    from transformers import PreTrainedModel


T = TypeVar("T")


class RayRanks:
    """The trainer's handle on ranks 1 .. world-1 as actors; create it before rank 0's trainer."""

    def __init__(self, cfg: Config, model: PreTrainedModel, ref: PreTrainedModel | None, world: int,
                 run_dir: Path) -> None:
        try:
            import ray
        except ImportError:
            raise AssayError("train.rank_workers: ray needs Ray: pip install -e '.[ray]'") from None
        if next(model.parameters()).is_cuda:
            raise AssayError("train.rank_workers: ray runs the ranks on the CPU: Ray would not keep rank 0's GPU "
                             "(the driver's) from its actors; with the model on CUDA use train.rank_workers: "
                             "process (a GPU per rank on this machine)")
        check_can_start(model, world)
        self.ray = ray
        self.started, self.temp = start_ray(cfg, run_dir)
        self.actors: list[ActorHandle] = []
        self.pending: list[ObjectRef[None]] = []  # the last step handed out, checked before the next
        self.store: TCPStore | None = None  # the rendezvous' server, kept while the group lives
        local = cfg.pipeline.ray.address is None
        # gloo reads it for every group it builds (FSDP's mesh may build one), so it stays for the group's life
        self.unpin_gloo = pin_gloo_to_loopback() if local else lambda: None
        try:
            # on rank 0's node: the loopback when the cluster is this machine, else the address Ray knows it by
            host = "127.0.0.1" if local else ray.util.get_node_ip_address()
            init, self.store = open_rendezvous(host, GROUP_TIMEOUT)
            remote = ray.remote(num_cpus=cfg.train.rank_cpus)(Rank)
            model_ref, ref_ref = ray.put(cpu_copy(model)), ray.put(cpu_copy(ref))  # each actor unpickles its own
            self.actors = [remote.remote(rank, world, init, cfg, model_ref, ref_ref, "cpu")
                           for rank in range(1, world)]
            # placed and built, or named, before rank 0 waits in the group for them
            wait = placement_wait(cfg)
            ready, _ = ray.wait([a.__ray_ready__.remote() for a in self.actors], num_returns=len(self.actors),
                                timeout=wait)
            if len(ready) < len(self.actors):
                raise AssayError(f"the Ray cluster could not place {len(self.actors) - len(ready)} trainer rank(s) "
                                 f"of {cfg.train.rank_cpus} CPU each within {wait:.0f} s; lower "
                                 "train.ranks or train.rank_cpus, or add nodes")
            self._get(ready)
            joins = [a.join.remote() for a in self.actors]
            join(init, 0, world, GROUP_TIMEOUT, server=self.store)
            self._get(joins)
        except BaseException:
            self.close()
            raise

    def _get(self, refs: Sequence[ObjectRef[T]]) -> list[T]:
        try:
            return self.ray.get(refs)
        except self.ray.exceptions.RayActorError as e:
            raise AssayError(f"a training rank's actor died ({e.__class__.__name__}); the run stops here: "
                             "`assay train --resume runs/NAME` continues from the last checkpoint") from None
        except self.ray.exceptions.RayTaskError as e:
            raise AssayError(f"a training rank failed:\n{e}") from None

    def step(self, batch: list[Trajectory], version: int) -> None:
        """Hand every other rank the batch (one copy in the object store); rank 0's own `trainer.step`
        then runs the step with them. The previous step's results are checked first."""
        self._get(self.pending)
        batch_ref = self.ray.put(batch)
        self.pending = [a.step.remote(batch_ref, version) for a in self.actors]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Hand every actor the trainer state to load, without waiting (sharded, loading is a collective
        that rank 0's own load, next, joins); checked with the next step."""
        self._get(self.pending)
        data = self.ray.put(state_bytes(state))
        self.pending = [a.state.remote(data) for a in self.actors]

    def gather(self) -> None:
        """Have every actor join the gather of the whole trainer state, without waiting: rank 0's own
        `trainer.state_dict()`, next, is the other side of it."""
        self._get(self.pending)
        self.pending = [a.gather.remote() for a in self.actors]

    def digests(self) -> list[str]:
        self._get(self.pending)
        return self._get([a.digest.remote() for a in self.actors])

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        self.actors, self.pending = [], []
        leave_process_group()
        self.store = None
        self.unpin_gloo()
        stop_ray(self.started, self.temp)
