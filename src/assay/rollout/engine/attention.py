"""Attention over the paged KV cache.

Sequences attend in groups, each one padded batch: the decoding sequences (one query each) and the
prefilling ones (a chunk of queries each). Keys and values are gathered block by block through each
sequence's block table. Grouped-query heads are folded into the query axis for decoding, so K/V are
never repeated per query head. Decoding in float32 on the CPU reads the blocks in place through the C
kernel of `cpu_kernel` instead of gathering them (decode is memory-bound there), writing straight into
the step's output when the decoding rows are the first of the batch (the scheduler puts them there).

Prefilling on the CPU goes a sequence at a time (`_prefill_each`), with no padding to the longest
chunk: in float32 at head sizes 64 and 128 through the C kernel's causal prefill, read in place;
otherwise gathered into SDPA (its causal kernel when no keys are cached before the chunk, which skips
the masked half of long prompts). On an accelerator the prefilling sequences are one padded batch
under a mask.

Decoding sequences that share leading blocks (the samples of one GRPO group share their prompt)
attend in two parts, merged exactly by their log-sum-exp: the shared prefix once for the whole
cluster, with all its members' queries in one batch, and each member's own suffix. A shared prompt
is then read from memory once per step instead of once per sample. On the kernel's path the merge is C too,
in place over each member's own part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from assay.rollout.engine import cpu_kernel


@dataclass
class SharedPrefix:
    tables: Tensor  # [C, P] the common leading blocks of each cluster (padding: block 0, masked out)
    members: Tensor  # [C, G] the group row of each member (padding repeats a member)
    real: Tensor  # [C * G] which member slots are real
    lengths: Tensor  # [C] keys in the cluster's prefix
    targets: Tensor | None = None  # [C, G] the group row of each member, -1 for padding (the C kernel's form)


@dataclass
class AttentionGroup:
    rows: Tensor | None  # [B, Tq] packed token index of each query row (padding repeats a valid index); None: spans
    block_tables: Tensor  # [B, M] cache blocks each row attends (after its shared prefix, if any)
    mask: Tensor | None  # prefilling off the CPU: [B, 1, Tq, M * block_size] True where a query may attend
    valid: Tensor | None  # [B * Tq] which query rows are real; None when all are
    lengths: Tensor | None = None  # decoding: [B] keys each row attends in its block_tables
    shared: SharedPrefix | None = None  # decoding only
    start: int | None = None  # decoding: rows are start, start + 1, ... (so q and out are slices, not gathers)
    spans: list[tuple[int, int, int]] | None = None  # prefilling: (first packed row, queries, cached keys) each


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, groups: list[AttentionGroup]) -> Tensor:
    """q [T, H, D] packed queries; k_cache, v_cache [blocks, block_size, Hkv, D] of one layer."""
    out = torch.empty_like(q)
    for g in groups:
        if g.spans is not None:
            _prefill_each(q, k_cache, v_cache, g, out)
            continue
        B, Tq = g.rows.shape
        if Tq == 1 and g.start is not None and cpu_kernel.usable(q, k_cache):
            _decode_in_place(q[g.start : g.start + B], k_cache, v_cache, g, out[g.start : g.start + B])
            continue
        if Tq == 1:
            o = _decode(q[g.rows[:, 0]], k_cache, v_cache, g)
        else:
            qg = q[g.rows].transpose(1, 2)  # [B, H, Tq, D]
            o = F.scaled_dot_product_attention(qg, _gather(k_cache, g.block_tables), _gather(v_cache, g.block_tables),
                                               attn_mask=g.mask, enable_gqa=True).transpose(1, 2)
        o = o.reshape(B * Tq, *q.shape[1:])
        rows = g.rows.reshape(-1)
        if g.valid is None:
            out[rows] = o
        else:
            out[rows[g.valid]] = o[g.valid]
    return out


def _gather(cache: Tensor, tables: Tensor) -> Tensor:
    """[B, M] block ids -> [B, Hkv, M * block_size, D]."""
    B, M = tables.shape
    return cache.index_select(0, tables.reshape(-1)).view(B, M * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def _prefill_each(q: Tensor, k_cache: Tensor, v_cache: Tensor, g: AttentionGroup, out: Tensor) -> None:
    """Each prefilling sequence's chunk over its cached keys and its own, written into out's rows."""
    bs = k_cache.shape[1]
    kernel = cpu_kernel.prefill_usable(q, k_cache)
    for b, (start, n, first) in enumerate(g.spans):
        keys = first + n
        if kernel:
            cpu_kernel.paged_prefill(q[start : start + n], k_cache, v_cache, g.block_tables[b], first,
                                     out[start : start + n])
            continue
        table = g.block_tables[b : b + 1, : -(-keys // bs)]
        k, v = _gather(k_cache, table)[:, :, :keys], _gather(v_cache, table)[:, :, :keys]
        qb = q[start : start + n].transpose(0, 1)[None]  # [1, H, n, D]
        if first == 0:
            o = F.scaled_dot_product_attention(qb, k, v, is_causal=True, enable_gqa=True)
        else:  # query i sits at position first + i
            mask = torch.arange(keys, device=q.device)[None, :] <= torch.arange(first, keys, device=q.device)[:, None]
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, enable_gqa=True)
        out[start : start + n] = o[0].transpose(0, 1)


def _decode_in_place(q: Tensor, k_cache: Tensor, v_cache: Tensor, g: AttentionGroup, out: Tensor) -> None:
    """The C kernel's decode: q and out [B, H, D] are contiguous slices of the step's queries and
    output; the shared prefixes are merged into each row's own part in place."""
    B, H, D = q.shape
    kv_heads = k_cache.shape[2]
    qf, of = q.view(B, kv_heads, H // kv_heads, D), out.view(B, kv_heads, H // kv_heads, D)
    _, lse = cpu_kernel.paged_attention(qf, k_cache, v_cache, g.block_tables, g.lengths, out=of)
    s = g.shared
    if s is not None:
        targets = s.targets if s.targets is not None else torch.where(s.real.view(s.members.shape), s.members, -1)
        cpu_kernel.paged_attention_shared(qf, k_cache, v_cache, s.tables, s.lengths, targets, of, lse)


def _decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, g: AttentionGroup) -> Tensor:
    """q [B, H, D] -> [B, H, D]; one query per sequence, query heads folded per KV head."""
    B, H, D = q.shape
    kv_heads = k_cache.shape[2]
    qf = q.view(B, kv_heads, H // kv_heads, D)
    if cpu_kernel.usable(q, k_cache):
        attend = cpu_kernel.paged_attention
    elif g.shared is None:  # nothing to merge, so no log-sum-exp needed: SDPA's fused kernel
        mask = _length_mask(g.block_tables, k_cache.shape[1], g.lengths)
        return F.scaled_dot_product_attention(qf, _gather(k_cache, g.block_tables), _gather(v_cache, g.block_tables),
                                              attn_mask=mask).reshape(B, H, D)
    else:
        attend = _attend_gathered
    own, own_lse = attend(qf, k_cache, v_cache, g.block_tables, g.lengths)
    if g.shared is None:
        return own.reshape(B, H, D)
    s = g.shared
    C, G = s.members.shape
    qc = qf[s.members].permute(0, 2, 1, 3, 4).reshape(C, kv_heads, G * (H // kv_heads), D)
    pre, pre_lse = attend(qc, k_cache, v_cache, s.tables, s.lengths)
    pre = pre.view(C, kv_heads, G, H // kv_heads, D).transpose(1, 2).reshape(C * G, kv_heads, H // kv_heads, D)
    pre_lse = pre_lse.view(C, kv_heads, G, H // kv_heads, 1).transpose(1, 2).reshape(C * G, kv_heads, -1, 1)
    at = s.members.reshape(-1)[s.real]
    shared = torch.zeros_like(own)
    shared_lse = torch.full_like(own_lse, float("-inf"))  # rows outside any cluster: no prefix part
    shared[at], shared_lse[at] = pre[s.real], pre_lse[s.real]
    total = torch.logaddexp(own_lse, shared_lse)
    merged = torch.exp(own_lse - total) * own + torch.exp(shared_lse - total) * shared
    return merged.reshape(B, H, D)


def _attend_gathered(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor,
                     lengths: Tensor) -> tuple[Tensor, Tensor]:
    mask = _length_mask(tables, k_cache.shape[1], lengths)
    return _attend(q, _gather(k_cache, tables), _gather(v_cache, tables), mask)


def _length_mask(tables: Tensor, block_size: int, lengths: Tensor) -> Tensor:
    """[B, 1, 1, M * block_size]: True for the first lengths[b] keys of each row's gathered blocks."""
    keys = torch.arange(tables.shape[1] * block_size, device=tables.device)
    return (keys[None, :] < lengths[:, None])[:, None, None, :]


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax attention that also returns the log-sum-exp of each query's scores (every query
    must have at least one key it may attend)."""
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2)).masked_fill_(~mask, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(top).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    return torch.matmul(weights, v) / total, top + total.log()
