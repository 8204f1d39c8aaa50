"""Supervised fine-tuning on (token_ids, loss_mask) pairs: the cold start before RL."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel

from assay.core.errors import AssayError
from assay.core.heap import keep_freed_memory_on
from assay.train.batching import adamw, check_sequence, lr_at, pad_tokens, set_lr
from assay.train.losses import selective_token_logprobs

Example = tuple[list[int], list[int]]  # token ids, loss mask (1 on the tokens to learn)


def _check(i: int, ids: Sequence[int], mask: Sequence[int]) -> None:
    check_sequence(f"SFT example {i}", ids, mask)
    if not any(mask):
        raise AssayError(f"SFT example {i} has no token to learn (its loss mask is all 0); drop it")


def pad_batch(batch: Sequence[Example], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Right-pad to the longest example: (input_ids, attention_mask, loss_mask)."""
    ids, attn, mask = pad_tokens([ids for ids, _ in batch], [mask for _, mask in batch])
    return ids.to(device), attn.to(device), mask.to(device)


def length_buckets(batch: Sequence[Example], max_tokens: int) -> list[list[Example]]:
    """The batch in micro-batches of similar length, each at most `max_tokens` once right-padded (an
    example longer than that alone): padding a short example to a long one's length is wasted compute.
    `max_tokens` 0 keeps the batch whole."""
    if max_tokens <= 0:
        return [list(batch)]
    buckets: list[list[Example]] = [[]]
    for ex in sorted(batch, key=lambda e: len(e[0])):
        if buckets[-1] and (len(buckets[-1]) + 1) * len(ex[0]) > max_tokens:
            buckets.append([])
        buckets[-1].append(ex)
    return buckets


def learned_tokens(batch: Sequence[Example]) -> int:
    """The tokens the loss averages over (the first token has no prediction)."""
    return sum(sum(mask[1:]) for _, mask in batch)


def sft_nll(model: nn.Module, batch: Sequence[Example]) -> Tensor:
    """Cross entropy of token t given tokens < t (logits at t-1), summed over the mask==1 tokens. A
    Hugging Face model with a linear head runs the head on those positions alone (a demonstration's
    prompt, most of its tokens, never needs the vocabulary-wide logits): the same loss and gradient."""
    ids, attn, mask = pad_batch(batch, next(model.parameters()).device)
    if isinstance(model, PreTrainedModel) and isinstance(model.get_output_embeddings(), nn.Linear):
        logp, _ = selective_token_logprobs(model, ids, attn, mask)
        return -logp.sum()  # zero off the mask
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return (nll * mask[:, 1:].reshape(-1)).sum()


def sft_loss(model: nn.Module, batch: Sequence[Example]) -> Tensor:
    """The batch's mean cross entropy over its mask==1 tokens."""
    return sft_nll(model, batch) / max(1, learned_tokens(batch))


def sft_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: Sequence[Example], grad_clip: float | None = 1.0,
    micro_batch_tokens: int = 0, bf16: bool = False,
) -> float:
    """One optimizer step on the batch's mean loss, its gradient accumulated over length buckets of at
    most `micro_batch_tokens` padded tokens (0: one pass), the forward under bf16 autocast if `bf16`;
    returns the loss before the step."""
    for i, (ids, mask) in enumerate(batch):
        _check(i, ids, mask)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total, loss = max(1, learned_tokens(batch)), 0.0
    device = next(model.parameters()).device
    for bucket in length_buckets(batch, micro_batch_tokens):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
            part = sft_nll(model, bucket) / total
        part.backward()
        loss += float(part.item())
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], grad_clip)
    optimizer.step()
    return loss


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
    micro_batch_tokens: int = 0,
    bf16: bool = False,
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
    keep_freed_memory_on(next(model.parameters()).device)
    optimizer = adamw(model.parameters(), lr, betas, weight_decay)
    batches = _batches(len(examples), batch_size, random.Random(seed))
    losses = []
    for step in range(steps):
        rate = lr_at(step, lr, warmup, decay_steps=steps)
        set_lr(optimizer, rate)
        loss = sft_step(model, optimizer, [examples[i] for i in next(batches)], grad_clip, micro_batch_tokens, bf16)
        losses.append(loss)
        if on_step is not None:
            on_step(step, loss, rate)
    return losses
