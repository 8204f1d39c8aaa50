"""Assay: RL post-training of LLM agents on verifiable rewards.

The nouns a user needs, importable from the top (`from assay import Task, Message, register`);
each is loaded on first use, so `import assay` stays light (no torch until a model is touched)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy imports below resolve to, for type checkers and IDEs
    from assay.core.config import Config, build_config, load_config
    from assay.core.types import Message, Observation, Reward, Task, ToolCall, ToolSpec, Trajectory
    from assay.envs import task_id
    from assay.envs.base import ClosingEpisode, EnvHooks, Environment, Episode
    from assay.envs.qa.gate import QAConfig, run_gate
    from assay.envs.registry import env_hash, generate_task, get_env, register
    from assay.eval.evaluate import evaluate
    from assay.pipeline.async_pipeline import make_pipeline, run_training
    from assay.pipeline.sft import run_sft
    from assay.rollout.base import GenRequest, GenResult, RolloutBackend, SamplingParams
    from assay.rollout.factory import register_backend
    from assay.sandbox.base import Limits

_EXPORTS = {
    # what an environment is made of
    "Task": "assay.core.types", "Message": "assay.core.types", "ToolCall": "assay.core.types",
    "ToolSpec": "assay.core.types", "Observation": "assay.core.types", "Reward": "assay.core.types",
    "Trajectory": "assay.core.types",
    "Environment": "assay.envs.base", "Episode": "assay.envs.base", "ClosingEpisode": "assay.envs.base",
    "EnvHooks": "assay.envs.base", "Limits": "assay.sandbox.base",
    "register": "assay.envs.registry", "get_env": "assay.envs.registry", "generate_task": "assay.envs.registry",
    "env_hash": "assay.envs.registry", "task_id": "assay.envs",
    # checking one before it trains anything
    "run_gate": "assay.envs.qa.gate", "QAConfig": "assay.envs.qa.gate",
    # configuring and running
    "Config": "assay.core.config", "load_config": "assay.core.config",
    "make_pipeline": "assay.pipeline.async_pipeline", "run_training": "assay.pipeline.async_pipeline",
    "run_sft": "assay.pipeline.sft", "build_config": "assay.core.config",
    "evaluate": "assay.eval.evaluate",
    # a rollout backend of one's own
    "RolloutBackend": "assay.rollout.base", "GenRequest": "assay.rollout.base", "GenResult": "assay.rollout.base",
    "SamplingParams": "assay.rollout.base", "register_backend": "assay.rollout.factory",
}

# spelled out (not sorted(_EXPORTS)) for the type checkers, which do not run code; a test keeps them equal
__all__ = ["ClosingEpisode", "Config", "EnvHooks", "Environment", "Episode", "GenRequest", "GenResult", "Limits",
           "Message", "Observation", "QAConfig", "Reward", "RolloutBackend", "SamplingParams", "Task", "ToolCall",
           "ToolSpec", "Trajectory", "build_config", "env_hash", "evaluate", "generate_task", "get_env", "load_config",
           "make_pipeline", "register", "register_backend", "run_gate", "run_sft", "run_training", "task_id"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'assay' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__
