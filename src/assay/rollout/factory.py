"""The rollout backend registry: `rollout.backend` names a factory that builds a backend around a policy model.

Built-in backends register here (`@register_backend`); third-party ones are found through the
`assay.rollout_backends` entry-point group, each entry point naming a factory, so that every process
that builds the rollout (a worker process, a Ray actor) finds them, not only the one that imported them.
A factory is called as `factory(cfg, model, tokenizer)` with the run's `RolloutConfig`, the policy
(a Hugging Face model) and its tokenizer, and returns an `assay.RolloutBackend`; a backend class whose
constructor takes those three is one. Nothing heavy is imported here: the config validates
`rollout.backend` against `backend_names()`."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint
from typing import TYPE_CHECKING, TypeVar

from assay.core.registry import Registry

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from assay.core.config import RolloutConfig
    from assay.rollout.base import RolloutBackend

ENTRY_POINT_GROUP = "assay.rollout_backends"

BackendFactory = Callable[["RolloutConfig", "PreTrainedModel", "PreTrainedTokenizerBase"], "RolloutBackend"]
F = TypeVar("F", bound=BackendFactory)


def _adopt(registry: Registry[BackendFactory], ep: EntryPoint, factory: object) -> None:
    """A plugin's entry point names a factory (or a backend class, whose constructor is one)."""
    if not callable(factory):
        raise registry.plugin_error(ep, "must name a factory or a backend class")
    registry.add(ep.name, factory)


backends: Registry[BackendFactory] = Registry("rollout backend", "backends", ENTRY_POINT_GROUP, _adopt)


def register_backend(name: str) -> Callable[[F], F]:
    """Decorator: make `factory(cfg, model, tokenizer)` the backend `rollout.backend: NAME` builds. In this
    process only; a backend that must also run in worker processes or Ray actors is named by an entry point
    in the `assay.rollout_backends` group (its own registration then finds the same factory)."""
    return backends.register(name)


def backend_names() -> list[str]:
    """Every backend `rollout.backend` may name: the registered ones and the installed plugins' (a plugin
    is imported only when a run builds it)."""
    return backends.names()


def resolve_backend(name: str) -> BackendFactory:
    """The factory `name` names: a registered one, else the plugin's (loaded and registered now)."""
    return backends.get(name)


def make_backend(cfg: RolloutConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> RolloutBackend:
    """The backend `cfg.backend` names, built around `model`."""
    from assay.rollout.base import require_backend

    return require_backend(resolve_backend(cfg.backend)(cfg, model, tokenizer), f"rollout backend {cfg.backend!r}")


@register_backend("engine")
def _engine(cfg: RolloutConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> RolloutBackend:
    """Assay's own engine: paged KV cache, prefix cache, continuous batching."""
    from assay.rollout.engine import Engine, EngineConfig

    return Engine(model, tokenizer, EngineConfig(block_size=cfg.block_size, kv_cache_bytes=cfg.kv_cache_mb * 2**20,
                                                 max_batched_tokens=cfg.max_batched_tokens, max_seqs=cfg.max_seqs,
                                                 speculative_tokens=cfg.speculative_tokens,
                                                 speculative_max_batch=cfg.speculative_max_batch, gemm=cfg.gemm,
                                                 weights=engine_weights(cfg.weights, model), warm_up=cfg.warm_up))


def engine_weights(setting: str, model: PreTrainedModel) -> str:
    """`rollout.weights` for this model: `auto` is bf16 on a CPU where bf16 matmuls are fast, else float32."""
    if setting != "auto":
        return setting
    import torch

    from assay.core.modeling import fast_bf16

    param = next(model.parameters())
    return "bf16" if param.device.type == "cpu" and param.dtype == torch.float32 and fast_bf16(param.device) \
        else "float32"


@register_backend("hf")
def _hf(cfg: RolloutConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> RolloutBackend:
    """transformers' `generate`."""
    from assay.rollout.hf import HFBackend

    return HFBackend(model, tokenizer)


@register_backend("vllm")
def _vllm(cfg: RolloutConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> RolloutBackend:
    """vLLM in this process (the optional extra `vllm`)."""
    from assay.rollout.vllm import VLLMBackend

    return VLLMBackend(model, tokenizer, block_size=cfg.vllm.block_size, kv_cache_bytes=cfg.kv_cache_mb * 2**20,
                       enforce_eager=cfg.vllm.enforce_eager, max_model_len=cfg.vllm.max_model_len)
