"""The multi-turn agent loop: a backend and episodes in, token-exact trajectories out.

All unfinished episodes advance together, one backend.generate call per turn. The sampled ids
are kept as sampled (never re-tokenized); tool results are appended as ids from agent.render,
the same layout SFT trains on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from transformers import PreTrainedTokenizerBase

from assay.agent.parse import parse_assistant
from assay.agent.render import observation_ids, prompt_ids
from assay.core.errors import AssayError
from assay.core.tokenizer import stop_token_ids
from assay.core.types import (
    OK,
    ROLLOUT_ERROR,
    VERIFIER_ERROR,
    FinishReason,
    Message,
    Observation,
    Status,
    Task,
    Trajectory,
)
from assay.envs.base import Episode
from assay.envs.tools import validate_call
from assay.rollout.base import GenRequest, GenResult, RolloutBackend, SamplingParams

VERIFY_WORKERS = 4  # episodes verified at once (a codegen verification is a sandboxed run)


@dataclass
class _Run:
    task: Task
    episode: Episode
    ids: list[int]
    messages: list[Message]
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_errors: int = 0
    finish: FinishReason = ""  # set when the episode stops acting
    status: Status = OK
    error: str = ""
    versions: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=lambda: {"generate_s": 0.0, "tool_s": 0.0, "verify_s": 0.0})

    def append(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


def run_episodes(
    backend: RolloutBackend,
    items: Sequence[tuple[Task, Episode]],
    tokenizer: PreTrainedTokenizerBase,
    params: SamplingParams,
    max_turns: int,
    max_context: int,
    policy_version: int = 0,
) -> list[Trajectory]:
    """Act out every (task, episode) to the end and verify it; one trajectory per item, in order.

    An episode ends on an answer (a turn without tool calls, or a tool result with done: "stop"),
    after max_turns assistant turns ("max_turns"), on a turn cut at max_tokens ("length"), or when
    the next turn or tool result would not fit in max_context tokens ("context"); each is then verified
    on its messages. An infrastructure failure (an Observation or Reward status other than ok, an
    exception from the environment) sets the trajectory's status instead of a reward.
    Trajectory.policy_version is the oldest weights version that sampled any of its tokens
    (`policy_version` when nothing was sampled). timings["generate_s"] is the wall time of the batched
    generate calls the episode took part in."""
    if max_turns < 1 or max_context < 1:
        raise AssayError(f"run_episodes: max_turns and max_context must be >= 1, got {max_turns}, {max_context}")
    stop = list(params.stop_token_ids) or stop_token_ids(tokenizer)
    runs = []
    for task, episode in items:
        ids = prompt_ids(tokenizer, task)
        run = _Run(task, episode, [], list(task.prompt))
        run.append(ids, sampled=False)
        if len(ids) >= max_context:
            run.finish = "context"
        runs.append(run)
    prompt_lens = [len(r.ids) for r in runs]

    turn = 0
    while active := [r for r in runs if not r.finish]:
        seed = None if params.seed is None else params.seed + turn  # turns must not replay one RNG stream
        reqs = [
            GenRequest(list(r.ids), replace(params, max_tokens=min(params.max_tokens, max_context - len(r.ids)),
                                            stop_token_ids=stop, seed=seed))
            for r in active
        ]
        t0 = time.perf_counter()
        results = backend.generate(reqs)
        dt = time.perf_counter() - t0
        if len(results) != len(reqs) or any(len(res) != 1 for res in results):
            raise AssayError("run_episodes: the backend must return exactly one result per request (n=1)")
        for r, req, res in zip(active, reqs, results, strict=True):
            r.timings["generate_s"] += dt
            _take_turn(r, res[0], req.params.max_tokens < params.max_tokens, tokenizer, stop, max_turns, max_context)
        turn += 1

    # Verification is independent per episode and mostly waits on sandboxes: run it concurrently.
    with ThreadPoolExecutor(max_workers=min(VERIFY_WORKERS, len(runs)) or 1) as pool:
        return list(pool.map(lambda rp: _finish(rp[0], rp[1], policy_version), zip(runs, prompt_lens, strict=True)))


def _take_turn(
    r: _Run,
    res: GenResult,
    room_limited: bool,
    tokenizer: PreTrainedTokenizerBase,
    stop: list[int],
    max_turns: int,
    max_context: int,
) -> None:
    r.turns += 1
    r.versions.append(res.policy_version)
    if len(res.logprobs) != len(res.token_ids):
        raise AssayError("run_episodes: the backend returned logprobs and token ids of different lengths")
    r.append(res.token_ids, sampled=True, logprobs=res.logprobs)
    stopped = res.finish_reason == "stop" and bool(res.token_ids) and res.token_ids[-1] in stop
    text = tokenizer.decode(res.token_ids[:-1] if stopped else res.token_ids, skip_special_tokens=False)
    content, calls, err = parse_assistant(text)
    r.messages.append(Message("assistant", content, calls))
    if not stopped:  # cut at max_tokens: an unfinished turn is not acted on
        r.finish = "context" if room_limited else "length"
        return
    if not calls and err is None:
        r.finish = "stop"
        return

    observations: list[tuple[str | None, Observation]] = []
    if err is not None:
        observations.append((None, Observation(f"error: {err}", is_error=True)))
    for call in calls:
        bad = validate_call(call, r.task.tools)
        if bad is not None:
            obs = Observation(f"error: {bad}", is_error=True)
        else:
            t0 = time.perf_counter()
            try:
                obs = r.episode.step(call)
            except Exception as e:  # an environment bug must not take the whole batch down
                obs = Observation("", status=ROLLOUT_ERROR)
                r.error = f"episode.step raised {type(e).__name__}: {e}"
            r.timings["tool_s"] += time.perf_counter() - t0
        observations.append((call.name, obs))
        if obs.status != OK or obs.done:
            break
    for name, obs in observations:
        r.tool_errors += int(obs.is_error)
        r.messages.append(Message("tool", obs.content, name=name))

    last = observations[-1][1]
    if last.status != OK:
        r.status, r.finish = last.status, "error"
        return
    if last.done:
        r.finish = "stop"
        return
    if r.turns >= max_turns:
        r.finish = "max_turns"
        return
    obs_ids = observation_ids(tokenizer, [o.content for _, o in observations])
    if len(r.ids) + len(obs_ids) >= max_context:  # no room left to sample even one token after it
        r.finish = "context"
        return
    r.append(obs_ids, sampled=False)


def _finish(r: _Run, prompt_len: int, policy_version: int) -> Trajectory:
    reward, passed, info = 0.0, False, {}
    if r.status == OK:
        t0 = time.perf_counter()
        try:
            rw = r.episode.verify(r.messages)
            reward, passed, info = rw.score, rw.passed, dict(rw.details)
            if rw.status != OK:
                r.status, reward, passed = rw.status, 0.0, False
        except Exception as e:
            r.status, r.error = VERIFIER_ERROR, f"episode.verify raised {type(e).__name__}: {e}"
        r.timings["verify_s"] = time.perf_counter() - t0
    if r.error:
        info["error"] = r.error
    return Trajectory(
        task=r.task,
        messages=r.messages,
        token_ids=r.ids,
        loss_mask=r.mask,
        logprobs=r.logprobs,
        prompt_len=prompt_len,
        policy_version=min(r.versions) if r.versions else policy_version,
        turns=r.turns,
        tool_errors=r.tool_errors,
        finish_reason=r.finish,
        reward=reward,
        passed=passed,
        reward_info=info,
        status=r.status,
        env_hash=r.task.env_hash,
        timings=r.timings,
    )
