"""The HTTP API: OpenAI's chat completions and completions (streamed as server-sent events), models,
health and Prometheus metrics, over the engine thread of `batcher.py`.

Every refusal is OpenAI's error JSON with a 4xx or 5xx status. A request waits for its results on the
event loop; one whose client goes away (a closed stream, or a disconnect noticed while it waits) is
cancelled, and the engine thread aborts it. With an API key, every route but /health needs
`Authorization: Bearer KEY`; the key is compared in constant time and never written anywhere."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from transformers import PreTrainedTokenizerBase

from assay.core.chat_format import chat_format
from assay.core.errors import AssayError
from assay.rollout.base import GenRequest, GenResult, SamplingParams
from assay.serve.batcher import Batcher, Done, Event, Failed, QueueFull, Ticket, Tokens
from assay.serve.metrics import ServeMetrics
from assay.serve.output import Reading, View, call_json, decode, delta, read, text_tokens, token_entries
from assay.serve.prompt import chat_prompt_ids, completion_prompt_ids, tool_specs
from assay.serve.protocol import (
    ApiError,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    FunctionOut,
    TokenLogprob,
    ToolCallOut,
    Usage,
    validation_error,
)
from assay.serve.sessions import SESSION_HEADER, PolicyVersion, Served, served

POLL_S = 0.25  # how often a waiting request looks for its client's disconnect
VERSION_HEADER = "X-Assay-Version"  # on every answer: the number of the deployment's version that gave it


@dataclass
class ServeState:
    """What the routes need: the served model's id and tokenizer, the engine thread, the metrics."""

    model_id: str
    tokenizer: PreTrainedTokenizerBase
    batcher: Batcher
    metrics: ServeMetrics
    max_positions: int
    vocab: int
    stop_ids: frozenset[int]
    api_key: str | None = field(default=None, repr=False)  # never in a repr, a log or a response
    created: int = field(default_factory=lambda: int(time.time()))
    version: PolicyVersion = PolicyVersion(1, "", "")  # the policy answering, with its weights' hash
    profile: str = "standard"
    # called (on a worker thread, before the response goes out) with every completed request: the session
    # log, the canary's statistics
    observers: list[Callable[[Served], None]] = field(default_factory=list)
    # a deployment of several versions: picks the state that answers a session (canary.Deployment.pick)
    route: Callable[[str | None], ServeState] | None = None
    # request checks run before a request is queued (a suite task it names must be verifiable): raise ApiError
    checks: list[Callable[[ChatCompletionRequest | CompletionRequest], None]] = field(default_factory=list)
    # more routes (the deployment's feedback and status), each given the app and the API-key check
    extra_routes: list[Callable[[FastAPI, Callable[[Request], None]], None]] = field(default_factory=list)


class _Disconnected(Exception):
    pass


def make_app(s: ServeState) -> FastAPI:
    app = FastAPI(title="Assay", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:  # unknown route, wrong method
        message = f"{request.method} {request.url.path}: {e.detail}"
        return _error(ApiError(e.status_code, message, code="not_found" if e.status_code == 404 else None))

    @app.get("/health")
    async def health() -> JSONResponse:
        if not s.batcher.alive:
            return JSONResponse({"status": "error", "error": s.batcher.error or "the engine thread stopped"}, 503)
        return JSONResponse({"status": "ok", "model": s.model_id})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        try:
            _authorize(s, request)
        except ApiError as e:
            return _error(e)
        return Response(s.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        try:
            _authorize(s, request)
        except ApiError as e:
            return _count(s, "models", _error(e), None)
        body = {"object": "list", "data": [{"id": s.model_id, "object": "model", "created": s.created,
                                            "owned_by": "assay"}]}
        return _count(s, "models", JSONResponse(body), None)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _serve(s, request, "chat", ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(s, request, "completions", CompletionRequest)

    for add in s.extra_routes:
        add(app, lambda request: _authorize(s, request))
    return app


# ---- the request path --------------------------------------------------------------------------------


async def _serve(s: ServeState, request: Request, route: str, model: type[BaseModel]) -> Response:
    t0 = time.perf_counter()
    ticket: Ticket | None = None
    try:
        _authorize(s, request)
        req = await _parse(request, model)
        if req.model != s.model_id:
            raise ApiError(404, f"model {req.model!r} is not served here; this server serves {s.model_id!r} "
                                "(GET /v1/models)", param="model", code="model_not_found")
        for check in s.checks:
            check(req)
        s = _routed(s, request, req)
        if isinstance(req, ChatCompletionRequest):
            prompts = [chat_prompt_ids(s.tokenizer, req)]
            how = _chat_reading(s, req)
        else:
            assert isinstance(req, CompletionRequest)
            prompts = [completion_prompt_ids(s.tokenizer, p, s.vocab) for p in req.prompts()]
            how = Reading(tuple(req.stop_list()))
        requests = [GenRequest(ids, _params(s, req, len(ids)), n=req.n) for ids in prompts]
        ticket = _submit(s, requests, req.stream)
        s.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        if req.stream:
            stream = _stream(s, request, route, req, ticket, how, prompts, t0)
            return StreamingResponse(stream, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                              VERSION_HEADER: str(s.version.number)})
        results = await _results(ticket, request)
        body = (_chat_body(s, req, results[0], how, len(prompts[0])) if isinstance(req, ChatCompletionRequest)
                else _completion_body(s, req, results, how, [len(p) for p in prompts]))
        await _observe(s, request, route, req, body.id, prompts, results, how, t0)
        return _count(s, route, JSONResponse(body.model_dump(exclude_none=False),
                                             headers={VERSION_HEADER: str(s.version.number)}), t0)
    except ApiError as e:
        return _count(s, route, _error(e), t0)
    except _Disconnected:
        s.metrics.requests.labels(route, "disconnected").inc()
        return Response(status_code=499)
    finally:
        if ticket is not None and not ticket.stream:
            ticket.cancelled = True  # after its results this does nothing; before them it aborts the request


def _routed(s: ServeState, request: Request, req: ChatCompletionRequest | CompletionRequest) -> ServeState:
    """The version that answers: in a deployment the router's pick, sticky by session."""
    return s.route(request.headers.get(SESSION_HEADER) or req.user) if s.route is not None else s


def _authorize(s: ServeState, request: Request) -> None:
    if s.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), s.api_key.encode()):
        raise ApiError(401, "a valid API key is required: send the header Authorization: Bearer KEY",
                       code="invalid_api_key")


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as e:  # not JSON, not UTF-8, or an integer past Python's 4300-digit limit
        raise ApiError(400, f"the request body is not JSON ({e}); send a JSON object") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body is a JSON {type(body).__name__}; send a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


def _chat_reading(s: ServeState, req: ChatCompletionRequest) -> Reading:
    fmt = chat_format(s.tokenizer)
    return Reading(tuple(req.stop_list()), fmt.think_tags, fmt.tool_calls if tool_specs(req) else None)


def _params(s: ServeState, req: ChatCompletionRequest | CompletionRequest, prompt_len: int) -> SamplingParams:
    room = s.max_positions - prompt_len
    if room < 1:
        raise ApiError(400, f"the prompt has {prompt_len} tokens, which leaves no room in the model's "
                            f"{s.max_positions} positions; shorten it", param="messages",
                       code="context_length_exceeded")
    limit = req.token_limit()
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, max_tokens=min(limit or room, room),
                          stop_token_ids=sorted(s.stop_ids), stop=req.stop_list(), seed=req.seed)


def _submit(s: ServeState, requests: list[GenRequest], stream: bool) -> Ticket:
    if not s.batcher.alive:
        raise ApiError(503, f"the engine is not running ({s.batcher.error or 'stopped'})", type_="server_error")
    ticket = Ticket(requests, stream, asyncio.get_running_loop())
    try:
        s.batcher.submit(ticket)
    except QueueFull:
        raise ApiError(429, f"the server is at capacity: {s.batcher.queue.maxsize} requests already wait; retry "
                            "later", type_="rate_limit_error", code="queue_full") from None
    except AssayError as e:
        raise ApiError(400, str(e), param="n") from None
    return ticket


async def _observe(s: ServeState, request: Request, route: str, req: ChatCompletionRequest | CompletionRequest,
                   rid: str, prompts: list[list[int]], results: list[list[GenResult]], how: Reading,
                   t0: float) -> None:
    """A completed request to the observers, before its response goes out: a logged request is durable by
    the time its client reads it."""
    if s.observers:
        done = served(s, request.headers.get(SESSION_HEADER), route, req, rid, prompts, results, how,
                      time.perf_counter() - t0)
        try:
            await asyncio.to_thread(lambda: [observe(done) for observe in s.observers])
        except OSError as e:  # the log's disk or store failed: the client must not take the answer as recorded
            raise ApiError(503, f"the request completed but could not be logged ({e}); retry it",
                           type_="server_error", code="log_failed") from None


async def _next_event(ticket: Ticket, request: Request) -> Event:
    while True:
        try:
            return await asyncio.wait_for(ticket.events.get(), POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                raise _Disconnected from None


async def _results(ticket: Ticket, request: Request) -> list[list[GenResult]]:
    while True:
        event = await _next_event(ticket, request)
        if isinstance(event, Done):
            return event.results
        if isinstance(event, Failed):
            raise ApiError(event.status, event.message, type_="server_error" if event.status >= 500 else
                           "invalid_request_error")


def _error(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 429 else None
    return JSONResponse(e.body(), e.status, headers=headers)


def _count(s: ServeState, route: str, response: Response, t0: float | None) -> Response:
    s.metrics.requests.labels(route, str(response.status_code)).inc()
    if t0 is not None:
        s.metrics.latency.labels(route).observe(time.perf_counter() - t0)
    return response


def _usage(prompt: int, results: list[list[GenResult]]) -> Usage:
    done = sum(len(r.token_ids) for rs in results for r in rs)
    return Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)


def _finish(result: GenResult, calls: bool) -> str:
    return "tool_calls" if calls else "length" if result.finish_reason == "length" else "stop"


# ---- whole responses ---------------------------------------------------------------------------------


def _call_out(view: View) -> list[ToolCallOut]:
    return [ToolCallOut(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionOut(name=c.name, arguments=call_json(c)))
            for c in view.calls]


def _chat_body(s: ServeState, req: ChatCompletionRequest, results: list[GenResult], how: Reading,
               prompt_len: int) -> ChatCompletion:
    choices = []
    for i, r in enumerate(results):
        ids = text_tokens(r, s.stop_ids)
        view = read(decode(s.tokenizer, ids), how, final=True, stopped=r.finish_reason == "stop")
        calls = _call_out(view)
        lps = ChoiceLogprobs(content=[TokenLogprob(token=t, logprob=lp, bytes=b) for t, lp, b in
                                      token_entries(s.tokenizer, ids, r.logprobs)]) if req.logprobs else None
        message = AssistantMessage(content=view.content if view.content or not calls else None,
                                   tool_calls=calls or None, reasoning_content=view.reasoning)
        choices.append(ChatChoice(index=i, message=message, logprobs=lps, finish_reason=_finish(r, bool(calls))))
    return ChatCompletion(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=s.model_id,
                          choices=choices, usage=_usage(prompt_len, [results]))


def _completion_logprobs(s: ServeState, ids: list[int], logprobs: list[float], offset: int) -> CompletionLogprobs:
    entries = token_entries(s.tokenizer, ids, logprobs)
    offsets = []
    for t, _, _ in entries:
        offsets.append(offset)
        offset += len(t)
    return CompletionLogprobs(tokens=[t for t, _, _ in entries], token_logprobs=[lp for _, lp, _ in entries],
                              text_offset=offsets)


def _completion_body(s: ServeState, req: CompletionRequest, results: list[list[GenResult]], how: Reading,
                     prompt_lens: list[int]) -> Completion:
    choices = []
    for p, rs in enumerate(results):
        for j, r in enumerate(rs):
            ids = text_tokens(r, s.stop_ids)
            text = read(decode(s.tokenizer, ids), how, final=True).content
            lps = _completion_logprobs(s, ids, r.logprobs, 0) if req.logprobs is not None else None
            choices.append(CompletionChoice(index=p * req.n + j, text=text, logprobs=lps,
                                            finish_reason=_finish(r, False)))
    return Completion(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=s.model_id, choices=choices,
                      usage=_usage(sum(prompt_lens), results))


# ---- streams -----------------------------------------------------------------------------------------


@dataclass
class _Choice:
    """One streamed choice: its tokens so far and what of them the client already has."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    content: str = ""
    reasoning: str = ""
    entries: int = 0  # logprob entries sent

    def add(self, r: GenResult) -> GenResult:
        self.ids += r.token_ids
        self.logprobs += r.logprobs
        return GenResult(self.ids, self.logprobs, r.finish_reason, r.policy_version)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(s: ServeState, request: Request, route: str, req: ChatCompletionRequest | CompletionRequest,
                  ticket: Ticket, how: Reading, prompts: list[list[int]], t0: float) -> AsyncIterator[str]:
    chat = isinstance(req, ChatCompletionRequest)
    prompt_lens = [len(p) for p in prompts]
    cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    head = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": s.model_id}
    choices = [[_Choice() for _ in range(req.n)] for _ in prompt_lens]
    want_logprobs = req.logprobs is True if chat else req.logprobs is not None  # chat: a flag; completions: 0
    finished = False
    status = "disconnected"

    def chunk(index: int, c: _Choice, r: GenResult, final: bool) -> dict[str, Any] | None:
        ids = text_tokens(r, s.stop_ids)
        view = read(decode(s.tokenizer, ids), how, final=final, stopped=r.finish_reason == "stop")
        text, think = delta(c.content, view.content), delta(c.reasoning, view.reasoning or "")
        c.content, c.reasoning = c.content + text, c.reasoning + think
        fresh = token_entries(s.tokenizer, ids[c.entries:], r.logprobs[c.entries:len(ids)]) if want_logprobs else []
        start, c.entries = c.entries, c.entries + len(fresh)
        calls = _call_out(view) if final else []
        reason = _finish(r, bool(calls)) if final else None
        if not (text or think or fresh or calls or reason):
            return None
        if chat:
            d: dict[str, Any] = {}
            if text:
                d["content"] = text
            if think:
                d["reasoning_content"] = think
            if calls:
                d["tool_calls"] = [{"index": k, **call.model_dump()} for k, call in enumerate(calls)]
            lp = {"content": [TokenLogprob(token=t, logprob=x, bytes=b).model_dump() for t, x, b in fresh]} \
                if fresh else None
            return {"index": index, "delta": d, "logprobs": lp, "finish_reason": reason}
        offset = len(decode(s.tokenizer, ids[:start]))
        lp = _completion_logprobs(s, ids[start:c.entries], r.logprobs[start:c.entries], offset).model_dump() \
            if fresh else None
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}

    try:
        if chat:
            yield _sse({**head, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None} for j in range(req.n)]})
        first = True
        while not finished:
            event = await _next_event(ticket, request)
            if isinstance(event, Failed):
                status = str(event.status)
                yield _sse(ApiError(event.status, event.message, type_="server_error").body())
                break
            final = isinstance(event, Done)
            updates = event.choices if isinstance(event, Tokens) else event.results
            out = []
            for p, rs in enumerate(updates):
                for j, r in enumerate(rs):
                    c = choices[p][j]
                    full = GenResult(r.token_ids, r.logprobs, r.finish_reason, r.policy_version) if final else c.add(r)
                    if final:
                        c.ids, c.logprobs = list(r.token_ids), list(r.logprobs)
                    if (piece := chunk(p * req.n + j, c, full, final)) is not None:
                        out.append(piece)
            if first and out:
                s.metrics.first_token.observe(time.perf_counter() - t0)
                first = False
            if final:
                await _observe(s, request, route, req, cid, prompts, event.results, how, t0)
            if out:
                yield _sse({**head, "choices": out})
            if final:
                finished, status = True, "200"
                if req.include_usage():
                    yield _sse({**head, "choices": [], "usage": _usage(sum(prompt_lens), event.results).model_dump()})
        yield "data: [DONE]\n\n"
    except _Disconnected:
        pass
    except ApiError as e:  # the session log failed at the end
        status = str(e.status)
        yield _sse(e.body())
    finally:
        if not finished:
            ticket.cancelled = True  # the engine thread aborts it at its next step
        s.metrics.requests.labels(route, status).inc()
        s.metrics.latency.labels(route).observe(time.perf_counter() - t0)
