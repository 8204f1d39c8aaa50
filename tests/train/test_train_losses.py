import math

import pytest
import torch
from train_helpers import Bigram

from assay.train.losses import aggregate, kl_penalty, logprobs_from_logits, policy_loss, token_logprobs

torch.set_num_threads(1)
EPS_LOW, EPS_HIGH = 0.2, 0.28


def clip_case():
    """Three sequences; behaviour logprobs 0, so exp(logp_new) is the ratio itself.

    row 0, A=+1:  ratio 1.5 -> clipped at 1.28 (no gradient); 0.5 -> below the range but A>0, so the
                  unclipped 0.5 is the min and the gradient flows; 1.1 -> inside.
    row 1, A=-2:  ratio 0.5 -> clipped at 0.8 (no gradient); 1.5 -> above the range but A<0, so the
                  unclipped -3 is the min and the gradient flows; position 3 masked (ratio 7).
    row 2, A=0.5: ratio 1; positions 2-3 masked with a huge logp that must not leak (exp overflow)."""
    ratios = torch.tensor([[1.0, 1.5, 0.5, 1.1], [1.0, 0.5, 1.5, 7.0], [1.0, 1.0, 1.0, 1.0]])
    logp_new = ratios.log()
    logp_new[2, 2:] = 1000.0
    logp_new.requires_grad_(True)
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([1.0, -2.0, 0.5])
    return logp_new, torch.zeros(3, 4), adv, mask


# per-token losses -min(r·A, clip(r)·A) of the masked tokens
ROW0 = [-1.28, -0.5, -1.1]
ROW1 = [1.6, 3.0]
ROW2 = [-0.5]


def test_token_aggregation_by_hand():
    logp_new, old, adv, mask = clip_case()
    loss, m = policy_loss(logp_new, old, adv, mask, EPS_LOW, EPS_HIGH, "token")
    assert loss.item() == pytest.approx(sum(ROW0 + ROW1 + ROW2) / 6, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 6)
    assert m["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.5 + 1.5 + 1.0) / 6, abs=1e-6)
    k3 = [r - 1 - math.log(r) for r in (1.5, 0.5, 1.1, 0.5, 1.5, 1.0)]
    assert m["approx_kl"] == pytest.approx(sum(k3) / 6, abs=1e-6)
    loss.backward()
    # d(-r·A)/d logp = -A·r where unclipped, 0 where the clip is active
    want = torch.tensor([[0, 0, -0.5, -1.1], [0, 0, 2 * 1.5, 0], [0, -0.5, 0, 0]]) / 6
    assert torch.allclose(logp_new.grad, want, atol=1e-6)


def test_sequence_aggregation_by_hand():
    logp_new, old, adv, mask = clip_case()
    loss, _ = policy_loss(logp_new, old, adv, mask, EPS_LOW, EPS_HIGH, "sequence")
    want = (sum(ROW0) / 3 + sum(ROW1) / 2 + sum(ROW2) / 1) / 3
    assert loss.item() == pytest.approx(want, abs=1e-6)


def test_symmetric_clip_differs():
    logp_new, old, adv, mask = clip_case()
    loss, _ = policy_loss(logp_new, old, adv, mask, 0.2, 0.2, "token")
    assert loss.item() == pytest.approx((-1.2 - 0.5 - 1.1 + 1.6 + 3.0 - 0.5) / 6, abs=1e-6)


@pytest.mark.parametrize("aggregation,total", [("token", 6.0), ("sequence", 3.0)])
def test_normalizer_splits_exactly(aggregation, total):
    logp_new, old, adv, mask = clip_case()
    whole, _ = policy_loss(logp_new, old, adv, mask, EPS_LOW, EPS_HIGH, aggregation)
    parts = [
        policy_loss(logp_new[s], old[s], adv[s], mask[s], EPS_LOW, EPS_HIGH, aggregation, normalizer=total)[0]
        for s in (slice(0, 2), slice(2, 3))
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), abs=1e-7)


def test_aggregate_ignores_empty_rows():
    values = torch.tensor([[2.0, 4.0], [9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert aggregate(values, mask, "sequence").item() == 3.0
    assert aggregate(values, mask, "token").item() == 3.0
    assert aggregate(values, torch.zeros(2, 2), "token").item() == 0.0


def test_kl_k3_by_hand():
    logp_new = torch.tensor([[0.0, math.log(0.5), math.log(0.2)]])
    logp_ref = torch.tensor([[5.0, math.log(0.25), math.log(0.2)]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    kl = kl_penalty(logp_new, logp_ref, mask)
    # d = log(.25) - log(.5) = log(.5): exp(d) - d - 1 = .5 + log 2 - 1; identical logprobs give 0
    assert kl.tolist()[0] == pytest.approx([0.0, 0.5 + math.log(2) - 1, 0.0], abs=1e-7)


def test_logprobs_read_logits_of_previous_position():
    probs = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]]])
    ids = torch.tensor([[3, 2, 0]])
    logp, ent = logprobs_from_logits(probs.log(), ids)
    # token 1 (=2) from row 0: p=.3; token 2 (=0) from row 1: p=.25; row 2 predicts nothing here
    assert logp.tolist()[0] == pytest.approx([0.0, math.log(0.3), math.log(0.25)], abs=1e-6)
    h0 = -sum(p * math.log(p) for p in (0.1, 0.2, 0.3, 0.4))
    assert ent.tolist()[0] == pytest.approx([0.0, h0, math.log(4)], abs=1e-6)


def test_token_logprobs_with_a_model():
    torch.manual_seed(0)
    table = torch.randn(5, 5)
    model = Bigram(table)
    ids = torch.tensor([[1, 4, 2, 0], [3, 3, 0, 0]])
    logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    lsm = table.log_softmax(-1)
    want = [[0.0, lsm[1, 4], lsm[4, 2], lsm[2, 0]], [0.0, lsm[3, 3], lsm[3, 0], lsm[0, 0]]]
    assert torch.allclose(logp, torch.tensor(want), atol=1e-6)


def test_token_logprobs_at_the_rollout_temperature():
    torch.manual_seed(0)
    table = torch.randn(5, 5)
    ids = torch.tensor([[1, 4, 2]])
    logp, _ = token_logprobs(Bigram(table), ids, torch.ones_like(ids), temperature=0.5)
    lsm = (table / 0.5).log_softmax(-1)
    assert torch.allclose(logp, torch.tensor([[0.0, lsm[1, 4], lsm[4, 2]]]), atol=1e-6)


def test_decoupled_objective_with_proximal_equal_to_behaviour_is_the_plain_one():
    torch.manual_seed(0)
    new = torch.randn(2, 5, requires_grad=True)
    old = torch.randn(2, 5)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.float32)
    adv = torch.tensor([1.0, -0.5])
    plain, pm = policy_loss(new, old, adv, mask, 0.2, 0.28)
    decoupled, dm = policy_loss(new, old, adv, mask, 0.2, 0.28, logp_prox=old.clone(), is_cap=2.0)
    assert torch.equal(plain, decoupled)
    assert dm["is_weight_mean"] == 1.0 and dm["is_weight_max"] == 1.0 and dm["is_truncated"] == 0.0


def test_decoupled_objective_learns_from_stale_samples_with_a_truncated_weight():
    # One token sampled long ago: behaviour logprob log(0.1); the trainer now gives it log(0.5).
    old = torch.tensor([[0.0, math.log(0.1)]])
    mask = torch.tensor([[0.0, 1.0]])
    adv = torch.tensor([1.0])
    new = torch.tensor([[0.0, math.log(0.5)]], requires_grad=True)
    loss, m = policy_loss(new, old, adv, mask, 0.2, 0.28)
    loss.backward()
    assert new.grad.abs().sum() == 0 and m["clip_frac"] == 1.0  # ratio 5 is clipped: plain PPO learns nothing
    new.grad = None
    loss, m = policy_loss(new, old, adv, mask, 0.2, 0.28, logp_prox=new.detach().clone(), is_cap=2.0)
    loss.backward()
    # ratio to the proximal policy is 1 (inside the clip): d(-ratio·A·w)/dlogp = -A·w, w = min(5, 2)
    assert new.grad[0, 1].item() == pytest.approx(-2.0) and m["clip_frac"] == 0.0
    assert m["is_weight_max"] == pytest.approx(5.0) and m["is_weight_mean"] == pytest.approx(2.0)
    assert m["is_truncated"] == 1.0


def test_selective_logprobs_equal_the_full_ones_where_the_mask_is_set_and_give_the_same_gradient():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from assay.train.losses import selective_token_logprobs

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=False))
    ids = torch.randint(0, 97, (3, 9))
    attn = torch.ones_like(ids)
    attn[2, 6:] = 0
    mask = torch.zeros(3, 9)
    mask[0, 4:] = 1
    mask[1, 2:5] = 1
    mask[2, 3:6] = 1
    full, full_ent = token_logprobs(model, ids, attn, temperature=1.3)
    (full * mask).sum().backward()
    full_grad = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    sel, sel_ent = selective_token_logprobs(model, ids, attn, mask, temperature=1.3, chunk_rows=4)  # 3 chunks
    (sel * mask).sum().backward()
    assert torch.allclose(sel * mask, full * mask, atol=1e-5) and (sel * (1 - mask)).abs().sum() == 0
    assert torch.allclose(sel_ent * mask, full_ent * mask, atol=1e-5)
    for a, p in zip(full_grad, model.parameters(), strict=True):
        assert torch.allclose(a, p.grad, atol=1e-5)


def test_a_shared_prefix_run_once_gives_the_logprobs_and_gradient_of_the_whole_batch():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from assay.train.losses import selective_token_logprobs, shareable_prefix

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64))
    prompt = torch.randint(0, 97, (7,)).tolist()
    rows = [prompt + [5, 6, 7, 8, 9], prompt + [1, 2, 3], prompt + [4, 4, 4, 4]]
    masks = [[0] * 7 + [1] * 5, [0] * 7 + [1] * 3, [0] * 8 + [1] * 3]
    assert shareable_prefix(rows, masks) == 6  # position 6 predicts the first loss token, so it stays out
    assert shareable_prefix([[1, 2, 3, 4], [1, 2, 9, 4]], [[0, 0, 0, 1], [0, 0, 0, 1]]) == 2
    ids = torch.zeros(3, 12, dtype=torch.long)
    attn, mask = torch.zeros(3, 12, dtype=torch.long), torch.zeros(3, 12)
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        ids[i, : len(r)], attn[i, : len(r)], mask[i, : len(m)] = torch.tensor(r), 1, torch.tensor(m, dtype=torch.float)
    results = []
    for prefix in (0, 6):
        model.zero_grad()
        logp, ent = selective_token_logprobs(model, ids, attn, mask, temperature=1.3, prefix_len=prefix)
        (logp * mask).sum().backward()
        results.append((logp, ent, [p.grad.clone() for p in model.parameters()]))
    (whole, whole_ent, whole_grad), (shared, shared_ent, shared_grad) = results
    assert torch.allclose(whole, shared, atol=1e-5) and torch.allclose(whole_ent, shared_ent, atol=1e-5)
    for a, b in zip(whole_grad, shared_grad, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="predicts a loss token"):
        selective_token_logprobs(model, ids, attn, mask, prefix_len=7)


@pytest.mark.parametrize("bf16", [False, True])
def test_the_head_logprobs_function_matches_autograd_through_the_logits(bf16):
    from assay.train.losses import _HeadLogprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50)
    hidden = torch.randn(7, 16, requires_grad=True)
    targets = torch.randint(0, 50, (7,))
    weights = torch.randn(7)  # a different gradient on each row's log-prob
    dtype = torch.bfloat16 if bf16 else torch.float32
    results = []
    for fused in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if fused:
                logp, entropy = _HeadLogprobs.apply(hidden, head.weight, head.bias, targets, 1.3, dtype)
            else:
                logits = head(hidden).float() / 1.3
                logp = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
                entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        (logp * weights).sum().backward()
        results.append((logp.detach(), entropy.detach(), [t.grad.clone() for t in (hidden, head.weight, head.bias)]))
        for t in (hidden, head.weight, head.bias):
            t.grad = None
    (ref, ref_ent, ref_grads), (out, ent, out_grads) = results
    assert not ent.requires_grad
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    for a, b in zip(ref_grads, out_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
