"""What the server refuses, and how: OpenAI's error JSON with a 4xx status; a full queue answers 429 and
the server goes on serving; the API key is enforced."""

import threading

import httpx
import openai
import pytest
from serve_helpers import MODEL, metric

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is 1+2?"}], "max_tokens": 8}


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert isinstance(body["message"], str) and body["message"] and isinstance(body["type"], str)
    return body


@pytest.fixture
def http(serve):
    server = serve()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        client.server = server
        yield client


def test_malformed_requests_get_4xx_with_openai_error_json(http):
    post = http.post
    assert "not JSON" in error_of(post("/v1/chat/completions", content=b"{not json",
                                       headers={"content-type": "application/json"}), 400)["message"]
    assert "JSON list" in error_of(post("/v1/chat/completions", json=[1, 2]), 400)["message"]
    assert error_of(post("/v1/chat/completions", json={"model": MODEL}), 400)["param"] == "messages"
    assert error_of(post("/v1/chat/completions", json={**CHAT, "messages": []}), 400)["param"] == "messages"
    unknown = error_of(post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404)
    assert unknown["code"] == "model_not_found" and MODEL in unknown["message"]
    assert error_of(post("/v1/chat/completions", json={**CHAT, "max_tokens": -1}), 400)["param"] == "max_tokens"
    assert error_of(post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0}), 400)["param"] \
        == "max_tokens"
    assert error_of(post("/v1/chat/completions", json={**CHAT, "temperature": -0.5}), 400)["param"] == "temperature"
    assert error_of(post("/v1/chat/completions", json={**CHAT, "n": 0}), 400)["param"] == "n"
    assert "frobnicate" in error_of(post("/v1/chat/completions", json={**CHAT, "frobnicate": 1}), 400)["message"]
    assert "top_logprobs" in error_of(post("/v1/chat/completions", json={**CHAT, "logprobs": True,
                                                                        "top_logprobs": 3}), 400)["message"]
    assert "logprobs" in error_of(post("/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 2}),
                                  400)["message"]
    assert "vocabulary" in error_of(post("/v1/completions", json={"model": MODEL, "prompt": [1, 10**6]}),
                                    400)["message"]
    bad_call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{oops"}}]}
    assert "not JSON" in error_of(post("/v1/chat/completions", json={**CHAT, "messages": [
        *CHAT["messages"], bad_call]}), 400)["message"]
    huge = b'{"model": "%s", "prompt": "x", "max_tokens": %s}' % (MODEL.encode(), b"9" * 5000)
    assert "digits" in error_of(post("/v1/completions", content=huge,
                                     headers={"content-type": "application/json"}), 400)["message"]
    huge_args = {**bad_call, "tool_calls": [{**bad_call["tool_calls"][0], "function": {
        "name": "calc", "arguments": '{"x": ' + "9" * 5000 + "}"}}]}
    assert "digits" in error_of(post("/v1/chat/completions", json={**CHAT, "messages": [
        *CHAT["messages"], huge_args]}), 400)["message"]
    long = error_of(post("/v1/completions", json={"model": MODEL, "prompt": [5] * 1024}), 400)
    assert long["code"] == "context_length_exceeded"
    assert "batch" in error_of(post("/v1/chat/completions", json={**CHAT, "n": 10_000}), 400)["message"]
    assert error_of(http.get("/v1/nothing"), 404)["code"] == "not_found"
    assert error_of(http.get("/v1/chat/completions"), 405)
    assert metric(http.server, "assay_serve_requests_total", route="chat", status="400") >= 8
    # and it still serves
    assert http.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["role"] == "assistant"


def test_a_full_queue_answers_429_and_the_server_keeps_serving(serve_babbler):
    server = serve_babbler(max_queue=1, max_batch=1)
    statuses: list[int] = []
    bodies: list[dict] = []
    lock = threading.Lock()

    def one() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "What is", "max_tokens": 200})
        with lock:
            statuses.append(r.status_code)
            bodies.append(r.json())

    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [b["error"] for s, b in zip(statuses, bodies, strict=True) if s == 429]
    assert statuses.count(200) >= 2 and len(refused) >= 5, statuses  # one running, one waiting: the rest refused
    assert set(statuses) == {200, 429}
    assert all(e["code"] == "queue_full" and e["type"] == "rate_limit_error" for e in refused)
    assert metric(server, "assay_serve_requests_total", route="completions", status="429") == len(refused)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": "What is", "max_tokens": 5}).status_code == 200
        assert c.get("/health").status_code == 200
    assert server.state.batcher.queue.qsize() == 0 and not server.state.batcher.engine.has_unfinished


def test_the_api_key_is_required_except_for_health(serve, monkeypatch):
    monkeypatch.setenv("ASSAY_TEST_SERVE_KEY", "s3cret-key-0123")
    server = serve(api_key_env="ASSAY_TEST_SERVE_KEY")
    with httpx.Client(base_url=server.url) as c:
        for path in ("/v1/models", "/metrics"):
            assert error_of(c.get(path), 401)["code"] == "invalid_api_key"
        missing = error_of(c.post("/v1/chat/completions", json=CHAT), 401)
        wrong = c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer s3cret-key-0124"})
        assert "s3cret" not in missing["message"] and "s3cret" not in wrong.text
        assert error_of(wrong, 401)
        assert c.get("/health").status_code == 200
        assert c.get("/metrics", headers={"Authorization": "Bearer s3cret-key-0123"}).status_code == 200
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret-key-0123", max_retries=0)
    assert good.chat.completions.create(**CHAT).choices[0].message.role == "assistant"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()
    assert "s3cret" not in repr(server.state)


def test_an_unset_key_variable_is_refused_before_serving(serve, monkeypatch):
    monkeypatch.delenv("ASSAY_TEST_SERVE_KEY", raising=False)
    from assay.core.errors import AssayError

    with pytest.raises(AssayError, match="ASSAY_TEST_SERVE_KEY"):
        serve(api_key_env="ASSAY_TEST_SERVE_KEY")
