"""Group-relative advantages (GRPO, Dr. GRPO, RLOO), per-domain scaling, and dynamic-sampling filtering.

Trajectories whose status is not ok (an infrastructure failure) carry no reward signal: they get
advantage None, are left out of their group's baseline, and are never trained on."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Literal

from assay.core.errors import AssayError
from assay.core.types import OK, Trajectory

AdvantageKind = Literal["grpo", "dr_grpo", "rloo"]
STD_EPS = 1e-6


def _std(xs: Sequence[float]) -> float:
    """Population standard deviation (divide by n): a group of 2 with rewards 0 and 1 has std 0.5."""
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def _groups(trajs: Sequence[Trajectory]) -> dict[str, list[int]]:
    """Indices of the ok trajectories of each group, in input order."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(trajs):
        if not t.group_id:
            raise AssayError(
                f"trajectory {i} (task {t.task.task_id!r}) has no group_id; group-relative advantages need "
                "the samples of one task to share a group_id"
            )
        if t.status == OK:
            groups[t.group_id].append(i)
    return groups


def group_advantages(
    trajs: Sequence[Trajectory],
    kind: AdvantageKind = "grpo",
    std_normalize: bool = False,
    per_domain_normalize: bool = False,
) -> list[float | None]:
    """One advantage per trajectory (None where status != ok), aligned with `trajs`.

    grpo:    r - mean(group), divided by (std(group) + 1e-6) when std_normalize.
    dr_grpo: r - mean(group), never divided (std_normalize is ignored: that is the point of Dr. GRPO).
    rloo:    r - mean(other members of the group); a group of one gets 0.
    per_domain_normalize: afterwards each domain's advantages are divided by their std (when > 0),
    so a domain with rewards in [0, 10] does not drown one with rewards in [0, 1]."""
    if kind not in ("grpo", "dr_grpo", "rloo"):
        raise AssayError(f"unknown advantage kind {kind!r}; use grpo, dr_grpo or rloo")
    adv: list[float | None] = [None] * len(trajs)
    for idx in _groups(trajs).values():
        rewards = [trajs[i].reward for i in idx]
        n, total = len(rewards), sum(rewards)
        mean = total / n
        if max(rewards) == min(rewards):
            values = [0.0] * n  # exactly 0: rounding in the mean must not leave noise that Adam would amplify
        elif kind == "rloo":
            values = [r - (total - r) / (n - 1) if n > 1 else 0.0 for r in rewards]
        elif kind == "grpo" and std_normalize:
            std = _std(rewards)
            values = [(r - mean) / (std + STD_EPS) for r in rewards]
        else:
            values = [r - mean for r in rewards]
        for i, v in zip(idx, values, strict=True):
            adv[i] = v
    if per_domain_normalize:
        by_domain: dict[str, list[int]] = defaultdict(list)
        for i, a in enumerate(adv):
            if a is not None:
                by_domain[trajs[i].task.domain].append(i)
        for idx in by_domain.values():
            std = _std([adv[i] for i in idx])  # type: ignore[misc]
            if std > 0:
                for i in idx:
                    adv[i] = adv[i] / std  # type: ignore[operator]
    return adv


def has_signal(rewards: Sequence[float]) -> bool:
    """Whether a GRPO group's rewards vary: the only groups with a non-zero advantage (and gradient)."""
    return len(rewards) >= 2 and max(rewards) != min(rewards)


def filter_zero_variance(trajs: Sequence[Trajectory]) -> tuple[list[Trajectory], int]:
    """Dynamic sampling (DAPO): drop every group whose ok members all have the same reward (or that
    has fewer than two ok members), since its advantages are all zero. Returns (kept, groups dropped);
    kept trajectories keep their input order, and a kept group keeps its failed members (the trainer
    skips them) so they stay visible to logging."""
    keep: set[str] = set()
    for gid, idx in _groups(trajs).items():
        if has_signal([trajs[i].reward for i in idx]):
            keep.add(gid)
    all_groups = {t.group_id for t in trajs}
    kept = [t for t in trajs if t.group_id in keep]
    return kept, len(all_groups - keep)


def paying_domains(trajs: Sequence[Trajectory], kept: Sequence[Trajectory], min_yield: float) -> set[str] | None:
    """The domains where at least `min_yield` of the groups in `trajs` were kept (had reward variance):
    at the rate the step has seen so far, a refill drawn there costs at most 1 / min_yield draws a kept
    group. None when min_yield is 0 (every domain, the mixer's ratios alone decide)."""
    if min_yield <= 0:
        return None
    drawn: dict[str, set[str]] = {}
    for t in trajs:
        drawn.setdefault(t.task.domain, set()).add(t.group_id)
    good = {t.group_id for t in kept}
    return {d for d, groups in drawn.items() if len(groups & good) >= min_yield * len(groups)}
