import copy

import pytest
import torch

from assay.core.errors import AssayError
from assay.core.tokenizer import stop_token_ids
from assay.rollout.base import GenRequest, SamplingParams
from assay.rollout.hf import HFBackend


def recomputed_logprobs(model, prompt: list[int], sampled: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each sampled token from one unpadded forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + sampled])).logits[0].float() / temperature
    logp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    return logp.gather(-1, torch.tensor(sampled)[:, None]).squeeze(-1)


def prompts(tok):
    return [tok.encode(t, add_special_tokens=False) for t in ("What is 3+6?", "Hi", "What is 12+24? Tell me.")]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_recomputed_forward_pass(tok, model, temperature):
    backend = HFBackend(model, tok)
    params = SamplingParams(temperature=temperature, max_tokens=12, seed=1)
    reqs = [GenRequest(p, params, n=2) for p in prompts(tok)]  # different lengths: left padding in play
    results = backend.generate(reqs)
    assert [len(r) for r in results] == [2, 2, 2]
    for req, group in zip(reqs, results, strict=True):
        for res in group:
            assert len(res.token_ids) == len(res.logprobs) > 0
            want = recomputed_logprobs(model, req.prompt_ids, res.token_ids, temperature)
            assert torch.allclose(torch.tensor(res.logprobs), want, atol=1e-4)
            assert res.policy_version == 0


def test_same_seed_same_samples_and_n_samples_differ(tok, model):
    backend = HFBackend(model, tok)
    reqs = [GenRequest(p, SamplingParams(max_tokens=8, seed=7), n=2) for p in prompts(tok)]
    a = [[r.token_ids for r in g] for g in backend.generate(reqs)]
    b = [[r.token_ids for r in g] for g in backend.generate(reqs)]
    assert a == b
    assert a[0][0] != a[0][1]  # the n samples of a prompt are independent draws
    other = [GenRequest(p, SamplingParams(max_tokens=8, seed=8), n=2) for p in prompts(tok)]
    assert [[r.token_ids for r in g] for g in backend.generate(other)] != a


def test_seeded_call_leaves_global_rng_alone(tok, model):
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    HFBackend(model, tok).generate([GenRequest(prompts(tok)[0], SamplingParams(max_tokens=4, seed=5))])
    assert torch.equal(torch.rand(3), want)


def test_stop_token_cuts_and_is_included(tok, model):
    backend = HFBackend(model, tok)
    p = prompts(tok)[0]
    free = backend.generate([GenRequest(p, SamplingParams(max_tokens=10, seed=3, stop_token_ids=[10_000]))])[0][0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    j = next(j for j in range(2, 10) if free.token_ids[j] not in free.token_ids[:j])
    stop = free.token_ids[j]
    cut = backend.generate([GenRequest(p, SamplingParams(max_tokens=10, seed=3, stop_token_ids=[stop]))])[0][0]
    assert cut.token_ids == free.token_ids[: j + 1]  # same seed, same draws, cut after the stop token
    assert cut.finish_reason == "stop"
    assert cut.logprobs == pytest.approx(free.logprobs[: j + 1], abs=1e-6)


def test_every_backend_stops_where_the_tokenizer_says(tok, model):
    from assay.rollout.engine import Engine

    expected = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    assert stop_token_ids(tok) == expected
    assert HFBackend(model, tok).default_stop == expected
    assert Engine(model, tok).default_stop == expected
    assert model.generation_config.eos_token_id == expected


def test_rows_with_different_max_tokens_share_a_batch(tok, model):
    backend = HFBackend(model, tok)
    p = prompts(tok)
    reqs = [GenRequest(p[0], SamplingParams(max_tokens=3, seed=2, stop_token_ids=[10_000])),
            GenRequest(p[1], SamplingParams(max_tokens=7, seed=2, stop_token_ids=[10_000]))]
    a, b = (g[0] for g in backend.generate(reqs))
    assert (len(a.token_ids), len(b.token_ids)) == (3, 7)
    assert a.finish_reason == b.finish_reason == "length"


def test_top_k_is_really_off_at_zero_and_on_at_one(tok, model):
    backend = HFBackend(model, tok)
    p = prompts(tok)[1]
    # A hot temperature makes the next-token distribution near-uniform over ~320 tokens: 400 draws
    # would hit only 50 distinct tokens if transformers' default top_k=50 leaked in.
    hot = backend.generate([GenRequest(p, SamplingParams(temperature=20.0, max_tokens=1, seed=0), n=400)])[0]
    assert len({r.token_ids[0] for r in hot}) > 100
    greedy = backend.generate([GenRequest(p, SamplingParams(temperature=0.0, max_tokens=5))])[0][0]
    top1 = backend.generate([GenRequest(p, SamplingParams(temperature=1.5, top_k=1, max_tokens=5, seed=4))])[0][0]
    assert top1.token_ids == greedy.token_ids
    with torch.no_grad():
        assert greedy.token_ids[0] == model(torch.tensor([p])).logits[0, -1].argmax().item()


def test_train_mode_restored(tok, model):
    model.train()
    HFBackend(model, tok).generate([GenRequest(prompts(tok)[0], SamplingParams(max_tokens=2))])
    assert model.training
    model.eval()
    HFBackend(model, tok).generate([GenRequest(prompts(tok)[0], SamplingParams(max_tokens=2))])
    assert not model.training


def test_update_weights_copies_in_place(tok, model):
    rollout_model = copy.deepcopy(model)
    trainer_model = copy.deepcopy(model)
    with torch.no_grad():
        for prm in trainer_model.parameters():
            prm.add_(0.01 * torch.randn_like(prm))
    backend = HFBackend(rollout_model, tok)
    emb = rollout_model.model.embed_tokens.weight
    backend.update_weights(trainer_model.named_parameters(), version=3)
    assert rollout_model.model.embed_tokens.weight is emb  # in place, same tensors
    x = torch.tensor([prompts(tok)[0]])
    with torch.no_grad():
        assert torch.equal(rollout_model(x).logits, trainer_model(x).logits)
    res = backend.generate([GenRequest(prompts(tok)[0], SamplingParams(max_tokens=2))])[0][0]
    assert res.policy_version == 3


def test_update_weights_shared_model_and_errors(tok, model):
    backend = HFBackend(model, tok)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    backend.update_weights(model.named_parameters(), version=1)
    assert backend.version == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(AssayError, match="no tensor"):
        backend.update_weights([("nope.weight", torch.zeros(1))], version=2)
    with pytest.raises(AssayError, match="shape"):
        backend.update_weights([("model.norm.weight", torch.zeros(3))], version=2)


def test_bad_requests(tok, model):
    backend = HFBackend(model, tok)
    with pytest.raises(AssayError, match="empty prompt"):
        backend.generate([GenRequest([], SamplingParams())])
    with pytest.raises(AssayError, match="top_p"):
        backend.generate([GenRequest([1], SamplingParams(top_p=0.0))])
