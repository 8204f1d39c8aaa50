"""Build the configured rollout backend around a policy model."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from assay.core.config import RolloutConfig
from assay.rollout.base import RolloutBackend


def make_backend(cfg: RolloutConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> RolloutBackend:
    if cfg.backend == "hf":
        from assay.rollout.hf import HFBackend

        return HFBackend(model, tokenizer)
    if cfg.backend == "vllm":
        from assay.rollout.vllm import VLLMBackend

        return VLLMBackend(model, tokenizer, block_size=cfg.vllm.block_size, kv_cache_bytes=cfg.kv_cache_mb * 2**20,
                           enforce_eager=cfg.vllm.enforce_eager, max_model_len=cfg.vllm.max_model_len)
    from assay.rollout.engine import Engine, EngineConfig

    return Engine(model, tokenizer, EngineConfig(block_size=cfg.block_size, kv_cache_bytes=cfg.kv_cache_mb * 2**20,
                                                 max_batched_tokens=cfg.max_batched_tokens, max_seqs=cfg.max_seqs,
                                                 speculative_tokens=cfg.speculative_tokens,
                                                 speculative_max_batch=cfg.speculative_max_batch, gemm=cfg.gemm,
                                                 warm_up=cfg.warm_up))
