"""Canary deployments: `assay serve STABLE --canary CANDIDATE --share 0.1`.

A `Deployment` holds its versions (each a `ServeState` with its `PolicyVersion`: number, name, weights hash)
and a pointer, `current`, to the version that serves. While a canary runs, a share of sessions goes to the
candidate: a session (the `X-Session-Id` header, else the request's `user`, else the request itself) is
hashed to a point in [0, 1) and goes to the candidate below `share`, so a session stays on one version.
Each version's requests, latency and token cost are recorded as they complete; success comes from
`POST /v1/feedback {"id": RESPONSE_ID, "success": BOOL}`, or from the task's own verifier where a request names
a task of a pinned suite (`verify.py`). After every verdict the sequential test decides:

The test. For each version the verdicts are Bernoulli draws with an unknown success rate p. Bernoulli
draws are 1/2-sub-Gaussian, so by Robbins' normal mixture (mixing precision rho) and Ville's inequality,
    P(exists n: |S_n - n p| >= sqrt((n/4 + rho) log((n/4 + rho) / (rho a^2)))) <= a,
a confidence sequence for p valid at every n at once, however often it is looked at. With a = alpha/2 per
version the two hold together with probability >= 1 - alpha, and give a confidence sequence for the
difference d = p_candidate - p_stable. The deployment
- rolls back when the whole interval is below 0 (the candidate is significantly worse): a candidate at
  least as good as the stable version is ever rolled back with probability <= alpha;
- promotes when the interval's lower end is above -margin, after at least `min_feedback` candidate
  verdicts (it is no more than `margin` worse): a candidate worse by more than `margin` is ever promoted
  with probability <= alpha;
- otherwise continues.
With a golden-suite gate (`golden.py`, computed from two evaluation records when the deployment starts) a
failing gate rolls the candidate back at once, and promotion needs the gate's `pass` as well as the live
test's; the live test may still roll back whatever the gate said. Without one, promotion is by live
feedback alone, and `GET /v1/deployment` says so.
Latency and cost are watched the same way when the operator states an objective: `latency_slo_s` (a request
slower than it misses) and `cost_budget_tokens` (a request using more prompt and completion tokens is over
budget). Each makes every completed request a Bernoulli draw, within the objective or not, whether or not
feedback comes, and the same confidence sequence on the difference of those rates rolls the candidate back
when it is significantly more often outside the objective than the stable version, and holds a promotion
until it is no more than `margin` worse. Each test runs at `alpha`, so with both objectives set, a candidate
as good as the stable version on all three is falsely rolled back with probability at most 3 alpha.
Rollback and promotion are pointer flips: no weights move, and every version stays loaded and listed with
its hash, so `POST /v1/deployment/rollback` flips back to the previous version at any time."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from assay.core.atomic import atomic_write
from assay.core.errors import AssayError
from assay.serve.golden import Gate
from assay.serve.protocol import ApiError
from assay.serve.sessions import Served

log = logging.getLogger("assay.serve.canary")

Decision = Literal["continue", "promote", "rollback"]
Guard = Literal["latency", "cost"]
PENDING = 100_000  # response ids remembered for feedback (the oldest are forgotten first)


@dataclass(frozen=True)
class CanaryConfig:
    share: float = 0.1  # of sessions sent to the candidate
    alpha: float = 0.05  # each error rate of the sequential test (see the module doc)
    margin: float = 0.1  # the success-rate loss a promotion tolerates
    min_feedback: int = 20  # candidate verdicts before a promotion
    rho: float = 1.0  # the normal mixture's precision: tightest near n = 4 rho verdicts, valid everywhere
    latency_slo_s: float | None = None  # a request slower than this misses the latency objective
    cost_budget_tokens: int | None = None  # a request using more tokens (prompt and completion) is over budget

    def __post_init__(self) -> None:
        if not 0 < self.share < 1:
            raise AssayError(f"--share {self.share}: give the candidate's share of sessions, between 0 and 1")
        if not 0 < self.alpha < 1:
            raise AssayError(f"--alpha {self.alpha}: an error rate between 0 and 1, e.g. 0.05")
        if not 0 <= self.margin < 1:
            raise AssayError(f"--margin {self.margin}: a success-rate difference in [0, 1), e.g. 0.05")
        if self.latency_slo_s is not None and not self.latency_slo_s > 0:
            raise AssayError(f"--latency-slo {self.latency_slo_s}: give the seconds a request may take, e.g. 2.0")
        if self.cost_budget_tokens is not None and self.cost_budget_tokens < 1:
            raise AssayError(f"--cost-budget {self.cost_budget_tokens}: give the tokens a request may use, e.g. 2048")

    def guards(self) -> dict[Guard, float]:
        """The objectives the operator stated: guard -> its limit."""
        limits: dict[Guard, float | None] = {"latency": self.latency_slo_s, "cost": self.cost_budget_tokens}
        return {g: v for g, v in limits.items() if v is not None}


def radius(n: int, alpha: float, rho: float) -> float:
    """Half-width of the confidence sequence for one Bernoulli rate after n verdicts (coverage 1 - alpha at
    all n at once); 1 before any."""
    if n == 0:
        return 1.0
    v = n / 4 + rho
    return min(1.0, math.sqrt(v * math.log(v / (rho * alpha * alpha))) / n)


def difference_interval(stable: tuple[int, int], candidate: tuple[int, int], cfg: CanaryConfig
                        ) -> tuple[float, float]:
    """Confidence sequence for p_candidate - p_stable from (successes, verdicts) of each."""
    (ss, ns), (sc, nc) = stable, candidate
    ps, pc = (ss / ns if ns else 0.5), (sc / nc if nc else 0.5)
    r = radius(ns, cfg.alpha / 2, cfg.rho) + radius(nc, cfg.alpha / 2, cfg.rho)
    return max(-1.0, pc - ps - r), min(1.0, pc - ps + r)


def decide(stable: tuple[int, int], candidate: tuple[int, int], cfg: CanaryConfig) -> Decision:
    low, high = difference_interval(stable, candidate, cfg)
    if high < 0:
        return "rollback"
    if low > -cfg.margin and candidate[1] >= cfg.min_feedback:
        return "promote"
    return "continue"


def bucket(session: str) -> float:
    """A session's point in [0, 1), the same in every process."""
    return int.from_bytes(hashlib.sha256(session.encode()).digest()[:8], "big") / 2**64


@dataclass
class VersionStats:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0  # summed
    successes: int = 0
    verdicts: int = 0
    # during the canary only: what the tests read
    canary_successes: int = 0
    canary_verdicts: int = 0
    canary_requests: int = 0
    canary_within: dict[str, int] = field(default_factory=dict)  # guard -> requests within its objective

    def summary(self) -> dict[str, Any]:
        n = max(self.requests, 1)
        within = {f"canary_within_{g}": k / self.canary_requests for g, k in self.canary_within.items()
                  if self.canary_requests}
        return {"requests": self.requests, "verdicts": self.verdicts, "successes": self.successes, **within,
                "success_rate": self.successes / self.verdicts if self.verdicts else None,
                "mean_latency_s": self.latency_s / n, "mean_prompt_tokens": self.prompt_tokens / n,
                "mean_completion_tokens": self.completion_tokens / n}


@dataclass
class Deployment:
    """A deployment's versions, its pointer and, while a canary runs, the router and the test."""

    states: dict[int, Any]  # version number -> ServeState
    current: int
    candidate: int | None
    cfg: CanaryConfig
    record: Path | None = None  # where the deployment is written on every change (JSON), if anywhere
    stats: dict[int, VersionStats] = field(default_factory=dict)
    decision: Decision = "continue"
    history: list[dict[str, Any]] = field(default_factory=list)
    gate: Gate | None = None  # the golden-suite gate, if the operator asked for one
    served_total: int = 0  # requests completed since the canary began
    _pending: OrderedDict[str, int] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        for n, s in self.states.items():
            self.stats.setdefault(n, VersionStats())
            s.observers.append(self.observe)
            s.route = self.pick
        self._event("start", self.current)
        if self.gate is None or self.candidate is None:
            return
        g = self.gate
        if g.verdict == "fail":
            log.warning("canary: version %d fails the golden suite %s (%s); rolled back", self.candidate, g.suite,
                        g.reason)
            self.candidate, self.decision = None, "rollback"
            self._event("rollback", self.current, reason=f"golden suite {g.suite}: {g.reason}")
        elif not g.allows_promotion:
            log.warning("canary: version %d may not be promoted: the golden suite %s is %s (%s); the live test may "
                        "still roll it back", self.candidate, g.suite, g.verdict, g.reason)
        else:
            log.info("canary: version %d passes the golden suite %s (%s); promotion waits for the live test",
                     self.candidate, g.suite, g.reason)

    # ---- routing and records ----

    def pick(self, session: str | None) -> Any:
        with self._lock:
            if self.candidate is not None and bucket(session or uuid.uuid4().hex) < self.cfg.share:
                return self.states[self.candidate]
            return self.states[self.current]

    def observe(self, d: Served) -> None:
        with self._lock:
            st = self.stats[d.version.number]
            prompt_tokens = sum(len(p) * len(rs) for p, rs in zip(d.prompts, d.results, strict=True))
            st.requests += 1
            st.prompt_tokens += prompt_tokens
            st.completion_tokens += d.completion_tokens()
            st.latency_s += d.latency_s
            self.served_total += 1
            self._pending[d.request_id] = d.version.number
            while len(self._pending) > PENDING:
                self._pending.popitem(last=False)
            guards = self.cfg.guards()
            if self.candidate is not None and guards:  # every request is evidence for the latency and cost tests
                st.canary_requests += 1
                used = {"latency": d.latency_s, "cost": prompt_tokens + d.completion_tokens()}
                for g, limit in guards.items():
                    st.canary_within[g] = st.canary_within.get(g, 0) + (used[g] <= limit)
                self._test()

    def feedback(self, request_id: str, success: bool) -> dict[str, Any]:
        with self._lock:
            if request_id not in self._pending:
                raise ApiError(404, f"no served response has id {request_id!r} (or it is too old, or its verdict "
                                    "was given already); send the id of a response this server gave",
                               param="id", code="unknown_response")
            number = self._record(request_id, [success])
            return {"id": request_id, "version": number, "decision": self.decision}

    def verdicts(self, request_id: str, successes: list[bool]) -> None:
        """A verifier's verdicts on a response (one per choice); nothing when the id was forgotten already."""
        with self._lock:
            if request_id in self._pending:
                self._record(request_id, successes)

    def _record(self, request_id: str, successes: list[bool]) -> int:
        number = self._pending.pop(request_id)
        st = self.stats[number]
        st.verdicts += len(successes)
        st.successes += sum(successes)
        if self.candidate is not None:  # only verdicts during the canary are evidence for the test
            st.canary_verdicts += len(successes)
            st.canary_successes += sum(successes)
            self._test()
        return number

    def _test(self) -> None:
        assert self.candidate is not None
        s, c = self.stats[self.current], self.stats[self.candidate]
        stable, candidate = (s.canary_successes, s.canary_verdicts), (c.canary_successes, c.canary_verdicts)
        self.decision = decide(stable, candidate, self.cfg)
        interval = difference_interval(stable, candidate, self.cfg)
        guards = {g: difference_interval((s.canary_within.get(g, 0), s.canary_requests),
                                         (c.canary_within.get(g, 0), c.canary_requests), self.cfg)
                  for g in self.cfg.guards()}
        if self.decision != "rollback" and (worse := [g for g, (_, high) in guards.items() if high < 0]):
            g = worse[0]
            self.decision = "rollback"
            reason = (f"{g}: the share of requests within the objective ({self._objective(g)}) is significantly "
                      f"lower, difference in [{guards[g][0]:.3f}, {guards[g][1]:.3f}]")
            log.warning("canary: version %d rolled back on %s", self.candidate, reason)
            self.candidate = None
            self._event("rollback", self.current, interval, reason)
        elif self.decision == "rollback":
            log.warning("canary: version %d is significantly worse than %d (success-rate difference in [%.3f, %.3f]); "
                        "rolled back", self.candidate, self.current, *interval)
            self.candidate = None
            self._event("rollback", self.current, interval)
        elif self.decision == "promote" and (held := [g for g, (low, _) in guards.items() if low <= -self.cfg.margin]):
            self.decision = "continue"  # not yet shown to be within the margin on latency or cost
            if not any(e["event"] == "promotion_held" for e in self.history):
                self._event("promotion_held", self.current, interval,
                            f"{', '.join(held)}: not yet shown within {self.cfg.margin} of the stable version")
        elif self.decision == "promote" and self.gate is not None and not self.gate.allows_promotion:
            self.decision = "continue"  # the live test may still roll back
            if not any(e["event"] == "promotion_blocked" for e in self.history):
                log.warning("canary: the live test would promote version %d (success-rate difference in [%.3f, "
                            "%.3f]); the golden suite (%s) blocks it", self.candidate, *interval, self.gate.verdict)
                self._event("promotion_blocked", self.current, interval,
                            f"golden suite {self.gate.suite} {self.gate.verdict}: {self.gate.reason}")
        elif self.decision == "promote":
            log.info("canary: version %d promoted (success-rate difference in [%.3f, %.3f])", self.candidate,
                     *interval)
            self.current, self.candidate = self.candidate, None
            self._event("promote", self.current, interval)

    def _objective(self, guard: Guard) -> str:
        return f"{self.cfg.latency_slo_s:g} s" if guard == "latency" else f"{self.cfg.cost_budget_tokens} tokens"

    def flip(self, to: int | None = None) -> dict[str, Any]:
        """Point the deployment at another version (by default the one before the current): a manual rollback."""
        with self._lock:
            order = [e["current"] for e in self.history]
            if to is None:
                earlier = [n for n in order if n != self.current]
                if not earlier:
                    raise ApiError(409, "no earlier version to roll back to", code="no_previous_version")
                to = earlier[-1]
            if to not in self.states:
                raise ApiError(404, f"version {to} is not in this deployment ({sorted(self.states)})", param="version")
            self.current, self.candidate = to, None
            self._event("flip", to)
            return self.status_locked()

    def _event(self, what: str, current: int, interval: tuple[float, float] | None = None,
               reason: str | None = None) -> None:
        """`interval`: the live test's, when it decided; `reason`: why, when the golden suite decided."""
        verdicts = {n: self.stats[n].canary_verdicts for n in self.states}
        self.history.append({"event": what, "current": current, "time": time.time(), "requests": self.served_total,
                             "verdicts": verdicts, "interval": list(interval) if interval else None,
                             "reason": reason})
        self._write()

    def status_locked(self) -> dict[str, Any]:
        return {
            "current": self.current, "candidate": self.candidate, "decision": self.decision,
            "config": asdict(self.cfg), "requests": self.served_total,
            "promotion": "live feedback only" if self.gate is None else f"live feedback and the golden suite "
                         f"{self.gate.suite} ({self.gate.verdict})",
            "golden": self.gate.summary() if self.gate is not None else None,
            "versions": [{**asdict(s.version), **self.stats[n].summary()} for n, s in sorted(self.states.items())],
            "history": self.history}

    def status(self) -> dict[str, Any]:
        with self._lock:
            return self.status_locked()

    def _write(self) -> None:
        if self.record is not None:
            atomic_write(self.record, json.dumps(self.status_locked(), indent=1))


def canary(stable: Any, candidate: Any, cfg: CanaryConfig, record: Path | None = None, gate: Gate | None = None
           ) -> Deployment:
    """A deployment of two loaded versions (ServeStates), the stable one current and the candidate in canary
    (rolled back at once when `gate`, the golden suite's, fails); the stable state's app gains the deployment's
    routes. The candidate shares the stable state's request metrics, so /metrics counts the deployment's
    requests."""
    if stable.model_id != candidate.model_id:
        raise AssayError(f"the canary must be served under the stable version's model id {stable.model_id!r}, "
                         f"not {candidate.model_id!r}")
    candidate.metrics = stable.metrics
    d = Deployment({stable.version.number: stable, candidate.version.number: candidate}, stable.version.number,
                   candidate.version.number, cfg, record, gate=gate)
    stable.extra_routes.append(lambda app, authorize: add_deployment_routes(app, d, authorize))
    return d


def add_deployment_routes(app: FastAPI, d: Deployment, authorize: Callable[[Request], None]) -> None:
    """POST /v1/feedback, GET /v1/deployment, POST /v1/deployment/rollback."""

    async def body(request: Request) -> dict[str, Any]:
        try:
            data = json.loads(await request.body())
        except ValueError as e:  # not JSON, not UTF-8, or an integer past Python's 4300-digit limit
            raise ApiError(400, f"the request body is not JSON ({e}); send a JSON object") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return data

    @app.post("/v1/feedback")
    async def feedback(request: Request) -> JSONResponse:
        try:
            authorize(request)
            data = await body(request)
            rid, ok = data.get("id"), data.get("success")
            if not isinstance(rid, str) or not isinstance(ok, bool) or set(data) - {"id", "success"}:
                raise ApiError(400, 'send {"id": RESPONSE_ID, "success": true|false}: the id of a response this '
                                    "server gave and whether it succeeded", param="id" if not isinstance(rid, str)
                               else "success")
            return JSONResponse(d.feedback(rid, ok))
        except ApiError as e:
            return JSONResponse(e.body(), e.status)

    @app.get("/v1/deployment")
    async def deployment(request: Request) -> JSONResponse:
        try:
            authorize(request)
        except ApiError as e:
            return JSONResponse(e.body(), e.status)
        return JSONResponse(d.status())

    @app.post("/v1/deployment/rollback")
    async def rollback(request: Request) -> JSONResponse:
        try:
            authorize(request)
            data = await body(request) if await request.body() else {}
            to = data.get("version")
            if to is not None and not isinstance(to, int):
                raise ApiError(400, "version: a version number (GET /v1/deployment lists them)", param="version")
            return JSONResponse(d.flip(to))
        except ApiError as e:
            return JSONResponse(e.body(), e.status)
