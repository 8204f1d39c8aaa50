"""A policy behind an OpenAI-compatible endpoint (a served Assay model, vLLM, SGLang, a hosted API):
episodes are acted out at the message level through chat completions, tools through the API's tool
calls, and verified by the environment as any other episode. There are no token ids to train on,
so such trajectories are for evaluation: they carry the token counts the server reports."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from assay.agent.approvals import ApprovalCounts, Approvals
from assay.agent.memory import step_calls
from assay.core.config import DomainConfig
from assay.core.errors import AssayError
from assay.core.types import OK, ROLLOUT_ERROR, VERIFIER_ERROR, Message, Observation, Task, ToolCall, Trajectory
from assay.envs.base import Environment, hooks
from assay.envs.episode import close_episode, start_episode
from assay.envs.milestones import mark_milestones

CONCURRENCY = 8  # episodes in flight against the server


DEFAULT_KEY_ENV = "OPENAI_API_KEY"


@dataclass(frozen=True)
class Endpoint:
    """The key is never held here (so no record, repr or log of an Endpoint can carry it): `client()` reads
    it from the environment variable `api_key_env` names. None: OPENAI_API_KEY if set, else no key (a
    local server); a variable the user named must be set."""

    url: str  # e.g. http://127.0.0.1:8000/v1
    model: str
    api_key_env: str | None = None
    timeout_s: float = 120.0

    def identity(self) -> dict[str, str]:
        return {"kind": "endpoint", "url": self.url, "model": self.model}

    def key_env(self) -> str:
        return self.api_key_env or DEFAULT_KEY_ENV

    def api_key(self) -> str:
        key = os.environ.get(self.key_env(), "")
        if not key and self.api_key_env is not None:
            raise AssayError(f"the API key variable {self.api_key_env} is not set (or empty); export it, or pass "
                             "--api-key-env NAME for the variable that holds the endpoint's key")
        return key or "none"  # the client needs some key; a server without authentication ignores it

    def redact(self, text: str) -> str:
        """`text` with the key masked: a server's error may echo the key it was sent."""
        key = os.environ.get(self.key_env(), "")
        return text.replace(key, "***") if len(key) >= 4 else text

    def client(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url, api_key=self.api_key(), timeout=self.timeout_s, max_retries=2)


def check_reachable(endpoint: Endpoint) -> None:
    """Fail at once, in one line, when nothing answers at the URL (before any episode runs)."""
    import openai

    try:
        endpoint.client().chat.completions.create(model=endpoint.model, max_tokens=1,
                                                  messages=[{"role": "user", "content": "ping"}])
    except openai.APIConnectionError as e:
        raise AssayError(f"endpoint {endpoint.url} is unreachable ({e.__class__.__name__}); check --endpoint and "
                         "that the server is running") from None
    except openai.APIStatusError as e:
        message = endpoint.redact(str(e.message))[:200]
        if e.status_code in (401, 403):
            raise AssayError(f"endpoint {endpoint.url} refused the API key in ${endpoint.key_env()} (HTTP "
                             f"{e.status_code}: {message}); set that variable to a valid key, or name the "
                             "one that holds it with --api-key-env") from None
        raise AssayError(f"endpoint {endpoint.url} refused model {endpoint.model!r} (HTTP {e.status_code}: "
                         f"{message}); check --model") from None


def _wire(m: Message, call_ids: list[str]) -> dict[str, Any]:
    if m.role == "tool":
        return {"role": "tool", "content": m.content, "tool_call_id": call_ids.pop(0) if call_ids else ""}
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in m.tool_calls]
    return out


def _wire_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Chat-completions messages; each tool result answers the call ids of the turn before it, in order."""
    out, pending = [], []
    for m in messages:
        if m.role == "assistant":
            pending = [c.id for c in m.tool_calls]
        out.append(_wire(m, pending))
    return out


def _episode(client: Any, model: str, env: Environment, task: Task, dom: DomainConfig, temperature: float,
             seed: int | None, approvals: Approvals | None = None, sample: int = 0) -> Trajectory:
    episode = start_episode(env, task)
    counts = ApprovalCounts()
    gate = approvals.gate(task, sample, counts) if approvals is not None else None
    messages = list(task.prompt)
    tools = [{"type": "function", "function": spec.to_json()} for spec in task.tools]
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    turns = tool_errors = 0
    finish, status, error = "max_turns", OK, ""
    t0 = time.perf_counter()
    while turns < dom.max_turns:
        try:
            resp = client.chat.completions.create(model=model, messages=_wire_messages(messages), temperature=temperature,
                                                  max_tokens=dom.max_new_tokens, seed=seed, **({"tools": tools} if tools
                                                                                             else {}))
        except Exception as e:  # a server failure is an infrastructure status, never a wrong answer
            finish, status, error = "error", ROLLOUT_ERROR, f"{type(e).__name__}: {e}"
            break
        turns += 1
        if resp.usage is not None:
            usage["prompt_tokens"] += resp.usage.prompt_tokens
            usage["completion_tokens"] += resp.usage.completion_tokens
        choice = resp.choices[0]
        calls, unreadable = [], {}
        for i, c in enumerate(choice.message.tool_calls or []):
            try:
                args = json.loads(c.function.arguments or "{}")
            except json.JSONDecodeError as e:
                args, unreadable[i] = None, f"error: tool call arguments are not JSON ({e.msg})"
            calls.append(ToolCall(c.function.name, args if isinstance(args, dict) else {}, id=c.id or f"call_{i}"))
        messages.append(Message("assistant", choice.message.content or "", calls))
        if not calls:
            finish = "length" if choice.finish_reason == "length" else "stop"
            break
        observations = []
        for i, call in enumerate(calls):
            if i in unreadable:
                observations.append(Observation(unreadable[i], is_error=True))
                continue
            stepped = step_calls(episode, [call], task.tools, None, gate)
            observations += stepped.observations
            error = error or stepped.error
            if stepped.observations[0].status != OK or stepped.observations[0].done:
                break
        for call, obs in zip(calls, observations, strict=False):
            tool_errors += int(obs.is_error)
            messages.append(Message("tool", obs.content, name=call.name, is_error=obs.is_error))
        if observations[-1].status != OK:
            finish, status = "error", observations[-1].status
            break
        if observations[-1].done:
            finish = "stop"
            break
        if dom.time_limit_s is not None and time.perf_counter() - t0 > dom.time_limit_s:
            finish = "time_limit"
            break
    reward, passed, info = 0.0, False, {}
    if status == OK:
        try:
            rw = episode.verify(messages)
            reward, passed, info, status = rw.score, rw.passed, dict(rw.details), rw.status
        except Exception as e:
            status, error = VERIFIER_ERROR, f"episode.verify raised {type(e).__name__}: {e}"
    close_episode(episode)
    if error:
        info["error"] = error
    traj = Trajectory(task=task, messages=messages, token_ids=[], loss_mask=[], logprobs=[],
                      prompt_len=0, turns=turns, tool_errors=tool_errors, approved_calls=counts.approved,
                      denied_calls=counts.denied, refused_calls=counts.refused, finish_reason=finish,
                      reward=reward if status == OK else 0.0, passed=passed and status == OK, reward_info=info,
                      status=status, env_hash=task.env_hash, usage=usage,
                      timings={"generate_s": time.perf_counter() - t0})
    mark_milestones([traj], {task.domain: hooks(env).milestones})
    return traj


def run_endpoint_episodes(endpoint: Endpoint, envs: dict[str, Environment], domains: dict[str, DomainConfig],
                          tasks: Sequence[Task], n: int, temperature: float, seed: int | None,
                          approvals: Approvals | None = None) -> list[Trajectory]:
    """n episodes per task against the endpoint, in task order, a task's samples sharing a group id; with
    `approvals`, each valid call is gated as in the agent loop (agent/approvals.py), and the episodes that wait
    for a person (up to CONCURRENCY at once) hold up none of the others."""
    check_reachable(endpoint)
    client = endpoint.client()
    jobs = [(i, task, k) for i, task in enumerate(tasks) for k in range(n)]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        trajs = list(pool.map(lambda job: _episode(client, endpoint.model, envs[job[1].domain], job[1],
                                                   domains[job[1].domain], temperature,
                                                   None if seed is None else seed + job[2], approvals,
                                                   job[0] * n + job[2]), jobs))
    for (i, task, _), t in zip(jobs, trajs, strict=True):
        t.group_id = f"{i}:{task.task_id}"
        if "error" in t.reward_info:  # a server's error text, recorded: never with the key in it
            t.reward_info["error"] = endpoint.redact(t.reward_info["error"])
    return trajs
