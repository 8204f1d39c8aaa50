"""The rollout seam: token ids in, sampled token ids and their logprobs out."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


@dataclass
class GenRequest:
    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1  # samples of the same prompt (a GRPO group shares its prefix)
    session_id: str | None = None  # multi-turn: the engine may keep this session's KV


@dataclass
class GenResult:
    token_ids: list[int]
    # Logprob of each sampled token under the sampling distribution actually used
    # (after temperature; before top-p/top-k truncation), i.e. the behaviour policy.
    logprobs: list[float]
    finish_reason: str  # stop | length
    policy_version: int


class RolloutBackend(Protocol):
    def generate(self, requests: Sequence[GenRequest]) -> list[list[GenResult]]:
        """One list of n results per request, in request order."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None: ...
