"""The built-in approval channels (agent.approvals): a prompt on the terminal (`cli`), a file queue
(`file:DIR`) and a webhook (`webhook:URL`). Each honours the request's timeout and answers a timeout or a
failure as a Decision, a denial, never an exception."""

from __future__ import annotations

import getpass
import hashlib
import hmac
import http.client
import json
import os
import pwd
import select
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO
from urllib.parse import urlsplit

from assay.agent.approvals import ApprovalRequest, Decision, decision_from_json, redact_channel, register_approver
from assay.core.atomic import atomic_write
from assay.core.errors import AssayError

POLL_S = 0.05  # the file queue looks for an answer this often
MAX_ANSWER = 64 * 1024  # bytes of a webhook's answer read


def _timeout(request: ApprovalRequest, by: str, note: str = "") -> Decision:
    return Decision("timeout", f"no decision within {request.timeout_s:g} s{note}", by)


@dataclass
class TerminalApprover:
    """Asks on a terminal: the call, its arguments and where it comes from, then waits for a line. `y` or
    `yes` approves; `n REASON`, anything else or nothing denies. One request at a time: the episodes that
    wait meanwhile queue for the terminal, and the queueing counts against each one's timeout. Input typed
    before a prompt is shown is discarded, so an answer never reaches a request its person did not see."""

    fd: int  # read with select and os.read: a line already read never hides in a buffer select cannot see
    out: TextIO
    user: str
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def decide(self, request: ApprovalRequest) -> Decision:
        deadline = time.monotonic() + request.timeout_s
        if not self._lock.acquire(timeout=request.timeout_s):
            return _timeout(request, self.user, " (the terminal was answering other requests)")
        try:
            _drain(self.fd)
            self.out.write(f"\n[assay] approve a call to {request.tool}? arguments: "
                           f"{json.dumps(request.arguments, ensure_ascii=False)}\n"
                           f"        task {request.task_id} ({request.env}), sample {request.sample}"
                           f"{f', policy {request.actor}' if request.actor else ''}; request {request.id}\n"
                           f"        y runs it; n [REASON] or nothing denies it (denied in {request.timeout_s:g} s): ")
            self.out.flush()
            line = _read_line(self.fd, deadline)
            if line is None:
                self.out.write("\n        no answer: denied\n")
                self.out.flush()
                return _timeout(request, self.user)
        finally:
            self._lock.release()
        return parse_answer(line, self.user)


def parse_answer(line: str, by: str) -> Decision:
    text = line.strip()
    word, _, rest = text.partition(" ")
    if word.lower() in ("y", "yes") and not rest.strip():
        return Decision("approved", "", by)
    reason = rest.strip() if word.lower() in ("n", "no") else text
    return Decision("denied", reason or "denied at the terminal", by)


def _drain(fd: int) -> None:
    while select.select([fd], [], [], 0)[0]:
        if not os.read(fd, 4096):
            return


def _read_line(fd: int, deadline: float) -> str | None:
    """One line from `fd` by `deadline` (None if none came); the end of input is an empty answer."""
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
    return buf.split(b"\n", 1)[0].decode(errors="replace")


@register_approver("cli")
def _cli(target: str) -> TerminalApprover:
    if target:
        raise AssayError(f"the cli approval channel takes no target, got cli:{target}; use --approvals cli")
    try:
        fd = sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):  # no stdin, or one replaced by something without a descriptor
        fd = -1
    if fd < 0 or not os.isatty(fd):
        raise AssayError("--approvals cli prompts on the terminal, and stdin is not one; use --approvals file:DIR "
                         "or --approvals webhook:URL")
    return TerminalApprover(fd, sys.stderr, getpass.getuser())


@dataclass
class FileQueue:
    """A queue in a directory: each request is written (whole) to `pending/<id>.json`; a person or a program
    answers with `<id>.approved` or `<id>.denied` in the directory (its text, if any, the reason; its
    owner who decided; both: denied), or `<id>.decision.json`, `{"approve": bool, "reason": str, "by": str}`
    (write it elsewhere and rename it in, so it is never read half-written). The pending file is removed
    when the request is decided or times out; an answer after that changes nothing."""

    directory: Path
    poll_s: float = POLL_S

    def __post_init__(self) -> None:
        try:
            (self.directory / "pending").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise AssayError(f"the approval queue {self.directory} cannot be created ({e.strerror}); pass a "
                             "writable directory: --approvals file:DIR") from None

    def decide(self, request: ApprovalRequest) -> Decision:
        deadline = time.monotonic() + request.timeout_s
        pending = self.directory / "pending" / f"{request.id}.json"
        atomic_write(pending, json.dumps(request.to_json(), indent=1, ensure_ascii=False))
        try:
            while (decision := self._answer(request.id)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return _timeout(request, f"file:{self.directory}")
                time.sleep(min(self.poll_s, left))
            return decision
        finally:
            pending.unlink(missing_ok=True)

    def _answer(self, request_id: str) -> Decision | None:
        for suffix, verdict in ((".denied", "denied"), (".approved", "approved")):
            path = self.directory / f"{request_id}{suffix}"
            try:
                return Decision(verdict, path.read_text(errors="replace").strip(), _owner(path))  # type: ignore[arg-type]
            except FileNotFoundError:
                continue
        path = self.directory / f"{request_id}.decision.json"
        try:
            return decision_from_json(json.loads(path.read_text()), _owner(path))
        except FileNotFoundError:
            return None
        except ValueError:  # written in place and not whole yet: read again at the next poll
            return None


def _owner(path: Path) -> str:
    uid = path.stat().st_uid
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


@register_approver("file")
def _file(target: str) -> FileQueue:
    if not target:
        raise AssayError("--approvals file:DIR needs the queue's directory, e.g. --approvals file:approvals")
    return FileQueue(Path(target))


SECRET_ENV = "ASSAY_APPROVAL_SECRET"  # the webhook's shared secret: requests and answers signed with it
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def signature(secret: str, bound_to: str, body: bytes) -> str:
    """`sha256=` and the hex HMAC-SHA256 of `bound_to.` and `body` under `secret`: a request is bound to its
    timestamp (`X-Assay-Timestamp`), an answer to the request's id, so neither can be replayed elsewhere."""
    return "sha256=" + hmac.new(secret.encode(), f"{bound_to}.".encode() + body, hashlib.sha256).hexdigest()


@dataclass
class Webhook:
    """POSTs the request as JSON to the URL and reads `{"approve": bool, "reason": str, "by": str}` back (reason
    and by optional). The server may hold the request open until a person decides, up to the request's
    timeout; no answer by then, an error status, a refused connection or another answer is a denial. With a
    shared secret (`$ASSAY_APPROVAL_SECRET`) every request carries `X-Assay-Timestamp` and `X-Assay-Signature`
    (`signature(secret, timestamp, body)`), and an answer counts only with `X-Assay-Signature` equal to
    `signature(secret, request id, answer body)`: whoever else answers at the URL cannot approve."""

    url: str
    secret: str | None = field(default=None, repr=False)

    def decide(self, request: ApprovalRequest) -> Decision:
        by = redact_channel(f"webhook:{self.url}").removeprefix("webhook:")
        data = json.dumps(request.to_json(), ensure_ascii=False).encode()
        headers = {"Content-Type": "application/json"}
        if self.secret is not None:
            stamp = str(int(time.time()))
            headers |= {"X-Assay-Timestamp": stamp, "X-Assay-Signature": signature(self.secret, stamp, data)}
        post = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(post, timeout=request.timeout_s) as resp:
                body = resp.read(MAX_ANSWER)
                signed = resp.headers.get("X-Assay-Signature", "")
        except urllib.error.HTTPError as e:
            return Decision("error", f"the webhook answered HTTP {e.code}", by)
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                return _timeout(request, by)
            return Decision("error", f"the webhook is unreachable ({e.reason})", by)
        except TimeoutError:
            return _timeout(request, by)
        except (OSError, http.client.HTTPException) as e:
            return Decision("error", f"the webhook failed ({type(e).__name__}: {e})", by)
        if self.secret is not None and not hmac.compare_digest(signed, signature(self.secret, request.id, body)):
            return Decision("error", f"the webhook's answer is not signed with ${SECRET_ENV} for this request "
                                     "(X-Assay-Signature missing or wrong)", by)
        try:
            answer = json.loads(body)
        except ValueError:
            return Decision("error", f"the webhook's answer is not JSON: {body[:200]!r}", by)
        return decision_from_json(answer, by)


@register_approver("webhook")
def _webhook(target: str) -> Webhook:
    parts = urlsplit(target)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise AssayError(f"--approvals webhook:URL needs an http or https URL, got {target!r}; e.g. "
                         "--approvals webhook:https://approvals.example.com/assay")
    secret = os.environ.get(SECRET_ENV) or None
    if secret is None and parts.scheme == "http" and parts.hostname not in LOOPBACK:
        raise AssayError(f"--approvals webhook:{redact_channel('webhook:' + target).removeprefix('webhook:')}: an "
                         f"approval over plain HTTP to {parts.hostname} could be forged on the way; use https, or "
                         f"set {SECRET_ENV} (a secret shared with the webhook) to sign requests and answers")
    return Webhook(target, secret)
