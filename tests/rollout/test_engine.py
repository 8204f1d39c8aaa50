import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from assay.core.errors import AssayError
from assay.rollout.base import GenRequest, SamplingParams
from assay.rollout.engine import Engine, EngineConfig
from assay.rollout.hf import HFBackend

GREEDY = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[10_000])  # no stop: full lengths compared


def spread(model):
    """Random weights at 4x the usual scale: decisive logits, so greedy never rides on a near tie."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4)
    return model.eval()


@pytest.fixture(scope="module")
def policy(model):
    return spread(model)


def random_prompts(vocab, count, max_len=60, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, max_len, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def hf_greedy(model, tok, prompts, params=GREEDY):
    hf = HFBackend(model, tok)
    return [hf.generate([GenRequest(p, params)])[0][0].token_ids for p in prompts]


def engine_tokens(engine, prompts, params=GREEDY):
    return [r[0].token_ids for r in engine.generate([GenRequest(p, params) for p in prompts])]


def block_bytes(model, block_size=16):
    from assay.rollout.engine.model import PagedModel

    return PagedModel.bytes_per_block(model, block_size)


@pytest.fixture(params=["kernel", "pytorch", "padded"])
def attention_path(request, monkeypatch):
    """Decode attention and the fused elementwise ops through the C kernels (where they build), the pure
    PyTorch path (the gather attention, what runs without a compiler), and that path with the prefilling
    sequences as one padded batch under a mask (what an accelerator runs)."""
    from assay.rollout.engine import cpu_kernel, model_runner

    if request.param == "kernel" and cpu_kernel._library() is None:
        pytest.skip("missing tool: the C kernels did not build (a C compiler with OpenMP); only the PyTorch path "
                    "exists here")
    if request.param in ("pytorch", "padded"):
        monkeypatch.setattr(cpu_kernel, "usable", lambda q, k_cache: False)
        monkeypatch.setattr(cpu_kernel, "fused_usable", lambda x: False)
    if request.param == "padded":
        monkeypatch.setattr(model_runner, "_padded_prefill", lambda device: True)
    return request.param


def test_greedy_matches_hf_generate_with_and_without_prefix_hits(tok, policy, attention_path):
    prompts = random_prompts(len(tok), 16)
    shared = [prompts[0][:40] + p for p in random_prompts(len(tok), 6, seed=2)]  # a common 40-token prefix
    want = hf_greedy(policy, tok, prompts + shared)
    engine = Engine(policy, tok, EngineConfig(max_batched_tokens=48))  # chunked prefill in play
    assert engine_tokens(engine, prompts + shared) == want
    assert engine.last_stats["prefix_hit_rate"] > 0  # the shared prefix was computed once
    assert engine_tokens(engine, prompts + shared) == want  # a second pass is served from the cache
    assert engine.last_stats["prefix_hit_rate"] > 0.5


def test_greedy_matches_hf_at_head_size_64_where_prefill_attends_in_the_c_kernel(tok):
    """The kernels' specialized head sizes: chunked prefill (chunks after cached keys), prefix hits and
    multi-turn continuations run the causal prefill kernel, decoding the block and many-query loops."""
    torch.manual_seed(5)
    model = spread(Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=256, max_position_embeddings=256, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None)))
    prompts = random_prompts(len(tok), 6, max_len=100, seed=4)
    shared = [prompts[0][:50] + p for p in random_prompts(len(tok), 3, seed=5)]
    engine = Engine(model, tok, EngineConfig(max_batched_tokens=40))
    assert engine_tokens(engine, prompts + shared) == hf_greedy(model, tok, prompts + shared)
    assert engine.last_stats["prefix_hit_rate"] > 0
    turns = [p + out + p[:30] for p, out in zip(prompts, engine_tokens(engine, prompts), strict=True)]
    assert engine_tokens(engine, turns) == hf_greedy(model, tok, turns)


def test_greedy_groups_fork_and_share_their_prefix_exactly(tok, policy, attention_path):
    prompts = random_prompts(len(tok), 5, max_len=120, seed=3)
    engine = Engine(policy, tok)
    groups = engine.generate([GenRequest(p, GREEDY, n=4) for p in prompts])  # forks + shared-prefix attention
    assert [[r.token_ids for r in g] for g in groups] == [[w] * 4 for w in hf_greedy(policy, tok, prompts)]


def test_greedy_matches_hf_generate_under_forced_preemption(tok, policy):
    prompts = random_prompts(len(tok), 12)
    engine = Engine(policy, tok, EngineConfig(kv_cache_bytes=12 * block_bytes(policy), max_batched_tokens=64))
    assert engine_tokens(engine, prompts) == hf_greedy(policy, tok, prompts)
    assert engine.last_stats["preemptions"] > 0


@pytest.mark.parametrize("arch,rope", [
    ("llama", {"rope_type": "default"}),
    ("llama", {"rope_type": "linear", "factor": 2.0}),
    ("llama", {"rope_type": "dynamic", "factor": 2.0}),
    ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}),
    ("qwen2", {"rope_type": "linear", "factor": 3.0}),
    ("qwen3", {"rope_type": "default"}),
])
def test_greedy_matches_hf_for_each_architecture_and_rope_scaling(tok, arch, rope):
    common = dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=96, max_position_embeddings=256,
                  rope_parameters={"rope_theta": 10000.0, **rope}, pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id, bos_token_id=None, tie_word_embeddings=arch == "qwen2")
    torch.manual_seed(3)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(attention_bias=True, mlp_bias=True, **common))
    elif arch == "qwen3":  # q/k norm, an explicit head_dim unlike hidden / heads
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=32, **common))
        with torch.no_grad():  # non-trivial norm weights, so a skipped q/k norm cannot pass
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    spread(model)
    prompts = random_prompts(len(tok), 6, max_len=120)
    assert engine_tokens(Engine(model, tok), prompts) == hf_greedy(model, tok, prompts)


def recomputed_logprobs(model, prompt, sampled, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + sampled])).logits[0].float() / temperature
    return torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(-1, torch.tensor(sampled)[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_the_trainers_recomputation(tok, policy, temperature):
    engine = Engine(policy, tok)
    prompts = random_prompts(len(tok), 5)
    params = SamplingParams(temperature=temperature, max_tokens=30, seed=4)
    for prompt, group in zip(prompts, engine.generate([GenRequest(p, params, n=3) for p in prompts]), strict=True):
        for res in group:
            want = recomputed_logprobs(policy, prompt, res.token_ids, temperature)
            assert torch.allclose(torch.tensor(res.logprobs), want, atol=1e-4)


def test_a_group_is_prefilled_once_and_its_samples_are_independent(tok, policy):
    engine = Engine(policy, tok)
    prompt = random_prompts(len(tok), 1, max_len=200, seed=5)[0] + [1] * 100
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=9)
    # the G members of a GRPO group arrive as separate requests (the agent loop's shape)
    group = [r[0] for r in engine.generate([GenRequest(prompt, params) for _ in range(8)])]
    assert engine.last_stats["prefix_hit_rate"] >= 7 / 8
    assert len({tuple(r.token_ids) for r in group}) > 1
    for res in group:
        assert torch.allclose(torch.tensor(res.logprobs), recomputed_logprobs(policy, prompt, res.token_ids, 1.0),
                              atol=1e-4)


def test_seeded_requests_reproduce_and_unseeded_ones_vary(tok, policy):
    engine = Engine(policy, tok)
    prompts = random_prompts(len(tok), 4)

    def draw(seed):
        return [[r.token_ids for r in g] for g in
                engine.generate([GenRequest(p, SamplingParams(max_tokens=12, seed=seed), n=2) for p in prompts])]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
    assert draw(None) != draw(None)


def test_truncation_keeps_samples_inside_top_k(tok, policy):
    engine = Engine(policy, tok)
    prompt = random_prompts(len(tok), 1)[0]
    with torch.no_grad():
        logits = policy(torch.tensor([prompt])).logits[0, -1]
    top2 = set(logits.topk(2).indices.tolist())
    for params in (SamplingParams(max_tokens=1, top_k=2, seed=1), SamplingParams(max_tokens=1, min_p=0.999, seed=1),
                   SamplingParams(max_tokens=1, top_p=1e-6, seed=1)):
        firsts = {r.token_ids[0] for r in engine.generate([GenRequest(prompt, params, n=16)])[0]}
        assert firsts <= top2
        if params.top_k != 2:
            assert firsts == {int(logits.argmax())}


def test_stop_tokens_and_stop_strings_end_a_sample(tok, policy):
    engine = Engine(policy, tok)
    prompt = random_prompts(len(tok), 1)[0]
    free = engine_tokens(engine, [prompt])[0]
    stop_tok = free[5]
    cut = engine_tokens(engine, [prompt], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_tok]))[0]
    assert cut == free[: free.index(stop_tok) + 1]
    text = tok.decode(free[10:12])
    res = engine.generate([GenRequest(prompt, SamplingParams(temperature=0, max_tokens=40, stop=[text]))])[0][0]
    assert res.finish_reason == "stop" and text in tok.decode(res.token_ids) and len(res.token_ids) <= 12


def test_a_multi_turn_session_computes_only_its_new_tokens(tok, policy):
    engine = Engine(policy, tok)
    history = random_prompts(len(tok), 1, seed=11)[0]
    for _ in range(3):
        res = engine.generate([GenRequest(history, GREEDY)])[0][0]
        history = history + res.token_ids + [5, 6, 7, 8, 9]  # the sample, then a tool observation
        computed = engine.last_stats["computed_tokens"]
    # the last turn computed its observation and the previous turn's final token, then its own samples
    assert computed == 1 + 5 + 40 - 1


def test_the_warm_up_step_leaves_no_trace(tok, policy):
    """The throwaway step at start caches nothing, counts nothing and draws from no global stream: a warmed
    engine samples what an unwarmed one does, token for token, from an empty cache."""
    prompts = random_prompts(len(tok), 5, seed=13)
    prompts[0] = [0] * 40 + prompts[0]  # the warm-up's own tokens: a prefix it must not have left cached
    torch.manual_seed(3)
    warmed = Engine(policy, tok, EngineConfig(warm_up=True))
    after_warm_up = torch.rand(1)
    torch.manual_seed(3)
    cold = Engine(policy, tok, EngineConfig(warm_up=False))
    assert torch.equal(torch.rand(1), after_warm_up)
    assert warmed.blocks.num_free == cold.blocks.num_free == len(cold.blocks.blocks)
    assert warmed.take_stats() == cold.take_stats() and warmed.last_stats == {}
    params = SamplingParams(max_tokens=20, seed=4)
    assert engine_tokens(warmed, prompts, params) == engine_tokens(cold, prompts, params)
    assert warmed.last_stats["cached_prompt_tokens"] == cold.last_stats["cached_prompt_tokens"] == 0


def test_update_weights_is_in_place_and_drops_the_cache(tok, model):
    import copy

    policy = spread(copy.deepcopy(model))
    other = spread(copy.deepcopy(model))
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5 * torch.randn_like(p))
    engine = Engine(policy, tok)
    prompts = random_prompts(len(tok), 4)
    engine_tokens(engine, prompts)
    ptrs = [p.data_ptr() for p in policy.parameters()]
    engine.update_weights(other.named_parameters(), version=3)
    assert [p.data_ptr() for p in policy.parameters()] == ptrs
    assert engine_tokens(engine, prompts) == hf_greedy(other, tok, prompts)
    assert engine.last_stats["prefix_hit_rate"] == 0  # nothing served from the old weights' K/V
    assert engine.generate([GenRequest(prompts[0], GREEDY)])[0][0].policy_version == 3


@pytest.mark.parametrize("gemm", ["onednn", "torch"])
def test_both_gemm_libraries_give_transformers_greedy_tokens(tok, policy, gemm):
    from assay.rollout.engine import onednn

    if gemm == "onednn" and not onednn.available():
        pytest.skip("this torch has no oneDNN")
    prompts = random_prompts(len(tok), 6, max_len=90, seed=5)  # some past the few-rows cut, some under it
    engine = Engine(policy, tok, EngineConfig(gemm=gemm))
    assert (engine.model.packs is not None) == (gemm == "onednn")
    assert engine_tokens(engine, prompts) == hf_greedy(policy, tok, prompts)


def test_the_c_decode_step_samples_exactly_what_the_layer_by_layer_forward_does(tok, policy, monkeypatch):
    """Few decoding rows run every layer in one C call: the same kernels in the same order, so the same
    tokens and the same logprobs to the bit, shared-prefix merges included."""
    from assay.rollout.engine import cpu_kernel, onednn
    from assay.rollout.engine import model as paged

    if cpu_kernel._library() is None:
        pytest.skip("missing tool: the C kernels did not build (a C compiler with OpenMP)")
    if not onednn.available():
        pytest.skip("the C step runs on the C kernels' panels beside oneDNN")
    # as many rows as the C step takes on this CPU (8 with 512-bit vectors, 2 with 256-bit ones): two groups
    # of four, or one group of two, so that every decode step runs in C
    rows = cpu_kernel.skinny_rows()
    groups, n = (2, 4) if rows >= 8 else (1, 2)
    prompts = [p[:48] + p[:48] for p in random_prompts(len(tok), groups + 8, max_len=60, seed=6) if len(p) >= 24]
    prompts = prompts[:groups]  # long enough to share whole KV blocks within a group
    requests = [GenRequest(p, SamplingParams(temperature=1.0, max_tokens=30, seed=i), n=n) for i, p in enumerate(prompts)]
    steps = []
    in_c = paged.PagedModel._decode_step_in_c
    monkeypatch.setattr(paged.PagedModel, "_decode_step_in_c", lambda self, b: steps.append(b) or in_c(self, b))
    got = Engine(policy, tok).generate(requests)
    assert len(steps) >= 25 and any(b.groups[0].shared is not None for b in steps)
    monkeypatch.setattr(paged.PagedModel, "_few_decodes", lambda self, b: False)
    want = Engine(policy, tok).generate(requests)
    assert [[(r.token_ids, r.logprobs) for r in g] for g in got] == [[(r.token_ids, r.logprobs) for r in g] for g in want]


def test_an_in_place_write_to_the_weights_reaches_the_packed_gemms(tok, model):
    """An optimizer step writes the parameters in place, without update_weights: the engine runs the new
    weights next (each packed copy is remade when its weight's version moves)."""
    import copy

    policy = spread(copy.deepcopy(model))
    engine = Engine(policy, tok)
    prompts = random_prompts(len(tok), 4)
    before = engine_tokens(engine, prompts)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5 * torch.randn_like(p))
    engine.blocks.reset_cache()  # the cached K/V are the old weights' (update_weights drops them too)
    after = engine_tokens(engine, prompts)
    assert after == hf_greedy(policy, tok, prompts) and after != before


def test_the_weights_are_packed_as_the_engine_starts_and_again_only_after_they_change(tok, model, monkeypatch):
    """Both layouts are made at start, so no timed call pays for packing; an in-place write repacks."""
    import copy

    from assay.rollout.engine import cpu_kernel, onednn

    if not onednn.available():
        pytest.skip("this torch has no oneDNN")
    packed = []
    for module, name in ((onednn, "_pack"), (cpu_kernel, "pack_panels")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda w, real=real: packed.append(w.shape) or real(w))
    policy = copy.deepcopy(model)
    engine = Engine(policy, tok)
    groups = 4 * policy.config.num_hidden_layers + 1  # qkv, o, gate|up, down a layer; the output head
    assert len(packed) == groups * (2 if cpu_kernel.skinny_rows() else 1)
    packed.clear()
    prompts = random_prompts(len(tok), 6, max_len=90, seed=5)  # prefill of many rows, decode of few
    engine_tokens(engine, prompts)
    assert packed == []
    with torch.no_grad():
        policy.lm_head.weight.mul_(1.0)  # an in-place write: a new version of the (tied) head
    engine_tokens(engine, prompts)
    assert packed and all(shape == policy.lm_head.weight.shape for shape in packed)


def test_onednn_gemms_are_refused_where_they_cannot_run(tok, model):
    import copy

    with pytest.raises(AssayError, match="rollout.gemm: onednn"):
        Engine(copy.deepcopy(model).to(torch.bfloat16), tok, EngineConfig(gemm="onednn"))


def test_bad_requests_get_clear_errors(tok, policy):
    engine = Engine(policy, tok, EngineConfig(kv_cache_bytes=2 * block_bytes(policy)))
    with pytest.raises(AssayError, match="KV blocks"):
        engine.generate([GenRequest([1] * 40, SamplingParams(max_tokens=10))])
    with pytest.raises(AssayError, match="no room"):
        Engine(policy, tok).generate([GenRequest([1] * 300, SamplingParams())])
    with pytest.raises(AssayError, match="min_p"):
        engine.generate([GenRequest([1], SamplingParams(min_p=1.5))])


def test_speculative_decoding_keeps_greedy_outputs_exact(tok, policy):
    prompts = [p * 3 for p in random_prompts(len(tok), 4, max_len=12, seed=21)]  # repetitive: drafts get accepted
    want = hf_greedy(policy, tok, prompts)
    engine = Engine(policy, tok, EngineConfig(speculative_tokens=4, speculative_max_batch=4, speculative_adaptive=False))
    for _ in range(2):  # the second pass reads blocks the first one cached while speculating
        assert engine_tokens(engine, prompts) == want
    assert engine.last_stats["draft_accepted"] > 0


def test_speculative_acceptance_leaves_the_distribution_unchanged():
    from assay.rollout.engine.speculative import verify

    torch.manual_seed(0)
    logits = torch.randn(3, 5) * 1.5
    draft = [int(logits[0].argmax()), 2]
    params = SamplingParams(temperature=1.0)
    p0, p1 = torch.softmax(logits[0], -1), torch.softmax(logits[1], -1)
    n = 20_000
    first, pair = torch.zeros(5), torch.zeros(5)
    for stream in range(n):
        out, lps = verify(logits, draft, params, stream, position=10)
        first[out[0]] += 1
        if out[0] == draft[0] and len(out) > 1:
            pair[out[1]] += 1
        assert lps == [pytest.approx(float(torch.log_softmax(logits[j], -1)[t]), abs=1e-6) for j, t in enumerate(out)]
    assert torch.allclose(first / n, p0, atol=0.015)  # the first token is distributed as without a draft
    assert torch.allclose(pair / first[draft[0]], p1, atol=0.02)  # and so is the next, given the first


def test_the_draft_length_is_the_one_expected_to_pay_most():
    from assay.rollout.engine.speculative import acceptance, draft_length

    assert draft_length([0.9], [3], (1.0, 4.0, 4.0, 4.0)) == 0  # a verifying step of 4x a decode step never pays
    assert draft_length([0.9], [3], (1.0, 1.1, 1.2, 1.3)) == 3  # cheap, and drafts mostly accepted
    assert draft_length([0.1], [3], (1.0, 1.1, 1.2, 1.3)) == 0  # cheap, but drafts mostly rejected
    assert draft_length([0.9], [1], (1.0, 1.1, 1.2, 1.3)) == 1  # one token to draft: a longer step buys nothing
    assert draft_length([0.9, 0.9], [3, 0], (1.0, 1.5, 1.6, 1.7)) == 3  # one sequence's draft pays the step
    assert draft_length([0.9], [3], (1.0, 1.05, 3.0, 3.1)) == 1  # a cost that jumps past one token
    assert acceptance(0, 0) == 0.5 and acceptance(9, 0) > 0.9 and acceptance(0, 9) < 0.1


def test_drafts_follow_the_timed_costs(tok, policy):
    """The engine times its verifying steps as it starts; with costs that make drafts lose it drafts none, with
    costs that make them pay it drafts, and the greedy output is the same either way."""
    from assay.rollout.engine.speculative import DraftCosts

    prompts = [p * 3 for p in random_prompts(len(tok), 2, max_len=12, seed=22)]  # repetitive: drafts get accepted
    want = hf_greedy(policy, tok, prompts)
    engine = Engine(policy, tok, EngineConfig(speculative_tokens=3, speculative_max_batch=2))
    timed = engine.draft_costs.seconds
    assert len(timed) == 2 and all(len(row) == 4 and min(row) > 0 for row in timed)
    assert engine.blocks.num_free == len(engine.blocks.blocks)  # the timing's sequences left nothing behind
    engine.draft_costs = DraftCosts(((1.0, 9.0, 9.0, 9.0),) * 2)
    assert engine_tokens(engine, prompts) == want
    assert engine.last_stats["draft_proposed"] == 0
    engine.draft_costs = DraftCosts(((1.0, 1.0, 1.0, 1.0),) * 2)
    assert engine_tokens(engine, prompts) == want
    assert engine.last_stats["draft_proposed"] > 0 and engine.last_stats["draft_accepted"] > 0
    assert engine.blocks.num_free == len(engine.blocks.blocks)


def test_a_failed_generate_frees_every_block(tok, policy, monkeypatch):
    engine = Engine(policy, tok)
    real, calls = engine.runner.run, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "run", flaky)
    with pytest.raises(RuntimeError):
        engine.generate([GenRequest(p, GREEDY) for p in random_prompts(len(tok), 4)])
    assert engine.blocks.num_free == len(engine.blocks.blocks)
    monkeypatch.setattr(engine.runner, "run", real)
    prompts = random_prompts(len(tok), 3)
    assert engine_tokens(engine, prompts) == hf_greedy(policy, tok, prompts)  # and it still works


def test_max_seqs_bounds_a_forked_group_too(tok, policy):
    prompt = random_prompts(len(tok), 1, seed=13)[0]
    engine = Engine(policy, tok, EngineConfig(max_seqs=3))
    widths, run = [], engine.runner.run

    def counting(plan, *args):
        widths.append(len(plan))
        return run(plan, *args)

    engine.runner.run = counting
    group = engine.generate([GenRequest(prompt, GREEDY, n=7)])[0]
    assert [r.token_ids for r in group] == [hf_greedy(policy, tok, [prompt])[0]] * 7
    assert max(widths) == 3


def test_stop_string_end_windowed_equals_scanning_whole_prefixes(tok):
    from assay.rollout.base import stop_string_end

    def naive(completion, stops):
        return next((end for end in range(1, len(completion) + 1)
                     if any(s in tok.decode(completion[:end], skip_special_tokens=False) for s in stops)), None)

    g = torch.Generator().manual_seed(3)
    for _ in range(40):
        completion = torch.randint(0, len(tok), (30,), generator=g).tolist()
        a, b = sorted(torch.randint(0, 30, (2,), generator=g).tolist())
        stops = [tok.decode(completion[a:b + 1]), "never-there"]
        want = naive(completion, stops)
        assert stop_string_end(tok, completion, stops) == want
        if want is not None:  # checked in two halves, as a step-by-step caller does
            half = want // 2
            first = stop_string_end(tok, completion[:half], stops)
            assert (first or stop_string_end(tok, completion, stops, half)) == want


def test_a_model_in_train_mode_samples_as_in_eval_mode(tok, model):
    """The trainer leaves the policy in train mode between steps; the engine's forward calls no module, so
    dropout never reaches it (and the engine does not switch the mode: it stays the trainer's)."""
    import copy

    policy = spread(copy.deepcopy(model))
    policy.config.attention_dropout = 0.9  # would scramble the tokens if any module's forward ran in train mode
    prompts = random_prompts(len(tok), 4)
    expected = hf_greedy(policy.eval(), tok, prompts)
    policy.train()
    assert engine_tokens(Engine(policy, tok), prompts) == expected
    assert policy.training
