"""Environments: versioned, procedurally generated task sources with verifiers, and their registry."""

from assay.envs.base import ClosingEpisode, EnvHooks, Environment, Episode, hooks
from assay.envs.registry import (
                                 ENTRY_POINT_GROUP,
                                 env_hash,
                                 env_parts,
                                 env_spec,
                                 generate_task,
                                 get_env,
                                 list_envs,
                                 register,
                                 resolve,
)
from assay.envs.tools import INVALID_CALL, object_schema, parse_call, validate_call

__all__ = ["ENTRY_POINT_GROUP", "ClosingEpisode", "EnvHooks", "Environment", "Episode", "INVALID_CALL", "env_hash",
           "env_parts", "env_spec", "generate_task", "get_env", "hooks", "list_envs", "object_schema", "parse_call",
           "register", "resolve", "task_id", "validate_call"]


def __getattr__(name: str) -> object:
    # task_id lives with the built-ins' helpers; imported on first use, since importing the built-ins
    # registers them (the registry does that lazily, on first lookup)
    if name == "task_id":
        from assay.envs.builtin._common import task_id

        return task_id
    raise AttributeError(f"module 'assay.envs' has no attribute {name!r}")
