"""The pipeline's seam to the other trainer ranks (`train.ranks` > 1, or `train.sharding: fsdp`): rank 0 is
the pipeline's own trainer, and ranks 1 .. N-1 are held through `Ranks`, whatever runs them:
`TrainRanks` (spawned processes, train_ranks.py) or `RayRanks` (Ray actors, ray_ranks.py), as
`train.rank_workers` says. Each call is made just before rank 0 does the same thing itself, so that the
collective it is part of finds every rank in it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from assay.core.config import Config
from assay.core.types import Trajectory
from assay.pipeline.train_ranks import TrainRanks

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@runtime_checkable
class Ranks(Protocol):
    """Ranks 1 .. world-1 of the process group; create them before rank 0's trainer (which joins it)."""

    def step(self, batch: list[Trajectory], version: int) -> None:
        """Hand every other rank the batch; rank 0's own `trainer.step` then runs the step with them."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Hand every other rank the trainer state to load, before rank 0's own load (sharded, a collective)."""
        ...

    def gather(self) -> None:
        """Have every other rank join the gather of the whole trainer state, before rank 0's `state_dict()`."""
        ...

    def digests(self) -> list[str]:
        """Each other rank's weights digest, after the steps handed to it (their weights equal rank 0's)."""
        ...

    def close(self) -> None:
        """Stop the other ranks and leave the process group."""
        ...


def make_ranks(cfg: Config, model: PreTrainedModel, ref: PreTrainedModel | None, run_dir: Path) -> Ranks:
    """Ranks 1 .. train.ranks-1 where `train.rank_workers` puts them: spawned processes, or Ray actors
    (one rank needs neither: only its group)."""
    if cfg.train.rank_workers == "ray" and cfg.train.ranks > 1:
        from assay.pipeline.ray_ranks import RayRanks  # Ray is an extra: imported only when asked for

        return RayRanks(cfg, model, ref, cfg.train.ranks, run_dir)
    return TrainRanks(cfg, model, ref, cfg.train.ranks)
