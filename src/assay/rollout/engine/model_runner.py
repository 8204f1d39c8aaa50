"""Turn a scheduled step into the tensors of one packed forward pass, and run it."""

from __future__ import annotations

import torch
from torch import Tensor

from assay.rollout.engine.model import AttentionGroup, Batch, PagedModel
from assay.rollout.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: PagedModel) -> None:
        self.model = model
        self.block_size = model.block_size

    def run(self, plan: list[tuple[Sequence, int]], sampling: list[Sequence]) -> Tensor:
        """Compute the planned tokens; return logits [len(sampling), V] for the sequences in
        `sampling` (each must finish its uncomputed tokens in this step)."""
        return self.model.forward(self.prepare(plan, sampling))

    def prepare(self, plan: list[tuple[Sequence, int]], sampling: list[Sequence]) -> Batch:
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last: dict[int, int] = {}
        decodes: list[tuple[Sequence, int, int]] = []
        prefills: list[tuple[Sequence, int, int]] = []
        for seq, n in plan:
            start = len(tokens)
            lo = seq.num_computed
            tokens += seq.tokens[lo : lo + n]
            positions += range(lo, lo + n)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(lo, lo + n)]
            last[id(seq)] = start + n - 1
            (decodes if n == 1 else prefills).append((seq, start, n))
        device = self.model.device
        groups = [self._group(g, device) for g in (decodes, prefills) if g]
        return Batch(
            tokens=torch.tensor(tokens, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slots=torch.tensor(slots, dtype=torch.long, device=device),
            groups=groups,
            logits_at=torch.tensor([last[id(s)] for s in sampling], dtype=torch.long, device=device),
        )

    def _group(self, members: list[tuple[Sequence, int, int]], device: torch.device) -> AttentionGroup:
        bs = self.block_size
        tq = max(n for _, _, n in members)
        width = max(-(-(seq.num_computed + n) // bs) for seq, _, n in members)
        rows = torch.tensor([[start + min(t, n - 1) for t in range(tq)] for _, start, n in members], dtype=torch.long)
        tables = torch.tensor([seq.block_table[:width] + [0] * (width - min(width, len(seq.block_table)))
                               for seq, _, _ in members], dtype=torch.long)
        first = torch.tensor([seq.num_computed for seq, _, _ in members])[:, None]
        lengths = torch.tensor([n for _, _, n in members])[:, None]
        offset = torch.arange(tq)[None, :]
        query_pos = first + offset  # [B, Tq]
        real = offset < lengths  # [B, Tq]
        key_pos = torch.arange(width * bs)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # causal; also bounds each row by its context
        mask = torch.where(real[:, :, None], mask, key_pos[None, None, :] == 0)  # padding rows: harmless
        valid = None if bool(real.all()) else real.reshape(-1).to(device)
        return AttentionGroup(rows.to(device), tables.to(device), mask[:, None].to(device), valid)
