"""The engine's online API: requests join a running batch, finish on their own, and can be aborted."""

import pytest
import torch

from assay.rollout.base import GenRequest, SamplingParams
from assay.rollout.engine import Engine, EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[10_000])


@pytest.fixture(scope="module")
def policy(model):
    with torch.no_grad():  # decisive logits: greedy never rides on a near tie
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4)
    return model.eval()


def prompts(vocab, count, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def test_requests_added_mid_batch_give_the_tokens_they_give_alone(tok, policy):
    ps = prompts(len(tok), 6)
    alone = [Engine(policy, tok).generate([GenRequest(p, GREEDY)])[0][0].token_ids for p in ps]
    engine = Engine(policy, tok)
    first = engine.add_requests([GenRequest(p, GREEDY) for p in ps[:3]])
    finished: dict[int, list[int]] = {}
    for _ in range(5):
        finished.update((rid, r[0].token_ids) for rid, r in engine.step())
    assert not finished and len(engine.sched.running) == 3  # the first three are mid-decode
    late = engine.add_requests([GenRequest(p, GREEDY) for p in ps[3:]])
    engine.step()
    assert len(engine.sched.running) == 6  # the late ones joined the running batch
    while engine.has_unfinished:
        finished.update((rid, r[0].token_ids) for rid, r in engine.step())
    assert [finished[rid] for rid in first + late] == alone
    assert engine.blocks.num_free == len(engine.blocks.blocks)


def test_each_request_is_delivered_when_it_finishes(tok, policy):
    engine = Engine(policy, tok)
    p = prompts(len(tok), 3)
    order: list[tuple[int, int]] = []
    ids = engine.add_requests([GenRequest(p[0], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[10_000])),
                               GenRequest(p[1], SamplingParams(temperature=0, max_tokens=3, stop_token_ids=[10_000])),
                               GenRequest(p[2], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[10_000]),
                                          n=2)],
                              on_done=lambda rid, results: order.append((rid, len(results[0].token_ids))))
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
    assert order == [(ids[1], 3), (ids[2], 10), (ids[0], 20)]
    assert steps >= 20


def test_abort_frees_blocks_and_a_sibling_waiting_on_its_prefill_still_finishes(tok, policy):
    engine = Engine(policy, tok, EngineConfig(max_batched_tokens=8))  # a long prompt takes several steps
    prompt = prompts(len(tok), 1, seed=9)[0] * 2
    params = SamplingParams(temperature=0.8, max_tokens=12, stop_token_ids=[10_000], seed=5)
    leader, sibling, other = engine.add_requests([GenRequest(prompt, params), GenRequest(prompt, params),
                                                  GenRequest(prompts(len(tok), 1, seed=4)[0], GREEDY)])
    engine.step()  # the leader is mid-prefill; the sibling waits to fork from it
    engine.abort(leader)
    engine.abort(other)
    engine.abort(other)  # twice, or an unknown id: ignored
    done = {}
    while engine.has_unfinished:
        done.update(engine.step())
    assert set(done) == {sibling} and len(done[sibling][0].token_ids) == 12
    assert engine.blocks.num_free == len(engine.blocks.blocks)
    # the sibling's stream is its own (the second sequence of seed 5 in its call), as in a blocking call
    again = Engine(policy, tok).generate([GenRequest(prompt, params), GenRequest(prompt, params)])
    assert done[sibling][0].token_ids == again[1][0].token_ids


def test_weights_can_change_between_steps(tok, policy):
    engine = Engine(policy, tok)
    rid = engine.add_request(GenRequest(prompts(len(tok), 1)[0], GREEDY))
    engine.step()
    engine.update_weights(list(policy.named_parameters()), version=7)
    results = {}
    while engine.has_unfinished:
        results.update(engine.step())
    assert results[rid][0].policy_version == 7


def test_partial_shows_a_running_requests_tokens_as_they_grow(tok, policy):
    engine = Engine(policy, tok)
    p = prompts(len(tok), 1)[0]
    rid = engine.add_request(GenRequest(p, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[10_000]), n=2))
    seen: list[list[int]] = []
    done = []
    while not done:
        done = engine.step()
        if not done:
            now = engine.partial(rid)
            assert len(now) == 2 and all(r.finish_reason == "" for r in now)
            assert now[0].token_ids[:len(seen[-1]) if seen else 0] == (seen[-1] if seen else [])
            seen.append(now[0].token_ids)
    assert done[0][1][0].token_ids[:len(seen[-1])] == seen[-1] and len(seen[-1]) == 11
    assert engine.partial(rid) is None  # delivered
