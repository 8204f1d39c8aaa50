"""RL losses as pure functions on [batch, time] tensors.

Every per-token tensor is aligned with the token ids: position t holds the value for token t, which
the model predicted from the logits at position t-1 (position 0 has no prediction and is 0)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache

from assay.train.cast_once import head_weight

Aggregation = Literal["token", "sequence"]


def aggregate(values: Tensor, mask: Tensor, aggregation: Aggregation, normalizer: float | None = None) -> Tensor:
    """Reduce a per-token tensor over the masked positions.

    token:    sum of all masked values / number of masked tokens (DAPO: long answers weigh more).
    sequence: mean per sequence, then mean over sequences that have a masked token (GRPO).
    `normalizer` replaces the denominator (tokens, or sequences) so that micro-batches of one batch,
    each divided by the whole batch's count, sum to exactly the whole-batch value."""
    mask = mask.to(values.dtype)
    if aggregation == "token":
        total = (values * mask).sum()
        denom = normalizer if normalizer is not None else mask.sum().item()
    elif aggregation == "sequence":
        lengths = mask.sum(-1)
        total = ((values * mask).sum(-1) / lengths.clamp_min(1)).sum()
        denom = normalizer if normalizer is not None else (lengths > 0).sum().item()
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}; use token or sequence")
    return total / max(float(denom), 1.0)


def _masked_mean(values: Tensor, mask: Tensor) -> float:
    n = mask.sum().item()
    return float((values * mask).sum().item() / n) if n else 0.0


def policy_loss(
    logp_new: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    aggregation: Aggregation = "token",
    normalizer: float | None = None,
    logp_prox: Tensor | None = None,
    is_cap: float = 2.0,
) -> tuple[Tensor, dict[str, float]]:
    """PPO/GRPO clipped surrogate with the asymmetric clip range [1 - eps_low, 1 + eps_high] (DAPO's
    clip-higher). `advantages` is [batch] (one per sequence) or [batch, time].

    With `logp_prox` (the decoupled objective, for stale or mismatched samples): the ratio is taken
    against the proximal policy (the trainer's weights when the batch arrived) instead of the
    behaviour policy that sampled, so the clip bounds the update rather than the samples' age, and
    each token is weighted by the importance weight prox / behaviour, truncated at `is_cap`.

    Metrics (means over masked tokens): clip_frac, the share of tokens whose gradient the clip
    removed; approx_kl, the k3 estimate of KL(behaviour or proximal || current); ratio_mean; with
    `logp_prox` also is_weight_mean (after truncation), is_weight_max (before) and is_truncated."""
    mask = mask.to(logp_new.dtype)
    adv = advantages.to(logp_new.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    anchor = logp_old if logp_prox is None else logp_prox
    # outside the mask the two logprobs are unrelated (padding): keep exp() away from them
    log_ratio = torch.where(mask > 0, logp_new - anchor, torch.zeros_like(logp_new))
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    is_metrics: dict[str, float] = {}
    if logp_prox is not None:
        weight, raw = importance_weight(logp_prox, logp_old, mask, is_cap)
        with torch.no_grad():
            is_metrics = {"is_weight_mean": _masked_mean(weight, mask),
                          "is_weight_max": float((raw * mask).max().item()) if mask.any() else 0.0,
                          "is_truncated": _masked_mean((raw > is_cap).to(mask.dtype), mask)}
        per_token = per_token * weight
    loss = aggregate(per_token, mask, aggregation, normalizer)
    with torch.no_grad():
        was_clipped = ((ratio < 1.0 - eps_low) & (adv < 0)) | ((ratio > 1.0 + eps_high) & (adv > 0))
        metrics = {
            "clip_frac": _masked_mean(was_clipped.to(mask.dtype), mask),
            "approx_kl": _masked_mean(ratio - 1.0 - log_ratio, mask),
            "ratio_mean": _masked_mean(ratio, mask),
            **is_metrics,
        }
    return loss, metrics


def importance_weight(logp_prox: Tensor, logp_old: Tensor, mask: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """(truncated, raw) per-token importance weights proximal / behaviour, 1 outside the mask; no gradient."""
    with torch.no_grad():
        raw = torch.exp(torch.where(mask > 0, logp_prox - logp_old, torch.zeros_like(logp_prox)))
    return raw.clamp(max=cap), raw


def kl_penalty(logp_new: Tensor, logp_ref: Tensor, mask: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(current || reference): exp(d) - d - 1 with d = logp_ref - logp_new.
    Non-negative, unbiased, and 0 outside the mask; reduce it with `aggregate`."""
    mask = mask.to(logp_new.dtype)
    d = torch.where(mask > 0, logp_ref - logp_new, torch.zeros_like(logp_new))
    return (torch.exp(d) - d - 1.0) * mask


def logprobs_from_logits(logits: Tensor, input_ids: Tensor) -> tuple[Tensor, Tensor]:
    """(logp, entropy), both [batch, time] and aligned with input_ids: logp[:, t] = log p(token t | tokens
    < t) read from logits[:, t-1], entropy[:, t] that distribution's entropy (no gradient). Column 0 is 0."""
    shifted = logits[:, :-1].float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    lse = torch.logsumexp(shifted, dim=-1)
    logp = shifted.gather(-1, targets).squeeze(-1) - lse
    with torch.no_grad():
        probs = torch.softmax(shifted, dim=-1)
        entropy = lse - (probs * shifted).sum(-1)
    zero = logp.new_zeros(logp.shape[0], 1)
    return torch.cat([zero, logp], dim=1), torch.cat([zero, entropy], dim=1)


def token_logprobs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                   temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Forward a (right-padded) batch through a causal LM and return `logprobs_from_logits` of the
    distribution the rollout sampled from: logits / temperature (what behaviour logprobs are)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    return logprobs_from_logits(logits / temperature if temperature != 1.0 else logits, input_ids)


class _HeadLogprobs(torch.autograd.Function):
    """log p(target) and the entropy (no gradient) of softmax((hidden @ weightᵀ + bias) / temperature), the
    matmuls in `dtype` (autocast's, as F.linear would run them) and the softmax in float32. The
    vocabulary-wide logits live only inside forward and inside backward, which recomputes them: memory
    holds one chunk of them, and each pass over them is one that the gradient needs."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
                dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        logits = _head_logits(hidden, weight, bias, temperature, dtype)
        lse = torch.logsumexp(logits, dim=-1)
        logp_all = logits.sub_(lse.unsqueeze(-1))
        logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.dtype = temperature, dtype
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        # d logp / d logits = onehot(target) - p, divided by the temperature
        grad = _head_logits(hidden, weight, bias, ctx.temperature, ctx.dtype).sub_(lse.unsqueeze(-1)).exp_()
        grad.mul_(-grad_logp.unsqueeze(-1)).scatter_add_(-1, targets.unsqueeze(-1), grad_logp.unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        grad = grad.to(ctx.dtype)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = (grad @ weight.to(ctx.dtype)).to(hidden.dtype) if need_hidden else None
        grad_weight = (grad.T @ hidden.to(ctx.dtype)).to(weight.dtype) if need_weight else None
        grad_bias = grad.sum(0).to(bias.dtype) if bias is not None and need_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _head_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, dtype: torch.dtype) -> Tensor:
    logits = F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)).float()
    return logits.div_(temperature) if temperature != 1.0 else logits


def shareable_prefix(ids: Sequence[Sequence[int]], masks: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every sequence of a micro-batch has in common and predicts nothing from:
    their longest common prefix, ended before the position that predicts the first loss token."""
    limit = min(min(m.index(1) if 1 in m else len(m) for m in masks), min(len(r) for r in ids)) - 1
    n = 0
    for column in zip(*ids, strict=False):
        if n >= limit or any(t != column[0] for t in column):
            break
        n += 1
    return n


@functools.cache
def _cache_kwarg(decoder: type) -> str:
    """The keyword under which this decoder takes its KV cache (`cache` or `past_key_values`, by model class)."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def _decoder_hidden(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, prefix_len: int) -> Tensor:
    """The decoder's last hidden states from position `prefix_len` on. With a prefix, its tokens (the
    same in every row) run forward once; their keys and values, repeated for each row, serve the rest,
    and backward sums the rows' gradients into that one pass: the same values as the whole batch
    forward, for one row's prefix tokens instead of every row's."""
    decoder = model.get_decoder()
    if not prefix_len:
        return decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    cache = DynamicCache()
    arg = _cache_kwarg(type(decoder))
    decoder(input_ids=input_ids[:1, :prefix_len], use_cache=True, **{arg: cache})
    cache.batch_repeat_interleave(input_ids.shape[0])
    return decoder(input_ids=input_ids[:, prefix_len:], attention_mask=attention_mask, use_cache=True,
                   **{arg: cache}).last_hidden_state


def selective_token_logprobs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, loss_mask: Tensor,
                             temperature: float = 1.0, chunk_rows: int = 1024, prefix_len: int = 0
                             ) -> tuple[Tensor, Tensor]:
    """`token_logprobs` computed only where `loss_mask` is 1: the output head runs on those positions'
    hidden states alone, `chunk_rows` at a time, and each chunk's logits are recomputed in the backward
    pass instead of kept (`_HeadLogprobs`), so memory holds one chunk of vocabulary-wide logits rather than
    batch × length of them (what a 150k vocabulary needs). Zeros elsewhere, as `token_logprobs`.
    `prefix_len` (from `shareable_prefix`): that many leading tokens, the same in every row, run once."""
    hidden = _decoder_hidden(model, input_ids, attention_mask, prefix_len)
    rows, cols = (loss_mask[:, 1:] > 0).nonzero(as_tuple=True)  # token cols + 1 is predicted at position cols
    if prefix_len and len(cols) and int(cols.min()) < prefix_len:
        raise ValueError(f"prefix_len {prefix_len} covers a position that predicts a loss token; use shareable_prefix")
    picked, targets = hidden[rows, cols - prefix_len], input_ids[rows, cols + 1]
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"train.selective_logprobs needs a linear output head, and this model's is a "
                         f"{type(head).__name__}; set train.selective_logprobs: false")
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    weight = head_weight(head, dtype)
    logps, entropies = [], []
    for lo in range(0, len(rows), chunk_rows):
        logp, entropy = _HeadLogprobs.apply(picked[lo:lo + chunk_rows], weight, head.bias, targets[lo:lo + chunk_rows],
                                            temperature, dtype)
        logps.append(logp)
        entropies.append(entropy)
    shape = input_ids.shape
    logp_all = torch.zeros(shape, dtype=torch.float32, device=input_ids.device)
    entropy_all = torch.zeros(shape, dtype=torch.float32, device=input_ids.device)
    if logps:
        logp_all = logp_all.index_put((rows, cols + 1), torch.cat(logps))
        entropy_all[rows, cols + 1] = torch.cat(entropies).detach()
    return logp_all, entropy_all
