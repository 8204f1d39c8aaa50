"""The quality gate of a serving profile against another: mean per-token KL divergence on the same prompts.

Profile A (the reference, `standard`) answers each prompt greedily; both profiles' engines are then
teacher-forced on A's answer and their next-token distributions compared at every answer position:
KL(A || B) = sum_v p_A(v) (log p_A(v) - log p_B(v)), averaged over all positions of all prompts. The
answer is fed a few tokens a step (`chunk`, by default 1: each position through the decode step that
serving runs, int8 C kernels included), never as one long prefill, which would take another GEMM path."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor

from assay.core.errors import AssayError
from assay.rollout.base import GenRequest, SamplingParams
from assay.rollout.engine import Engine
from assay.rollout.engine.sequence import Sequence


@dataclass(frozen=True)
class KLResult:
    mean_kl: float  # nats per token
    max_kl: float  # the largest at one position
    tokens: int  # positions compared
    top1_agreement: float  # share of positions where both engines' argmax is the same token


def teacher_forced_logprobs(engine: Engine, prompt: list[int], answer: list[int], chunk: int = 1) -> Tensor:
    """log_softmax of the engine's next-token logits at each answer position, [len(answer), V]: the prompt
    prefilled, then the answer fed `chunk` tokens a step. The engine must be idle; nothing stays cached."""
    if not prompt or not answer or chunk < 1:
        raise AssayError("teacher_forced_logprobs: a prompt, an answer and a chunk of at least 1 token are needed")
    seq = Sequence(-1, prompt + answer, len(prompt), SamplingParams(temperature=0), frozenset(), None)
    if not engine.blocks.reserve(seq, len(seq.tokens)):
        raise AssayError(f"teacher_forced_logprobs: {len(seq.tokens)} tokens do not fit the engine's KV cache")
    out: list[Tensor] = []
    try:
        spans = [len(prompt)] + [min(chunk, len(answer) - 1 - i) for i in range(0, len(answer) - 1, chunk)]
        for k, n in enumerate(spans):
            logits = engine.runner.run([(seq, n)], [seq], {id(seq): 1 if k == 0 else n})
            seq.num_computed += n
            out.append(torch.log_softmax(logits.float(), dim=-1))
    finally:
        engine.blocks.release(seq, keep_partial=False)
    return torch.cat(out)


def profile_kl(reference: Engine, candidate: Engine, prompts: Seq[list[int]], max_tokens: int,
               chunk: int = 1) -> KLResult:
    """KL(reference || candidate) per token on the reference's greedy answers to `prompts`."""
    answers = reference.generate([GenRequest(p, SamplingParams(temperature=0, max_tokens=max_tokens))
                                  for p in prompts])
    total, worst, count, agree = 0.0, 0.0, 0, 0
    for prompt, [result] in zip(prompts, answers, strict=True):
        if not result.token_ids:
            continue
        a = teacher_forced_logprobs(reference, list(prompt), result.token_ids, chunk)
        b = teacher_forced_logprobs(candidate, list(prompt), result.token_ids, chunk)
        kl = (a.exp() * (a - b)).sum(dim=-1).clamp_(min=0.0)
        total, worst, count = total + float(kl.sum()), max(worst, float(kl.max())), count + kl.shape[0]
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
    if count == 0:
        raise AssayError("profile_kl: the reference answered every prompt with no token; give longer max_tokens")
    return KLResult(total / count, worst, count, agree / count)
