"""Approvals for critical tool calls: a deployment's tool allowlist, and a person's yes or no before a
critical call runs.

Where episodes act for real (`assay eval`, on a local policy or an endpoint), a call to a tool outside the
allowlist is refused without asking anyone, and a call to a critical tool waits for a decision from the
deployment's channel: a prompt on the terminal, a file queue or a webhook (agent/approvers.py; a plugin adds
one through the `assay.approvers` entry-point group). No decision within the timeout, or a channel that
fails, is a denial. A refused call runs nothing: it becomes an error observation the policy sees and can act
on, never a crash and never a reward. Every decision is one line of a JSONL audit log, written before the
call runs. Calls the loop answers itself (the memory tools) touch nothing outside the episode and are not
gated. RL rollouts never wait for a person: a run config refuses approvals (core.config)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, get_args
from urllib.parse import urlsplit, urlunsplit

from assay.core.errors import AssayError
from assay.core.registry import Registry
from assay.core.types import Observation, Task, ToolCall

ENTRY_POINT_GROUP = "assay.approvers"
LATE_S = 1.0  # slack for a channel's own clock: an approval later than timeout_s + this is a timeout

# approved: a person said yes; denied: a person said no; timeout: no decision in time; error: the channel
# failed (unreachable, a bad answer); not_allowed: outside the allowlist, nobody asked. Only approved runs.
Verdict = Literal["approved", "denied", "timeout", "error", "not_allowed"]
VERDICTS: tuple[str, ...] = get_args(Verdict)


@dataclass(frozen=True)
class ApprovalPolicy:
    """One deployment's rules. `audit`: the JSONL file every decision is appended to; `critical`: the tools
    whose calls wait for a person; `allow`: the tools its episodes may call at all (None: every tool a task
    offers); `timeout_s`: how long a decision may take before it is a denial; `channel`: where a person
    decides, `NAME` or `NAME:TARGET` (`cli`, `file:DIR`, `webhook:URL`, or a plugin's)."""

    audit: Path
    critical: frozenset[str] = frozenset()
    allow: frozenset[str] | None = None
    timeout_s: float = 60.0
    channel: str = "cli"

    def __post_init__(self) -> None:
        object.__setattr__(self, "audit", Path(self.audit))
        object.__setattr__(self, "critical", frozenset(self.critical))
        if self.allow is not None:
            object.__setattr__(self, "allow", frozenset(self.allow))
        if not self.timeout_s > 0:
            raise AssayError(f"the approval timeout must be a positive number of seconds, got {self.timeout_s}")
        if self.allow is not None and not self.allow:
            raise AssayError("an empty tool allowlist refuses every call; name the allowed tools (--allow-tools "
                             "a,b), or leave the allowlist out to allow every tool a task offers")
        if self.allow is not None and (outside := sorted(self.critical - self.allow)):
            raise AssayError(f"critical tools {', '.join(outside)} are not on the allowlist, so they could never "
                             "run; add them to the allowlist (--allow-tools) or drop them from the critical tools")
        if not self.channel.partition(":")[0]:
            raise AssayError(f"approval channel {self.channel!r} has no name; use cli, file:DIR or webhook:URL")

    def describe(self) -> dict[str, Any]:
        """The policy as a record holds it (the channel without a URL's credentials or query)."""
        return {"critical": sorted(self.critical), "allow": None if self.allow is None else sorted(self.allow),
                "timeout_s": self.timeout_s, "channel": redact_channel(self.channel), "audit": str(self.audit)}


def redact_channel(channel: str) -> str:
    """`channel` with a URL target's user, password, query and fragment left out: a webhook's token must not
    reach a record or a log."""
    name, sep, target = channel.partition(":")
    parts = urlsplit(target)
    if parts.scheme in ("http", "https") and parts.hostname:
        netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
        target = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    return f"{name}{sep}{target}"


def tool_names(text: str | None) -> frozenset[str] | None:
    """`a,b,c` as a set of tool names (None stays None)."""
    if text is None:
        return None
    return frozenset(n.strip() for n in text.split(",") if n.strip())


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


def arguments_sha256(arguments: dict[str, Any]) -> str:
    """A call's arguments' hash over their canonical JSON: the same arguments, the same hash."""
    text = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class ApprovalRequest:
    """What a person is asked about: one call, where it comes from, and how long they have."""

    id: str  # unique; the file queue's file names
    tool: str
    arguments: dict[str, Any]
    task_id: str
    env: str
    sample: int  # which sample of the task (its index in the evaluation's batch)
    call_id: str
    actor: str  # the policy that made the call
    asked_at: float  # Unix time
    timeout_s: float

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "tool": self.tool, "arguments": self.arguments,
                "arguments_sha256": arguments_sha256(self.arguments), "task_id": self.task_id, "env": self.env,
                "sample": self.sample, "call_id": self.call_id, "actor": self.actor, "asked_at": _iso(self.asked_at),
                "timeout_s": self.timeout_s, "deadline": _iso(self.asked_at + self.timeout_s)}


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str = ""
    by: str = ""  # who decided: a user name, a webhook's own `by` or its URL, "allowlist"

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise AssayError(f"approval verdict {self.verdict!r} is none of {', '.join(VERDICTS)}")

    @property
    def approved(self) -> bool:
        return self.verdict == "approved"


def decision_from_json(data: object, by: str) -> Decision:
    """`{"approve": bool, "reason": str, "by": str}` (reason and by optional) as a Decision; anything else is
    the channel's error, a denial."""
    approve = data.get("approve") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(approve, bool):
        return Decision("error", f'expected {{"approve": true or false, "reason": "..."}}, got {str(data)[:200]}', by)
    return Decision("approved" if approve else "denied", str(data.get("reason") or ""), str(data.get("by") or by))


class Approver(Protocol):
    """An approval channel. `decide` returns within about `request.timeout_s`; a timeout or a failure of the
    channel is a Decision (verdict timeout or error), not an exception."""

    def decide(self, request: ApprovalRequest) -> Decision: ...


ApproverFactory = Callable[[str], Approver]  # the channel's target (after `NAME:`; "" without one) -> Approver
F = TypeVar("F", bound=ApproverFactory)


def _adopt(registry: Registry[ApproverFactory], ep: EntryPoint, factory: object) -> None:
    if not callable(factory):
        raise registry.plugin_error(ep, "must name an approver factory (a callable taking the channel's target)")
    registry.add(ep.name, factory)  # type: ignore[arg-type]  # checked callable; its signature is the plugin's


approvers: Registry[ApproverFactory] = Registry("approval channel", "channels", ENTRY_POINT_GROUP, _adopt,
                                                builtins="assay.agent.approvers")


def register_approver(name: str) -> Callable[[F], F]:
    """Decorator: make `factory(target)` the channel `NAME` or `NAME:TARGET` builds."""
    return approvers.register(name)


def make_approver(channel: str) -> Approver:
    name, _, target = channel.partition(":")
    return approvers.get(name)(target)


@dataclass
class AuditLog:
    """One JSON line per decision, appended with one write to a file opened for appending and synced to disk
    before the call it decides runs: lines from threads or processes sharing the file never interleave, and a
    crash loses no decision already acted on. Created readable by its owner only (arguments may be private)."""

    path: Path
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            os.close(self._open())
        except OSError as e:
            raise AssayError(f"the approvals audit log {self.path} cannot be written ({e.strerror}); pass a "
                             "writable path (--audit-log)") from None

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def append(self, entry: dict[str, Any]) -> None:
        line = memoryview((json.dumps(entry, ensure_ascii=False, default=str) + "\n").encode())
        with self._lock:
            fd = self._open()
            try:
                while line:
                    line = line[os.write(fd, line):]
                os.fsync(fd)
            finally:
                os.close(fd)


@dataclass
class ApprovalCounts:
    """One episode's gated calls, by outcome."""

    approved: int = 0
    denied: int = 0  # a person's no, a timeout, a failed channel
    refused: int = 0  # outside the allowlist: nobody was asked

    def add(self, decision: Decision) -> None:
        if decision.approved:
            self.approved += 1
        elif decision.verdict == "not_allowed":
            self.refused += 1
        else:
            self.denied += 1


Gate = Callable[[ToolCall], Observation | None]  # None: the call runs; else what the policy is shown instead


@dataclass(frozen=True)
class Approvals:
    """A deployment's approvals at work: its policy, the channel that asks a person (None when no tool is
    critical), the audit log. `actor` names the policy acting, on every request and audit line."""

    policy: ApprovalPolicy
    approver: Approver | None
    audit: AuditLog
    actor: str = ""

    @property
    def waits(self) -> bool:
        """Whether a call may wait for a person (the loops then overlap the waits of episodes)."""
        return bool(self.policy.critical)

    def decide(self, call: ToolCall, task: Task, sample: int) -> Decision | None:
        """None: the call runs without a decision (allowed and not critical). Otherwise its decision, in the
        audit log before this returns."""
        allow, critical = self.policy.allow, self.policy.critical
        if allow is not None and call.name not in allow:
            asked = time.time()
            decision = Decision("not_allowed", f"{call.name} is not on the deployment's allowlist", "allowlist")
            channel = None
        elif call.name in critical:
            assert self.approver is not None
            request = ApprovalRequest(uuid.uuid4().hex, call.name, call.arguments, task.task_id, task.env, sample,
                                      call.id, self.actor, time.time(), self.policy.timeout_s)
            asked, start = request.asked_at, time.monotonic()
            try:
                decision = self.approver.decide(request)
            except Exception as e:  # a channel's bug denies the call; it must not take the evaluation down
                decision = Decision("error", f"the channel raised {type(e).__name__}: {e}", "")
            if decision.approved and time.monotonic() - start > self.policy.timeout_s + LATE_S:
                decision = Decision("timeout", f"approved after the {self.policy.timeout_s:g} s timeout", decision.by)
            channel = redact_channel(self.policy.channel)
        else:
            return None
        done = time.time()
        self.audit.append({
            "verdict": decision.verdict, "approved": decision.approved, "reason": decision.reason, "by": decision.by,
            "channel": channel, "tool": call.name, "arguments": call.arguments,
            "arguments_sha256": arguments_sha256(call.arguments), "task_id": task.task_id, "env": task.env,
            "sample": sample, "call_id": call.id, "actor": self.actor, "asked_at": _iso(asked),
            "decided_at": _iso(done), "wait_s": round(done - asked, 3), "timeout_s": self.policy.timeout_s})
        return decision

    def gate(self, task: Task, sample: int, counts: ApprovalCounts) -> Gate:
        """What the loop asks before each call of one episode; outcomes counted in `counts`."""

        def check(call: ToolCall) -> Observation | None:
            decision = self.decide(call, task, sample)
            if decision is None:
                return None
            counts.add(decision)
            return None if decision.approved else Observation(self.refusal(call.name, decision), is_error=True)
        return check

    def refusal(self, tool: str, decision: Decision) -> str:
        """The error observation the policy is shown for a call that did not run (a failed channel's details
        stay in the audit log)."""
        if decision.verdict == "not_allowed":
            allowed = ", ".join(sorted(self.policy.allow or ()))
            return f"error: tool {tool!r} is not allowed in this deployment; it was not run (allowed: {allowed})"
        why = {"timeout": f"no decision within {self.policy.timeout_s:g} s",
               "error": "the approval channel failed"}.get(decision.verdict, decision.reason or "no reason given")
        return f"error: denied by approver: {why}; {tool} was not run"


def open_approvals(policy: ApprovalPolicy, actor: str = "") -> Approvals:
    """The policy's channel (built only when some tool is critical) and audit log, ready for the loops."""
    approver = make_approver(policy.channel) if policy.critical else None
    return Approvals(policy, approver, AuditLog(policy.audit), actor)


def check_critical_offered(policy: ApprovalPolicy, offered: Iterable[str]) -> None:
    """Refuse critical tools no task offers: a misspelled name would leave the real tool ungated."""
    tools = set(offered)
    if missing := sorted(policy.critical - tools):
        raise AssayError(f"critical tools {', '.join(missing)} are offered by no task here (tools: "
                         f"{', '.join(sorted(tools)) or 'none'}); check the spelling in --critical-tools")
