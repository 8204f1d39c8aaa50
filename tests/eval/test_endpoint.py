"""Evaluating a policy behind an OpenAI-compatible endpoint: a scripted server the test starts on the
loopback solves arith and toolcalc (through the API's tool calls, after one deliberately bad call),
so the record must show full pass rates, two-plus rounds, and a recovered tool error."""

import ast
import json
import operator
import os
import re
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pandas as pd
import pytest

from assay.eval.record import read_record

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _calc(node: ast.AST) -> int:
    if isinstance(node, ast.Constant):
        return node.value
    return _OPS[type(node.op)](_calc(node.left), _calc(node.right))


def _reply(body: dict) -> dict:
    """The scripted policy: arith computed; toolcalc: a bad call first, then every lookup, then the sum."""
    messages = body["messages"]
    user = next(m["content"] for m in messages if m["role"] == "user")
    tool_calls, content = None, ""
    if m := re.fullmatch(r"Compute (.+?)\. End your reply .*", user):
        content = f"Answer: {_calc(ast.parse(m.group(1), mode='eval').body)}"
    elif m := re.fullmatch(r"What is (.+?)\? End your reply .*", user):
        names = re.findall(r"[a-z]+", m.group(1))
        signs = ["+", *re.findall(r"[+-]", m.group(1))]
        results = [x["content"] for x in messages if x["role"] == "tool"]
        if not results:
            tool_calls = [{"id": "c0", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "zz"}'}}]
        elif len(results) == 1:
            tool_calls = [{"id": f"c{i + 1}", "type": "function",
                           "function": {"name": "lookup", "arguments": json.dumps({"key": n})}}
                          for i, n in enumerate(names)]
        else:
            values = [int(v) for v in results[1:]]
            content = f"Answer: {sum(v if s == '+' else -v for s, v in zip(signs, values, strict=True))}"
    else:  # the reachability ping
        content = "pong"
    message = {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})}
    return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if tool_calls else "stop"}],
            "usage": {"prompt_tokens": 10 * len(messages), "completion_tokens": 7, "total_tokens": 10 * len(messages) + 7}}


KEY = "sk-test-0123456789abcdef"  # the key model "locked" requires


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/approve":  # an approval webhook: every lookup but the scripted policy's bad one
            self._send(200, json.dumps({"approve": body["arguments"] != {"key": "zz"}, "reason": "zz is no name",
                                        "by": "reviewer"}).encode())
            return
        sent = self.headers.get("Authorization", "").removeprefix("Bearer ")
        ping = body["messages"][-1]["content"] == "ping"
        if (body.get("model") == "locked" and sent != KEY) or (body.get("model") == "leaky" and not ping):
            # refused, echoing the key it got, as some servers do ("leaky" answers only the reachability ping)
            data, code = json.dumps({"error": {"message": f"Incorrect API key provided: {sent}"}}).encode(), 401
        elif body.get("model") not in ("scripted", "locked", "leaky"):
            data, code = json.dumps({"error": {"message": "no such model"}}).encode(), 404
        else:
            data, code = json.dumps(_reply(body)).encode(), 200
        self._send(code, data)

    def _send(self, code: int, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()


def assay(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "assay.cli", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "250", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1",
                               **env})


def test_an_endpoint_policy_is_evaluated_through_chat_completions_and_tool_calls(server, tmp_path):
    out = assay("eval", "suites/golden.yaml", "--endpoint", server, "--model", "scripted", "--out", str(tmp_path))
    # the golden suite's arith and toolcalc entries are solved; codegen and terminal are not attempted well
    assert out.returncode == 0, out.stderr
    record = read_record(tmp_path)
    assert record["policy"] == {"kind": "endpoint", "url": server, "model": "scripted"}
    arith, toolcalc = record["domains"]["arith@4"]["metrics"], record["domains"]["toolcalc@4"]["metrics"]
    assert arith["pass_at"]["1"]["value"] == 1.0 and arith["mean_rounds"] == 1.0
    assert toolcalc["pass_at"]["1"]["value"] == 1.0 and toolcalc["mean_rounds"] == 3.0
    assert toolcalc["recovery_rate"] == 1.0 and toolcalc["tool_error_rate"] > 0  # the bad call, then success
    assert toolcalc["prompt_tokens"] > 0 and toolcalc["completion_tokens"] == 21  # the server's usage, 3 turns
    assert record["domains"]["codegen@7"]["metrics"]["infra_errors"] == 0


def test_a_record_without_out_goes_under_the_home_whatever_the_working_directory(server, tmp_path, assay_home):
    suite = Path(__file__).parents[2] / "suites" / "arith.yaml"
    src = str(Path(__file__).parents[2] / "src")  # this checkout's assay, from another working directory
    out = subprocess.run([sys.executable, "-m", "assay.cli", "eval", str(suite), "--endpoint", server, "--model",
                          "scripted"], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": src, "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"})
    assert out.returncode == 0, out.stderr
    [record] = (assay_home / "evals").iterdir()  # evals/<time>
    assert read_record(record)["domains"]["arith@4"]["metrics"]["pass_at"]["1"]["value"] == 1.0
    assert not (tmp_path / "evals").exists()


def test_an_unreachable_endpoint_or_unknown_model_is_one_line(server, tmp_path):
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    for url, model, what in ((dead, "scripted", "unreachable"), (server, "nope", "refused model")):
        out = assay("eval", "suites/arith.yaml", "--endpoint", url, "--model", model, "--out", str(tmp_path / "x"))
        lines = out.stderr.strip().splitlines()
        assert out.returncode != 0 and len(lines) == 1 and what in lines[0], out.stderr
    half = assay("eval", "suites/arith.yaml", "--endpoint", server)
    assert half.returncode != 0 and "both --endpoint URL and --model NAME" in half.stderr


def test_the_api_key_comes_from_the_named_variable_and_is_never_printed_or_recorded(server, tmp_path):
    out = assay("eval", "suites/arith.yaml", "--endpoint", server, "--model", "locked", "--api-key-env", "MY_KEY",
                "--out", str(tmp_path / "ok"), "--html", MY_KEY=KEY)
    assert out.returncode == 0, out.stderr
    assert read_record(tmp_path / "ok")["domains"]["arith@4"]["metrics"]["pass_at"]["1"]["value"] == 1.0
    default = assay("eval", "suites/arith.yaml", "--endpoint", server, "--model", "locked",
                    "--out", str(tmp_path / "default"), OPENAI_API_KEY=KEY)  # the default variable
    assert default.returncode == 0, default.stderr
    wrong = "sk-wrong-9876543210"  # refused: one line naming the variable, the echoed key masked
    refused = assay("eval", "suites/arith.yaml", "--endpoint", server, "--model", "locked", "--api-key-env", "MY_KEY",
                    "--out", str(tmp_path / "wrong"), MY_KEY=wrong)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode != 0 and len(lines) == 1 and "refused the API key in $MY_KEY" in lines[0], refused.stderr
    unset = assay("eval", "suites/arith.yaml", "--endpoint", server, "--model", "locked", "--api-key-env", "NO_SUCH_KEY")
    assert unset.returncode != 0 and "NO_SUCH_KEY is not set" in unset.stderr
    leaky = assay("eval", "suites/arith.yaml", "--endpoint", server, "--model", "leaky", "--out",
                  str(tmp_path / "leaky"), OPENAI_API_KEY=KEY)  # every episode fails with the key in the error
    assert leaky.returncode == 0, leaky.stderr
    errors = pd.read_parquet(tmp_path / "leaky" / "trajectories", columns=["reward_info"])["reward_info"]
    assert errors.str.contains(r"Incorrect API key provided: \*\*\*").all()
    for run in (out, default, refused, unset, leaky):
        assert KEY not in run.stdout + run.stderr and wrong not in run.stdout + run.stderr
    files = [p for p in tmp_path.rglob("*") if p.is_file()]  # the records, their trajectories and report.html
    assert any(p.suffix == ".parquet" for p in files) and any(p.suffix == ".html" for p in files)
    for path in files:
        text = pd.read_parquet(path).to_json() if path.suffix == ".parquet" else path.read_text(errors="replace")
        assert KEY not in text and wrong not in text, path


def test_critical_calls_wait_for_the_webhook_and_a_denied_one_never_runs(server, tmp_path):
    suite = tmp_path / "toolcalc.yaml"
    suite.write_text("name: toolcalc\nsamples: 2\nlimits: {max_turns: 5, max_new_tokens: 48}\n"
                     "entries:\n- {env: toolcalc@4, tasks: 2, hash: 10f6efba32bd}\n")
    hook = server.removesuffix("/v1") + "/approve"
    out = assay("eval", str(suite), "--endpoint", server, "--model", "scripted", "--critical-tools", "lookup",
                "--approvals", f"webhook:{hook}", "--approval-timeout", "5", "--out", str(tmp_path / "rec"))
    assert out.returncode == 0, out.stderr
    record = read_record(tmp_path / "rec")
    metrics = record["domains"]["toolcalc@4"]["metrics"]
    # each episode's bad lookup is denied (an error result it recovers from), its real lookups approved and run
    assert metrics["pass_at"]["1"]["value"] == 1.0 and metrics["denied_calls"] == 4
    assert metrics["approved_calls"] >= 4 and metrics["refused_calls"] == 0
    lines = [json.loads(line) for line in (tmp_path / "rec" / "approvals.jsonl").read_text().splitlines()]
    assert len(lines) == metrics["approved_calls"] + metrics["denied_calls"]
    assert {(d["arguments"]["key"] == "zz", d["verdict"], d["by"]) for d in lines} == {
        (True, "denied", "reviewer"), (False, "approved", "reviewer")}
    trajs = pd.read_parquet(tmp_path / "rec" / "trajectories")
    assert all("error: denied by approver: zz is no name; lookup was not run" in m for m in trajs["messages"])
    assert record["settings"]["approvals"]["critical"] == ["lookup"]
