"""The policy a run starts from: a local Hugging Face directory, or a tiny model and tokenizer
built here from the config (tokenizer trained on the environments' own generated text); and what a
Python caller gives the pipeline instead of names (`Given`)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from assay.core.config import Config
from assay.core.errors import ConfigError
from assay.core.modeling import build_model, load_model, place
from assay.core.tokenizer import render_messages, train_tokenizer
from assay.envs.base import Environment
from assay.envs.split import draw_task
from assay.rollout.base import RolloutBackend

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

Policy = tuple["PreTrainedModel", "PreTrainedTokenizerBase"]
# what a Python caller may give instead of `rollout.backend`: (model, tokenizer) -> a backend around that model
GivenBackend = Callable[["PreTrainedModel", "PreTrainedTokenizerBase"], RolloutBackend]


@dataclass
class Given:
    """What a Python caller hands the pipeline instead of names in the config: environment objects by
    domain name, a policy (model, tokenizer) to start RL from, and a factory for the rollout backend
    (called with the model it must run and the tokenizer; it then receives every weight update). They
    live in this process, so they need `pipeline.workers: thread`."""

    envs: Mapping[str, Environment] = field(default_factory=dict)
    policy: Policy | None = None
    backend: GivenBackend | None = None

    def check(self, cfg: Config) -> None:
        if unknown := sorted(set(self.envs) - {d.name for d in cfg.domains}):
            raise ConfigError(f"environment objects for {', '.join(unknown)}, which the config has no domain for; "
                              f"its domains are {', '.join(d.name for d in cfg.domains)}")
        if (self.envs or self.policy or self.backend) and cfg.pipeline.workers != "thread":
            raise ConfigError(f"objects given from Python stay in this process, and pipeline.workers: "
                              f"{cfg.pipeline.workers} runs the rollout elsewhere; register the environment and save "
                              "the policy (model.path) to use worker processes, or use pipeline.workers: thread")


def domain_envs(cfg: Config, given: Mapping[str, Environment] | None = None) -> dict[str, Environment]:
    """Each domain's environment: the object given for it, else the registry's by `env` name."""
    from assay.envs.registry import get_env

    given = given or {}
    return {d.name: given[d.name] if d.name in given else get_env(d.env, **d.env_args) for d in cfg.domains}


def reference_corpus(envs: dict[str, Environment], per_domain: int, seed: int) -> Iterator[str]:
    """Rendered reference conversations over every difficulty: what the tokenizer must encode well."""
    for name, env in envs.items():
        rng = random.Random(f"corpus:{seed}:{name}")
        for i in range(per_domain):
            difficulty = env.difficulties[i % len(env.difficulties)]
            task = draw_task(env, rng, difficulty, "train")
            yield render_messages(task.prompt + env.reference_solution(task), list(task.tools))


def build_policy(cfg: Config, envs: dict[str, Environment]) -> Policy:
    if cfg.model.path:
        return load_model(cfg.model.path, cfg.model)
    tokenizer = train_tokenizer(reference_corpus(envs, cfg.model.tokenizer_corpus, cfg.seed), cfg.model.vocab_size)
    torch.manual_seed(cfg.seed)  # the initial weights are part of what the seed pins
    return place(build_model(cfg.model, tokenizer), cfg.model), tokenizer
