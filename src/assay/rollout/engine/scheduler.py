"""Continuous batching under a per-step token budget: decode first, then chunked prefill.

Every running sequence has some tokens whose K/V are not yet computed: one (the token it just
sampled) when it is decoding, more while its prompt is being prefilled. A step computes one token
for every decoding sequence, then spends what is left of the budget on prompt chunks, first for
sequences already admitted, then for waiting ones in arrival order. When a decoding sequence
needs a block and none is free, the most recently admitted sequence is preempted: its blocks are
released and it waits to be recomputed (its cached prefix usually survives, so that is cheap).
"""

from __future__ import annotations

from collections import deque

from assay.rollout.engine.block_manager import BlockManager
from assay.rollout.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batched_tokens: int, max_seqs: int) -> None:
        self.blocks = blocks
        self.max_batched_tokens = max_batched_tokens
        self.max_seqs = max_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.cached_tokens = 0  # prompt tokens served from the prefix cache at first admission

    def add(self, seq: Sequence, front: bool = False) -> None:
        seq.status = Status.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def start(self, seq: Sequence) -> None:
        """A sequence that already holds its blocks (a fork) joins the running set."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.running.remove(seq)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, number of its tokens to compute) for the next step."""
        budget = self.max_batched_tokens
        plan: list[tuple[Sequence, int]] = []
        decoding = [s for s in self.running if s.num_uncomputed == 1]
        for seq in decoding:
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            while not self.blocks.reserve(seq, seq.num_computed + 1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                plan.append((seq, 1))
                budget -= 1
        for seq in self.running:
            if budget <= 0:
                break
            if seq.num_uncomputed > 1:
                n = min(seq.num_uncomputed, budget)
                plan.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            cached = self.blocks.admit(seq)
            if cached is None:
                break
            self.waiting.popleft()
            if not seq.admitted:
                seq.admitted = True
                self.cached_tokens += cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget)
            plan.append((seq, n))
            budget -= n
        return plan

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq, keep_partial=False)
        self.add(seq, front=True)
        self.preemptions += 1
