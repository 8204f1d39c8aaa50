"""Per-domain difficulty curriculum: promote on a clean rolling pass rate, back off on regression."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from assay.core.config import DomainConfig
from assay.core.errors import AssayError, CheckpointError


@dataclass
class Curriculum:
    """The difficulty level of one domain and the pass results seen at that level.

    The window holds the last `window_size` results at the current level only: a level change
    clears it, so a decision is never based on results from another difficulty."""

    min_level: int
    max_level: int
    level: int
    window_size: int
    acceptance: float  # window pass rate >= this promotes one level
    regression: float  # window pass rate < this demotes one level
    window: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.min_level <= self.level <= self.max_level:
            raise AssayError(
                f"curriculum: level {self.level} outside [{self.min_level}, {self.max_level}]; "
                "fix the domain's difficulty.start/min/max"
            )
        if self.window_size <= 0:
            raise AssayError(f"curriculum: window size must be positive, got {self.window_size}")
        if self.regression >= self.acceptance:
            raise AssayError(
                f"curriculum: regression ({self.regression}) must be below acceptance ({self.acceptance}), "
                "otherwise a level would promote and demote on the same pass rate"
            )

    @classmethod
    def from_config(cls, domain: DomainConfig) -> Curriculum:
        d = domain.difficulty
        return cls(d.min, d.max, d.start, d.window, d.acceptance, d.regression)

    @property
    def pass_rate(self) -> float | None:
        return sum(self.window) / len(self.window) if self.window else None

    @property
    def full(self) -> bool:
        return len(self.window) >= self.window_size

    def saturated(self, rate: float | None) -> bool:
        """At the top level and passing at `rate` >= the acceptance bar: nothing left to learn here.
        The rate is the caller's (the mixer's is over its recent updates)."""
        return rate is not None and self.level == self.max_level and rate >= self.acceptance

    def record(self, passed: bool) -> int:
        """Add one pass result at the current level; returns the level change (-1, 0 or +1)."""
        self.window.append(bool(passed))
        if len(self.window) > self.window_size:
            del self.window[0]
        if not self.full:
            return 0
        rate = sum(self.window) / len(self.window)
        change = 0
        if rate >= self.acceptance and self.level < self.max_level:
            change = 1
        elif rate < self.regression and self.level > self.min_level:
            change = -1
        if change:
            self.level += change
            self.window = []
        return change

    def state_dict(self) -> dict[str, Any]:
        return {"level": self.level, "window": list(self.window)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        level, window = int(d["level"]), [bool(x) for x in d["window"]]
        if not self.min_level <= level <= self.max_level:
            raise CheckpointError(
                f"curriculum state: level {level} outside the configured [{self.min_level}, {self.max_level}]; "
                "resume with the difficulty range the run was started with"
            )
        self.level, self.window = level, window[-self.window_size :]
