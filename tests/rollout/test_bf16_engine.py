"""The engine on bf16 weights (`rollout.weights: bf16`): every GEMM of the layers on oneDNN in bf16, the LM head
and everything between the GEMMs in float32; against itself on float32 (per-token KL small, not zero), the same
log-probs whatever the rows a step computes, and `auto` choosing by the CPU."""

import math

import pytest
import torch

import assay.core.modeling as modeling
from assay.core.config import RolloutConfig
from assay.core.errors import AssayError
from assay.rollout.base import GenRequest, SamplingParams
from assay.rollout.engine import Engine, EngineConfig, onednn
from assay.rollout.factory import engine_weights, make_backend
from assay.serve.quality import profile_kl, teacher_forced_logprobs

SMALL = dict(kv_cache_bytes=8 * 2**20, max_batched_tokens=128)
PROMPTS = [f"<|im_start|>user\nWhat is {i}+{2 * i}?<|im_end|>\n<|im_start|>assistant\n" for i in (3, 17, 40)]


def test_bf16_sampling_is_well_formed_and_close_to_float32(model, tok):
    ref = Engine(model, tok, EngineConfig(**SMALL))
    bf16 = Engine(model, tok, EngineConfig(**SMALL, weights="bf16"))
    assert bf16.model.packs.bf16 and bf16.model.head_packs.weights == "float32"  # the logits stay float32
    prompts = [tok.encode(p) for p in PROMPTS]
    for [r] in bf16.generate([GenRequest(p, SamplingParams(temperature=1.0, max_tokens=24, seed=1)) for p in prompts]):
        assert 1 <= len(r.token_ids) <= 24 and all(0 <= t < len(tok) for t in r.token_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in r.logprobs)
    kl = profile_kl(ref, bf16, prompts, max_tokens=24)
    assert kl.tokens >= 3 and 0 < kl.mean_kl < 5e-3, kl  # bf16 rounds: a little off float32, never far


def test_every_row_count_computes_with_the_same_bf16_weights(model, tok):
    """A token a step (as decoding) or eight a step (as a prefill): no row count takes the float32 C kernel."""
    bf16 = Engine(model, tok, EngineConfig(**SMALL, weights="bf16"))
    prompt = tok.encode(PROMPTS[0])
    answer = tok.encode("9<|im_end|>\n<|im_start|>user\nWhat is 6+12?<|im_end|>")
    one = teacher_forced_logprobs(bf16, prompt, answer, chunk=1)
    eight = teacher_forced_logprobs(bf16, prompt, answer, chunk=8)
    assert torch.allclose(one, eight, atol=1e-3)
    ref = teacher_forced_logprobs(Engine(model, tok, EngineConfig(**SMALL)), prompt, answer, chunk=1)
    assert not torch.allclose(one, ref, atol=1e-6)  # and they are bf16's, not float32's


def test_torchs_bf16_linear_computes_what_onednns_does(model, tok, monkeypatch):
    """Where oneDNN has no bf16 GEMM for the CPU, torch's bf16 F.linear stands in: the same bf16 products."""
    prompt, answer = tok.encode(PROMPTS[1]), tok.encode("51<|im_end|>\n<|im_start|>user\nWhat is 6+12?<|im_end|>")
    here = teacher_forced_logprobs(Engine(model, tok, EngineConfig(**SMALL, weights="bf16")), prompt, answer)
    monkeypatch.setattr(onednn, "bf16_available", lambda: False)
    fallback = Engine(model, tok, EngineConfig(**SMALL, weights="bf16"))
    qkv = fallback.model.step_weights[0][1]
    assert torch.equal(fallback.model.packs.blocked(*qkv).onednn, torch.cat(qkv[0]).to(torch.bfloat16))  # torch's
    assert torch.allclose(teacher_forced_logprobs(fallback, prompt, answer), here, atol=1e-3)


def test_auto_is_bf16_where_bf16_matmuls_are_fast(model, tok, monkeypatch):
    for fast, want in ((True, "bf16"), (False, "float32")):
        monkeypatch.setattr(modeling, "fast_bf16", lambda device, fast=fast: fast)
        assert engine_weights("auto", model) == want
        engine = make_backend(RolloutConfig(weights="auto", kv_cache_mb=8, warm_up=False), model, tok)
        assert engine.model.packs.weights == want
    assert engine_weights("int8", model) == "int8"


def test_bf16_needs_onednn(model, tok):
    with pytest.raises(AssayError, match="weights bf16 run a float32 model on the CPU with oneDNN"):
        Engine(model, tok, EngineConfig(**SMALL, weights="bf16", gemm="torch"))
