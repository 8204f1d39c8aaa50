"""In-place weight updates shared by the rollout backends."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor
from transformers import PreTrainedModel

from assay.core.errors import AssayError


def copy_weights(model: PreTrainedModel, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
    """Copy each tensor into the model's tensor of that name, without reallocating; a tensor that
    already is the model's own (a backend sharing the trainer's model) is skipped."""
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(model.named_buffers())
    with torch.no_grad():
        for name, t in named_tensors:
            p = own.get(name)
            if p is None:
                raise AssayError(f"update_weights: the rollout model has no tensor {name!r}")
            if p.shape != t.shape:
                raise AssayError(f"update_weights: {name} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
            if p.data_ptr() != t.data_ptr():
                p.copy_(t)
