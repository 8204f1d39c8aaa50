"""Prompt-lookup speculative decoding with exact acceptance.

When few sequences are decoding, each step is dominated by fixed costs, so a sequence may verify
several tokens at once. The draft is free: the tokens that followed the most recent earlier
occurrence of the sequence's last n-gram (in its prompt or its own output). The model scores the
sampled token and the draft in one forward pass; draft token d at a position with sampling
distribution p is accepted with probability p(d) (the draft is a point mass, so this is
min(1, p/q)); on the first rejection the token is drawn from p with d removed, renormalized; if
every draft token is accepted, one more token is drawn from the last position. Each emitted token
is therefore distributed exactly as without speculation (greedy: accepted iff it is the argmax).

Whether a draft pays depends on the machine: a step that verifies k drafted tokens per sequence runs
1 + k rows, and on a CPU whose few-row kernels are bound by arithmetic rather than by reading the weights,
it costs several plain decode steps (3.8 at 4 rows on a Zen 4 with int8 weights; docs/experiments.md S2).
So the engine times the verifying steps as it starts (`DraftCosts`), tracks each sequence's acceptance,
and drafts the length that maximizes expected tokens per second (`draft_length`), none where none pays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from assay.rollout.base import SamplingParams
from assay.rollout.engine.sampler import truncate, uniform

_ACCEPT_SALT = 0x5DEECE66D  # acceptance tests draw from a stream apart from the token draws


@dataclass(frozen=True)
class DraftCosts:
    """Seconds of a step in which b sequences each verify k drafted tokens, timed on this machine:
    seconds[b - 1][k], b from 1 to the engine's speculative_max_batch, k from 0 (a plain decode step) to its
    speculative_tokens."""

    seconds: tuple[tuple[float, ...], ...]

    def relative(self, batch: int) -> str:
        """Each draft length's step as a multiple of the plain step, for the log: "1.0/2.1/3.6/4.2"."""
        row = self.seconds[batch - 1]
        return "/".join(f"{t / row[0]:.1f}" for t in row)


def acceptance(accepted: int, rejected: int) -> float:
    """A sequence's chance to accept its next draft token: its accepted draft tokens against its drafts that
    ended in a rejection (each token is accepted only if those before it were), with one of each as a prior."""
    return (accepted + 1) / (accepted + rejected + 2)


def draft_length(accept: list[float], available: list[int], costs: tuple[float, ...]) -> int:
    """The draft length k (0: no draft) with the most expected tokens per second of step: with k drafted,
    sequence i emits sum_{t=0}^{min(k, available_i)} accept_i^t tokens in expectation, and the step takes
    costs[k] seconds (`DraftCosts.seconds` of this batch size)."""
    best_k, best_rate = 0, len(accept) / costs[0]
    for k in range(1, len(costs)):
        expected = sum(sum(a ** t for t in range(min(k, n) + 1)) for a, n in zip(accept, available, strict=True))
        if expected / costs[k] > best_rate:
            best_k, best_rate = k, expected / costs[k]
    return best_k


def propose(tokens: list[int], ngram: int, limit: int, min_ngram: int = 1) -> list[int]:
    """Up to `limit` tokens that followed the latest earlier occurrence of the last n tokens
    (n from `ngram` down to `min_ngram`)."""
    if limit <= 0:
        return []
    for n in range(min(ngram, len(tokens) - 1), max(min_ngram, 1) - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + limit]
    return []


def verify(logits: Tensor, draft: list[int], params: SamplingParams, stream: int | None,
           position: int) -> tuple[list[int], list[float]]:
    """logits [len(draft) + 1, V] at the draft's positions (row j predicts the token at
    `position + j`) -> the emitted tokens (accepted draft tokens, then one drawn token) and their
    logprobs, log_softmax(logits / temperature) as in `sampler.sample`."""
    temperature = params.temperature if params.temperature > 0 else 1.0
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    out: list[int] = []
    for j, d in enumerate(draft + [None]):
        if params.temperature == 0:
            tok = int(logp[j].argmax())
            out.append(tok)
            if tok != d:
                break
            continue
        p = truncate(logp[j:j + 1].exp(), [params])[0].double()
        p = p / p.sum()
        if d is not None:
            u = uniform(stream ^ _ACCEPT_SALT, position + j) if stream is not None else float(torch.rand(()))
            if u < float(p[d]):
                out.append(d)
                continue
            p[d] = 0.0  # rejected: draw from what is left
        u = uniform(stream, position + j) if stream is not None else float(torch.rand(()))
        cdf = p.cumsum(0)
        out.append(int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp_(max=len(p) - 1)))
        break
    lps = [float(logp[j, t]) for j, t in enumerate(out)]
    return out, lps
