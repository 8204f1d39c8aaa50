"""Is an evaluation held out from a run? Its tasks' ids against every task the run trained on: the
run's trajectories (RL) and SFT data, and those of the runs its starting policy came from (SFT data is
re-derived from each run's config, since it is a pure function of it)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from assay.core.config import load_recorded_config
from assay.core.errors import AssayError
from assay.core.storage import trajectory_shards


@dataclass(frozen=True)
class Overlap:
    run: Path
    trained: dict[str, int]  # source -> distinct training task ids found there
    shared: dict[str, int]  # source -> evaluation tasks among them
    evaluated: int  # distinct evaluation tasks checked
    contaminated: int  # distinct evaluation tasks found in any source

    @property
    def held_out(self) -> bool:
        return self.contaminated == 0

    def describe(self) -> str:
        if not self.trained:
            return f"held-out check: {self.run} holds no trajectories or SFT data to check against"
        where = "; ".join(f"{src}: {self.shared[src]} of its {n} tasks" for src, n in self.trained.items())
        verdict = "held out" if self.held_out else "NOT held out"
        return f"{verdict}: {self.contaminated} of {self.evaluated} evaluation tasks are in the training data ({where})"


def run_chain(run_dir: Path) -> list[Path]:
    """The run, a quickstart's nested `sft/` run, and the runs whose policy each one started from."""
    chain: list[Path] = []
    todo = [run_dir]
    while todo:
        d = todo.pop().resolve()
        if d in chain or not d.is_dir():
            continue
        chain.append(d)
        todo.append(d / "sft")
        config = d / "config.yaml"
        if config.is_file():
            start = load_recorded_config(config).model.path
            if start:  # runs/X/policy or runs/X/checkpoints/step_N: the run that made it
                p = Path(start)
                todo += [p.parent, p.parent.parent]
    return chain


def training_task_ids(run_dir: Path) -> dict[str, set[str]]:
    from assay.pipeline.policy import domain_envs
    from assay.pipeline.sft import sft_tasks

    if not (run_dir / "config.yaml").is_file() and not (run_dir / "trajectories").is_dir():
        raise AssayError(f"{run_dir} is not a run directory (no config.yaml or trajectories/); "
                         "pass --run runs/NAME of the run that trained the policy")
    ids: dict[str, set[str]] = {}
    for d in run_chain(run_dir):
        shards = trajectory_shards(d / "trajectories", superseded=True)  # all a run ever sampled
        if shards:
            ids[f"{d.name} trajectories"] = {t for s in shards for t in pq.read_table(s, columns=["task_id"])["task_id"]
                                             .to_pylist()}
        if (d / "policy").is_dir() and (d / "config.yaml").is_file():  # an SFT run (assay sft, quickstart's sft/)
            cfg = load_recorded_config(d / "config.yaml")
            if cfg.sft.steps == 0:  # the starting policy saved as it came: it saw no SFT data
                continue
            ids[f"{d.name} SFT data"] = {t.task_id for ts in sft_tasks(cfg, domain_envs(cfg)).values() for t in ts}
    return ids


def check_overlap(run_dir: Path, eval_task_ids: Iterable[str], trained: dict[str, set[str]] | None = None) -> Overlap:
    """`trained`: `training_task_ids(run_dir)` when already read (read it before a long evaluation, so that
    a wrong run directory fails at once)."""
    evaluated = set(eval_task_ids)
    trained = training_task_ids(run_dir) if trained is None else trained
    seen = set().union(*trained.values()) if trained else set()
    return Overlap(run_dir, {src: len(ids) for src, ids in trained.items()},
                   {src: len(ids & evaluated) for src, ids in trained.items()}, len(evaluated), len(seen & evaluated))
