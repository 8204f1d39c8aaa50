"""Reward shaping without forking an environment: a domain's training reward as a weighted sum of
terms. `verifier` is the environment's own score; `format` and `length` are built in; any other
name is a user function `package.module:function` taking (trajectory, domain config) and returning a
float. Each term's value is kept in `reward_info["terms"]` and logged per domain. `passed` stays the
verifier's verdict, so pass rates, curricula and evaluation never see the shaping."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

from assay.core.config import DomainConfig
from assay.core.errors import ConfigError
from assay.core.types import OK, Trajectory

RewardFn = Callable[[Trajectory, DomainConfig], float]


def _verifier(t: Trajectory, dom: DomainConfig) -> float:
    return t.reward  # shaping runs once, on the verifier's score


def _format(t: Trajectory, dom: DomainConfig) -> float:
    """1 when the episode ended on an answer of its own (not cut by length, context, turns or time)
    and every tool call it made was well-formed and valid."""
    return float(t.finish_reason == "stop" and t.tool_errors == 0)


def _length(t: Trajectory, dom: DomainConfig) -> float:
    """Minus the share of the episode's token budget its completions used (0 for an empty answer,
    -1 for one that used every turn's max_new_tokens)."""
    return -sum(t.loss_mask) / (dom.max_new_tokens * dom.max_turns)


BUILTIN: dict[str, RewardFn] = {"verifier": _verifier, "format": _format, "length": _length}


def resolve(spec: str) -> RewardFn:
    """A built-in term by name, or `package.module:function`."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    module, _, name = spec.partition(":")
    if not name:
        raise ConfigError(f"reward term {spec!r}: not one of {sorted(BUILTIN)} and not package.module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"reward term {spec!r} could not be imported ({e}); check the module path and name") from e
    if not callable(fn):
        raise ConfigError(f"reward term {spec!r} is not callable")
    return fn


def check_rewards(domains: Sequence[DomainConfig]) -> None:
    """Resolve every configured term now, so a typo fails before any sampling."""
    for dom in domains:
        for term in dom.rewards:
            resolve(term.fn)


def shape_rewards(trajs: Sequence[Trajectory], domains: dict[str, DomainConfig]) -> None:
    """Replace each ok trajectory's reward by its domain's weighted sum of terms (in place), plus
    `milestone_reward` per milestone it is credited with (`envs.milestones`) where that is on; domains
    with neither keep the verifier's score untouched."""
    fns = {name: [(term, resolve(term.fn)) for term in dom.rewards] for name, dom in domains.items()}
    for t in trajs:
        dom = domains[t.task.domain]
        if not (dom.rewards or dom.milestone_reward) or t.status != OK:
            continue
        terms = {term.fn: float(fn(t, dom)) for term, fn in fns[t.task.domain]}
        shaped = sum(term.weight * terms[term.fn] for term in dom.rewards) if dom.rewards else t.reward
        if dom.milestone_reward:
            terms["milestones"] = float(t.reward_info.get("milestone_credit", 0))
            shaped += dom.milestone_reward * terms["milestones"]
        t.reward_info["terms"] = {"verifier": t.reward, **terms}
        t.reward = shaped
