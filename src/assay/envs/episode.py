"""Acting on an episode, the one way every caller does it: the agent loops, the endpoint evaluator
and the QA gate's player start episodes (with a pooled sandbox where the environment declares one),
step tool calls and close episodes through these functions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from assay.core.types import OK, ROLLOUT_ERROR, Observation, Task, ToolCall, ToolSpec
from assay.envs.base import ClosingEpisode, Environment, Episode, hooks
from assay.envs.tools import validate_call
from assay.sandbox import isolation_problem
from assay.sandbox.pool import LeasedSandbox, shared_pool


@dataclass
class Stepped:
    observations: list[Observation]  # one per call acted on, in order
    error: str = ""  # what the environment raised, for the record (the policy is not shown it)


def step_episode(episode: Episode, calls: Sequence[ToolCall], tools: Sequence[ToolSpec]) -> Stepped:
    """An assistant turn's tool calls, in order: each validated against its schema (a bad call is an
    error observation the policy sees, not a step), then stepped; an exception from the environment
    is an infrastructure failure. Stops after a call whose observation ends the episode or failed."""
    out = Stepped([])
    for call in calls:
        bad = validate_call(call, tools)
        if bad is not None:
            obs = Observation(f"error: {bad}", is_error=True)
        else:
            try:
                obs = episode.step(call)
            except Exception as e:  # an environment bug must not take the whole batch down
                obs = Observation("", status=ROLLOUT_ERROR)
                out.error = f"episode.step raised {type(e).__name__}: {e}"
        out.observations.append(obs)
        if obs.status != OK or obs.done:
            break
    return out


@dataclass
class _Leased:
    """An episode with the pooled sandbox the framework gave it: closing it gives the sandbox back."""

    episode: Episode
    sandbox: Any

    def __getattr__(self, name: str) -> Any:  # step, verify, tool_errors, ...: the episode's own
        return getattr(self.episode, name)

    def close(self) -> None:
        try:
            close_episode(self.episode)
        finally:
            self.sandbox.close()


def start_episode(env: Environment, task: Task) -> Episode:
    """`env.start(task, sandbox)`: with a warm sandbox from this process's pool where the environment
    declares `sandbox_limits` and the host can isolate, else with None (the environment opens its own)."""
    limits = hooks(env).sandbox_limits
    if limits is None or isolation_problem() is not None:
        return env.start(task, None)
    sandbox = LeasedSandbox(shared_pool(limits))
    try:
        return _Leased(env.start(task, sandbox), sandbox)
    except BaseException:
        sandbox.close()
        raise


def close_episode(episode: object) -> None:
    """Release what an episode holds (a sandbox), on every path: after verification or a failure."""
    if isinstance(episode, ClosingEpisode):
        episode.close()


def close_episodes(episodes: Sequence[object]) -> None:
    """Close every one, even when one's close raises (the first such error is raised after all)."""
    error: Exception | None = None
    for episode in episodes:
        try:
            close_episode(episode)
        except Exception as e:
            error = error or e
    if error is not None:
        raise error
