"""Continuous batching for the server: one thread owns the engine and steps it; requests reach it through a
bounded queue.

The HTTP side (an asyncio loop) puts a `Ticket` in the queue and awaits its events; a full queue is a
refusal (429), so memory is bounded by the queue and the batch, whatever the load. The engine thread admits
tickets while the engine runs fewer than `max_batch` sequences (a request of n choices counts n), steps the
engine, and hands each ticket its events on the ticket's own event loop: a streamed ticket its new tokens
after every step, every ticket its results when the engine delivers them. A ticket the client gave up
(`cancel`: a disconnect) is aborted in the engine at the next step, its KV blocks freed, or dropped unrun
if it is still queued. The engine is never touched from any other thread."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from assay.core.errors import AssayError
from assay.rollout.base import GenRequest, GenResult
from assay.rollout.engine import Engine


@dataclass
class Tokens:
    """New tokens of a streamed ticket since its last event: per request, per choice (ids, logprobs, finish
    reason so far)."""

    choices: list[list[GenResult]]


@dataclass
class Done:
    """Every request of the ticket finished: its results, per request, per choice."""

    results: list[list[GenResult]]


@dataclass
class Failed:
    status: int
    message: str


Event = Tokens | Done | Failed


@dataclass(eq=False)
class Ticket:
    """One HTTP request's work: one engine request per prompt (a completion may carry several)."""

    requests: list[GenRequest]
    stream: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    enqueued: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # set by the HTTP side; read by the engine thread (a plain flag is enough)
    ids: list[int] = field(default_factory=list)  # engine request ids, once admitted
    results: dict[int, list[GenResult]] = field(default_factory=dict)
    sent: list[list[int]] = field(default_factory=list)  # tokens already streamed, per request, per choice

    @property
    def width(self) -> int:
        return sum(r.n for r in self.requests)

    def post(self, event: Event) -> None:
        """Hand an event to the HTTP side, from the engine thread."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class QueueFull(Exception):
    pass


class Batcher:
    """The engine thread and its bounded queue. `on_step(engine_seconds, tokens)`, `on_admit(wait_s)` and
    `on_abort()` (a cancelled ticket left the engine or the queue unfinished) feed the metrics."""

    def __init__(self, engine: Engine, max_queue: int, max_batch: int,
                 on_step: Callable[[float, int], None] = lambda s, n: None,
                 on_admit: Callable[[float], None] = lambda s: None,
                 on_abort: Callable[[], None] = lambda: None) -> None:
        if max_queue < 1 or max_batch < 1:
            raise AssayError(f"serve: --max-queue and --max-batch must be at least 1, got {max_queue} and {max_batch}")
        self.engine = engine
        self.max_batch = max_batch
        self.queue: queue.Queue[Ticket] = queue.Queue(maxsize=max_queue)
        self.on_step, self.on_admit, self.on_abort = on_step, on_admit, on_abort
        self.error: str | None = None  # the engine failed; the server answers 503 from then on
        self._active: dict[int, Ticket] = {}  # engine request id -> ticket
        self._tickets: list[Ticket] = []  # admitted, in admission order
        self._next: Ticket | None = None  # dequeued, waiting for room in the batch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="assay-serve-engine", daemon=True)

    # -- the HTTP side ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def submit(self, ticket: Ticket) -> None:
        """Queue a ticket, or raise QueueFull at once."""
        if ticket.width > self.max_batch:
            raise AssayError(f"{ticket.width} choices in one request exceed the server's batch of {self.max_batch} "
                             "sequences; ask for fewer (n, or fewer prompts)")
        try:
            self.queue.put_nowait(ticket)
        except queue.Full:
            raise QueueFull from None

    @property
    def running(self) -> int:
        return len(self._tickets)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # -- the engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drop_cancelled()
                self._admit()
                if self.engine.has_unfinished:
                    self._step()
                elif self._next is None:
                    try:
                        self._next = self.queue.get(timeout=0.05)
                    except queue.Empty:
                        pass
        except Exception as e:  # an engine failure: every waiting client is told, nothing new is taken
            self.error = f"{type(e).__name__}: {e}"
            for t in self._tickets + ([self._next] if self._next else []):
                t.post(Failed(500, f"the engine failed ({self.error}); the server stops serving"))
            self._drain(Failed(503, "the engine failed; the server stops serving"))
        finally:
            self._drain(Failed(503, "the server is shutting down"))

    def _drain(self, event: Failed) -> None:
        while True:
            try:
                self.queue.get_nowait().post(event)
            except queue.Empty:
                return

    def _width(self) -> int:
        return sum(t.width for t in self._tickets)

    def _admit(self) -> None:
        while True:
            if self._next is None:
                try:
                    self._next = self.queue.get_nowait()
                except queue.Empty:
                    return
            t = self._next
            if t.cancelled:
                self._next = None
                self.on_abort()
                continue
            if self._tickets and self._width() + t.width > self.max_batch:
                return
            self._next = None
            try:
                t.ids = self.engine.add_requests(t.requests)
            except AssayError as e:  # a prompt the engine cannot hold (too long for the model or the cache)
                t.post(Failed(400, str(e)))
                continue
            self.on_admit(time.perf_counter() - t.enqueued)
            t.sent = [[0] * r.n for r in t.requests]
            self._tickets.append(t)
            for rid in t.ids:
                self._active[rid] = t

    def _drop_cancelled(self) -> None:
        for t in [t for t in self._tickets if t.cancelled]:
            for rid in t.ids:
                self.engine.abort(rid)
                self._active.pop(rid, None)
            self._tickets.remove(t)
            self.on_abort()

    def _step(self) -> None:
        t0 = time.perf_counter()
        done = self.engine.step()
        tokens = 0
        for rid, results in done:
            t = self._active.pop(rid)
            t.results[rid] = results
        for t in list(self._tickets):
            if len(t.results) == len(t.ids):
                self._tickets.remove(t)
                if t.stream:
                    tokens += self._stream(t, [t.results[rid] for rid in t.ids])
                else:
                    tokens += sum(len(r.token_ids) for rid in t.ids for r in t.results[rid])
                t.post(Done([t.results[rid] for rid in t.ids]))
            elif t.stream:
                now = [t.results.get(rid) or self.engine.partial(rid) or [] for rid in t.ids]
                tokens += self._stream(t, now)
        self.on_step(time.perf_counter() - t0, tokens)

    def _stream(self, t: Ticket, now: list[list[GenResult]]) -> int:
        """Post the tokens sampled since the ticket's last event; the number of them."""
        fresh: list[list[GenResult]] = []
        count = 0
        for sent, results in zip(t.sent, now, strict=True):
            row = []
            for j, r in enumerate(results):
                k = sent[j]
                row.append(GenResult(r.token_ids[k:], r.logprobs[k:], r.finish_reason, r.policy_version))
                count += len(r.token_ids) - k
                sent[j] = len(r.token_ids)
            fresh.append(row)
        if count:
            t.post(Tokens(fresh))
        return count
