"""Frozen linear weights cast to autocast's precision once, not at every call.

Under bf16 autocast every linear layer casts its float32 weight to bf16 each time it runs; autocast
caches the cast only for weights that train. Under LoRA almost every weight is frozen (the base
layers, the output head tied to the embeddings), so a training step recast each of them once per
micro-batch forward, and the output head twice more. A `CastOnceLinear` keeps its one bf16 copy
(exactly what autocast would compute) and makes it again only when the weight changes in place,
as a loaded checkpoint changes it; the float32 weight stays what checkpoints and the rollout see."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class CastOnceLinear(nn.Linear):
    """An nn.Linear that, while its weight does not train, runs under autocast on a cached copy of
    the weight in autocast's dtype."""

    _cast: tuple[tuple[object, ...], Tensor] | None = None

    def cast_weight(self, dtype: torch.dtype) -> Tensor:
        """The weight in `dtype`, without gradient: cast once per version of the weight."""
        w = self.weight
        key = (dtype, w.device, w.data_ptr(), w._version)
        if self._cast is None or self._cast[0] != key:
            self._cast = (key, w.detach().to(dtype))
        return self._cast[1]

    def forward(self, x: Tensor) -> Tensor:
        device = x.device.type
        if self.weight.requires_grad or not torch.is_autocast_enabled(device):
            return super().forward(x)
        return F.linear(x, self.cast_weight(torch.get_autocast_dtype(device)), self.bias)


def cast_frozen_linears(model: nn.Module) -> int:
    """Make each plain nn.Linear of `model` whose weight does not train a CastOnceLinear (in place: names,
    parameters and state_dict are unchanged). Returns how many."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear and not module.weight.requires_grad:
            module.__class__ = CastOnceLinear
            n += 1
    return n


def head_weight(head: nn.Linear, dtype: torch.dtype) -> Tensor:
    """The output head's weight for a matmul in `dtype`: its cached copy where it has one and does not train."""
    if isinstance(head, CastOnceLinear) and not head.weight.requires_grad:
        return head.cast_weight(dtype)
    return head.weight
