"""Weight-only int8: the C kernel against a torch reference of the same int8 math and against float32, and the
engine on int8 weights against itself on float32 (greedy output well-formed, per-token KL small)."""

import math

import pytest
import torch
import torch.nn.functional as F

from assay.core.errors import AssayError
from assay.rollout.base import GenRequest, SamplingParams
from assay.rollout.engine import Engine, EngineConfig, cpu_kernel
from assay.serve.quality import profile_kl, teacher_forced_logprobs

pytestmark = pytest.mark.skipif(cpu_kernel._library() is None,  # "missing tool": CI fails it (tests/conftest.py)
                                reason="missing tool: the C kernels did not build (a C compiler with OpenMP)")

SMALL = dict(kv_cache_bytes=8 * 2**20, max_batched_tokens=128)


def test_quantization_is_per_feature_symmetric_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(13, 40, generator=g) * torch.logspace(-3, 1, 13)[:, None]  # features of very different scales
    w[5] = 0.0
    q, scale = cpu_kernel.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (13,)
    assert int(q.abs().max()) == 127 and bool((q[5] == 0).all())
    err = (cpu_kernel.dequantize_int8(q, scale) - w).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("features,inputs", [(37, 29), (8, 1), (200, 576)])
def test_int8_linear_equals_the_int8_math_in_torch(rows, features, inputs):
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(features, inputs, generator=g), torch.randn(features, generator=g)
    x = torch.randn(rows, inputs + 3, generator=g)[:, 3:]  # rows strided, as a column slice
    q, scale = cpu_kernel.quantize_int8(w)
    panels = cpu_kernel.pack_int8_panels(q)
    for bias in (b, None):
        y = cpu_kernel.int8_linear(x, panels, scale, bias, features)
        ref = (x.double() @ q.double().T) * scale.double() + (0 if bias is None else bias.double())
        # the same sums in another order: float32 rounding, relative to the products' magnitude
        bound = 1e-5 * ((x.double().abs() @ q.double().abs().T) * scale.double()) + 1e-6
        assert bool(((y.double() - ref).abs() <= bound).all())
        # against the float32 weights: each weight is off by at most half its feature's step
        full = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        quant_bound = (x.double().abs().sum(1, keepdim=True) * scale.double()[None, :] / 2) + bound
        assert bool(((y.double() - full).abs() <= quant_bound).all())


@pytest.mark.skipif("avx512f" not in cpu_kernel._cpu_signature().split(), reason="the native build is the AVX2 one")
def test_the_avx2_build_of_the_int8_kernel_equals_the_int8_math(tmp_path):
    """An AVX-512 CPU's build runs panels of 16; the AVX2 build (panels of 8), what an AVX2-only CPU runs, passes
    the same check here, built for x86-64-v3 (`ASSAY_CPU_MARCH`) in a process of its own."""
    import os
    import subprocess
    import sys

    check = ("import sys, pytest; from assay.rollout.engine import cpu_kernel; "
             "assert cpu_kernel._library().int8_panel_f32() == 8; "
             f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {__file__!r}, '-k', "
             "'int8_linear_equals_the_int8_math']))")
    env = {**os.environ, "ASSAY_CPU_MARCH": "x86-64-v3", "ASSAY_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "24 passed" in proc.stdout


def test_int8_linear_refuses_what_it_cannot_take():
    q, scale = cpu_kernel.quantize_int8(torch.randn(16, 8))
    panels = cpu_kernel.pack_int8_panels(q)
    with pytest.raises(ValueError, match="at most"):
        cpu_kernel.int8_linear(torch.randn(cpu_kernel.int8_rows() + 1, 8), panels, scale, None, 16)
    with pytest.raises(ValueError, match="int8 panels"):
        cpu_kernel.int8_linear(torch.randn(2, 8), panels.float(), scale, None, 16)


def test_engine_int8_greedy_is_well_formed_and_close_to_float32(model, tok):
    ref = Engine(model, tok, EngineConfig(**SMALL))
    fast = Engine(model, tok, EngineConfig(**SMALL, weights="int8"))
    prompts = [tok.encode(f"<|im_start|>user\nWhat is {i}+{2 * i}?<|im_end|>\n<|im_start|>assistant\n")
               for i in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=24)
    for [r] in fast.generate([GenRequest(p, params) for p in prompts]):
        assert 1 <= len(r.token_ids) <= 24 and r.finish_reason in ("stop", "length")
        assert all(0 <= t < len(tok) for t in r.token_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in r.logprobs)
    kl = profile_kl(ref, fast, prompts, max_tokens=24)
    assert kl.tokens >= 3
    assert 0 < kl.mean_kl < 5e-3, kl  # int8 differs from float32, a little
    same = profile_kl(ref, Engine(model, tok, EngineConfig(**SMALL)), prompts, max_tokens=24)
    assert same.mean_kl < 1e-7 and same.top1_agreement == 1.0  # the gate reads 0 for identical engines


def test_int8_decode_step_in_c_equals_the_fused_rows(model, tok):
    """Fed a token a step, the answer runs the whole-step C kernel; fed 8 a step, the fused path's int8 GEMMs:
    the same int8 weights, so the same logprobs up to float rounding."""
    fast = Engine(model, tok, EngineConfig(**SMALL, weights="int8", int8_rows=cpu_kernel.int8_rows()))
    prompt = tok.encode("<|im_start|>user\nWhat is 5+10?<|im_end|>\n<|im_start|>assistant\n")
    answer = tok.encode("15<|im_end|>\n<|im_start|>user\nWhat is 6+12?<|im_end|>")
    one = teacher_forced_logprobs(fast, prompt, answer, chunk=1)
    eight = teacher_forced_logprobs(fast, prompt, answer, chunk=8)
    assert one.shape == (len(answer), one.shape[1])
    assert torch.allclose(one, eight, atol=1e-4)


def test_int8_needs_the_cpu_kernels_and_onednn(model, tok):
    with pytest.raises(AssayError, match="weights int8"):
        Engine(model, tok, EngineConfig(**SMALL, weights="int8", gemm="torch"))
    with pytest.raises(AssayError, match="float32, int8 or bf16"):
        Engine(model, tok, EngineConfig(**SMALL, weights="int4"))


def test_propose_drafts_only_from_a_match_of_min_ngram_tokens():
    from assay.rollout.engine.speculative import propose

    tokens = [5, 6, 7, 9, 1, 7]  # the last token, 7, occurred before; the last two, 1 7, did not
    assert propose(tokens, 3, 2) == [9, 1]
    assert propose(tokens, 3, 2, min_ngram=2) == []
    assert propose([5, 6, 7, 8, 5, 6], 3, 2, min_ngram=2) == [7, 8]


def test_speculation_on_int8_keeps_the_int8_greedy_output(model, tok):
    """Verifying a draft runs 1 + draft rows through the int8 GEMMs; a step decodes one row in the C step:
    the same int8 weights, so the same greedy tokens."""
    prompts = [tok.encode(f"<|im_start|>user\nWhat is {i}+{2 * i}? What is {i}+{2 * i}?<|im_end|>\n") for i in (4, 21)]
    params = SamplingParams(temperature=0, max_tokens=32)
    every = cpu_kernel.int8_rows()  # every row count on the int8 kernel, whatever this CPU's timing says
    plain = Engine(model, tok, EngineConfig(**SMALL, weights="int8", int8_head=True, int8_rows=every))
    spec = Engine(model, tok, EngineConfig(**SMALL, weights="int8", int8_head=True, speculative_tokens=3,
                                           speculative_max_batch=2, int8_rows=every, speculative_adaptive=False))
    want = [r.token_ids for [r] in plain.generate([GenRequest(p, params) for p in prompts])]
    assert [r.token_ids for [r] in spec.generate([GenRequest(p, params) for p in prompts])] == want
    assert spec.last_stats["draft_proposed"] > 0


@pytest.mark.parametrize(("slower_from", "want"), [(4, 3), (1, 0), (None, 8)])
def test_the_int8_row_limit_is_the_last_count_before_the_float32_kernel_wins(monkeypatch, slower_from, want):
    """`time_int8_rows` races the int8 kernel against the float32 one row count by row count, each over every linear
    given, stops at the first loss, and never times past the float32 kernel's rows."""
    from assay.rollout.engine import onednn

    timed = []

    def race(a, b, reps):  # each side a pass over every linear, whose partials carry x: its rows are the count
        assert [c.func for c in b.args[0]] == [cpu_kernel.skinny_linear] * len(linears)
        assert [c.func for c in a.args[0]] == [cpu_kernel.int8_linear] * len(linears)
        rows = a.args[0][0].args[0].shape[0]
        timed.append(rows)
        return (2.0, 1.0) if slower_from is not None and rows >= slower_from else (1.0, 2.0)

    monkeypatch.setattr(onednn, "_race", race)
    packs = onednn.PackedWeights("int8")
    packs.int8_rows = packs.skinny_rows = 8
    w = torch.randn(24, 16)
    linears = [((w,), (None,)), ((w[:8],), (None,))]
    assert packs.time_int8_rows(linears) == want == packs.int8_rows
    assert max(timed) == (slower_from or 8)  # no count past the first loss is timed
    # the float32 panels stay only where the float32 kernel takes rows
    kept = [packs.panels(*lin, int8=True).float_panels is not None for lin in linears]
    assert kept == [want < packs.skinny_rows] * 2


def test_the_engine_times_its_int8_rows_or_takes_them_from_its_config(model, tok):
    most = cpu_kernel.int8_rows()
    timed = Engine(model, tok, EngineConfig(**SMALL, weights="int8", int8_head=True))
    assert timed.model.head_packs is not timed.model.packs  # the head's limit is its own
    for packs in (timed.model.packs, timed.model.head_packs):
        assert 0 <= packs.int8_rows <= most and packs.c_rows >= packs.int8_rows
    fixed = Engine(model, tok, EngineConfig(**SMALL, weights="int8", int8_head=True, int8_rows=3))
    assert fixed.model.packs.int8_rows == fixed.model.head_packs.int8_rows == 3
    with pytest.raises(AssayError, match="int8_rows"):
        Engine(model, tok, EngineConfig(**SMALL, weights="int8", int8_rows=most + 1))


def test_int8_weights_give_the_same_output_at_any_row_limit(model, tok):
    """At limit 1 a step of the three prompts runs the float32 kernel on the dequantized weights (or oneDNN, past
    its rows), at 8 the int8 kernel: the same weights, so the same tokens and log-probs up to float rounding."""
    prompts = [tok.encode(f"<|im_start|>user\nWhat is {i}+{3 * i}?<|im_end|>\n") for i in (2, 5, 8)]
    params = SamplingParams(temperature=0, max_tokens=24)
    outs = [[r for [r] in Engine(model, tok, EngineConfig(**SMALL, weights="int8", int8_head=True, int8_rows=rows))
             .generate([GenRequest(p, params) for p in prompts])] for rows in (cpu_kernel.int8_rows(), 1)]
    assert [r.token_ids for r in outs[0]] == [r.token_ids for r in outs[1]]
    for a, b in zip(outs[0], outs[1], strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
