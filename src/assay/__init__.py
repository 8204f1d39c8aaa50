"""Assay: RL post-training of LLM agents on verifiable rewards.

The nouns a user needs, importable from the top (`from assay import Task, Message, register`);
each is loaded on first use, so `import assay` stays light (no torch until a model is touched)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    # what an environment is made of
    "Task": "assay.core.types", "Message": "assay.core.types", "ToolCall": "assay.core.types",
    "ToolSpec": "assay.core.types", "Observation": "assay.core.types", "Reward": "assay.core.types",
    "Trajectory": "assay.core.types",
    "Environment": "assay.envs.base", "Episode": "assay.envs.base",
    "register": "assay.envs.registry", "get_env": "assay.envs.registry", "generate_task": "assay.envs.registry",
    "env_hash": "assay.envs.registry", "task_id": "assay.envs",
    # checking one before it trains anything
    "run_gate": "assay.envs.qa.gate", "QAConfig": "assay.envs.qa.gate",
    # configuring and running
    "Config": "assay.core.config", "load_config": "assay.core.config",
    "make_pipeline": "assay.pipeline.async_pipeline", "run_training": "assay.pipeline.async_pipeline",
    "run_sft": "assay.pipeline.sft", "build_config": "assay.core.config",
    "evaluate": "assay.eval.evaluate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'assay' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__
