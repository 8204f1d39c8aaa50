"""One sampled continuation as the engine tracks it: its tokens, what of them is in the KV cache,
its blocks and its sampling state."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

from assay.rollout.base import SamplingParams


class Status(Enum):
    WAITING = auto()  # no blocks; admitted by the scheduler when blocks and budget allow
    RUNNING = auto()  # holds blocks; computes its uncomputed tokens (a prompt chunk, or the last sample)
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    seq_id: int
    tokens: list[int]  # prompt, then sampled tokens
    num_prompt: int
    params: SamplingParams
    stop_ids: frozenset[int]
    stream: int | None  # a seeded request's own random stream (see sampler.sample)
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose K/V are in the cache
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    # A GRPO sibling with the same prompt waits for its leader's prefill and then forks from it.
    leader: Sequence | None = None
    followers: list[Sequence] = field(default_factory=list)
    admitted: bool = False  # prompt-cache accounting happens once, not again after a preemption
    request: int = -1  # the engine request it belongs to
    # speculative drafts so far: tokens accepted, and drafts that ended in a rejected token
    draft_accepted: int = 0
    draft_rejected: int = 0

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def completion(self) -> list[int]:
        return self.tokens[self.num_prompt:]
