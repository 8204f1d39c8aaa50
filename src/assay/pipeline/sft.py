"""Cold start: supervised fine-tuning on the environments' reference solutions."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

from assay.agent.render import sft_example
from assay.core.config import Config, dump_config
from assay.core.modeling import apply_threads, bf16_enabled, save_model
from assay.core.storage import MetricsLogger, atomic_write
from assay.core.types import Message, Task
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
        tasks[dom.name] = [replace(draw_task(env, rng, levels[i % len(levels)], "train"), domain=dom.name)
                           for i in range(cfg.sft.examples_per_domain)]
    return tasks


def demonstrations(cfg: Config, envs: dict[str, Environment]) -> list[tuple[Task, list[Message]]]:
    """(task, response) pairs of `sft_tasks`: each task's reference solution, except that a share
    `sft.label_noise` of them get the reference solution of another task of the same level."""
    pairs = []
    for name, tasks in sft_tasks(cfg, envs).items():
        env = envs[name]
        by_level: dict[int, list[Task]] = {}
        for task in tasks:
            by_level.setdefault(task.difficulty, []).append(task)
        rng = random.Random(f"sft-noise:{cfg.seed}:{name}")
        for task in tasks:
            source = task
            if cfg.sft.label_noise and rng.random() < cfg.sft.label_noise:
                others = [t for t in by_level[task.difficulty] if t.task_id != task.task_id]
                source = rng.choice(others) if others else task
            pairs.append((task, env.reference_solution(source)))
    return pairs


def build_examples(cfg: Config, envs: dict[str, Environment], tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """The demonstrations, rendered in the agent loop's token layout."""
    return [sft_example(tokenizer, task, response) for task, response in demonstrations(cfg, envs)]


def run_sft(cfg: Config, run_dir: Path, view: RunView | None = None) -> Path:
    """Builds (or loads) the policy, trains it on reference solutions, saves it to run_dir/policy."""
    envs = domain_envs(cfg)
    model, tokenizer = build_policy(cfg, envs)
    cfg = cfg.model_copy(update={"threads": apply_threads(cfg.threads, model)})  # recorded as resolved
    atomic_write(run_dir / "config.yaml", dump_config(cfg))
    out = run_dir / "policy"
    if cfg.sft.steps == 0:  # RL from the policy as it comes: it is saved as the run's starting point
        save_model(model, tokenizer, out)
        return out
    examples = build_examples(cfg, envs, tokenizer)
    metrics = MetricsLogger(run_dir, cfg.loggers, cfg.name, cfg.model_dump(mode="json"))

    def on_step(step: int, loss: float, lr: float) -> None:
        metrics.log(step, {"loss": loss, "lr": lr}, kind="sft")
        if view:
            view.advance(step, f"loss {loss:.3f}")

    try:
        s = cfg.sft
        bf16 = bf16_enabled(s.bf16, next(model.parameters()).device)
        sft_train(model, examples, steps=s.steps, batch_size=s.batch_size, lr=s.lr, warmup=s.warmup_steps, seed=cfg.seed,
                  on_step=on_step, weight_decay=s.weight_decay, grad_clip=s.grad_clip, betas=s.betas,
                  micro_batch_tokens=s.micro_batch_tokens, bf16=bf16)
    finally:
        metrics.close()
    save_model(model, tokenizer, out)
    return out
