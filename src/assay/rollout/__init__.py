"""Rollout: token ids in, sampled ids and behaviour logprobs out (see base.RolloutBackend).

Each name loads on first use: the backend registry (`factory`) is read while a config is validated,
which must not import torch or the engine."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from assay.rollout.base import GenRequest, GenResult, RolloutBackend, SamplingParams
    from assay.rollout.engine import Engine, EngineConfig
    from assay.rollout.factory import backend_names, make_backend, register_backend
    from assay.rollout.hf import HFBackend

_EXPORTS = {
    "GenRequest": "assay.rollout.base", "GenResult": "assay.rollout.base", "RolloutBackend": "assay.rollout.base",
    "SamplingParams": "assay.rollout.base", "Engine": "assay.rollout.engine", "EngineConfig": "assay.rollout.engine",
    "backend_names": "assay.rollout.factory", "make_backend": "assay.rollout.factory",
    "register_backend": "assay.rollout.factory", "HFBackend": "assay.rollout.hf",
}

__all__ = ["Engine", "EngineConfig", "GenRequest", "GenResult", "HFBackend", "RolloutBackend", "SamplingParams",
           "backend_names", "make_backend", "register_backend"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'assay.rollout' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
