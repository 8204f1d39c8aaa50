"""The engine's CPU GEMMs through oneDNN, on weights prepacked into its blocked layout.

On some CPUs MKL's sgemm (what `torch.mm` calls) takes a generic path: on the development machine's
AMD EPYC (Zen 5, AVX-512) it ran 80-90 GFLOP/s a core where oneDNN's prepacked kernels ran 150-210 at
the engine's shapes (docs/experiments.md R4). A packed copy is made once per weight and made again
whenever the weight changed: torch bumps a tensor's version counter on every in-place write (an
optimizer step, `copy_weights`), so the engine still runs whatever the model's parameters hold."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor


@functools.cache
def available() -> bool:
    """oneDNN's packed linear exists in this torch build and agrees with F.linear on a probe."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 40, generator=g), torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    try:
        y = _linear(x, _pack(w), b)
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5))


def _pack(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def _linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedWeights:
    """x @ weight.T + bias on a packed copy of each weight, kept current with the weight."""

    def __init__(self) -> None:
        self._packs: dict[int, tuple[tuple[int, int], Tensor]] = {}  # id(weight) -> ((version, address), packed)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        stamp = (weight._version, weight.data_ptr())
        entry = self._packs.get(id(weight))
        if entry is None or entry[0] != stamp:
            entry = self._packs[id(weight)] = (stamp, _pack(weight))
        return _linear(x.contiguous(), entry[1], bias)
