"""The C paged-attention kernel against the PyTorch gather path it replaces on the CPU."""

import pytest
import torch

from assay.rollout.engine import attention, cpu_kernel

pytestmark = pytest.mark.skipif(cpu_kernel._library() is None,  # "missing tool": CI fails it (tests/conftest.py)
                                reason="missing tool: the C kernels did not build (a C compiler with OpenMP); "
                                       "the PyTorch path runs")


@pytest.fixture(params=[1, 2, 8], ids=["1-thread", "2-threads", "8-threads"])
def threads(request):
    """1 thread: a task takes a whole row (or cluster), all its heads a block at a time; 2: the same, each
    thread also requesting the next row it takes; 8: fewer rows than threads, so each task takes one head."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


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


# -- the fused elementwise kernels against the PyTorch ops they replace (odd sizes, both layouts) -----------

TOL = dict(atol=1e-5, rtol=1e-5)  # float32: the C loops sum in another order (and may fuse multiply-adds)


def activation(T, n, layout, g):
    """A logical [T, n] activation: token-major (layout False), the transpose of a contiguous [n, T]
    (True: feature-major), or "sliced": columns of a wider token-major tensor (one GEMM over several
    weights)."""
    if layout == "sliced":
        return torch.randn(T, n + 11, generator=g)[:, 3:3 + n]
    return torch.randn(n, T, generator=g).t() if layout else torch.randn(T, n, generator=g)


@pytest.mark.parametrize("feature_major", [False, True])
@pytest.mark.parametrize("T", [1, 5, 37])
@pytest.mark.parametrize("with_delta,with_bias", [(False, False), (True, False), (True, True)])
def test_add_rms_norm_matches_the_residual_add_and_rms_norm(feature_major, T, with_delta, with_bias):
    g = torch.Generator().manual_seed(T)
    n = 43
    h = activation(T, n, feature_major, g)
    delta = activation(T, n, feature_major, g) if with_delta else None
    bias = torch.randn(n, generator=g) if with_bias else None
    weight = torch.rand(n, generator=g) + 0.5
    want_h = h + (delta + bias if with_bias else delta) if with_delta else h.clone()
    want = weight * torch.nn.functional.rms_norm(want_h, (n,), eps=1e-6)
    out = torch.empty(T, n)  # token-major, whatever h's layout
    cpu_kernel.add_rms_norm(h, delta, bias, weight, out, 1e-6)
    torch.testing.assert_close(h, want_h, **TOL)
    torch.testing.assert_close(out, want, **TOL)
    again = torch.empty_like(h)  # and in h's own layout
    cpu_kernel.add_rms_norm(h, None, None, weight, again, 1e-6)
    torch.testing.assert_close(again, want, **TOL)


@pytest.mark.parametrize("layout", [False, True, "sliced"])
@pytest.mark.parametrize("biases", [False, True])
def test_silu_mul_matches_silu_times_up(layout, biases):
    g = torch.Generator().manual_seed(1)
    T, n = 7, 29
    gate, up = activation(T, n, layout, g), activation(T, n, layout, g)
    bg, bu = (torch.randn(n, generator=g), torch.randn(n, generator=g)) if biases else (None, None)
    want = torch.nn.functional.silu(gate + bg if biases else gate) * (up + bu if biases else up)
    got = cpu_kernel.silu_mul(gate, up, bg, bu)
    torch.testing.assert_close(got, want, **TOL)
    assert got.is_contiguous()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("layout", [False, True, "sliced"])
@pytest.mark.parametrize("biases", [False, True])
def test_qkv_rope_matches_rope_and_the_cache_write(layout, biases):
    g = torch.Generator().manual_seed(2)
    T, H, Hkv, D, blocks, bs = 9, 6, 2, 10, 7, 3  # head size 10: neither 64 nor a multiple of 8
    q, k, v = (activation(T, heads * D, layout, g) for heads in (H, Hkv, Hkv))
    bq, bk, bv = ((torch.randn(heads * D, generator=g) for heads in (H, Hkv, Hkv)) if biases else (None,) * 3)
    angles = torch.rand(50, D // 2, generator=g) * 6
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    positions = torch.randint(0, 50, (T,), generator=g)
    slots = torch.randperm(blocks * bs, generator=g)[:T]
    k_cache, v_cache = torch.zeros(blocks, bs, Hkv, D), torch.zeros(blocks, bs, Hkv, D)

    def rope(x, b, heads):
        x = (x if b is None else x + b).reshape(T, heads, D)
        c, s = cos[positions][:, None], sin[positions][:, None]
        return x * c + rotate_half(x) * s

    got = cpu_kernel.qkv_rope(q, k, v, (bq, bk, bv), cos, sin, positions, slots, k_cache, v_cache, H)
    torch.testing.assert_close(got, rope(q, bq, H), **TOL)
    flat_k, flat_v = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
    torch.testing.assert_close(flat_k[slots], rope(k, bk, Hkv), **TOL)
    torch.testing.assert_close(flat_v[slots], (v if bv is None else v + bv).reshape(T, Hkv, D), **TOL)
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert (flat_k[untouched] == 0).all() and (flat_v[untouched] == 0).all()
    with pytest.raises(ValueError, match="outside"):
        cpu_kernel.qkv_rope(q, k, v, (bq, bk, bv), cos, sin, positions + 50, slots, k_cache, v_cache, H)


@pytest.mark.parametrize("nq", [3, 5])  # 5: the first cluster's 15 queries a head take the many-query kernel
@pytest.mark.parametrize("dim", [16, 64])
def test_the_shared_prefix_merge_equals_attention_over_prefix_and_own_keys(dim, nq, threads):
    g = torch.Generator().manual_seed(3)
    B, Hkv, bs, blocks = 7, 2, 4, 60
    k, v = torch.randn(blocks, bs, Hkv, dim, generator=g), torch.randn(blocks, bs, Hkv, dim, generator=g)
    q = torch.randn(B, Hkv, nq, dim, generator=g)
    perm = torch.randperm(blocks, generator=g).tolist()
    prefix = [perm[0:3], perm[3:5]]  # two clusters: 12 and 8 shared keys
    members = torch.tensor([[0, 2, 5], [1, 4, -1]])  # rows 3 and 6 share nothing
    own_tables = torch.tensor([perm[10 + 3 * r : 13 + 3 * r] for r in range(B)])
    own_lengths = torch.tensor([1, 5, 9, 12, 2, 7, 4])
    out, lse = cpu_kernel.paged_attention(q, k, v, own_tables, own_lengths)
    cpu_kernel.paged_attention_shared(q, k, v, torch.tensor([prefix[0], prefix[1] + [0]]),
                                      torch.tensor([12, 8]), members, out, lse)
    for r in range(B):  # the reference: one attention over the row's prefix blocks (all full), then its own
        c = next((i for i, m in enumerate(members.tolist()) if r in m), None)
        table = (prefix[c] if c is not None else []) + own_tables[r].tolist()
        n = (len(prefix[c]) * bs if c is not None else 0) + int(own_lengths[r])
        want, want_lse = attention._attend_gathered(q[r : r + 1], k, v, torch.tensor([table]), torch.tensor([n]))
        torch.testing.assert_close(out[r : r + 1], want, **TOL)
        torch.testing.assert_close(lse[r : r + 1], want_lse, **TOL)


@pytest.mark.parametrize("nq", [5, 20])  # 20: past MANY_QUERIES, a full and a partial chunk of query lanes
@pytest.mark.parametrize("dim", [64, 128])
def test_kernel_matches_the_gather_path_at_its_specialized_head_sizes(dim, nq, threads):
    q, k, v, tables, _ = cache_and_rows(rows=5, nq=nq, dim=dim, block_size=16, blocks=40)
    lengths = torch.tensor([1, 7, 8, 61, 96])  # under, at and past the kernel's blocks of eight keys
    out, lse = cpu_kernel.paged_attention(q, k, v, tables, lengths)
    want, want_lse = attention._attend_gathered(q, k, v, tables, lengths)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("first,n", [(0, 1), (0, 40), (37, 1), (37, 16), (100, 121), (5, 33)])
@pytest.mark.parametrize("dim", [64, 128])
def test_prefill_kernel_is_causal_attention_over_cached_and_own_keys(dim, first, n, threads):
    g = torch.Generator().manual_seed(4)
    heads, kv_heads, bs, blocks = 6, 2, 16, 30
    k, v = torch.randn(blocks, bs, kv_heads, dim, generator=g), torch.randn(blocks, bs, kv_heads, dim, generator=g)
    q = torch.randn(n, heads, dim, generator=g)
    keys = first + n
    table = torch.randperm(blocks, generator=g)[: -(-keys // bs) + 1]  # scattered, one block to spare
    poisoned_k, poisoned_v = k.clone(), v.clone()  # keys past the last position must not count
    last, at = table[(keys - 1) // bs], (keys - 1) % bs
    poisoned_k[last, at + 1 :], poisoned_v[last, at + 1 :] = 1e6, 1e6
    out = torch.empty_like(q)
    cpu_kernel.paged_prefill(q, poisoned_k, poisoned_v, table, first, out)
    gathered = [attention._gather(c, table[None])[:, :, :keys] for c in (k, v)]
    mask = torch.arange(keys)[None, :] <= torch.arange(first, keys)[:, None]  # query i at position first + i
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], *gathered, attn_mask=mask,
                                                            enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_prefill_kernel_refuses_a_table_too_short_or_outside_the_cache():
    k = v = torch.zeros(8, 16, 2, 64)
    q, out = torch.zeros(20, 4, 64), torch.zeros(20, 4, 64)
    with pytest.raises(ValueError, match="do not fit the block table"):
        cpu_kernel.paged_prefill(q, k, v, torch.tensor([0, 1]), 20, out)  # 40 keys, 32 slots
    with pytest.raises(ValueError, match="do not fit the block table"):
        cpu_kernel.paged_prefill(q, k, v, torch.tensor([0, 8]), 0, out)  # block 8 of 8
    with pytest.raises(ValueError, match="contiguous"):
        cpu_kernel.paged_prefill(q.transpose(0, 1), k, v, torch.tensor([0, 1]), 0, out)


# -- the GEMM of a decode step's few rows ------------------------------------------------------------


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("layout", [False, "sliced"])
def test_skinny_linear_matches_f_linear_at_every_row_count(with_bias, layout):
    g = torch.Generator().manual_seed(3)
    N, K = 77, 45  # neither a multiple of a panel nor of a vector
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g) if with_bias else None
    panels = cpu_kernel.pack_panels(w)
    assert panels.shape[1] == K and panels.shape[0] * panels.shape[2] >= N
    for M in range(1, cpu_kernel.skinny_rows() + 1):
        x = activation(M, K, layout, g)
        torch.testing.assert_close(cpu_kernel.skinny_linear(x, panels, b, N), torch.nn.functional.linear(x, w, b),
                                   atol=1e-4, rtol=1e-5)


def test_skinny_linear_refuses_what_it_cannot_compute():
    w = torch.randn(40, 16)
    panels = cpu_kernel.pack_panels(w)
    for x in (torch.randn(cpu_kernel.skinny_rows() + 1, 16), torch.randn(0, 16), torch.randn(2, 15),
              torch.randn(16, 2).t()):
        with pytest.raises(ValueError, match="skinny_linear"):
            cpu_kernel.skinny_linear(x, panels, None, 40)
    with pytest.raises(ValueError, match="bias"):
        cpu_kernel.skinny_linear(torch.randn(1, 16), panels, torch.randn(39), 40)


def test_packed_weights_give_f_linear_on_either_side_of_the_few_rows_cut():
    """PackedWeights sends up to skinny_rows() rows to the C kernel's panels and more to oneDNN: both equal
    F.linear, and the panels follow an in-place write to the weights."""
    from assay.rollout.engine import onednn

    if not onednn.available():
        pytest.skip("this torch has no oneDNN")
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(64, 48, generator=g), torch.randn(16, 48, generator=g)
    bq = torch.randn(64, generator=g)
    packs = onednn.PackedWeights()
    for rows in (1, cpu_kernel.skinny_rows(), cpu_kernel.skinny_rows() + 1, 40):
        x = torch.randn(rows, 48, generator=g)
        torch.testing.assert_close(packs.linear_cat(x, (q, k), (bq, None)),
                                   torch.nn.functional.linear(x, torch.cat([q, k]), torch.cat([bq, torch.zeros(16)])),
                                   atol=1e-4, rtol=1e-5)
    k.mul_(-2.0)  # as an optimizer step writes a parameter: the next call packs again
    x = torch.randn(1, 48, generator=g)
    torch.testing.assert_close(packs.linear_cat(x, (q, k), (bq, None)),
                               torch.nn.functional.linear(x, torch.cat([q, k]), torch.cat([bq, torch.zeros(16)])),
                               atol=1e-4, rtol=1e-5)
