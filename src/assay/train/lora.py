"""LoRA through peft (`train.lora.rank` > 0): the trainer updates low-rank adapters on the named
projections while the base weights stay frozen, so the optimizer holds state for the adapters only.
Everything that runs or stores the policy (the rollout engine, checkpoints in Hugging Face layout,
evaluation) sees plain weights with each adapter folded in, W + scale·B·A, under the names the plain
model gives them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from assay.core.config import LoraConfig
from assay.core.errors import ConfigError


def peft_config(cfg: LoraConfig) -> Any:
    """peft's LoraConfig for `cfg` (what `with_lora` injects; other trainers compared with Assay's take it too)."""
    try:
        from peft import LoraConfig as PeftLoraConfig
    except ImportError:
        raise ConfigError("train.lora needs peft: pip install -e '.[lora]'") from None
    return PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                          target_modules=list(cfg.target_modules), bias="none")


def with_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """`model` with adapters injected (in place) and wrapped as a peft model; only the adapters train."""
    config = peft_config(cfg)
    from peft import get_peft_model
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if tied and {"lm_head", "embed_tokens"} & set(cfg.target_modules):
        raise ConfigError("train.lora.target_modules: this model ties its output head to its embeddings, and an "
                          "adapter on one of them would not reach the other; leave lm_head and embed_tokens out")
    names = [name for name, _ in model.named_modules()]
    missing = sorted(t for t in set(cfg.target_modules) if not any(n == t or n.endswith(f".{t}") for n in names))
    if missing:
        raise ConfigError(f"train.lora.target_modules: the model has no module named {missing}; "
                          f"its linear layers are {sorted(_linear_names(model))}")
    return get_peft_model(model, config)


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def merged_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The plain model's tensors, each adapted weight with its adapter folded in (computed, never
    merged in place: merging and unmerging would round the frozen base weights a little each step)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    with torch.no_grad():
        deltas = {f"{name}.base_layer.weight": module.get_delta_weight("default")
                  for name, module in base.named_modules() if isinstance(module, LoraLayer)}
        for name, tensor in base.state_dict().items():
            if ".lora_" in name:
                continue
            if name in deltas:
                tensor = tensor + deltas[name].to(tensor.dtype)
            yield name.replace(".base_layer.", "."), tensor.detach()


def _linear_names(model: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
