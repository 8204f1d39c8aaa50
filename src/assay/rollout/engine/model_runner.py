"""Turn a scheduled step into the tensors of one packed forward pass, and run it."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from assay.rollout.engine.attention import AttentionGroup, SharedPrefix
from assay.rollout.engine.model import Batch, PagedModel
from assay.rollout.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: PagedModel) -> None:
        self.model = model
        self.block_size = model.block_size

    def run(self, plan: list[tuple[Sequence, int]], sampling: list[Sequence],
            spans: dict[int, int] | None = None) -> Tensor:
        """Compute the planned tokens; return the logits of the last token of each sequence in
        `sampling` (each must finish its uncomputed tokens in this step), or of its last
        spans[id(seq)] tokens, in order: [sum of spans, V]."""
        return self.model.forward(self.prepare(plan, sampling, spans or {}))

    def prepare(self, plan: list[tuple[Sequence, int]], sampling: list[Sequence], spans: dict[int, int]) -> Batch:
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last: dict[int, int] = {}
        decodes: list[tuple[Sequence, int]] = []
        prefills: list[tuple[Sequence, int, int]] = []
        for seq, n in plan:
            start = len(tokens)
            lo = seq.num_computed
            tokens += seq.tokens[lo : lo + n]
            positions += range(lo, lo + n)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(lo, lo + n)]
            last[id(seq)] = start + n - 1
            if n == 1:
                decodes.append((seq, start))
            else:
                prefills.append((seq, start, n))
        groups = []
        if decodes:
            groups.append(self._decode_group(decodes))
        if prefills:
            groups.append(self._prefill_group(prefills))
        device = self.model.device
        return Batch(
            tokens=torch.tensor(tokens, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slots=torch.tensor(slots, dtype=torch.long, device=device),
            groups=groups,
            logits_at=torch.tensor([i for s in sampling for i in range(last[id(s)] - spans.get(id(s), 1) + 1,
                                                                         last[id(s)] + 1)],
                                   dtype=torch.long, device=device),
        )

    def _prefill_group(self, members: list[tuple[Sequence, int, int]]) -> AttentionGroup:
        bs = self.block_size
        width = max(-(-(seq.num_computed + n) // bs) for seq, _, n in members)
        tables = _pad([seq.block_table[:width] for seq, _, _ in members], width)
        if not _padded_prefill(self.model.device):  # a sequence at a time (attention._prefill_each)
            spans = [(start, n, seq.num_computed) for seq, start, n in members]
            return AttentionGroup(None, tables, mask=None, valid=None, spans=spans)
        tq = max(n for _, _, n in members)
        rows = torch.tensor([[start + min(t, n - 1) for t in range(tq)] for _, start, n in members])
        first = torch.tensor([seq.num_computed for seq, _, _ in members])[:, None]
        lengths = torch.tensor([n for _, _, n in members])[:, None]
        offset = torch.arange(tq)[None, :]
        real = offset < lengths  # [B, Tq]
        key_pos = torch.arange(width * bs)
        mask = key_pos[None, None, :] <= (first + offset)[:, :, None]  # causal; bounds each row by its context
        mask = torch.where(real[:, :, None], mask, key_pos[None, None, :] == 0)  # padding rows: harmless
        valid = None if bool(real.all()) else real.reshape(-1)
        return self._to_device(AttentionGroup(rows, tables, mask[:, None], valid))

    def _decode_group(self, members: list[tuple[Sequence, int]]) -> AttentionGroup:
        bs = self.block_size
        seqs = [seq for seq, _ in members]
        skip = [0] * len(seqs)  # leading blocks each row reads through its cluster's shared prefix
        clusters = _clusters(seqs, bs)
        for rows, shared in clusters:
            for r in rows:
                skip[r] = shared
        ctx = [seq.num_computed + 1 for seq in seqs]
        width = max(-(-c // bs) - s for c, s in zip(ctx, skip, strict=True))
        tables = _pad([seq.block_table[s : -(-c // bs)] for seq, c, s in zip(seqs, ctx, skip, strict=True)], width)
        own = torch.tensor([c - s * bs for c, s in zip(ctx, skip, strict=True)])
        rows = torch.tensor([[start] for _, start in members])
        shared = None
        if clusters:
            most = max(len(r) for r, _ in clusters)
            longest = max(s for _, s in clusters)
            shared = SharedPrefix(
                tables=_pad([seqs[r[0]].block_table[:s] for r, s in clusters], longest),
                members=torch.tensor([r + [r[0]] * (most - len(r)) for r, _ in clusters]),
                real=torch.tensor([i < len(r) for r, _ in clusters for i in range(most)]),
                lengths=torch.tensor([s * bs for _, s in clusters]),
                targets=torch.tensor([r + [-1] * (most - len(r)) for r, _ in clusters]),
            )
        starts = [start for _, start in members]
        first = starts[0] if starts == list(range(starts[0], starts[0] + len(starts))) else None
        return self._to_device(AttentionGroup(rows, tables, mask=None, valid=None, lengths=own, shared=shared,
                                              start=first))

    def _to_device(self, g: AttentionGroup) -> AttentionGroup:
        d = self.model.device
        if d.type == "cpu":
            return g
        s = g.shared
        if s is not None:
            s = SharedPrefix(s.tables.to(d), s.members.to(d), s.real.to(d), s.lengths.to(d),
                             None if s.targets is None else s.targets.to(d))
        return AttentionGroup(*(None if t is None else t.to(d) for t in (g.rows, g.block_tables, g.mask, g.valid,
                                                                          g.lengths)), s, g.start)


def _padded_prefill(device: torch.device) -> bool:
    """The prefilling sequences as one padded batch under a mask: one launch on an accelerator. The CPU takes
    them one at a time, with no padding and SDPA's causal kernel where it applies."""
    return device.type != "cpu"


def _clusters(seqs: list[Sequence], block_size: int) -> list[tuple[list[int], int]]:
    """Decoding rows that share leading computed blocks: (rows, number of shared blocks) for each
    cluster of two or more."""
    by_first: dict[int, list[int]] = defaultdict(list)
    for i, seq in enumerate(seqs):
        if seq.num_computed >= block_size:
            by_first[seq.block_table[0]].append(i)
    out = []
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        ref = seqs[rows[0]].block_table
        shared = min(seqs[r].num_computed // block_size for r in rows)
        for r in rows[1:]:
            table = seqs[r].block_table
            n = 0
            while n < shared and table[n] == ref[n]:
                n += 1
            shared = n
        out.append((rows, shared))
    return out


def _pad(tables: list[list[int]], width: int) -> Tensor:
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
