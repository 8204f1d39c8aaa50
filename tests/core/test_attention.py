import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

import assay.core.attention as attention
from assay.core.config import ModelConfig

torch.set_num_threads(1)


class Heads(torch.nn.Module):  # what transformers' attention functions read off the layer
    num_key_value_groups = 2
    is_causal = True
    training = True


def _inputs(dtype, B=3, H=4, Q=5, P=3, D=8):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, Q, D, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(B, H // 2, P + Q, D, generator=g).to(dtype).requires_grad_() for _ in range(2))
    # causal after a P-token prefix, and row 1 right-padded by two
    mask = torch.ones(Q, P + Q, dtype=torch.bool).tril(P)[None, None].repeat(B, 1, 1, 1)
    mask[1, :, :, -2:] = False
    return q, k, v, mask


def _reference(q, k, v, mask):
    """Float32 SDPA on the same inputs, as [B, Q, H, D]."""
    k, v = (t.float().repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask).transpose(1, 2)


def test_the_math_path_matches_sdpa_in_values_and_gradients():
    q, k, v, mask = _inputs(torch.bfloat16)
    out, _ = attention.auto_attention(Heads(), q, k, v, mask)
    out.float().square().sum().backward()
    got = [t.grad.float().clone() for t in (q, k, v)]
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    want = _reference(qf, kf, vf, mask)
    want.square().sum().backward()
    assert torch.allclose(out.float(), want, atol=3e-2, rtol=3e-2)
    for a, b in zip(got, (qf.grad, kf.grad, vf.grad), strict=True):
        assert torch.allclose(a, b, atol=6e-2, rtol=6e-2)


@pytest.mark.parametrize("case", ["float32", "no mask", "too many scores"])
def test_the_rest_goes_to_sdpa(monkeypatch, case):
    q, k, v, mask = _inputs(torch.float32 if case == "float32" else torch.bfloat16)
    if case == "no mask":
        mask = None
    if case == "too many scores":
        monkeypatch.setattr(attention, "MATH_MAX_SCORES", q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] - 1)
    calls = []
    real = attention.sdpa_attention_forward
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    attention.auto_attention(Heads(), q, k, v, mask)
    assert calls == [1]


def test_the_math_path_runs_for_small_bf16_batches(monkeypatch):
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **kw: pytest.fail("went to SDPA"))
    attention.auto_attention(Heads(), *_inputs(torch.bfloat16))


def test_a_model_under_auto_gives_sdpas_logits_and_gradients():
    """The default, end to end: a Qwen2 model's loss and gradients under bf16 autocast with a padded batch,
    `auto` against `sdpa`."""
    assert ModelConfig().attn_implementation == "auto"
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # sharp attention, so that a wrong score or mask shows in the loss
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30.0)
    ids = torch.randint(0, 64, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    results = []
    for name in ("sdpa", attention.implementation("auto")):
        model.set_attn_implementation(name)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    (sdpa_loss, sdpa_grads), (auto_loss, auto_grads) = results
    assert auto_loss == pytest.approx(sdpa_loss, rel=1e-2)
    for a, b in zip(auto_grads, sdpa_grads, strict=True):
        assert torch.allclose(a, b, atol=2e-2 * b.abs().max().item() + 1e-4)
