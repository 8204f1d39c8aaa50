"""vLLM as a rollout backend, against the native engine on the same weights. These run where vLLM is
installed (`pip install -e '.[vllm]'`); without it only the install hint is checked."""

import importlib.util

import pytest
import torch
from test_engine import spread

from assay.core.config import ModelConfig, RolloutConfig
from assay.core.errors import AssayError
from assay.core.modeling import build_model
from assay.rollout.base import GenRequest, OnlineBackend, SamplingParams
from assay.rollout.engine import Engine
from assay.rollout.factory import make_backend

pytestmark = pytest.mark.vllm
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (pip install -e '.[vllm]')")
GREEDY = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[10_000])  # no stop: full lengths compared
# Measured on the 2-core dev machine, float32: greedy logprobs agree to 1e-6, sampled ones to 1e-6 against the
# trainer's recomputation, and to 5e-5 after a weight update (vLLM's CPU kernels repack weights and sum in
# another order); 1e-4 leaves room for other CPUs.
ATOL = 1e-4


@pytest.fixture(scope="module")
def policy(tok):
    """A Qwen2 policy whose heads vLLM's CPU attention takes (head size 32), with decisive logits."""
    torch.manual_seed(0)
    return spread(build_model(ModelConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                          intermediate_size=256, max_position=256), tok))


@pytest.fixture(scope="module")
def vllm_backend(tok, policy):
    backend = make_backend(RolloutConfig(backend="vllm", kv_cache_mb=64), policy, tok)
    yield backend
    backend.close()


def prompts(vocab, count, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(torch.randint(5, 60, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def recomputed(model, prompt, completion, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed")
def test_without_vllm_the_backend_names_the_install(tok, policy):
    with pytest.raises(AssayError, match=r"pip install -e '\.\[vllm\]'"):
        make_backend(RolloutConfig(backend="vllm"), policy, tok)


@needs_vllm
def test_greedy_tokens_and_logprobs_equal_the_engines(tok, policy, vllm_backend):
    ps = prompts(len(tok), 8)
    ours = Engine(policy, tok).generate([GenRequest(p, GREEDY) for p in ps])
    theirs = vllm_backend.generate([GenRequest(p, GREEDY) for p in ps])
    for a, b in zip(ours, theirs, strict=True):
        assert b[0].token_ids == a[0].token_ids and b[0].finish_reason == "length"
        assert torch.allclose(torch.tensor(b[0].logprobs), torch.tensor(a[0].logprobs), atol=ATOL)


@needs_vllm
def test_sampled_logprobs_match_the_trainers_recomputation_and_seeds_reproduce(tok, policy, vllm_backend):
    ps = prompts(len(tok), 4, seed=2)
    params = SamplingParams(temperature=0.7, max_tokens=16, seed=3)
    first = vllm_backend.generate([GenRequest(p, params, n=3) for p in ps])
    for p, group in zip(ps, first, strict=True):
        for r in group:
            assert torch.allclose(torch.tensor(r.logprobs), recomputed(policy, p, r.token_ids, 0.7), atol=ATOL)
    assert len({tuple(r.token_ids) for r in first[0]}) > 1  # a group's samples draw streams of their own
    # a sample depends on its seed and stream, not on which other requests share the call
    alone = vllm_backend.generate([GenRequest(ps[1], params, n=3, stream=3)])
    assert [r.token_ids for r in alone[0]] == [r.token_ids for r in first[1]]


@needs_vllm
def test_stop_tokens_and_strings_end_a_sample_as_in_the_engine(tok, policy, vllm_backend):
    p = prompts(len(tok), 1, seed=4)[0]
    free = vllm_backend.generate([GenRequest(p, GREEDY)])[0][0].token_ids
    stop_tok = free[5]
    cut = vllm_backend.generate([GenRequest(p, SamplingParams(temperature=0, max_tokens=24,
                                                              stop_token_ids=[stop_tok]))])[0][0]
    assert cut.token_ids == free[: free.index(stop_tok) + 1] and cut.finish_reason == "stop"
    text = tok.decode(free[10:12])
    res = vllm_backend.generate([GenRequest(p, SamplingParams(temperature=0, max_tokens=24, stop=[text]))])[0][0]
    engine = Engine(policy, tok).generate([GenRequest(p, SamplingParams(temperature=0, max_tokens=24, stop=[text]))])
    assert res.finish_reason == "stop" and res.token_ids == engine[0][0].token_ids


@needs_vllm
def test_a_weight_update_reaches_vllm_under_its_version(tok, policy, vllm_backend):
    import copy

    other = copy.deepcopy(policy)
    with torch.no_grad():
        for p in other.parameters():  # the tied embedding too: vLLM's output head keeps a packed copy of it
            p.add_(torch.randn_like(p) * 0.3)
    ps = prompts(len(tok), 4, seed=5)
    before = vllm_backend.generate([GenRequest(p, GREEDY) for p in ps])
    try:
        vllm_backend.update_weights(other.named_parameters(), version=7)
        after = vllm_backend.generate([GenRequest(p, GREEDY) for p in ps])
        want = Engine(other, tok).generate([GenRequest(p, GREEDY) for p in ps])
    finally:
        vllm_backend.update_weights(policy.named_parameters(), version=0)
    assert [r[0].token_ids for r in after] != [r[0].token_ids for r in before]
    for a, b in zip(want, after, strict=True):
        assert b[0].token_ids == a[0].token_ids and b[0].policy_version == 7
        assert torch.allclose(torch.tensor(b[0].logprobs), torch.tensor(a[0].logprobs), atol=ATOL)


@needs_vllm
def test_the_online_api_admits_requests_while_others_run(tok, policy, vllm_backend):
    assert isinstance(vllm_backend, OnlineBackend)
    ps = prompts(len(tok), 3, seed=6)
    done: dict[int, list] = {}
    first = vllm_backend.add_request(GenRequest(ps[0], GREEDY), on_done=lambda rid, res: done.setdefault(rid, res))
    vllm_backend.step()
    later = vllm_backend.add_requests([GenRequest(p, GREEDY) for p in ps[1:]])
    dropped = vllm_backend.add_request(GenRequest(ps[0], SamplingParams(max_tokens=24, seed=1)))
    vllm_backend.abort(dropped)
    finished = {}
    while vllm_backend.has_unfinished:
        finished.update(vllm_backend.step())
    assert set(finished) == {first, *later} and done[first] == finished[first]
    alone = vllm_backend.generate([GenRequest(p, GREEDY) for p in ps])
    assert [finished[rid][0].token_ids for rid in (first, *later)] == [r[0].token_ids for r in alone]


@needs_vllm
def test_a_prompt_longer_than_the_model_is_refused(tok, vllm_backend):
    with pytest.raises(AssayError, match="leaves no room"):
        vllm_backend.generate([GenRequest([5] * 300, GREEDY)])


@needs_vllm
def test_seeded_requests_whose_prompts_exceed_a_step_budget_sample(tok, vllm_backend):
    # vLLM's default chunked prefill would split these prompts over steps, then fail to rewind a seeded
    # generator on the CPU ("CPU Generator does not use offset"); the backend prefills whole prompts.
    g = torch.Generator().manual_seed(8)
    ps = [torch.randint(2, len(tok), (200,), generator=g).tolist() for _ in range(64)]  # 12,800 prompt tokens
    params = SamplingParams(max_tokens=8, seed=5, stop_token_ids=[10_000])
    res = vllm_backend.generate([GenRequest(p, params, n=2) for p in ps])
    assert all(len(r.token_ids) == 8 for group in res for r in group)


@needs_vllm
def test_a_weight_update_under_running_requests_is_refused(tok, policy, vllm_backend):
    rid = vllm_backend.add_request(GenRequest(prompts(len(tok), 1, seed=9)[0], GREEDY))
    try:
        with pytest.raises(AssayError, match="requests still running"):
            vllm_backend.update_weights(policy.named_parameters(), version=3)
        assert vllm_backend.version == 0
    finally:
        vllm_backend.abort(rid)
    assert not vllm_backend.has_unfinished
