"""Data-parallel training over processes on this machine (`train.ranks` > 1). The pipeline's trainer is
rank 0; ranks 1 .. N-1 are spawned processes, each with a copy of the trainer's model (and of the KL
reference), joined to rank 0 by a torch.distributed process group: gloo on the CPU; on CUDA nccl,
with a GPU per rank (rank 0 keeps its model's, the others take the remaining visible ones in order).
Every step each rank receives the whole batch, computes the advantages and normalizers over all of
it and the gradient of its share of the samples; the gradients are summed, and every rank takes the
same optimizer step, so the ranks' weights stay identical (tested) and rank 0's are the run's.
With `train.sharding: fsdp` each rank holds a shard instead (train/sharding.py), and whatever reads
or writes the whole state (a step's weight gather, a checkpoint, a resume) is a collective that rank 0
asks every other rank to join before it joins itself; the group then exists with train.ranks: 1 too."""

from __future__ import annotations

import copy
import datetime
import hashlib
import io
import queue
import shutil
import tempfile
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from assay.core.checkpoint import load_trainer_file
from assay.core.config import Config
from assay.core.errors import AssayError
from assay.core.types import Trajectory
from assay.pipeline.rendezvous import Rendezvous, join, pin_gloo_to_loopback
from assay.pipeline.worker import POLL_S
from assay.train.sharding import leave_process_group, local

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue

    from transformers import PreTrainedModel

    from assay.train.trainer import GRPOTrainer


# what rank 0 sends a spawned rank: (a Rank method's name, its arguments...); None stops it. What the rank
# answers: ("started",), ("ready",), (the method's name, what it returned) or ("error", traceback)
Order = tuple[Any, ...]
Reply = tuple[Any, ...]

# a collective that waits longer has lost a rank (rank 0 also waits this long for the others to start)
GROUP_TIMEOUT = datetime.timedelta(minutes=10)


def weights_digest(model: torch.nn.Module) -> str:
    """A hash of every tensor's bytes: equal across ranks when their weights are (sharded: of this
    rank's shards, which differ between ranks)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(local(t).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def backend_for(device: torch.device) -> str:
    """nccl reduces tensors on GPUs, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def rank_devices(first: torch.device, world: int) -> list[torch.device]:
    """Each rank's device: on the CPU all share it; on CUDA rank 0 keeps `first` and the others take the
    remaining visible GPUs in order, one each (nccl allows one rank per GPU)."""
    if first.type != "cuda":
        return [first] * world
    visible = torch.cuda.device_count()
    if visible < world:
        raise AssayError(f"train.ranks: {world} with the model on CUDA needs a GPU per rank, and {visible} "
                         f"{'is' if visible == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES); lower train.ranks to "
                         f"{max(visible, 1)}, or put the model on the CPU (model.device: cpu)")
    index = first.index if first.index is not None else torch.cuda.current_device()
    return [torch.device("cuda", i) for i in [index, *(i for i in range(visible) if i != index)][:world]]


def on_device(device: torch.device) -> None:
    """Make `device` this process's current GPU, before nccl joins (it binds a rank to the current one)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


M = TypeVar("M", bound=torch.nn.Module)


def cpu_copy(model: M | None) -> M | None:
    """A copy on the CPU to hand to another rank (which moves it to its own device), without a second
    copy on the GPU first; tied weights stay tied. None stays None."""
    if model is None:
        return None
    memo: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(p.detach().cpu().clone(), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().cpu().clone()
    return copy.deepcopy(model, memo)


class Rank:
    """Rank 1 .. N-1: joins the group, holds a trainer, and takes the steps rank 0 hands it. A spawned
    process (`_serve_rank`) or a Ray actor (`pipeline.ray_ranks`) runs it. The models arrive on the CPU
    and go to `device`. `init`: the spawned ranks' file store (a URL), or the Ray ranks' authenticated
    rendezvous."""

    def __init__(self, rank: int, world: int, init: str | Rendezvous, cfg: Config, model: PreTrainedModel,
                 ref: PreTrainedModel | None, device: str) -> None:
        self.rank, self.world, self.init, self.cfg, self.model, self.ref = rank, world, init, cfg, model, ref
        self.device = torch.device(device)
        self.trainer: GRPOTrainer | None = None

    def join(self) -> None:
        from assay.core.modeling import set_threads
        from assay.train.trainer import GRPOTrainer

        set_threads(self.cfg.threads)
        on_device(self.device)
        model, ref = self.model.to(self.device), self.ref.to(self.device) if self.ref is not None else None
        if isinstance(self.init, Rendezvous):
            if self.init.loopback:
                pin_gloo_to_loopback()  # for this process's life, which is the group's
            join(self.init, self.rank, self.world, GROUP_TIMEOUT)
        else:
            dist.init_process_group(backend_for(self.device), init_method=self.init, rank=self.rank,
                                    world_size=self.world, timeout=GROUP_TIMEOUT)
        self.trainer = GRPOTrainer(model, self.cfg.train, ref_model=ref, temperature=self.cfg.rollout.temperature,
                                   data_parallel=True)

    def step(self, batch: list[Trajectory], version: int) -> None:
        self._joined().step(batch, version=version)

    def state(self, data: bytes) -> None:
        """Bytes, so that no two ranks share the tensors of one optimizer state; read onto the CPU (loading
        copies each tensor, or a sharded rank its shard, to the device)."""
        self._joined().load_state_dict(load_trainer_file(io.BytesIO(data)))  # tensors and plain data only

    def gather(self) -> None:
        """Join rank 0's gather of the whole trainer state (sharded: a collective); rank 0 keeps it."""
        self._joined().state_dict()

    def digest(self) -> str:
        return weights_digest(self._joined().model)

    def _joined(self) -> GRPOTrainer:
        if self.trainer is None:
            raise AssayError(f"training rank {self.rank} was handed work before it joined the group (or after it left)")
        return self.trainer

    def leave(self) -> None:
        self.trainer = None  # its sharded weights hold the group
        leave_process_group()


def state_bytes(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _serve_rank(rank: int, world: int, init: str, cfg: Config, model: PreTrainedModel, ref: PreTrainedModel | None,
                device: str, inbox: Queue[Order | None], outbox: Queue[Reply]) -> None:
    outbox.put(("started",))  # rank 0 joins the group only once every rank got this far
    me = Rank(rank, world, init, cfg, model, ref, device)
    try:
        me.join()
    except BaseException:
        outbox.put(("error", traceback.format_exc()))
        return
    outbox.put(("ready",))
    try:
        while (msg := inbox.get()) is not None:
            kind, *args = msg
            answer = getattr(me, kind)(*args)
            if answer is not None:
                outbox.put((kind, answer))
    except BaseException:
        outbox.put(("error", traceback.format_exc()))
    finally:
        me.leave()


def check_can_start(model: PreTrainedModel, world: int) -> list[torch.device]:
    """What ranks on processes or Ray actors both need: no process group yet, and a device for each
    rank (returned, rank 0's first)."""
    if dist.is_initialized():
        raise AssayError("train.ranks > 1 (or train.sharding: fsdp) starts its own process group, but one is "
                         "already initialized here")
    return rank_devices(next(model.parameters()).device, world)


class TrainRanks:
    """Ranks 1 .. world-1 and the process group; create it before rank 0's trainer (which joins it).
    With world 1 (train.sharding: fsdp on one rank) it is the group alone."""

    def __init__(self, cfg: Config, model: PreTrainedModel, ref: PreTrainedModel | None, world: int) -> None:
        devices = check_can_start(model, world)
        ctx = mp.get_context("spawn")
        self.dir = Path(tempfile.mkdtemp(prefix="assay-ranks-"))
        init = f"file://{self.dir / 'store'}"
        self.procs: list[BaseProcess] = []
        self.inboxes: list[Queue[Order | None]] = []
        self.outboxes: list[Queue[Reply]] = []
        try:
            for rank in range(1, world):
                inbox, outbox = ctx.Queue(), ctx.Queue()
                # a copy each: a tensor handed to a process goes to shared memory, which two ranks must not share
                proc = ctx.Process(target=_serve_rank, name=f"assay-train-rank-{rank}", daemon=True,
                                   args=(rank, world, init, cfg, cpu_copy(model), cpu_copy(ref), str(devices[rank]),
                                         inbox, outbox))
                proc.start()
                self.procs.append(proc)
                self.inboxes.append(inbox)
                self.outboxes.append(outbox)
            for i in range(len(self.procs)):
                self._receive(i)  # "started": it unpickled and can join; a rank that died instead is named here
            on_device(devices[0])
            dist.init_process_group(backend_for(devices[0]), init_method=init, rank=0, world_size=world,
                                    timeout=GROUP_TIMEOUT)
            for i in range(len(self.procs)):
                self._receive(i)  # "ready", or why it could not build its trainer
        except BaseException:
            self.close()
            raise

    def step(self, batch: list[Trajectory], version: int) -> None:
        """Hand every other rank the batch; rank 0's own `trainer.step` then runs the step with them."""
        for i, proc in enumerate(self.procs):
            if not proc.is_alive():
                raise AssayError(f"training rank {i + 1} died (exit code {proc.exitcode}); the run stops here: "
                                 "`assay train --resume runs/NAME` continues from the last checkpoint")
            self.inboxes[i].put(("step", batch, version))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Hand every other rank the trainer state to load; call it before rank 0's own load (sharded,
        loading is a collective they join)."""
        data = state_bytes(state)
        for inbox in self.inboxes:
            inbox.put(("state", data))

    def gather(self) -> None:
        """Have every other rank join the gather of the whole trainer state; call it before rank 0's own
        `trainer.state_dict()`."""
        for inbox in self.inboxes:
            inbox.put(("gather",))

    def digests(self) -> list[str]:
        """Each other rank's weights digest (after the steps handed to it)."""
        for inbox in self.inboxes:
            inbox.put(("digest",))
        return [self._receive(i)[1] for i in range(len(self.procs))]

    def _receive(self, i: int) -> Reply:
        while True:
            try:
                msg = self.outboxes[i].get(timeout=POLL_S)
            except queue.Empty:
                if not self.procs[i].is_alive():
                    raise AssayError(f"training rank {i + 1} exited (code {self.procs[i].exitcode})") from None
                continue
            if msg[0] == "error":
                raise AssayError(f"training rank {i + 1} failed:\n{msg[1]}")
            return msg

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        leave_process_group()
        shutil.rmtree(self.dir, ignore_errors=True)
