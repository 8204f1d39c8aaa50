"""Acting on an episode, the one way every caller does it: the agent loops, the endpoint evaluator
and the QA gate's player all step tool calls and close episodes through these two functions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from assay.core.types import OK, ROLLOUT_ERROR, Observation, ToolCall, ToolSpec
from assay.envs.base import Episode
from assay.envs.tools import validate_call


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


def close_episode(episode: object) -> None:
    """Release what an episode holds (a sandbox), on every path: after verification or a failure."""
    close = getattr(episode, "close", None)
    if callable(close):
        close()


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
