"""Per-domain statistics of one training step, learning progress, and the seesaw alarm."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from assay.core.types import OK, Trajectory
from assay.train.advantages import has_signal

TRUNCATED = ("length", "context")  # finish reasons that mean the model was cut off


@dataclass
class DomainStep:
    """One domain's numbers for one mixer update. Rates are over trajectories with status ok;
    they are None when the domain had no such trajectory this step."""

    n: int  # trajectories received, infrastructure failures included
    infra_errors: int  # status != ok: excluded from every rate and from the curriculum
    reward_mean: float | None
    pass_rate: float | None
    completion_len: float | None  # mean sum(loss_mask)
    truncation_rate: float | None
    tool_errors: float | None  # per trajectory
    difficulty: int  # the curriculum level after this update
    ratio: float  # the sampling share after this update
    signal_share: float | None = None  # share of GRPO groups whose rewards vary (the others teach nothing)
    # tool-call reliability: malformed share of the turns that called a tool, share of retry prompts answered
    # well-formed, degraded calls (repaired or fallback-routed) and fallback-routed ones per trajectory (None
    # where nothing called a tool, or nothing was retried)
    malformed_rate: float | None = None
    retry_success_rate: float | None = None
    degraded_calls: float | None = None
    fallback_calls: float | None = None
    # context handling (domain key agent): per trajectory, the largest context a turn saw, compactions, memory calls
    peak_context: float | None = None
    compactions: float | None = None
    memory_calls: float | None = None
    reward_terms: dict[str, float] = field(default_factory=dict)  # mean of each shaped reward term
    milestones: dict[str, float] = field(default_factory=dict)  # hit rate of each milestone (staged verification)


@dataclass
class DomainStats:
    step: int  # mixer updates so far, this one included
    domains: dict[str, DomainStep]
    warnings: list[str] = field(default_factory=list)

    def metrics(self, prefix: str = "domain") -> dict[str, float]:
        """Flat `domain/<name>/<field>` metrics; fields that are None this step are left out."""
        out: dict[str, float] = {}
        for name, step in self.domains.items():
            for key, value in asdict(step).items():
                if isinstance(value, dict):
                    tag = "milestone" if key == "milestones" else "term"
                    out |= {f"{prefix}/{name}/{tag}_{term}": float(v) for term, v in value.items()}
                elif value is not None:
                    out[f"{prefix}/{name}/{key}"] = float(value)
        return out


def summarize(trajs: Sequence[Trajectory], difficulty: int, ratio: float) -> DomainStep:
    ok = [t for t in trajs if t.status == OK]
    k = len(ok)

    def mean(values: list[float]) -> float | None:
        return sum(values) / k if k else None

    return DomainStep(
        n=len(trajs),
        infra_errors=len(trajs) - k,
        reward_mean=mean([t.reward for t in ok]),
        pass_rate=mean([float(t.passed) for t in ok]),
        completion_len=mean([float(sum(t.loss_mask)) for t in ok]),
        truncation_rate=mean([float(t.finish_reason in TRUNCATED) for t in ok]),
        tool_errors=mean([float(t.tool_errors) for t in ok]),
        difficulty=difficulty,
        ratio=ratio,
        signal_share=_signal_share(ok),
        malformed_rate=ratio_of(ok, "malformed_calls", "call_turns"),
        retry_success_rate=ratio_of(ok, "retry_successes", "retries"),
        degraded_calls=mean_of(ok, "degraded_calls"),
        fallback_calls=mean_of(ok, "fallback_calls"),
        peak_context=mean_of(ok, "peak_context"),
        compactions=mean_of(ok, "compactions"),
        memory_calls=mean_of(ok, "memory_calls"),
        reward_terms=_term_means(ok),
        milestones=hit_rates(ok),
    )


def mean_of(trajs: Sequence[Trajectory], count: str) -> float | None:
    """One count per trajectory, averaged (None for no trajectories): the per-episode numbers the step logs and
    the evaluation reports."""
    return sum(getattr(t, count) for t in trajs) / len(trajs) if trajs else None


def ratio_of(trajs: Sequence[Trajectory], part: str, whole: str) -> float | None:
    """Sum of one count over the sum of another (None when that is 0): a rate pooled over trajectories."""
    total = sum(getattr(t, whole) for t in trajs)
    return sum(getattr(t, part) for t in trajs) / total if total else None


def _term_means(ok: Sequence[Trajectory]) -> dict[str, float]:
    terms: dict[str, list[float]] = {}
    for t in ok:
        for name, v in t.reward_info.get("terms", {}).items():
            terms.setdefault(name, []).append(v)
    return {name: sum(v) / len(v) for name, v in terms.items()}


def hit_rates(ok: Sequence[Trajectory]) -> dict[str, float]:
    """Each milestone's share of the trajectories whose environment declares it."""
    hits: dict[str, list[bool]] = {}
    for t in ok:
        for name, hit in t.milestones.items():
            hits.setdefault(name, []).append(hit)
    return {name: sum(h) / len(h) for name, h in hits.items()}


def _signal_share(ok: Sequence[Trajectory]) -> float | None:
    groups: dict[str, list[float]] = {}
    for t in ok:
        groups.setdefault(t.group_id, []).append(t.reward)
    return sum(has_signal(r) for r in groups.values()) / len(groups) if groups else None


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def progress(rates: Sequence[float], window: int) -> float:
    """Signed pass-rate change: mean of the last `window` updates minus the mean of the `window`
    before them. With fewer than 2·window points the available ones are split in halves; < 2: 0."""
    h = list(rates[-2 * window :])
    if len(h) < 2:
        return 0.0
    half = len(h) // 2
    return _mean(h[half:]) - _mean(h[:half])


def seesaw_warnings(history: Mapping[str, Sequence[tuple[float, int]]], window: int, margin: float) -> list[str]:
    """Warn when one domain's pass rate fell by more than `margin` over the progress window while
    another's rose by more than `margin`.

    `history` maps a domain to its (pass_rate, level) per update. Only spans of 2·window updates at
    one unchanged difficulty level count: a drop right after a promotion is the curriculum working,
    not a seesaw."""
    delta: dict[str, float] = {}
    for name, entries in history.items():
        span = list(entries[-2 * window :])
        if len(span) < 2 * window or len({level for _, level in span}) != 1:
            continue
        delta[name] = progress([rate for rate, _ in span], window)
    fell = sorted(n for n, d in delta.items() if d < -margin)
    rose = sorted(n for n, d in delta.items() if d > margin)
    return [
        f"seesaw: {a} pass rate fell by {-delta[a]:.2f} while {b} rose by {delta[b]:.2f} over the last {window} updates"
        for a in fell
        for b in rose
    ]
