"""Supervised fine-tuning on (token_ids, loss_mask) pairs: the cold start before RL."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from assay.core.errors import AssayError
from assay.train.batching import adamw, check_sequence, lr_at, pad_tokens, set_lr

Example = tuple[list[int], list[int]]  # token ids, loss mask (1 on the tokens to learn)


def _check(i: int, ids: Sequence[int], mask: Sequence[int]) -> None:
    check_sequence(f"SFT example {i}", ids, mask)
    if not any(mask):
        raise AssayError(f"SFT example {i} has no token to learn (its loss mask is all 0); drop it")


def pad_batch(batch: Sequence[Example], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Right-pad to the longest example: (input_ids, attention_mask, loss_mask)."""
    ids, attn, mask = pad_tokens([ids for ids, _ in batch], [mask for _, mask in batch])
    return ids.to(device), attn.to(device), mask.to(device)


def sft_loss(model: nn.Module, batch: Sequence[Example]) -> Tensor:
    """Cross entropy of token t given tokens < t (logits at t-1), averaged over all mask==1 tokens."""
    ids, attn, mask = pad_batch(batch, next(model.parameters()).device)
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    m = mask[:, 1:].reshape(-1)
    return (nll * m).sum() / m.sum().clamp_min(1.0)


def sft_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: Sequence[Example], grad_clip: float | None = 1.0
) -> float:
    """One optimizer step on one batch; returns the loss before the step."""
    for i, (ids, mask) in enumerate(batch):
        _check(i, ids, mask)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss = sft_loss(model, batch)
    loss.backward()
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], grad_clip)
    optimizer.step()
    return float(loss.item())


def _batches(n: int, batch_size: int, rng: random.Random) -> Iterator[list[int]]:
    """Endless shuffled passes over the indices; a batch may straddle two passes."""
    pending: list[int] = []
    while True:
        while len(pending) < batch_size:
            order = list(range(n))
            rng.shuffle(order)
            pending += order
        yield pending[:batch_size]
        pending = pending[batch_size:]


def sft_train(
    model: nn.Module,
    examples: Sequence[Example],
    steps: int,
    batch_size: int,
    lr: float,
    warmup: int,
    seed: int,
    on_step: Callable[[int, float, float], None] | None = None,
    weight_decay: float = 0.0,
    grad_clip: float | None = 1.0,
    betas: tuple[float, float] = (0.9, 0.95),
) -> list[float]:
    """AdamW with warmup + cosine; the batch order depends only on `seed`. Returns the loss per step;
    `on_step(step, loss, lr)` is called after each step (for logging)."""
    if not examples:
        raise AssayError("SFT: no examples; generate reference solutions first (sft.examples_per_domain > 0)")
    if batch_size <= 0 or steps < 0 or warmup < 0 or lr <= 0:
        raise AssayError(
            f"SFT: need batch_size > 0, steps >= 0, warmup >= 0, lr > 0; got {batch_size}, {steps}, {warmup}, {lr}"
        )
    for i, (ids, mask) in enumerate(examples):
        _check(i, ids, mask)
    optimizer = adamw(model.parameters(), lr, betas, weight_decay)
    batches = _batches(len(examples), batch_size, random.Random(seed))
    losses = []
    for step in range(steps):
        rate = lr_at(step, lr, warmup, decay_steps=steps)
        set_lr(optimizer, rate)
        loss = sft_step(model, optimizer, [examples[i] for i in next(batches)], grad_clip)
        losses.append(loss)
        if on_step is not None:
            on_step(step, loss, rate)
    return losses
