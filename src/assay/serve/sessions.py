"""What a completed request leaves behind: a `Served` record (its prompts, what was sampled, what the client
read, latency, the policy version that answered), given to the server's observers (the session log, the
canary's statistics), and its choices as trajectories in the run store's schema.

One choice is one `Trajectory`: the task is the request (`task_id` the response id, `prompt` the messages,
`tools` the tools shown, `payload` the serving record: route, sampling settings, policy name, version and
hash, profile, session, time, the API finish reason); `messages` the prompt and the assistant turn as the
client read it (content, reasoning, tool calls); `token_ids`, `loss_mask`, `logprobs` and `prompt_len` as an
agent turn's (sampled tokens masked 1, their behaviour logprobs); `timings` the latency; `group_id` the
request (its n choices share it)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from assay.core.storage import trajectory_row
from assay.core.types import Message, Task, Trajectory
from assay.rollout.base import GenResult
from assay.serve.output import Reading, View, decode, read, text_tokens
from assay.serve.prompt import chat_messages, tool_specs
from assay.serve.protocol import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from assay.serve.app import ServeState
    from assay.serve.session_log import SessionLog

SESSION_HEADER = "x-session-id"  # a client's session id (else the request's `user`): the canary keeps it sticky


@dataclass(frozen=True)
class PolicyVersion:
    """One deployed policy: its number in the deployment (1 the first), its name, its weights' content hash."""

    number: int
    name: str
    hash: str


def weights_hash(model: torch.nn.Module) -> str:
    """sha256 of the parameters and buffers (names, dtypes, shapes, bytes): two versions with equal hashes
    answer alike."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return f"sha256:{h.hexdigest()}"


@dataclass
class Served:
    request_id: str
    route: str  # chat | completions
    req: ChatCompletionRequest | CompletionRequest
    prompts: list[list[int]]
    results: list[list[GenResult]]  # per prompt, per choice
    views: list[list[View]]  # what the client read of each choice
    finish: list[list[str]]  # the API finish reason of each choice (stop, length, tool_calls)
    latency_s: float
    version: PolicyVersion
    profile: str
    session: str | None
    time: float = field(default_factory=time.time)

    def completion_tokens(self) -> int:
        return sum(len(r.token_ids) for rs in self.results for r in rs)


def api_finish(result: GenResult, view: View) -> str:
    return "tool_calls" if view.calls else "length" if result.finish_reason == "length" else "stop"


def served(s: ServeState, session: str | None, route: str, req: ChatCompletionRequest | CompletionRequest,
           request_id: str, prompts: list[list[int]], results: list[list[GenResult]], how: Reading,
           latency_s: float) -> Served:
    views = [[read(decode(s.tokenizer, text_tokens(r, s.stop_ids)), how, final=True,
                   stopped=r.finish_reason == "stop") for r in rs] for rs in results]
    finish = [[api_finish(r, v) for r, v in zip(rs, vs, strict=True)] for rs, vs in zip(results, views, strict=True)]
    return Served(request_id, route, req, prompts, results, views, finish, latency_s, s.version, s.profile,
                  session or req.user)


def sampling_record(req: ChatCompletionRequest | CompletionRequest, prompt_len: int, max_positions: int,
                    stop_ids: frozenset[int]) -> dict[str, Any]:
    """The settings a replay needs to sample the same way."""
    limit = req.token_limit()
    room = max_positions - prompt_len
    return {"temperature": req.temperature, "top_p": req.top_p, "max_tokens": min(limit or room, room),
            "stop": req.stop_list(), "seed": req.seed, "n": req.n, "stop_token_ids": sorted(stop_ids)}


def _prompt_messages(s: ServeState, d: Served, p: int) -> list[Message]:
    if isinstance(d.req, ChatCompletionRequest):
        return chat_messages(d.req.messages)
    prompt = d.req.prompts()[p]
    return [Message("user", prompt if isinstance(prompt, str) else decode(s.tokenizer, list(prompt)))]


def trajectories(s: ServeState, d: Served) -> list[Trajectory]:
    tools = tool_specs(d.req) if isinstance(d.req, ChatCompletionRequest) else []
    out = []
    for p, (ids, rs) in enumerate(zip(d.prompts, d.results, strict=True)):
        prompt = _prompt_messages(s, d, p)
        for j, r in enumerate(rs):
            view = d.views[p][j]
            payload = {"route": d.route, "model": s.model_id, "policy": d.version.name, "version": d.version.number,
                       "policy_hash": d.version.hash, "profile": d.profile, "session": d.session, "time": d.time,
                       "prompt_index": p, "choice": j, "finish": d.finish[p][j],
                       "sampling": sampling_record(d.req, len(ids), s.max_positions, s.stop_ids)}
            task = Task(env="serve", task_id=d.request_id, difficulty=0, prompt=prompt, tools=tools, payload=payload,
                        seed=d.req.seed or 0)
            turn = Message("assistant", view.content, view.calls, reasoning=view.reasoning)
            out.append(Trajectory(
                task=task, messages=[*prompt, turn], token_ids=[*ids, *r.token_ids],
                loss_mask=[0] * len(ids) + [1] * len(r.token_ids), logprobs=[0.0] * len(ids) + list(r.logprobs),
                prompt_len=len(ids), policy_version=d.version.number, turns=1, call_turns=int(bool(view.calls)),
                finish_reason="length" if r.finish_reason == "length" else "stop",
                timings={"latency_s": d.latency_s}, group_id=d.request_id,
                usage={"prompt_tokens": len(ids), "completion_tokens": len(r.token_ids)}))
    return out


def log_rows(s: ServeState, d: Served) -> list[dict[str, Any]]:
    return [trajectory_row(t, step=0) for t in trajectories(s, d)]


def attach_log(s: ServeState, log: SessionLog) -> None:
    """Log every request `s` completes."""
    s.observers.append(lambda d: log.append(d.request_id, log_rows(s, d)))
