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
from dataclasses import asdict, dataclass, field
from typing import Any

from assay.agent.approvals import ApprovalCounts, Approvals
from assay.agent.compaction import MESSAGE_RULES, compact_messages
from assay.agent.fallback import route_fallbacks
from assay.agent.loop import RETRY_PROMPT
from assay.agent.memory import NoteStore, offered_tools, step_calls
from assay.agent.parse import repair_json
from assay.core.config import DomainConfig
from assay.core.errors import AssayError
from assay.core.types import OK, ROLLOUT_ERROR, VERIFIER_ERROR, Message, Observation, Task, ToolCall, Trajectory
from assay.envs.base import Environment, hooks
from assay.envs.episode import close_episode, start_episode
from assay.envs.milestones import mark_milestones
from assay.envs.tools import validate_call

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


@dataclass
class _Counts:
    """What an endpoint episode counts: Trajectory's fields of the same names, counted as the agent loop does."""

    turns: int = 0
    tool_errors: int = 0
    call_turns: int = 0
    malformed_calls: int = 0
    retries: int = 0
    retry_successes: int = 0
    degraded_calls: int = 0
    fallback_calls: int = 0
    compactions: int = 0
    peak_context: int = 0
    compacted_turns: list[int] = field(default_factory=list)


def _read_calls(message: Any, repair: bool) -> tuple[list[ToolCall], dict[int, str], list[bool]]:
    """The response's tool calls; the parse error of each whose arguments are not a JSON object (after
    `repair_json` when `repair`); which were repaired."""
    calls, unreadable, repaired = [], {}, []
    for i, c in enumerate(message.tool_calls or []):
        text, fixed = c.function.arguments or "{}", False
        try:
            args = json.loads(text)
        except json.JSONDecodeError as e:
            args, unreadable[i] = None, f"tool call arguments are not JSON ({e.msg})"
            if repair:
                try:
                    args, fixed = json.loads(repair_json(text)), True
                    del unreadable[i]
                except json.JSONDecodeError:
                    pass
        if args is not None and not isinstance(args, dict):
            args, unreadable[i], fixed = None, "tool call arguments must be a JSON object", False
        calls.append(ToolCall(c.function.name, args or {}, id=c.id or f"call_{i}"))
        repaired.append(fixed)
    return calls, unreadable, repaired


def _episode(client: Any, model: str, env: Environment, task: Task, dom: DomainConfig, temperature: float,
             seed: int | None, approvals: Approvals | None = None, sample: int = 0) -> Trajectory:
    """One episode through chat completions, with the agent loop's countermeasures where the domain asks for
    them: bounded retries of malformed calls (`tool_retries`), repaired arguments (`repair_tool_calls`),
    declared fallback tools, the memory tools, and compaction at the message level (agent.compaction)."""
    episode = start_episode(env, task)
    counts, approved = _Counts(), ApprovalCounts()
    gate = approvals.gate(task, sample, approved) if approvals is not None else None
    agent = dom.agent
    notes = NoteStore(agent.note_max_chars, agent.notes_max_chars) if agent.memory and task.tools else None
    offered = offered_tools(task.tools) if notes is not None else list(task.tools)
    messages = list(task.prompt)  # everything, as it happened
    shown = list(messages)  # what the server is sent: compaction sheds the oldest turns here only
    tools = [{"type": "function", "function": spec.to_json()} for spec in offered]
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    finish, status, error = "max_turns", OK, ""
    t0 = time.perf_counter()
    free_turns = streak = 0  # turns answered with a retry prompt (not counted against max_turns); those in a row
    while counts.turns - free_turns < dom.max_turns:
        try:
            resp = client.chat.completions.create(model=model, messages=_wire_messages(shown), temperature=temperature,
                                                  max_tokens=dom.max_new_tokens, seed=seed, **({"tools": tools} if tools
                                                                                             else {}))
        except Exception as e:  # a server failure is an infrastructure status, never a wrong answer
            finish, status, error = "error", ROLLOUT_ERROR, f"{type(e).__name__}: {e}"
            break
        counts.turns += 1
        if resp.usage is not None:
            usage["prompt_tokens"] += resp.usage.prompt_tokens
            usage["completion_tokens"] += resp.usage.completion_tokens
            counts.peak_context = max(counts.peak_context, resp.usage.prompt_tokens + resp.usage.completion_tokens)
        choice = resp.choices[0]
        calls, unreadable, repaired = _read_calls(choice.message, dom.repair_tool_calls)
        routed = [False] * len(calls)
        if agent.fallback_tools:
            calls, routed = route_fallbacks(calls, offered, agent.fallback_tools)
        turn = Message("assistant", choice.message.content or "", calls)
        messages.append(turn)
        shown.append(turn)
        retried, streak = streak, 0
        if not calls:
            counts.retry_successes += int(retried > 0)
            finish = "length" if choice.finish_reason == "length" else "stop"
            break
        problems = [unreadable.get(i) or validate_call(c, offered) for i, c in enumerate(calls)]
        counts.call_turns += 1
        counts.malformed_calls += int(any(problems))
        counts.retry_successes += int(retried > 0 and not any(problems))
        if any(problems) and retried < dom.tool_retries:
            free_turns += 1  # every call answered (the API needs it), none run
            streak, counts.retries = retried + 1, counts.retries + 1
            said = "; ".join(p for p in problems if p)
            observations = [Observation(f"error: {said}\n{RETRY_PROMPT}", is_error=True) for _ in calls]
        else:
            observations = []
            for i, call in enumerate(calls):
                if i in unreadable:
                    observations.append(Observation(f"error: {unreadable[i]}", is_error=True))
                    continue
                stepped = step_calls(episode, [call], task.tools, notes, gate)
                observations += stepped.observations
                error = error or stepped.error
                acted = problems[i] is None
                counts.degraded_calls += int(acted and (repaired[i] or routed[i]))
                counts.fallback_calls += int(acted and routed[i])
                if stepped.observations[0].status != OK or stepped.observations[0].done:
                    break
        for call, obs in zip(calls, observations, strict=False):
            counts.tool_errors += int(obs.is_error)
            result = Message("tool", obs.content, name=call.name, is_error=obs.is_error)
            messages.append(result)
            shown.append(result)
        if observations[-1].status != OK:
            finish, status = "error", observations[-1].status
            break
        if observations[-1].done:
            finish = "stop"
            break
        if dom.time_limit_s is not None and time.perf_counter() - t0 > dom.time_limit_s:
            finish = "time_limit"
            break
        near = resp.usage is not None and resp.usage.prompt_tokens + resp.usage.completion_tokens >= \
            agent.compact_at * dom.max_context
        if near and agent.compaction != "none" and \
                (compacted := compact_messages(shown, len(task.prompt), agent.compaction, agent.keep_last)):
            shown = compacted
            counts.compactions += 1
            counts.compacted_turns.append(counts.turns + 1)
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
                      prompt_len=0, **asdict(counts),
                      memory_calls=notes.calls if notes is not None else 0,
                      memory_errors=notes.errors if notes is not None else 0,
                      approved_calls=approved.approved, denied_calls=approved.denied, refused_calls=approved.refused,
                      finish_reason=finish, reward=reward if status == OK else 0.0, passed=passed and status == OK,
                      reward_info=info, status=status, env_hash=task.env_hash, usage=usage,
                      timings={"generate_s": time.perf_counter() - t0})
    mark_milestones([traj], {task.domain: hooks(env).milestones})
    return traj


def run_endpoint_episodes(endpoint: Endpoint, envs: dict[str, Environment], domains: dict[str, DomainConfig],
                          tasks: Sequence[Task], n: int, temperature: float, seed: int | None,
                          approvals: Approvals | None = None) -> list[Trajectory]:
    """n episodes per task against the endpoint, in task order, a task's samples sharing a group id; with
    `approvals`, each valid call is gated as in the agent loop (agent/approvals.py), and the episodes that wait
    for a person (up to CONCURRENCY at once) hold up none of the others."""
    for name in {t.domain for t in tasks}:
        agent = domains[name].agent
        if agent.mode != "react":
            raise AssayError(f"domain {name}: agent.mode {agent.mode!r} needs the token-level agent loop; evaluate "
                             "an endpoint with agent.mode: react")
        if agent.compaction not in ("none", *MESSAGE_RULES):
            raise AssayError(f"domain {name}: agent.compaction {agent.compaction!r} has no message-level form for an "
                             f"endpoint; use none or one of {', '.join(MESSAGE_RULES)}")
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
