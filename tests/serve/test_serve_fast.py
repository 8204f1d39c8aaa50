"""`--profile fast` (int8 weights, prompt lookup while the batch is small) serves chat completions, whole and streamed;
and `assay bench serve` runs standard against fast on the tiny policy (no speed is asserted)."""

import math
import sys

import openai
import pytest
from serve_helpers import MODEL

from assay.bench.serve import (
    PROMPTS,
    _drive,
    assay_starter,
    free_loopback_port,
    in_process_starters,
    level_requests,
    run_serve_bench,
    start_process_server,
    table,
)
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


def test_every_level_of_bench_serve_sends_every_prompt(fast_server):
    """One client sending one request timed one short answer; a level now sends the whole mix of prompts, and
    more requests where the clients ask for more."""
    import asyncio

    for clients, per_client, want in ((1, 1, len(PROMPTS)), (3, 1, len(PROMPTS)), (3, 4, 12)):
        _, results = asyncio.run(_drive(fast_server.url, MODEL, clients, level_requests(clients, per_client), 2))
        assert len(results) == want and all(tokens >= 1 for _, _, tokens in results)


def test_bench_serve_runs_both_profiles_at_two_concurrencies(policy, tok):
    rows = run_serve_bench(in_process_starters(policy, tok, ["standard", "fast"], max_queue=8), [1, 2], rounds=1,
                           per_client=1, max_tokens=4)
    assert [(r.profile, r.concurrency) for r in rows] == [("standard", 1), ("fast", 1), ("standard", 2), ("fast", 2)]
    for r in rows:
        assert r.tokens_per_s > 0 and r.ttft_p50_ms > 0 and math.isfinite(r.ttft_p99_ms)
        assert (r.ratio_to_standard is None) == (r.profile == "standard")
    text = table(rows, "vLLM: not installed here")
    assert "fast" in text and "vLLM" in text and "÷ vLLM" not in text


def test_bench_serve_drives_servers_in_processes_of_their_own(policy, tok, tmp_path):
    """What the command runs: each profile as `assay serve` in a process of its own (`--threads`, served as "bench"),
    and vLLM's column the same way (`--vllm-python`); here a second `assay serve` stands in for vLLM, under the
    column name the ratios to vLLM are taken against."""
    from assay.core.modeling import save_model

    save_model(policy, tok, tmp_path / "weights")
    starters = {name: assay_starter(profile, tmp_path / "weights", 1, 8, tmp_path / f"{name}.log")
                for name, profile in (("standard", "standard"), ("vllm", "standard"))}
    started = []

    def recorded(start):
        return lambda: started.append(start()) or started[-1]

    rows = run_serve_bench({name: recorded(start) for name, start in starters.items()}, [1, 2], rounds=2,
                           per_client=1, max_tokens=4)
    assert [(r.profile, r.concurrency) for r in rows] == [("standard", 1), ("vllm", 1), ("standard", 2), ("vllm", 2)]
    for r in rows:
        assert r.tokens_per_s > 0
        assert (r.ratio_to_vllm is None) == (r.profile == "vllm") and len(r.ratio_to_vllm or [0, 0]) == 2
    assert len(started) == 2 and all(s.process.poll() is not None for s in started)  # stopped with the bench
    assert "1 torch threads" in (tmp_path / "standard.log").read_text()  # --threads reached the server
    assert "÷ vLLM" in table(rows, None)
    with pytest.raises(AssayError, match="fastest"):
        assay_starter("fastest", tmp_path / "weights", 1, 8, tmp_path / "x.log")
    # a server that dies before it serves: an error that quotes its log
    with pytest.raises(AssayError, match="exited with 3.*NoModelError: none here"):
        start_process_server([sys.executable, "-c", "import sys; print('NoModelError: none here'); print('bye'); sys.exit(3)"],
                             f"http://127.0.0.1:{free_loopback_port()}", tmp_path / "dead.log")
