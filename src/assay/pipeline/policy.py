"""The policy a run starts from: a local Hugging Face directory, or a tiny model and tokenizer
built here from the config (tokenizer trained on the environments' own generated text)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import torch

from assay.core.config import Config
from assay.core.modeling import build_model, load_model, place
from assay.core.tokenizer import render_messages, train_tokenizer
from assay.envs.base import Environment
from assay.envs.split import draw_task


def domain_envs(cfg: Config) -> dict[str, Environment]:
    from assay.envs.registry import get_env

    return {d.name: get_env(d.env, **d.env_args) for d in cfg.domains}


def reference_corpus(envs: dict[str, Environment], per_domain: int, seed: int) -> Iterator[str]:
    """Rendered reference conversations over every difficulty: what the tokenizer must encode well."""
    for name, env in envs.items():
        rng = random.Random(f"corpus:{seed}:{name}")
        for i in range(per_domain):
            difficulty = env.difficulties[i % len(env.difficulties)]
            task = draw_task(env, rng, difficulty, "train")
            yield render_messages(task.prompt + env.reference_solution(task), list(task.tools))


def build_policy(cfg: Config, envs: dict[str, Environment]) -> tuple[Any, Any]:
    if cfg.model.path:
        return load_model(cfg.model.path, cfg.model)
    tokenizer = train_tokenizer(reference_corpus(envs, cfg.model.tokenizer_corpus, cfg.seed), cfg.model.vocab_size)
    torch.manual_seed(cfg.seed)  # the initial weights are part of what the seed pins
    return place(build_model(cfg.model, tokenizer), cfg.model), tokenizer
