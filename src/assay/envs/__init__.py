"""Environments: versioned, procedurally generated task sources with verifiers, and their registry."""

from assay.envs.base import Environment, Episode
from assay.envs.registry import ENTRY_POINT_GROUP, env_hash, env_parts, env_spec, get_env, list_envs, register, resolve
from assay.envs.tools import INVALID_CALL, object_schema, parse_call, validate_call

__all__ = ["ENTRY_POINT_GROUP", "Environment", "Episode", "INVALID_CALL", "env_hash", "env_parts", "env_spec", "get_env",
           "list_envs", "object_schema", "parse_call", "register", "resolve", "validate_call"]
