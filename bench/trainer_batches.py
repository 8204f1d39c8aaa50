"""The RL trainer's forward and backward on a finished run's own batches, micro-batch settings side by side.

Reads the trajectories of the given steps from RUN/trajectories, keeps the groups the trainer trained (those
with reward variance), loads the policy (default: RUN's SFT policy) with the run's LoRA and bf16 settings, and
times one `GRPOTrainer.accumulate_gradients` over each batch (no optimizer step, so every setting sees the
same weights) for each setting, the settings alternated over rounds in one process:
    python bench/trainer_batches.py runs/NAME --steps 6 20 --rounds 2
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from assay.core.config import load_recorded_config
from assay.core.modeling import load_model
from assay.core.storage import trajectory_from_row
from assay.core.types import Trajectory
from assay.train.lora import with_lora
from assay.train.trainer import GRPOTrainer

SETTINGS = {"4 whole": (4, False), "4, prompt once": (4, True), "8, prompt once": (8, True)}


def trained_groups(run: Path, step: int) -> list[Trajectory]:
    groups: dict[str, list[Trajectory]] = collections.defaultdict(list)
    for shard in sorted((run / "trajectories").glob(f"step_{step:06d}_a*.parquet")):
        for row in pq.read_table(shard).to_pylist():
            t = trajectory_from_row(row)
            groups[t.group_id].append(t)
    return [t for g in groups.values() if len({t.reward for t in g}) > 1 for t in g]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path)
    p.add_argument("--steps", type=int, nargs="+", default=[6, 20])
    p.add_argument("--policy", type=Path, default=None, help="default: RUN/sft/policy")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cfg = load_recorded_config(a.run / "config.yaml")
    model, _ = load_model(a.policy or a.run / "sft" / "policy", cfg.model)
    if cfg.train.lora.rank:
        model = with_lora(model, cfg.train.lora)
    batches = {s: trained_groups(a.run, s) for s in a.steps}
    for s, b in batches.items():
        print(f"step {s}: {len(b)} trajectories, {sum(len(t.token_ids) for t in b)} tokens, "
              f"{sum(sum(t.loss_mask) for t in b)} of them completion")
    seconds: dict[str, list[float]] = collections.defaultdict(list)
    for r in range(a.rounds):
        for name, (micro, share) in list(SETTINGS.items())[:: 1 if r % 2 == 0 else -1]:
            train = cfg.train.model_copy(update={"micro_batch": micro, "shared_prefix": share})
            trainer = GRPOTrainer(model, train, temperature=cfg.rollout.temperature)
            t0 = time.perf_counter()
            losses = [trainer.accumulate_gradients(b)["loss"] for b in batches.values()]
            seconds[name].append(time.perf_counter() - t0)
            print(f"round {r + 1}, micro-batches of {name}: {seconds[name][-1]:.1f} s, losses {losses}")
    print("| micro-batches | " + " | ".join(f"round {r + 1} s" for r in range(a.rounds)) + " | / 4 whole |")
    print("|---|" + "---|" * (a.rounds + 1))
    base = seconds["4 whole"]
    for name, ts in seconds.items():
        print(f"| {name} | " + " | ".join(f"{t:.1f}" for t in ts) + " | "
              + ", ".join(f"{t / b:.2f}" for t, b in zip(ts, base, strict=True)) + " |")


if __name__ == "__main__":
    main()
