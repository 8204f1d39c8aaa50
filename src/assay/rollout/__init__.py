"""Rollout: token ids in, sampled ids and behaviour logprobs out (see base.RolloutBackend)."""

from assay.rollout.base import GenRequest, GenResult, RolloutBackend, SamplingParams
from assay.rollout.hf import HFBackend

__all__ = ["GenRequest", "GenResult", "HFBackend", "RolloutBackend", "SamplingParams"]
