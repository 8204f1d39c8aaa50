"""pass@k and pass^k with unbiased estimators, bootstrap confidence intervals over tasks (tasks are
the clusters: samples of one task are not independent), and paired comparisons by task."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import comb

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k samples passes) from c passes among n samples:
    1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(all of k samples pass) (pass^k, reliability) from c passes among n:
    C(c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return comb(c, k) / comb(n, k)


@dataclass
class Estimate:
    value: float
    low: float  # bootstrap interval (95% unless bootstrap_mean was asked for another level)
    high: float
    se: float = 0.0  # task-clustered standard error: the spread of per-task values over sqrt(tasks)

    def __str__(self) -> str:
        return f"{self.value:.3f} [{self.low:.3f}, {self.high:.3f}]"


def bootstrap_mean(per_task: np.ndarray, rounds: int = 2000, seed: int = 0, level: float = 0.95) -> Estimate:
    """The mean of per-task values with a `level` (two-sided, equal tails) interval that resamples tasks, and
    its standard error."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(per_task), size=(rounds, len(per_task)))
    means = per_task[idx].mean(axis=1)
    tail = 50 * (1 - level)
    low, high = np.percentile(means, [tail, 100 - tail])
    se = float(per_task.std(ddof=1) / np.sqrt(len(per_task))) if len(per_task) > 1 else 0.0
    return Estimate(float(per_task.mean()), float(low), float(high), se)


def pass_at_k_ci(passes: Sequence[Sequence[bool]], k: int, rounds: int = 2000, seed: int = 0) -> Estimate:
    """passes[i] holds the n sample results of task i; the interval resamples tasks."""
    per_task = np.array([pass_at_k(len(p), sum(p), k) for p in passes], dtype=float)
    return bootstrap_mean(per_task, rounds, seed)


def pass_hat_k_ci(passes: Sequence[Sequence[bool]], k: int, rounds: int = 2000, seed: int = 0) -> Estimate:
    per_task = np.array([pass_hat_k(len(p), sum(p), k) for p in passes], dtype=float)
    return bootstrap_mean(per_task, rounds, seed)


def minimum_detectable_effect(diff_se: float) -> float:
    """The smallest true difference a paired test at 5% (two-sided) detects with 80% power:
    (1.96 + 0.84) standard errors of the difference."""
    return 2.8 * diff_se


def paired_difference_ci(before: Sequence[Sequence[bool]], after: Sequence[Sequence[bool]], k: int = 1,
                         rounds: int = 2000, seed: int = 0) -> Estimate:
    """after − before on the same tasks, resampling tasks jointly so task difficulty cancels."""
    if len(before) != len(after):
        raise ValueError("paired comparison needs the same tasks before and after")
    diff = np.array([pass_at_k(len(a), sum(a), k) - pass_at_k(len(b), sum(b), k) for b, a in zip(before, after, strict=True)])
    return bootstrap_mean(diff, rounds, seed)
