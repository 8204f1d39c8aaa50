"""The multi-turn agent loop: a backend and episodes in, token-exact trajectories out.

`run_episodes` advances all unfinished episodes together, one backend.generate call per turn;
`run_episodes_online` lets each advance on its own through the engine's online API. The sampled
ids are kept as sampled (never re-tokenized); tool results are appended as ids from agent.render,
the same layout SFT trains on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace

from transformers import PreTrainedTokenizerBase

from assay.agent.approvals import ApprovalCounts, Approvals
from assay.agent.compaction import TurnBlock
from assay.agent.context import ContextState, start_context
from assay.agent.fallback import route_fallbacks
from assay.agent.memory import step_calls
from assay.agent.parse import parse_repairing, split_reasoning
from assay.agent.render import observation_ids
from assay.core.chat_format import chat_format
from assay.core.config import AgentConfig
from assay.core.errors import AssayError
from assay.core.tokenizer import stop_token_ids
from assay.core.types import (
    OK,
    VERIFIER_ERROR,
    FinishReason,
    Message,
    Observation,
    Reward,
    Status,
    Task,
    ToolCall,
    Trajectory,
)
from assay.envs.base import Episode
from assay.envs.episode import close_episode, close_episodes
from assay.envs.tools import validate_call
from assay.envs.verifiers import VerifierPool
from assay.rollout.base import GenRequest, GenResult, OnlineBackend, RolloutBackend, SamplingParams

VERIFY_WORKERS = 16  # episodes verified at once (rollout.verifiers): codegen grades those waiting in one run
TOOL_WORKERS = 4  # tool calls run at once while the engine generates (online loop)
RETRY_PROMPT = "Nothing was run. Call the tool again with a corrected call."


@dataclass
class EpisodeJob:
    """One episode to act out, with its domain's limits."""

    task: Task
    episode: Episode
    params: SamplingParams  # per turn; seed + turn number seeds each turn
    max_turns: int
    max_context: int
    stream: int  # which of the seed's random streams its samples draw: its index in its batch
    time_limit_s: float | None = None  # wall clock from its start; checked after each turn
    verify_timeout_s: float | None = None  # a verifier past it gives the episode VERIFIER_ERROR, not a reward
    verifier: VerifierPool | None = None  # verifies a fresh episode elsewhere (processes, actors); None: this one
    tool_retries: int = 0  # malformed turns in a row answered with a retry prompt, outside max_turns
    repair_tool_calls: bool = False  # repair calls that do not parse (the degraded path)
    agent: AgentConfig = field(default_factory=AgentConfig)  # mode, memory tool, compaction
    approvals: Approvals | None = None  # allowlist and critical tools (agent.approvals); never in RL rollouts


@dataclass
class _Run:
    job: EpisodeJob
    ids: list[int]
    messages: list[Message]
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_len: int = 0
    turns: int = 0
    free_turns: int = 0  # malformed turns answered with a retry prompt: not counted against max_turns
    streak: int = 0  # retry prompts in a row; 0 after any turn counted against max_turns
    tool_errors: int = 0
    call_turns: int = 0
    malformed: int = 0
    retries: int = 0
    retry_successes: int = 0
    degraded: int = 0
    fallbacks: int = 0
    finish: FinishReason = ""  # set when the episode stops acting
    status: Status = OK
    error: str = ""
    versions: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=lambda: {"generate_s": 0.0, "tool_s": 0.0, "verify_s": 0.0})
    started: float = field(default_factory=time.perf_counter)
    closed: bool = False  # its episode's close() was called
    ctx: ContextState | None = None  # head, turns, plan and notes (agent/context.py)
    seg: int = 0  # where the current context starts in ids: the engine is prompted with ids[seg:]
    segment_starts: list[int] = field(default_factory=list)
    compacted_turns: list[int] = field(default_factory=list)
    peak: int = 0  # the largest context a turn saw
    plan_turns: int = 0
    approvals: ApprovalCounts = field(default_factory=ApprovalCounts)

    def append(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def new_segment(self, ids: list[int]) -> None:
        """A re-rendered context: the next turns are prompted with it, not with what came before."""
        self.segment_starts.append(len(self.ids))
        self.seg = len(self.ids)
        self.append(ids, sampled=False)

    @property
    def context_len(self) -> int:
        return len(self.ids) - self.seg


def run_episodes(
    backend: RolloutBackend,
    items: Sequence[tuple[Task, Episode]],
    tokenizer: PreTrainedTokenizerBase,
    params: SamplingParams,
    max_turns: int,
    max_context: int,
    policy_version: int = 0,
    time_limit_s: float | None = None,
    verify_timeout_s: float | None = None,
    verifiers: int = VERIFY_WORKERS,
    verifier: VerifierPool | None = None,
    tool_retries: int = 0,
    repair_tool_calls: bool = False,
    agent: AgentConfig | None = None,
    approvals: Approvals | None = None,
) -> list[Trajectory]:
    """Act out every (task, episode) to the end and verify it (in `verifier` when given);
    one trajectory per item, in order.
    All unfinished episodes take their next turn together, in one backend call.

    An episode ends on an answer (a turn without tool calls, or a tool result with done: "stop"),
    after max_turns assistant turns ("max_turns"), after a turn that ends past time_limit_s seconds
    from the episode's start ("time_limit"), on a turn cut at max_tokens ("length"), or when
    the next turn or tool result would not fit in max_context tokens ("context"); each is then verified
    on its messages. An infrastructure failure (an Observation or Reward status other than ok, an
    exception from the environment) sets the trajectory's status instead of a reward.
    A malformed tool-call turn (a call that does not parse, names an unknown tool or breaks its schema)
    is an error result the policy sees and counts as a turn; with `tool_retries` the first that many in
    a row run nothing and answer with the validator's message and a retry prompt instead, outside the
    max_turns budget (see `_take_turn`). With `repair_tool_calls`, a call that does not parse is repaired
    (agent.parse.repair_json) before it is called malformed. `agent` sets the mode, the memory tool,
    compaction (agent/context.py) and the declared fallback tools (agent/fallback.py: a call naming a tool the
    task does not offer runs as its fallback's, a degraded call); a compaction or a plan_execute turn starts a
    new token segment.
    `approvals` gates each valid call (agent/approvals.py): one outside the allowlist, or a critical one a
    person denies, runs nothing and is an error result; when calls may wait for a person, the episodes of a
    turn act on threads of their own, so that their waits overlap.
    Trajectory.policy_version is the oldest weights version that sampled any of its tokens
    (`policy_version` when nothing was sampled). timings["generate_s"] is the wall time of the batched
    generate calls the episode took part in."""
    jobs = [EpisodeJob(task, episode, params, max_turns, max_context, i, time_limit_s, verify_timeout_s, verifier,
                       tool_retries, repair_tool_calls, agent or AgentConfig(), approvals)
            for i, (task, episode) in enumerate(items)]
    runs: list[_Run] = []
    try:
        for job in jobs:
            runs.append(_start(job, tokenizer))
        while active := [r for r in runs if not r.finish]:
            reqs = [_request(r) for r in active]
            t0 = time.perf_counter()
            results = backend.generate(reqs)
            dt = time.perf_counter() - t0
            if len(results) != len(reqs) or any(len(res) != 1 for res in results):
                raise AssayError("run_episodes: the backend must return exactly one result per request (n=1)")
            for r in active:
                r.timings["generate_s"] += dt
            if approvals is not None and approvals.waits and len(active) > 1:
                with ThreadPoolExecutor(len(active)) as pool:  # a wait for a person holds up no other episode
                    list(pool.map(lambda r, res: _take_turn(r, res[0], tokenizer), active, results))
            else:
                for r, res in zip(active, results, strict=True):
                    _take_turn(r, res[0], tokenizer)
        # Verification is independent per episode and mostly waits on sandboxes: run it concurrently.
        with ThreadPoolExecutor(max_workers=min(verifiers, len(runs)) or 1) as pool:
            return list(pool.map(lambda r: _finish(r, policy_version), runs))
    finally:
        _close_all(jobs, runs)


def run_episodes_online(
    engine: OnlineBackend,
    jobs: Sequence[EpisodeJob],
    tokenizer: PreTrainedTokenizerBase,
    policy_version: int = 0,
    tool_workers: int = TOOL_WORKERS,
    verifiers: int = VERIFY_WORKERS,
) -> list[Trajectory]:
    """`run_episodes` with every episode advancing on its own: as soon as its turn's tokens come back,
    its tool calls run on a worker thread while the engine keeps generating for the others, its next
    turn joins the running batch, and a finished episode is verified on the verifier pool at once.
    Jobs of several domains (each with its own limits) share one batch. A job's samples depend only
    on its seed, turn and stream, so the trajectories are those of `run_episodes` on the same jobs, up
    to float rounding: the two loops batch sequences differently, and a GEMM's rounding can depend on
    its batch size (tested equal where the batches stay small; `assay bench agent` reports how many
    trajectories agree on a real policy).
    timings["generate_s"] is the time from a turn's submission to its last token. Where a job's calls may
    wait for a person (approvals), every episode gets a tool thread, so that one waiting for a decision
    holds up no other."""
    if any(job.approvals is not None and job.approvals.waits for job in jobs):
        tool_workers = max(tool_workers, len(jobs))
    runs: list[_Run] = []
    try:
        for job in jobs:
            runs.append(_start(job, tokenizer))
        return _run_online(engine, runs, tokenizer, policy_version, tool_workers, verifiers)
    finally:
        _close_all(jobs, runs)


def _run_online(engine: OnlineBackend, runs: list[_Run], tokenizer: PreTrainedTokenizerBase, policy_version: int,
                tool_workers: int, verifiers: int) -> list[Trajectory]:
    out: list[Trajectory | None] = [None] * len(runs)
    in_engine: dict[int, tuple[int, float]] = {}  # request id -> (run, submitted at)
    acting: dict[Future[None], int] = {}
    verifying: dict[Future[Trajectory], int] = {}
    with ThreadPoolExecutor(tool_workers) as tools, ThreadPoolExecutor(verifiers) as verifying_pool:

        def advance(i: int) -> None:
            if runs[i].finish:
                verifying[verifying_pool.submit(_finish, runs[i], policy_version)] = i
            else:
                in_engine[engine.add_request(_request(runs[i]))] = (i, time.perf_counter())

        try:
            # First turns go in as one call, as in the lockstep loop: a GRPO group's identical prompts
            # are prefilled once and forked. Every later turn joins the batch when its episode is ready.
            first = [i for i, r in enumerate(runs) if not r.finish]
            now = time.perf_counter()
            for i, rid in zip(first, engine.add_requests([_request(runs[i]) for i in first]), strict=True):
                in_engine[rid] = (i, now)
            for i in range(len(runs)):
                if runs[i].finish:
                    advance(i)
            while in_engine or acting or verifying:
                if in_engine:
                    for rid, results in engine.step():
                        i, t0 = in_engine.pop(rid)
                        runs[i].timings["generate_s"] += time.perf_counter() - t0
                        acting[tools.submit(_take_turn, runs[i], results[0], tokenizer)] = i
                else:  # nothing to generate: wait for a tool call or a verification
                    wait([*acting, *verifying], return_when=FIRST_COMPLETED)
                for fut in [f for f in acting if f.done()]:
                    fut.result()  # _take_turn turns environment failures into statuses; anything else is a bug
                    advance(acting.pop(fut))
                for fut in [f for f in verifying if f.done()]:
                    out[verifying.pop(fut)] = fut.result()
        finally:
            for rid in in_engine:  # after a failure, nothing stays in the engine's batch
                engine.abort(rid)
    return [t for t in out if t is not None]


def _start(job: EpisodeJob, tokenizer: PreTrainedTokenizerBase) -> _Run:
    if job.max_turns < 1 or job.max_context < 1:
        raise AssayError(f"run_episodes: max_turns and max_context must be >= 1, got {job.max_turns}, "
                         f"{job.max_context}")
    if not job.params.stop_token_ids:
        job = replace(job, params=replace(job.params, stop_token_ids=stop_token_ids(tokenizer)))
    ctx = start_context(job.agent, job.task)
    ids = ctx.render(tokenizer)
    r = _Run(job, [], list(job.task.prompt), prompt_len=len(ids), ctx=ctx, peak=len(ids))
    r.append(ids, sampled=False)
    if len(ids) >= job.max_context:
        r.finish = "context"
    return r


def _request(r: _Run) -> GenRequest:
    """The episode's next turn: seeded by turn (turns must not replay one random stream), cut to the
    room left in its context."""
    p = r.job.params
    seed = None if p.seed is None else p.seed + r.turns
    return GenRequest(r.ids[r.seg:], replace(p, max_tokens=min(p.max_tokens, r.job.max_context - r.context_len),
                                             seed=seed), stream=r.job.stream)


def _take_turn(r: _Run, res: GenResult, tokenizer: PreTrainedTokenizerBase) -> None:
    job = r.job
    room_limited = job.max_context - r.context_len < job.params.max_tokens
    r.turns += 1
    r.versions.append(res.policy_version)
    if len(res.logprobs) != len(res.token_ids):
        raise AssayError("run_episodes: the backend returned logprobs and token ids of different lengths")
    r.append(res.token_ids, sampled=True, logprobs=res.logprobs)
    r.peak = max(r.peak, r.context_len)
    stopped = res.finish_reason == "stop" and bool(res.token_ids) and res.token_ids[-1] in job.params.stop_token_ids
    text = tokenizer.decode(res.token_ids[:-1] if stopped else res.token_ids, skip_special_tokens=False)
    fmt = chat_format(tokenizer)
    reasoning, rest = split_reasoning(text, fmt.think_tags)  # calls and the answer come from after </think>
    content, calls, err, repaired = parse_repairing(rest, fmt.tool_calls, job.repair_tool_calls)
    ctx = r.ctx
    assert ctx is not None
    routed = [False] * len(calls)
    if ctx.kind == "act" and job.agent.fallback_tools:  # recorded as routed, as a repair is recorded repaired
        calls, routed = route_fallbacks(calls, ctx.tools, job.agent.fallback_tools)
    r.messages.append(Message("assistant", content, calls, reasoning=reasoning))
    if not stopped:  # cut at max_tokens: an unfinished turn is not acted on
        r.finish = "context" if room_limited else "length"
        return
    if ctx.kind == "plan":
        _plan_turn(r, calls, err, tokenizer)
        return
    retried, r.streak = r.streak, 0
    if not calls and err is None:
        r.retry_successes += int(retried > 0)  # a well-formed answer after a retry prompt
        r.finish = "stop"
        return

    # Validated before anything runs, so that a turn to be retried runs none of its calls. The episode
    # validates again in step_episode (the one place every caller goes through); the same schema check.
    invalid = [validate_call(c, ctx.tools) for c in calls]
    problems = [err] if err is not None else [p for p in invalid if p is not None]
    r.call_turns += 1
    r.malformed += int(bool(problems))
    r.retry_successes += int(retried > 0 and not problems)
    observations: list[tuple[str | None, Observation]] = []
    if problems and retried < job.tool_retries:
        # Retry: the validator's messages and an instruction, as one tool result; the turn is free.
        r.free_turns += 1
        r.streak = retried + 1
        message = "error: " + "; ".join(problems) + "\n" + RETRY_PROMPT
        observations.append((None, Observation(message, is_error=True)))
    else:
        if err is not None:
            observations.append((None, Observation(f"error: {err}", is_error=True)))
        t0 = time.perf_counter()
        gate = job.approvals.gate(job.task, job.stream, r.approvals) if job.approvals is not None else None
        stepped = step_calls(job.episode, calls, job.task.tools, ctx.notes, gate)
        r.timings["tool_s"] += time.perf_counter() - t0
        r.error = r.error or stepped.error
        # degraded: a repaired or fallback-routed call that passed its schema and was acted on (stepping may
        # stop early)
        acted = [bad is None for bad, _ in zip(invalid, stepped.observations, strict=False)]
        r.degraded += sum(ok and (fix or moved) for ok, fix, moved in zip(acted, repaired, routed, strict=False))
        r.fallbacks += sum(ok and moved for ok, moved in zip(acted, routed, strict=False))
        observations += [(call.name, obs) for call, obs in zip(calls, stepped.observations, strict=False)]
    for name, obs in observations:
        r.tool_errors += int(obs.is_error)
        r.messages.append(Message("tool", obs.content, name=name, is_error=obs.is_error))

    last = observations[-1][1]
    if last.status != OK:
        r.status, r.finish = last.status, "error"
        return
    if last.done:
        r.finish = "stop"
        return
    if r.turns - r.free_turns >= job.max_turns:
        r.finish = "max_turns"
        return
    if job.time_limit_s is not None and time.perf_counter() - r.started > job.time_limit_s:
        r.finish = "time_limit"
        return
    outputs = [o.content for _, o in observations]
    obs_ids = observation_ids(tokenizer, outputs)
    ctx.turns.append(TurnBlock(tuple(res.token_ids), tuple(name or "" for name, _ in observations), tuple(outputs),
                               tuple(obs_ids), subtask=ctx.plan.current))
    ctx.advance_kind()
    if _next_context(r, tokenizer, obs_ids):
        r.retries += int(r.streak > 0)  # the retry prompt was shown: the policy will answer it


def _plan_turn(r: _Run, calls: list[ToolCall], err: str | None, tokenizer: PreTrainedTokenizerBase) -> None:
    """A plan_execute planning turn: its plan call updates the plan kept outside the context (agent/modes.py);
    the turn does not count against max_turns, and an acting turn always follows it."""
    assert r.ctx is not None
    r.plan_turns += 1
    r.free_turns += 1
    obs = r.ctx.plan.apply(calls, err)
    r.tool_errors += int(obs.is_error)
    r.messages.append(Message("tool", obs.content, name="plan", is_error=obs.is_error))
    if r.job.time_limit_s is not None and time.perf_counter() - r.started > r.job.time_limit_s:
        r.finish = "time_limit"
        return
    r.ctx.advance_kind()
    _next_context(r, tokenizer, [])


def _next_context(r: _Run, tokenizer: PreTrainedTokenizerBase, appended: list[int]) -> bool:
    """Prompt the next turn: the current context plus `appended`, or a re-rendered one (compacted, or
    plan_execute's next kind of turn) as a new segment; False (finish "context") when no token would fit."""
    assert r.ctx is not None
    compactions = r.ctx.compactions
    nxt = r.ctx.next_prompt(tokenizer, r.context_len, appended, r.job.max_context, r.job.params.max_tokens)
    if nxt is None:  # no room left to sample even one token after it
        r.finish = "context"
        return False
    if r.ctx.compactions > compactions:
        r.compacted_turns.append(r.turns + 1)  # where a reader of the messages sees the context shrink
    ids, fresh = nxt
    if fresh:
        r.new_segment(ids)
    else:
        r.append(ids, sampled=False)
    return True


def _verify(r: _Run) -> Reward:
    """`episode.verify` within the job's verify_timeout_s, else TimeoutError. A thread cannot be
    killed, so a verifier past its time is left to finish on its own and closes the episode when it
    does: closing it under the verifier could return a sandbox still in use to the pool."""
    timeout = r.job.verify_timeout_s
    if r.job.verifier is not None:  # a process or actor of its own, killed at the timeout
        return r.job.verifier.verify(r.job.task, r.messages, timeout)
    if timeout is None:
        return r.job.episode.verify(r.messages)
    box: dict[str, object] = {}
    lock = threading.Lock()

    def call() -> None:
        try:
            box["reward"] = r.job.episode.verify(r.messages)
        except BaseException as e:  # handed to the caller, or dropped with the abandoned episode
            box["error"] = e
        with lock:
            box["done"] = True
            late = "abandoned" in box
        if late:
            close_episode(r.job.episode)

    worker = threading.Thread(target=call, name="assay-verify", daemon=True)
    worker.start()
    worker.join(timeout)
    with lock:
        if "done" not in box:
            box["abandoned"] = r.closed = True  # the verifier's thread closes it
            raise TimeoutError(f"episode.verify took longer than {timeout:g} s (the domain's verify_timeout_s); "
                               "a verifier that hangs is an infrastructure failure, not a wrong answer")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["reward"]  # type: ignore[return-value]


def _close(r: _Run) -> None:
    if not r.closed:
        r.closed = True
        close_episode(r.job.episode)


def _close_all(jobs: Sequence[EpisodeJob], runs: list[_Run]) -> None:
    """Every episode is closed once, whatever stopped the loop: a failed backend call or tool step
    must not leave an episode's sandbox open. Jobs that never became runs are closed too."""
    open_runs = [r for r in runs if not r.closed]
    for r in open_runs:
        r.closed = True
    close_episodes([r.job.episode for r in open_runs] + [job.episode for job in jobs[len(runs):]])


def _finish(r: _Run, policy_version: int) -> Trajectory:
    reward, passed, info = 0.0, False, {}
    if r.status == OK:
        t0 = time.perf_counter()
        try:
            rw = _verify(r)
            reward, passed, info = rw.score, rw.passed, dict(rw.details)
            if rw.status != OK:
                r.status, reward, passed = rw.status, 0.0, False
        except TimeoutError as e:
            r.status, r.error = VERIFIER_ERROR, str(e)
        except Exception as e:
            r.status, r.error = VERIFIER_ERROR, f"episode.verify raised {type(e).__name__}: {e}"
        r.timings["verify_s"] = time.perf_counter() - t0
    _close(r)
    if r.error:
        info["error"] = r.error
    return Trajectory(
        task=r.job.task,
        messages=r.messages,
        token_ids=r.ids,
        loss_mask=r.mask,
        logprobs=r.logprobs,
        prompt_len=r.prompt_len,
        policy_version=min(r.versions) if r.versions else policy_version,
        turns=r.turns,
        tool_errors=r.tool_errors,
        call_turns=r.call_turns,
        malformed_calls=r.malformed,
        retries=r.retries,
        retry_successes=r.retry_successes,
        degraded_calls=r.degraded,
        fallback_calls=r.fallbacks,
        segment_starts=r.segment_starts,
        peak_context=r.peak,
        compactions=r.ctx.compactions if r.ctx is not None else 0,
        compacted_turns=r.compacted_turns,
        memory_calls=r.ctx.notes.calls if r.ctx is not None and r.ctx.notes is not None else 0,
        memory_errors=r.ctx.notes.errors if r.ctx is not None and r.ctx.notes is not None else 0,
        plan_turns=r.plan_turns,
        approved_calls=r.approvals.approved,
        denied_calls=r.approvals.denied,
        refused_calls=r.approvals.refused,
        finish_reason=r.finish,
        reward=reward,
        passed=passed,
        reward_info=info,
        status=r.status,
        env_hash=r.job.task.env_hash,
        timings=r.timings,
    )
