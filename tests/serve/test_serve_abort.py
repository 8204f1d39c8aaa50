"""A client that goes away has its request aborted in the engine: nothing keeps generating for nobody."""

import time

import httpx
from serve_helpers import MODEL, metric

LONG = {"model": MODEL, "prompt": "What is", "max_tokens": 1000, "temperature": 0}  # the babbler never stops early


def settled(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while server.state.batcher.engine.has_unfinished or server.state.batcher.running:
        assert time.monotonic() < deadline, "the request still runs in the engine"
        time.sleep(0.02)


def test_a_stream_whose_client_disconnects_is_aborted(serve_babbler):
    server = serve_babbler()
    with httpx.Client(base_url=server.url, timeout=30) as c, \
            c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()
        first = [next(lines) for _ in range(4)]  # a few tokens arrive: the request runs
        assert all(line.startswith("data: {") or not line for line in first)
    # the connection is closed here, with ~1000 tokens still to go
    settled(server)
    assert metric(server, "assay_serve_requests_total", route="completions", status="disconnected") == 1
    assert metric(server, "assay_serve_aborted_requests_total") == 1  # taken out of the engine unfinished
    assert metric(server, "assay_serve_generated_tokens_total") < 1000
    assert server.state.batcher.engine.blocks.num_free == len(server.state.batcher.engine.blocks.blocks)


def test_a_waiting_request_whose_client_gives_up_is_aborted(serve_babbler, monkeypatch):
    server = serve_babbler()
    engine = server.state.batcher.engine
    step = engine.step

    def slow_step():  # at least 2 ms a token: 1000 tokens outlast the client's 0.5 s on any CPU
        time.sleep(0.002)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    with httpx.Client(base_url=server.url, timeout=0.5) as c:
        try:
            c.post("/v1/completions", json=LONG)
            raise AssertionError("a 1000-token request answered within 0.5 s; the test needs a longer one")
        except httpx.ReadTimeout:
            pass
    settled(server)
    assert metric(server, "assay_serve_requests_total", route="completions", status="disconnected") == 1
    assert metric(server, "assay_serve_requests_total", route="completions", status="200") == 0
    assert metric(server, "assay_serve_aborted_requests_total") == 1
    assert server.state.batcher.engine.totals["tokens"] == 0  # no request ran to its end
