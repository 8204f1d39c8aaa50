"""Cold start: supervised fine-tuning on the environments' reference solutions."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from assay.agent.render import sft_example
from assay.core.config import Config, dump_config
from assay.core.modeling import apply_threads, save_model
from assay.core.storage import MetricsLogger, atomic_write
from assay.core.types import Task
from assay.envs.base import Environment
from assay.envs.split import draw_task
from assay.pipeline.policy import build_policy, domain_envs
from assay.pipeline.ui import RunView
from assay.train.sft import sft_train


def sft_tasks(cfg: Config, envs: dict[str, Environment]) -> dict[str, list[Task]]:
    """Per domain, the tasks SFT trains on: training-partition tasks over every level in the domain's
    range (capped at `sft.max_level` when set, so RL's curriculum has harder levels left to open), a
    pure function of the config (so a run's SFT data can be re-derived to check for overlap)."""
    tasks = {}
    cap = cfg.sft.max_level
    for dom in cfg.domains:
        env = envs[dom.name]
        levels = dom.difficulty.levels(env.difficulties)
        if cap is not None:
            levels = [lv for lv in levels if lv <= cap] or levels[:1]
        rng = random.Random(f"sft:{cfg.seed}:{dom.name}")
        tasks[dom.name] = [draw_task(env, rng, levels[i % len(levels)], "train")
                           for i in range(cfg.sft.examples_per_domain)]
    return tasks


def build_examples(cfg: Config, envs: dict[str, Environment], tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """Reference conversations of `sft_tasks`, rendered in the agent loop's token layout."""
    return [sft_example(tokenizer, task, envs[name].reference_solution(task))
            for name, tasks in sft_tasks(cfg, envs).items() for task in tasks]


def run_sft(cfg: Config, run_dir: Path, view: RunView | None = None) -> Path:
    """Builds (or loads) the policy, trains it on reference solutions, saves it to run_dir/policy."""
    envs = domain_envs(cfg)
    model, tokenizer = build_policy(cfg, envs)
    cfg = cfg.model_copy(update={"threads": apply_threads(cfg.threads, model)})  # recorded as resolved
    atomic_write(run_dir / "config.yaml", dump_config(cfg))
    examples = build_examples(cfg, envs, tokenizer)
    metrics = MetricsLogger(run_dir)

    def on_step(step: int, loss: float, lr: float) -> None:
        metrics.log(step, {"loss": loss, "lr": lr}, kind="sft")
        if view:
            view.advance(step, f"loss {loss:.3f}")

    try:
        sft_train(model, examples, steps=cfg.sft.steps, batch_size=cfg.sft.batch_size, lr=cfg.sft.lr,
                  warmup=cfg.sft.warmup, seed=cfg.seed, on_step=on_step)
    finally:
        metrics.close()
    out = run_dir / "policy"
    save_model(model, tokenizer, out)
    return out
