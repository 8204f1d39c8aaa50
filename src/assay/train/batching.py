"""What the SFT and RL trainers share: checking a token sequence and its loss mask, right-padding a
micro-batch, and the AdamW optimizer with its learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from assay.core.errors import AssayError

PAD_ID = 0  # any id works: padded positions are masked out of attention and loss


def check_sequence(where: str, ids: Sequence[int], mask: Sequence[int], **aligned: Sequence[float]) -> None:
    """A trainable sequence: one mask entry (and one entry of each `aligned` list) per token, something
    to learn, and no loss on the first token, which has no prediction."""
    n = len(ids)
    if any(len(v) != n for v in (mask, *aligned.values())):
        names = ", ".join(["token ids", "loss mask", *aligned])
        lengths = ", ".join(str(len(v)) for v in (ids, mask, *aligned.values()))
        raise AssayError(f"{where}: {names} must have one entry per token, got {lengths}")
    if n == 0:
        raise AssayError(f"{where} has no tokens; drop empty sequences before training")
    if mask[0]:
        raise AssayError(f"{where}: loss_mask[0] is 1, but the first token has no prediction; start with the prompt")


def right_pad(rows: Sequence[Sequence[float]], dtype: torch.dtype, value: float = 0) -> Tensor:
    """rows as one (len(rows), longest) tensor, each padded on the right with `value`."""
    out = torch.full((len(rows), max(len(r) for r in rows)), value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out


def pad_tokens(ids: Sequence[Sequence[int]], masks: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor, Tensor]:
    """(input_ids, attention_mask, loss_mask) of a right-padded micro-batch."""
    return (right_pad(ids, torch.long, PAD_ID), right_pad([[1] * len(r) for r in ids], torch.long),
            right_pad(masks, torch.float32))


def adamw(params: Iterable[nn.Parameter], lr: float, betas: tuple[float, float], weight_decay: float
          ) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr, betas=betas, weight_decay=weight_decay)


def set_lr(optimizer: torch.optim.Optimizer, rate: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = rate


def lr_at(step: int, lr: float, warmup: int, decay_steps: int | None = None) -> float:
    """Linear warmup over `warmup` steps to `lr` (Adam's first updates move every weight by about lr
    whatever the gradient's size, so a fresh optimizer starts small); then constant, or with
    `decay_steps` a cosine decay towards 0 at that step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if decay_steps is None:
        return lr
    progress = (step - warmup) / max(1, decay_steps - warmup)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))
