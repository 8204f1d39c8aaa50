"""The C paged-attention kernel against the PyTorch gather path it replaces on the CPU."""

import pytest
import torch

from assay.rollout.engine import attention, cpu_kernel

pytestmark = pytest.mark.skipif(cpu_kernel._library() is None, reason="no C compiler: the PyTorch path runs")


def cache_and_rows(rows=5, kv_heads=2, nq=3, dim=16, block_size=4, blocks=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks, block_size, kv_heads, dim, generator=g)
    v = torch.randn(blocks, block_size, kv_heads, dim, generator=g)
    q = torch.randn(rows, kv_heads, nq, dim, generator=g)
    width = 6
    tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in range(rows)])  # scattered blocks
    lengths = torch.tensor([1, 3, 4, 17, width * block_size])[:rows]  # a partial block, one exactly full, all
    return q, k, v, tables, lengths


def test_kernel_matches_the_gather_path():
    q, k, v, tables, lengths = cache_and_rows()
    out, lse = cpu_kernel.paged_attention(q, k, v, tables, lengths)
    want, want_lse = attention._attend_gathered(q, k, v, tables, lengths)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_kernel_reads_only_each_rows_own_keys():
    q, k, v, tables, lengths = cache_and_rows()
    out, _ = cpu_kernel.paged_attention(q, k, v, tables, lengths)
    used = {int(b) for r, n in enumerate(lengths) for b in tables[r, : -(-int(n) // k.shape[1])]}
    poisoned_k, poisoned_v = k.clone(), v.clone()
    for b in set(range(k.shape[0])) - used:
        poisoned_k[b], poisoned_v[b] = float("nan"), float("nan")
    last = tables[1, 0]  # row 1 attends 3 of its first block's 4 slots: the 4th must not count
    poisoned_k[last, 3], poisoned_v[last, 3] = 1e6, 1e6
    again, _ = cpu_kernel.paged_attention(q, poisoned_k, poisoned_v, tables, lengths)
    torch.testing.assert_close(again[1], out[1])
    assert torch.isfinite(again).all()


def test_a_row_without_keys_has_zero_weight_in_a_merge():
    q, k, v, tables, _ = cache_and_rows(rows=2)
    out, lse = cpu_kernel.paged_attention(q, k, v, tables, torch.tensor([0, 5]))
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert torch.isfinite(lse[1]).all()


def test_a_bad_block_table_is_an_error_not_a_stray_read():
    q, k, v, tables, lengths = cache_and_rows()
    bad = tables.clone()
    bad[2, 0] = k.shape[0]  # one past the last block
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_kernel.paged_attention(q, k, v, bad, lengths)
    with pytest.raises(ValueError, match="exceeds"):
        cpu_kernel.paged_attention(q, k, v, tables, lengths + tables.shape[1] * k.shape[1])


def test_mismatched_shapes_and_dtypes_are_clear_errors():
    q, k, v, tables, lengths = cache_and_rows()
    with pytest.raises(ValueError, match="do not fit"):
        cpu_kernel.paged_attention(q[..., :8], k, v, tables, lengths)
    with pytest.raises(ValueError, match="float32"):
        cpu_kernel.paged_attention(q.double(), k.double(), v.double(), tables, lengths)
