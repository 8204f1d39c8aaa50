"""Rollout: token ids in, sampled ids and behaviour logprobs out (see base.RolloutBackend)."""

from assay.rollout.base import GenRequest, GenResult, RolloutBackend, SamplingParams
from assay.rollout.engine import Engine, EngineConfig
from assay.rollout.factory import make_backend
from assay.rollout.hf import HFBackend

__all__ = ["Engine", "EngineConfig", "GenRequest", "GenResult", "HFBackend", "RolloutBackend", "SamplingParams",
           "make_backend"]
