"""`--profile fast` (int8 weights, prompt lookup while the batch is small) serves chat completions, whole and streamed;
and `assay bench serve` runs standard against fast on the tiny policy (no speed is asserted)."""

import math

import openai
import pytest
from serve_helpers import MODEL

from assay.bench.serve import run_serve_bench, table, vllm_status
from assay.core.errors import AssayError
from assay.rollout.engine.cpu_kernel import int8_rows
from assay.serve.profile import FAST, get_profile, profile_names
from assay.serve.server import ServeOptions, build_state, start_server


@pytest.fixture
def fast_server(policy, tok):
    s = start_server(build_state(policy, tok, MODEL, FAST, ServeOptions()))
    yield s
    s.close()


def test_fast_is_a_registered_profile_of_int8_and_speculation():
    assert {"standard", "fast"} <= set(profile_names())
    fast = get_profile("fast")
    assert fast.engine.weights == "int8" and fast.engine.speculative_tokens > 0
    # a verifying step's rows stay within the int8 kernel's; under load the batch grows as standard's does
    assert fast.engine.speculative_max_batch * (1 + fast.engine.speculative_tokens) <= int8_rows()
    assert fast.max_batch == get_profile("standard").max_batch
    with pytest.raises(AssayError, match="standard"):
        get_profile("fastest")


def test_fast_profile_serves_chat_completions(fast_server):
    assert fast_server.state.batcher.engine.model.packs.int8
    client = openai.OpenAI(base_url=f"{fast_server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "Use the calc tool."}, {"role": "user", "content": "What is 4+9?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32,
                                           logprobs=True)
    choice = whole.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls") and whole.usage.completion_tokens >= 1
    assert all(math.isfinite(t.logprob) for t in choice.logprobs.content)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=32, stream=True) if c.choices)
    assert streamed == (choice.message.content or "")


def test_bench_serve_runs_both_profiles_at_two_concurrencies(policy, tok):
    rows = run_serve_bench(policy, tok, ["standard", "fast"], [1, 2], rounds=1, per_client=1, max_tokens=4)
    assert [(r.profile, r.concurrency) for r in rows] == [("standard", 1), ("fast", 1), ("standard", 2), ("fast", 2)]
    for r in rows:
        assert r.tokens_per_s > 0 and r.ttft_p50_ms > 0 and math.isfinite(r.ttft_p99_ms)
        assert (r.ratio_to_standard is None) == (r.profile == "standard")
    text = table(rows, vllm_status())
    assert "fast" in text and "vLLM" in text
