"""The session log: every completed request in the trajectory schema, in a local directory, fsspec's memory
filesystem and a loopback S3 server; journals and shards read as one; durable across a kill -9 of
`assay serve`."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from serve_helpers import CALC, MODEL, served_url

from assay.core.errors import AssayError
from assay.core.modeling import save_model
from assay.serve.session_log import SessionLog, read_session_rows, read_sessions
from assay.serve.sessions import weights_hash

TOOLS = [{"type": "function", "function": CALC.to_json()}]


def ask(a: int, b: int) -> list[dict]:
    return [{"role": "system", "content": "Use the calc tool."}, {"role": "user", "content": f"What is {a}+{b}?"}]


def traffic(url: str) -> list:
    """Four requests of every kind: chat with tools (greedy), chat streamed, completions with n=2 and logprobs."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    r1 = client.chat.completions.create(model=MODEL, messages=ask(12, 5), tools=TOOLS, temperature=0, max_tokens=40,
                                        logprobs=True, extra_headers={"X-Session-Id": "alice"})
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask(3, 4), temperature=0, max_tokens=20,
                                                 stream=True))
    r3 = client.completions.create(model=MODEL, prompt="What is", max_tokens=8, n=2, temperature=1.0, seed=3,
                                   logprobs=0)
    r4 = client.chat.completions.create(model=MODEL, messages=ask(1, 2), temperature=0, max_tokens=10, user="bob")
    return [r1, chunks, r3, r4]


def check_log(rows: list[dict], sessions: list, responses: list, policy) -> None:
    r1, chunks, r3, r4 = responses
    assert [t.task.task_id for t in sessions] == [r1.id, chunks[0].id, r3.id, r3.id, r4.id]
    first = sessions[0]
    assert first.task.payload["session"] == "alice" and sessions[-1].task.payload["session"] == "bob"
    assert first.task.payload["policy_hash"] == weights_hash(policy) and first.policy_version == 1
    assert first.task.payload["profile"] == "standard" and first.task.payload["sampling"]["temperature"] == 0
    assert [m.role for m in first.messages] == ["system", "user", "assistant"]
    assert first.task.tools and first.task.tools[0].name == "calc"
    call = r1.choices[0].message.tool_calls
    assert first.task.payload["finish"] == r1.choices[0].finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in first.messages[-1].tool_calls] == \
        [(c.function.name, __import__("json").loads(c.function.arguments)) for c in call]
    sampled = first.token_ids[first.prompt_len:]
    assert len(sampled) == sum(first.loss_mask) and first.prompt_len == r1.usage.prompt_tokens
    assert first.logprobs[first.prompt_len:][:len(r1.choices[0].logprobs.content)] == \
        pytest.approx([e.logprob for e in r1.choices[0].logprobs.content], abs=1e-6)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert sessions[1].messages[-1].content == streamed
    assert [t.messages[-1].content for t in sessions[2:4]] == [c.text for c in r3.choices]
    assert [t.task.payload["choice"] for t in sessions[2:4]] == [0, 1]
    assert all(t.timings["latency_s"] > 0 and t.task.payload["route"] for t in sessions)
    assert len(rows) == 5


def test_every_request_is_logged_in_the_trajectory_schema_across_shards_and_journal(logged, policy, tmp_path):
    server, log = logged(str(tmp_path / "log"), compact_every=3)
    responses = traffic(server.url)
    # three requests made a shard; the fourth is in the journal until the log closes
    assert len(list((tmp_path / "log").glob("part-*.parquet"))) == 1
    assert len(list((tmp_path / "log").glob("journal-*.jsonl"))) == 1
    check_log(read_session_rows(str(tmp_path / "log")), read_sessions(str(tmp_path / "log")), responses, policy)
    log.close()
    assert len(list((tmp_path / "log").glob("part-*.parquet"))) == 2
    assert not list((tmp_path / "log").glob("journal-*"))
    check_log(read_session_rows(str(tmp_path / "log")), read_sessions(str(tmp_path / "log")), responses, policy)


def test_a_log_on_an_object_store_through_fsspec(logged, policy):
    server, log = logged("memory://assay-test/sessions", compact_every=2)
    responses = traffic(server.url)
    check_log(read_session_rows("memory://assay-test/sessions"), read_sessions("memory://assay-test/sessions"),
              responses, policy)
    log.close()
    check_log(read_session_rows("memory://assay-test/sessions"), read_sessions("memory://assay-test/sessions"),
              responses, policy)


def test_a_log_on_a_loopback_s3_server(logged, policy, monkeypatch):
    pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    s3.start()
    try:
        host, port = s3.get_host_and_port()
        for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(k, v)
        opts = {"endpoint_url": f"http://{host}:{port}", "skip_instance_cache": True}
        import s3fs

        s3fs.S3FileSystem(**opts).mkdir("assay-logs")
        server, log = logged("s3://assay-logs/prod", compact_every=3, storage_options=opts)
        responses = traffic(server.url)
        check_log(read_session_rows("s3://assay-logs/prod", opts), read_sessions("s3://assay-logs/prod", opts),
                  responses, policy)
        log.close()
        fs = s3fs.S3FileSystem(**opts)
        assert len(fs.glob("assay-logs/prod/part-*.parquet")) == 2 and not fs.glob("assay-logs/prod/journal/*")
        check_log(read_session_rows("s3://assay-logs/prod", opts), read_sessions("s3://assay-logs/prod", opts),
                  responses, policy)
    finally:
        s3.stop()


def test_a_request_in_both_a_shard_and_its_journal_is_read_once(tmp_path):
    """A kill between writing a shard and removing its journal leaves both: each request is read once."""
    from assay.core.storage import trajectory_row
    from assay.core.types import Message, Task, Trajectory

    def row(rid: str) -> dict:
        t = Trajectory(Task("serve", rid, 0, [Message("user", "hi")], payload={"time": time.time()}),
                       [Message("user", "hi")], [1, 2], [0, 1], [0.0, -0.5], 1)
        return trajectory_row(t, 0)

    log = SessionLog(str(tmp_path), compact_every=2)
    log.append("a", [row("a")])
    journal = next(tmp_path.glob("journal-*.jsonl"))
    kept = journal.read_bytes()
    log.append("b", [row("b")])  # the shard is written and the journal removed
    assert not journal.exists()
    journal.write_bytes(kept + b'{"id": "c", "rows": [')  # the journal as a kill left it, with a torn last line
    assert [r["task_id"] for r in read_session_rows(str(tmp_path))] == ["a", "b"]
    log.close()


def test_a_log_that_is_not_one_is_named(tmp_path):
    with pytest.raises(AssayError, match="no session log there"):
        read_sessions(str(tmp_path / "nothing"))
    with pytest.raises(AssayError, match="fsspec URL"):
        SessionLog("nosuchproto://x/y")


def test_every_completed_request_survives_a_kill_9_of_assay_serve(policy, tok, tmp_path):
    save_model(policy, tok, tmp_path / "run" / "policy")
    log_dir = tmp_path / "log"
    proc = subprocess.Popen([sys.executable, "-m", "assay.cli", "serve", str(tmp_path / "run"), "--port", "0",
                             "--log", str(log_dir)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = served_url(proc, [], 180)
        ids = []
        with httpx.Client(base_url=url, timeout=60) as c:
            for k in range(6):
                r = c.post("/v1/chat/completions", json={"model": str(tmp_path / "run"), "messages": ask(k, 2),
                                                         "temperature": 0, "max_tokens": 12})
                assert r.status_code == 200, r.text
                ids.append(r.json()["id"])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    sessions = read_sessions(str(log_dir))
    assert [t.task.task_id for t in sessions] == ids
    assert all(t.token_ids[t.prompt_len:] for t in sessions)
    assert not list(Path(log_dir).glob("part-*"))  # the journal alone held them
