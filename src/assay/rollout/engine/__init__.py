"""The native rollout engine (paged KV cache, prefix caching, continuous batching)."""

from assay.rollout.engine.engine import Engine, EngineConfig

__all__ = ["Engine", "EngineConfig"]
