"""The API through the openai client and plain HTTP, on a real loopback socket: greedy text equal to the
engine's own, streams that add up to the whole, n choices, logprobs, tool calls, concurrent requests."""

import json
import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from serve_helpers import CALC, MODEL, SMALL_ENGINE, calc_task, metric

from assay.agent.parse import parse_assistant
from assay.agent.render import prompt_ids
from assay.core.types import Message, Task
from assay.rollout.base import GenRequest, SamplingParams
from assay.rollout.engine import Engine

TOOLS = [{"type": "function", "function": CALC.to_json()}]


def chat(a: int, b: int, system: bool = True) -> list[dict]:
    return [*([{"role": "system", "content": "Use the calc tool."}] if system else []),
            {"role": "user", "content": f"What is {a}+{b}?"}]


@pytest.fixture
def server(serve):
    return serve()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def engine_greedy(policy, tok, task: Task, max_tokens: int = 40) -> tuple[list[int], list[float], str]:
    """The engine's own greedy sample for the task's prompt: ids and logprobs without the turn end, the text."""
    engine = Engine(policy, tok, SMALL_ENGINE)
    r = engine.generate([GenRequest(prompt_ids(tok, task), SamplingParams(temperature=0, max_tokens=max_tokens))])[0][0]
    ids, lps = r.token_ids, r.logprobs
    if r.finish_reason == "stop" and ids[-1] in engine.default_stop:
        ids, lps = ids[:-1], lps[:-1]
    return ids, lps, tok.decode(ids, skip_special_tokens=False)


def test_greedy_chat_is_the_engines_own_greedy_generation(client, policy, tok):
    task = calc_task(3, 21)
    task.tools = []  # no tools offered: the call the policy writes anyway stays text
    _, _, text = engine_greedy(policy, tok, task)
    r = client.chat.completions.create(model=MODEL, messages=chat(3, 21), temperature=0, max_tokens=40)
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens == len(prompt_ids(tok, task))
    assert r.model == MODEL and r.object == "chat.completion"


def test_tools_become_tool_calls_in_the_models_own_format(client, policy, tok):
    task = calc_task(12, 5)
    _, _, text = engine_greedy(policy, tok, task)
    content, calls, err = parse_assistant(text, "assay")
    assert calls and err is None, f"the fixture's policy wrote no tool call: {text!r}"
    r = client.chat.completions.create(model=MODEL, messages=chat(12, 5), tools=TOOLS, temperature=0, max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [(c.name, c.arguments) for c in calls]
    assert all(c.id and c.type == "function" for c in choice.message.tool_calls)

    # the call and its result go back as the conversation continues: rendered as the agent loop renders them
    history = [*chat(12, 5), choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "17"}]
    again = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=20)
    rendered = Task(env="x", task_id="x", difficulty=0, tools=[CALC], prompt=[
        *task.prompt, Message("assistant", content, calls), Message("tool", "17", name="calc")])
    assert again.usage.prompt_tokens == len(prompt_ids(tok, rendered))


@pytest.mark.parametrize("tools", [False, True])
def test_stream_deltas_add_up_to_the_whole_response(client, tools):
    extra = {"tools": TOOLS} if tools else {}
    whole = client.chat.completions.create(model=MODEL, messages=chat(7, 30), temperature=0, max_tokens=40,
                                           logprobs=True, **extra)
    chunks = list(client.chat.completions.create(model=MODEL, messages=chat(7, 30), temperature=0, max_tokens=40,
                                                 logprobs=True, stream=True, stream_options={"include_usage": True},
                                                 **extra))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (whole.choices[0].message.content or "")
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # token by token, not at once
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in calls] == \
        [(t.function.name, t.function.arguments) for t in whole.choices[0].message.tool_calls or []]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content] \
        == [e.logprob for e in whole.choices[0].logprobs.content]


def test_n_choices_seeded_and_streamed_alike(client):
    kw = dict(model=MODEL, messages=chat(4, 9), temperature=1.0, max_tokens=30, n=3, seed=11)
    whole = client.chat.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert client.chat.completions.create(**kw).choices[1].message == \
        whole.choices[1].message  # a seed samples the same choices again
    streamed = ["", "", ""]
    for c in client.chat.completions.create(**kw, stream=True):
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == [c.message.content or "" for c in whole.choices]
    assert len(set(streamed)) > 1  # three samples, not one repeated


def test_logprobs_are_the_policys_own(client, policy, tok):
    task = calc_task(3, 21)
    task.tools = []
    ids, engine_lps, _ = engine_greedy(policy, tok, task)
    r = client.chat.completions.create(model=MODEL, messages=chat(3, 21), temperature=0, max_tokens=40, logprobs=True)
    served = [e.logprob for e in r.choices[0].logprobs.content]
    assert len(served) == len(ids) and all(math.isfinite(x) and x <= 0 for x in served)
    assert "".join(e.token for e in r.choices[0].logprobs.content) == r.choices[0].message.content
    prompt = prompt_ids(tok, task)
    with torch.no_grad():  # the model's own log-softmax at each sampled token
        logits = policy(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    own = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(served), own, atol=1e-4)
    assert served == pytest.approx(engine_lps, abs=1e-5)


def test_completions_text_ids_lists_and_logprobs(client, server, tok):
    r = client.completions.create(model=MODEL, prompt=["What is", "Let me add."], max_tokens=12, temperature=0, n=2,
                                  logprobs=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy: both choices of one prompt alike
    for c in r.choices:
        assert "".join(c.logprobs.tokens) == c.text and all(math.isfinite(x) for x in c.logprobs.token_logprobs)
    by_ids = client.completions.create(model=MODEL, prompt=tok.encode("What is"), max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text
    stop = r.choices[0].text[3:5]
    cut = client.completions.create(model=MODEL, prompt="What is", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == r.choices[0].text[:r.choices[0].text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="What is", max_tokens=12, temperature=0, stop=[stop], stream=True) if c.choices)
    assert streamed == cut.choices[0].text


def test_concurrent_requests_all_complete(client, server):
    def one(i: int) -> str:
        r = client.chat.completions.create(model=MODEL, messages=chat(i, 2 * i), tools=TOOLS, temperature=0.7,
                                           max_tokens=40, seed=i)
        return r.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        reasons = list(pool.map(one, range(8)))
    assert len(reasons) == 8 and set(reasons) <= {"stop", "tool_calls", "length"}
    assert metric(server, "assay_serve_requests_total", route="chat", status="200") == 8
    assert metric(server, "assay_serve_generated_tokens_total") > 0
    assert not server.state.batcher.engine.has_unfinished


def test_models_health_and_metrics(server):
    with httpx.Client(base_url=server.url) as http:
        assert http.get("/v1/models").json()["data"][0]["id"] == MODEL
        assert http.get("/health").json() == {"status": "ok", "model": MODEL}
        http.post("/v1/completions", json={"model": MODEL, "prompt": "What is", "max_tokens": 4})
        text = http.get("/metrics").text
    for name in ("assay_serve_requests_total", "assay_serve_generated_tokens_total", "assay_serve_queue_depth",
                 "assay_serve_request_seconds_bucket", "assay_serve_queue_wait_seconds_bucket"):
        assert name in text
    assert 'assay_serve_requests_total{route="completions",status="200"} 1.0' in text


def test_assays_own_endpoint_evaluator_runs_episodes_against_the_server(server):
    """`assay eval --endpoint` on a served policy: multi-turn tool episodes through the API, no failures."""
    from assay.core.config import DomainConfig
    from assay.envs.registry import get_env
    from assay.eval.endpoint import Endpoint, run_endpoint_episodes
    from assay.eval.evaluate import eval_tasks

    env = get_env("toolcalc")
    tasks = eval_tasks(env, "toolcalc", 2, seed=0, difficulties=[1])
    domains = {"toolcalc": DomainConfig(name="toolcalc", env="toolcalc", max_new_tokens=40, max_turns=3)}
    trajs = run_endpoint_episodes(Endpoint(f"{server.url}/v1", MODEL), {"toolcalc": env}, domains, tasks, n=2,
                                  temperature=0.7, seed=1)
    assert len(trajs) == 4 and all(t.status == "ok" for t in trajs), [t.reward_info for t in trajs]
    assert all(t.usage["completion_tokens"] > 0 and t.turns >= 1 for t in trajs)
