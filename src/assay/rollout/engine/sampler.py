"""Next-token sampling, one row of logits per sequence.

Each returned logprob is log_softmax(logits / temperature) of the sampled token: the tempered
distribution before top-k / top-p / min-p truncation (for temperature 0, greedy, the untempered
log_softmax). It is what the trainer recomputes from its own forward pass, so the two compare
token by token; truncation is left out because the trainer cannot know the truncated support
(with top_p=1, top_k=0, min_p=0, the RL default, the two coincide).

That default, every row sampled and none truncated, runs in C on the CPU (`cpu_kernel.sample_rows`):
one pass over each row for its maximum, one for its sum, and a scan of the 64 entries the uniform
falls in, where PyTorch takes a dozen passes and allocations over [rows, vocab].
"""

from __future__ import annotations

import torch
from torch import Tensor

from assay.rollout.base import SamplingParams
from assay.rollout.engine import cpu_kernel


def sample(logits: Tensor, params: list[SamplingParams], streams: list[int | None],
           positions: list[int]) -> tuple[list[int], list[float]]:
    """logits [N, V] float32 -> (token ids, their logprobs), one per row.

    A row with a stream key (a seeded request) draws its uniform from a counter-based generator keyed
    by (stream, position): its samples depend on nothing else, not on the batch it shares, nor on a
    preemption. Rows without one draw from torch's global generator."""
    stochastic = [i for i, p in enumerate(params) if p.temperature > 0]
    every = bool(stochastic) and len(stochastic) == len(params)
    if every and not any(_truncates(p) for p in params) and cpu_kernel.sample_usable(logits):
        return cpu_kernel.sample_rows(logits, [p.temperature for p in params], _uniforms(stochastic, streams, positions))
    if all(p.temperature in (0, 1) for p in params):  # dividing by 1 changes nothing: skip the pass
        logp = torch.log_softmax(logits, dim=-1)
    else:
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=logits.dtype,
                             device=logits.device)
        logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = None if every else logp.argmax(dim=-1)  # greedy rows' tokens (not needed when none is greedy)
    if stochastic:
        probs = truncate((logp if every else logp[stochastic]).exp(), [params[i] for i in stochastic])
        u = _uniforms(stochastic, streams, positions)
        cdf = probs.double().cumsum(-1)
        picked = torch.searchsorted(cdf, (u.to(cdf.device) * cdf[:, -1])[:, None], right=True).squeeze(-1)
        picked = picked.clamp_(max=probs.shape[-1] - 1)
        if every:
            tokens = picked
        else:
            tokens[stochastic] = picked
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens.tolist(), chosen.tolist()


def _uniforms(stochastic: list[int], streams: list[int | None], positions: list[int]) -> Tensor:
    """The uniform each stochastic row samples at (float64)."""
    u = torch.rand(len(stochastic), dtype=torch.float64)  # drawn even when every row is seeded, as always
    seeded = [j for j, i in enumerate(stochastic) if streams[i] is not None]
    if seeded:
        u[seeded] = torch.tensor([uniform(streams[stochastic[j]], positions[stochastic[j]]) for j in seeded],
                                 dtype=torch.float64)
    return u


def _truncates(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0


_MASK = 2**64 - 1


def uniform(key: int, counter: int) -> float:
    """A uniform in [0, 1) from (key, counter) by SplitMix64: cheap, stateless, well mixed."""
    z = (key + (counter + 1) * 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


def truncate(probs: Tensor, params: list[SamplingParams]) -> Tensor:
    """Zero the tokens that top-k, top-p and min-p exclude (rows without them stay as they are)."""
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(min_p):
        floor = torch.tensor(min_p, dtype=probs.dtype, device=probs.device)[:, None] * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        k = torch.tensor([k if k > 0 else probs.shape[-1] for k in top_k], device=probs.device)[:, None]
        # keep a token while the mass strictly before it is below top_p (the top token always stays)
        before = sorted_p.cumsum(-1) - sorted_p
        p = torch.tensor(top_p, dtype=probs.dtype, device=probs.device)[:, None]
        keep = (rank < k) & (before < p * sorted_p.sum(-1, keepdim=True))
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
    return probs
