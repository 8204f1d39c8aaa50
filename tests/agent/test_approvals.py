"""Approvals for critical tool calls: the file queue, the webhook and the terminal prompt each approve and deny
for real; no decision in time, or a channel that fails, denies; a call outside the allowlist is refused without
asking; every decision is one audit line; in the agent loop a denied call never runs, the policy is shown why
and the episode goes on, and the waits of several episodes overlap (lockstep and online)."""

import io
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from agent_fakes import FakeEpisode, OnlineScripted, ScriptedBackend, calc_task, turn

from assay.agent.approvals import (
    ApprovalPolicy,
    ApprovalRequest,
    Approvals,
    AuditLog,
    Decision,
    arguments_sha256,
    check_critical_offered,
    open_approvals,
)
from assay.agent.approvers import FileQueue, TerminalApprover
from assay.agent.loop import EpisodeJob, run_episodes, run_episodes_online
from assay.agent.render import prompt_ids
from assay.core.errors import AssayError, ConfigError
from assay.core.types import Message, ToolCall
from assay.rollout.base import SamplingParams

PARAMS = SamplingParams(max_tokens=64)
ANSWER = Message("assistant", "Answer: 5")
AUDIT_FIELDS = {"verdict", "approved", "reason", "by", "channel", "tool", "arguments", "arguments_sha256", "task_id",
                "env", "sample", "call_id", "actor", "asked_at", "decided_at", "wait_s", "timeout_s"}


def call(expression: str) -> ToolCall:
    return ToolCall("calc", {"expression": expression}, id="c1")


def calc_turn(expression: str) -> Message:
    return Message("assistant", "", [ToolCall("calc", {"expression": expression})])


def audit(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def file_policy(tmp_path: Path, timeout_s: float = 5.0, **kw) -> ApprovalPolicy:
    return ApprovalPolicy(tmp_path / "audit.jsonl", kw.pop("critical", {"calc"}), timeout_s=timeout_s,
                          channel=f"file:{tmp_path / 'queue'}", **kw)


class Answerer:
    """A person at the file queue, on a thread: once at least `at_once` requests are pending, answers each with
    `decide(request) -> (verdict, reason)`, writing the answer whole (elsewhere, then renamed in)."""

    def __init__(self, queue: Path, decide: Callable[[dict], tuple[str, str]], at_once: int = 1):
        self.queue, self.decide, self.at_once = queue, decide, at_once
        self.answered: list[str] = []
        self.most_pending = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Answerer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stop.is_set():
            pending = [p for p in (self.queue / "pending").glob("*.json") if p.stem not in self.answered]
            self.most_pending = max(self.most_pending, len(pending))
            if pending and len(pending) >= self.at_once:
                for p in pending:
                    verdict, reason = self.decide(json.loads(p.read_text()))
                    tmp = self.queue / f".{p.stem}.tmp"
                    tmp.write_text(reason)
                    os.replace(tmp, self.queue / f"{p.stem}.{verdict}")
                    self.answered.append(p.stem)
            time.sleep(0.01)


def test_the_file_queue_approves_one_call_and_denies_another_and_audits_both(tmp_path):
    approvals = open_approvals(file_policy(tmp_path), actor="policy-a")
    task = calc_task(2, 3)

    def decide(req: dict) -> tuple[str, str]:
        return ("approved", "") if req["arguments"] == {"expression": "2+3"} else ("denied", "not that one")

    with Answerer(tmp_path / "queue", decide):
        yes, no = approvals.decide(call("2+3"), task, 4), approvals.decide(call("9+9"), task, 5)
    me = Path(tmp_path).owner()
    assert yes == Decision("approved", "", me) and no == Decision("denied", "not that one", me)
    assert list((tmp_path / "queue" / "pending").iterdir()) == []  # decided requests leave the queue
    lines = audit(tmp_path / "audit.jsonl")
    assert [set(line) for line in lines] == [AUDIT_FIELDS] * 2
    first, second = lines
    assert (first["verdict"], first["approved"], first["by"], first["tool"], first["task_id"], first["env"],
            first["sample"], first["call_id"], first["actor"]) == ("approved", True, me, "calc", "2+3", "fakecalc@1",
                                                                   4, "c1", "policy-a")
    assert first["arguments"] == {"expression": "2+3"}
    assert first["arguments_sha256"] == arguments_sha256({"expression": "2+3"}) != second["arguments_sha256"]
    assert first["channel"] == f"file:{tmp_path / 'queue'}" and first["timeout_s"] == 5.0
    assert first["asked_at"] <= first["decided_at"] and 0 <= first["wait_s"] < 5
    assert (second["verdict"], second["approved"], second["reason"]) == ("denied", False, "not that one")


def test_no_decision_before_the_timeout_denies(tmp_path):
    approvals = open_approvals(file_policy(tmp_path, timeout_s=0.2))
    t0 = time.monotonic()
    decision = approvals.decide(call("2+3"), calc_task(2, 3), 0)
    assert decision.verdict == "timeout" and not decision.approved
    assert 0.2 <= time.monotonic() - t0 < 2
    assert list((tmp_path / "queue" / "pending").iterdir()) == []  # a late answer finds nothing to decide
    [line] = audit(tmp_path / "audit.jsonl")
    assert line["verdict"] == "timeout" and line["wait_s"] >= 0.2
    assert approvals.refusal("calc", decision) == "error: denied by approver: no decision within 0.2 s; calc was not run"


def test_a_decision_file_with_json_and_both_answers_at_once(tmp_path):
    approvals = open_approvals(file_policy(tmp_path))
    queue = tmp_path / "queue"
    answers = iter([{"approve": True, "reason": "fine", "by": "carol"}, {"approve": "yes"}])

    def decide(req: dict) -> tuple[str, str]:
        return "decision.json", json.dumps(next(answers))

    with Answerer(queue, decide):
        assert approvals.decide(call("2+3"), calc_task(2, 3), 0) == Decision("approved", "fine", "carol")
        malformed = approvals.decide(call("2+3"), calc_task(2, 3), 1)
    assert malformed.verdict == "error" and "approve" in malformed.reason  # neither true nor false: denied
    (queue / "both.approved").write_text("")
    (queue / "both.denied").write_text("changed my mind")
    assert FileQueue(queue)._answer("both").verdict == "denied"  # both answers: denied


SECRET = "s3cret-shared-with-the-webhook"


class _Webhook(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        request = json.loads(raw)
        if self.path.startswith("/signed"):  # checks Assay's signature, signs its answer (or, /signed-wrong, not)
            from assay.agent.approvers import signature

            stamp = self.headers.get("X-Assay-Timestamp", "")
            genuine = self.headers.get("X-Assay-Signature") == signature(SECRET, stamp, raw)
            body = json.dumps({"approve": genuine, "reason": "signed" if genuine else "unsigned request",
                               "by": "bob"}).encode()
            key = SECRET if self.path == "/signed" else "another secret"
            self.send_response(200)
            self.send_header("X-Assay-Signature", signature(key, request["id"], body))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if self.path == "/broken":
            self.send_response(500)
            self.end_headers()
            return
        if self.path == "/slow":
            time.sleep(1.0)
        body = (b"not json" if self.path == "/garbled" else
                json.dumps({"approve": request["arguments"] == {"expression": "2+3"}, "reason": "only 2+3",
                            "by": "alice"}).encode())
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def webhook(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Webhook)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_webhook_approves_and_denies_and_a_failing_one_denies(webhook, tmp_path):
    def approvals(path: str, timeout_s: float = 5.0) -> Approvals:
        return open_approvals(ApprovalPolicy(tmp_path / "audit.jsonl", {"calc"}, timeout_s=timeout_s,
                                             channel=f"webhook:{webhook}{path}"))

    task = calc_task(2, 3)
    assert approvals("/decide").decide(call("2+3"), task, 0) == Decision("approved", "only 2+3", "alice")
    assert approvals("/decide").decide(call("1+1"), task, 0) == Decision("denied", "only 2+3", "alice")
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"webhook:http://127.0.0.1:{s.getsockname()[1]}/decide"
    unreachable = open_approvals(ApprovalPolicy(tmp_path / "audit.jsonl", {"calc"}, channel=dead))
    failures = [approvals("/broken").decide(call("2+3"), task, 0), approvals("/garbled").decide(call("2+3"), task, 0),
                unreachable.decide(call("2+3"), task, 0)]
    assert [d.verdict for d in failures] == ["error"] * 3
    assert "HTTP 500" in failures[0].reason and "not JSON" in failures[1].reason and "unreachable" in failures[2].reason
    slow = approvals("/slow", timeout_s=0.2).decide(call("2+3"), task, 0)  # it would approve, too late
    assert slow.verdict == "timeout"
    assert approvals("/decide").refusal("calc", failures[0]) == ("error: denied by approver: the approval channel "
                                                                 "failed; calc was not run")
    lines = audit(tmp_path / "audit.jsonl")
    assert [line["verdict"] for line in lines] == ["approved", "denied", "error", "error", "error", "timeout"]
    assert {line["channel"].rsplit("/", 1)[0] for line in lines[:2]} == {f"webhook:{webhook}"}


def test_a_shared_secret_signs_requests_and_answers_and_plain_http_elsewhere_is_refused(webhook, tmp_path,
                                                                                      monkeypatch):
    def approvals(path: str) -> Approvals:
        return open_approvals(ApprovalPolicy(tmp_path / "audit.jsonl", {"calc"}, channel=f"webhook:{webhook}{path}"))

    task = calc_task(2, 3)
    unsigned = approvals("/signed").decide(call("2+3"), task, 0)  # no secret here: the webhook's check fails
    assert unsigned == Decision("denied", "unsigned request", "bob")
    monkeypatch.setenv("ASSAY_APPROVAL_SECRET", SECRET)
    assert approvals("/signed").decide(call("2+3"), task, 0) == Decision("approved", "signed", "bob")
    forged = approvals("/signed-wrong").decide(call("2+3"), task, 0)  # an approval signed with another key
    assert forged.verdict == "error" and "not signed with $ASSAY_APPROVAL_SECRET" in forged.reason
    plain = approvals("/decide").decide(call("2+3"), task, 0)  # a webhook that does not sign: no approval
    assert plain.verdict == "error"
    assert SECRET not in (tmp_path / "audit.jsonl").read_text()
    monkeypatch.delenv("ASSAY_APPROVAL_SECRET")
    with pytest.raises(AssayError, match="plain HTTP to hooks.example.com could be forged"):
        open_approvals(ApprovalPolicy(tmp_path / "audit.jsonl", {"calc"}, channel="webhook:http://hooks.example.com/a"))
    open_approvals(ApprovalPolicy(tmp_path / "audit.jsonl", {"calc"}, channel="webhook:https://hooks.example.com/a"))


def test_a_call_outside_the_allowlist_is_refused_without_asking(tmp_path):
    policy = file_policy(tmp_path, timeout_s=30.0, critical={"lookup"}, allow={"lookup", "search"})
    approvals = open_approvals(policy)
    t0 = time.monotonic()
    decision = approvals.decide(call("2+3"), calc_task(2, 3), 0)
    assert decision == Decision("not_allowed", "calc is not on the deployment's allowlist", "allowlist")
    assert time.monotonic() - t0 < 1  # nobody was asked: the 30 s wait never began
    assert list((tmp_path / "queue" / "pending").iterdir()) == []
    assert approvals.refusal("calc", decision) == ("error: tool 'calc' is not allowed in this deployment; it was not "
                                                   "run (allowed: lookup, search)")
    [line] = audit(tmp_path / "audit.jsonl")
    assert (line["verdict"], line["by"], line["channel"], line["wait_s"]) == ("not_allowed", "allowlist", None, 0.0)
    # a tool on the allowlist and not critical runs without a decision, and without an audit line
    free = open_approvals(ApprovalPolicy(tmp_path / "free.jsonl", allow={"calc"}))
    assert free.approver is None and free.decide(call("2+3"), calc_task(2, 3), 0) is None
    assert (tmp_path / "free.jsonl").read_text() == ""


def test_a_channel_that_raises_denies(tmp_path):
    class Broken:
        def decide(self, request: ApprovalRequest) -> Decision:
            raise RuntimeError("boom")

    policy = ApprovalPolicy(tmp_path / "audit.jsonl", {"calc"})
    decision = Approvals(policy, Broken(), AuditLog(policy.audit)).decide(call("2+3"), calc_task(2, 3), 0)
    assert decision.verdict == "error" and "RuntimeError: boom" in decision.reason


def test_the_terminal_prompt(tmp_path):
    r, w = os.pipe()
    out = io.StringIO()
    approver = TerminalApprover(r, out, "tester")

    def request(timeout_s: float = 5.0) -> ApprovalRequest:
        return ApprovalRequest("r1", "bash", {"command": "rm -rf build"}, "t1", "terminal@6", 3, "c1", "", time.time(),
                               timeout_s)

    def answer(text: bytes, prompts: int) -> threading.Thread:
        def run() -> None:
            while out.getvalue().count("denies it (denied in") < prompts:
                time.sleep(0.01)
            os.write(w, text)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    try:
        os.write(w, b"y\n")  # typed before the prompt: never taken for its answer
        answer(b"n not now\n", 1)
        assert approver.decide(request()) == Decision("denied", "not now", "tester")
        assert '{"command": "rm -rf build"}' in out.getvalue() and "task t1 (terminal@6), sample 3" in out.getvalue()
        answer(b"yes\n", 2)
        assert approver.decide(request()) == Decision("approved", "", "tester")
        assert approver.decide(request(0.2)).verdict == "timeout"
        assert out.getvalue().endswith("no answer: denied\n")
    finally:
        os.close(r)
        os.close(w)


def play(tok, tasks, scripts, approvals, online=False, max_turns=3):
    scripted = {tuple(prompt_ids(tok, t)): [turn(tok, m) for m in s] for t, s in zip(tasks, scripts, strict=True)}
    episodes = [FakeEpisode(t) for t in tasks]
    if online:
        jobs = [EpisodeJob(t, ep, PARAMS, max_turns, 2048, i, approvals=approvals)
                for i, (t, ep) in enumerate(zip(tasks, episodes, strict=True))]
        return run_episodes_online(OnlineScripted(scripted), jobs, tok), episodes
    return run_episodes(ScriptedBackend(scripted), list(zip(tasks, episodes, strict=True)), tok, PARAMS,
                        max_turns=max_turns, max_context=2048, approvals=approvals), episodes


def test_in_the_agent_loop_a_denied_call_never_runs_and_the_episode_goes_on(tok, tmp_path):
    approvals = open_approvals(file_policy(tmp_path))
    verdicts = iter([("denied", "not now"), ("approved", "")])
    with Answerer(tmp_path / "queue", lambda req: next(verdicts)):
        [traj], [ep] = play(tok, [calc_task(2, 3)], [[calc_turn("2+3"), calc_turn("2+3"), ANSWER]], approvals)
    assert ep.calls == [ToolCall("calc", {"expression": "2+3"})]  # the denied call did not run; the approved one did
    assert [m.content for m in traj.messages if m.role == "tool"] == [
        "error: denied by approver: not now; calc was not run", "5"]
    assert traj.passed and traj.finish_reason == "stop" and traj.turns == 3
    assert (traj.approved_calls, traj.denied_calls, traj.refused_calls, traj.tool_errors) == (1, 1, 0, 1)
    assert [line["verdict"] for line in audit(tmp_path / "audit.jsonl")] == ["denied", "approved"]

    # outside the allowlist: refused at once, the episode goes on to its answer; an invalid call asks nobody
    refusing = open_approvals(ApprovalPolicy(tmp_path / "allow.jsonl", allow={"lookup"}))
    bad = Message("assistant", "", [ToolCall("calc", {"expr": 1})])
    [traj], [ep] = play(tok, [calc_task(2, 3)], [[bad, calc_turn("2+3"), ANSWER]], refusing)
    assert ep.calls == [] and traj.refused_calls == 1 and traj.turns == 3
    assert [m.content for m in traj.messages if m.role == "tool"][1] == (
        "error: tool 'calc' is not allowed in this deployment; it was not run (allowed: lookup)")
    assert [line["verdict"] for line in audit(tmp_path / "allow.jsonl")] == ["not_allowed"]


@pytest.mark.parametrize("online", [False, True])
def test_episodes_wait_for_their_decisions_at_once(tok, tmp_path, online):
    """Six episodes each make one critical call; the person answers only once all six are pending together,
    which a loop that asked one episode at a time (or on four tool threads) would never reach."""
    approvals = open_approvals(file_policy(tmp_path, timeout_s=3.0))
    tasks = [calc_task(a, 1) for a in range(1, 7)]
    scripts = [[calc_turn(f"{a}+1"), Message("assistant", f"Answer: {a + 1}")] for a in range(1, 7)]
    with Answerer(tmp_path / "queue", lambda req: ("approved", ""), at_once=6) as person:
        trajs, episodes = play(tok, tasks, scripts, approvals, online=online)
    assert person.most_pending == 6
    assert [t.approved_calls for t in trajs] == [1] * 6 and all(t.passed for t in trajs)
    assert all(len(ep.calls) == 1 for ep in episodes)


def test_bad_approval_settings_are_refused_with_the_fix(tmp_path, monkeypatch):
    audit_path = tmp_path / "a.jsonl"
    with pytest.raises(AssayError, match="not on the allowlist, so they could never run"):
        ApprovalPolicy(audit_path, {"bash"}, {"read"})
    with pytest.raises(AssayError, match="empty tool allowlist"):
        ApprovalPolicy(audit_path, allow=set())
    with pytest.raises(AssayError, match="positive number of seconds"):
        ApprovalPolicy(audit_path, {"bash"}, timeout_s=0)
    with pytest.raises(AssayError, match="unknown approval channel 'pager'; known channels: cli, file, webhook"):
        open_approvals(ApprovalPolicy(audit_path, {"bash"}, channel="pager:ops"))
    with pytest.raises(AssayError, match="needs the queue's directory"):
        open_approvals(ApprovalPolicy(audit_path, {"bash"}, channel="file:"))
    with pytest.raises(AssayError, match="needs an http or https URL"):
        open_approvals(ApprovalPolicy(audit_path, {"bash"}, channel="webhook:ftp://x"))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # no terminal
    with pytest.raises(AssayError, match="stdin is not one; use --approvals file:DIR"):
        open_approvals(ApprovalPolicy(audit_path, {"bash"}, channel="cli"))
    (tmp_path / "a_file").write_text("")
    with pytest.raises(AssayError, match="cannot be written"):
        open_approvals(ApprovalPolicy(tmp_path / "a_file" / "audit.jsonl", allow={"bash"}))
    with pytest.raises(AssayError, match="bsh are offered by no task here"):
        check_critical_offered(ApprovalPolicy(audit_path, {"bsh"}), {"bash", "read"})
    policy = ApprovalPolicy(audit_path, {"bash"}, channel="webhook:https://u:secret@hooks.example.com/a?token=t")
    assert policy.describe()["channel"] == "webhook:https://hooks.example.com/a"  # no credentials in a record


def test_training_refuses_approvals():
    from assay.core.config import build_config

    for data in ({"approvals": {"critical": ["bash"]}}, {"domains": [{"name": "a", "env": "arith",
                                                                      "agent": {"critical_tools": ["bash"]}}]}):
        with pytest.raises(ConfigError, match="RL rollouts never wait for a person"):
            build_config({"domains": [{"name": "a", "env": "arith"}], **data})


def test_assay_evals_options_make_the_policy(tmp_path):
    from assay.cli import _approval_policy

    assert _approval_policy(None, None, None, None, None, tmp_path) is None  # nothing set: no gate at all
    assert _approval_policy("bash, write", "bash,write,read", "file:q", 5.0, None, tmp_path) == ApprovalPolicy(
        tmp_path / "approvals.jsonl", {"bash", "write"}, {"bash", "write", "read"}, 5.0, "file:q")
    assert _approval_policy(None, "read", None, None, tmp_path / "a.jsonl", tmp_path).allow == {"read"}
    for args, problem in (((None, None, "file:q", None, None), "name the critical tools"),
                          ((None, None, None, 30.0, None), "name the critical tools"),
                          ((" , ", None, None, None, None), "names no tool"),
                          ((None, None, None, None, tmp_path / "a.jsonl"), "needs --critical-tools or --allow-tools")):
        with pytest.raises(AssayError, match=problem):
            _approval_policy(*args, tmp_path)
