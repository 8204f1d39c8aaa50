"""Environment regression monitoring during training.

Every step, the pass rates training saw are appended per environment version and difficulty to the
QA store (`<store>/NAME@VERSION/training.jsonl`, beside the gate's records; `assay env show` sums
them up). With `eval.every`, the policy is evaluated on the evaluation partition every that many
steps, and a domain whose training pass rate climbs while its held-out pass rate does not is
flagged: the signature of a loophole being learned rather than the task."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from assay.core.types import OK, Trajectory

TRAINING_LOG = "training.jsonl"


def log_training(store: Path, run: str, step: int, trajs: Sequence[Trajectory], domain_env: dict[str, str]) -> None:
    """Append one line per environment version: passed and tried per difficulty, with the env's hash."""
    per: dict[str, dict[str, Any]] = {}
    for t in trajs:
        if t.status != OK:
            continue
        spec = domain_env.get(t.task.domain, t.task.env)
        entry = per.setdefault(spec, {"run": run, "step": step, "hash": t.env_hash, "levels": {}})
        level = entry["levels"].setdefault(str(t.task.difficulty), [0, 0])
        level[0] += int(t.passed)
        level[1] += 1
    for spec, entry in per.items():
        path = store / spec / TRAINING_LOG
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:  # a line at a time: a crash loses at most the line being written
            f.write(json.dumps(entry) + "\n")


def training_summary(store: Path, spec: str) -> dict[str, dict[str, Any]]:
    """Per hash: runs, steps and the pass rate by level over everything logged for `spec`."""
    path = store / spec / TRAINING_LOG
    out: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:  # a line torn by a crash
            continue
        s = out.setdefault(e["hash"], {"runs": set(), "steps": 0, "levels": defaultdict(lambda: [0, 0])})
        s["runs"].add(e["run"])
        s["steps"] += 1
        for level, (passed, tried) in e["levels"].items():
            s["levels"][level][0] += passed
            s["levels"][level][1] += tried
    return out


@dataclass
class LoopholeWatch:
    """Compares, between consecutive held-out evaluations, each domain's change in training pass rate
    with its change in held-out pass@1. A warning needs the training rise above `margin`, no held-out rise
    beyond its standard error, and the gap between the two changes beyond twice its own standard error
    (both held-out estimates' and both training windows'): a small watch set's noise alone never warns."""

    margin: float  # a training rise above this, with no held-out rise, is flagged
    train: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # per step since last eval
    # domain -> (train rate, its s.e., held-out pass@1, its s.e.) at the last evaluation
    last: dict[str, tuple[float, float, float, float]] = field(default_factory=dict)

    def observe(self, pass_rates: dict[str, float | None]) -> None:
        for name, rate in pass_rates.items():
            if rate is not None:
                self.train[name].append(rate)

    def evaluated(self, held_out: dict[str, tuple[float, float]]) -> list[str]:
        """held_out: domain -> (pass@1, its standard error). Returns the warnings."""
        warnings = []
        for name, (value, se) in held_out.items():
            recent = self.train.get(name) or []
            if not recent:
                continue
            train_rate = sum(recent) / len(recent)
            train_se = statistics.stdev(recent) / math.sqrt(len(recent)) if len(recent) > 1 else 0.0
            if name in self.last:
                train_before, train_se_before, held_before, se_before = self.last[name]
                rise, moved = train_rate - train_before, value - held_before
                gap_se = math.sqrt(se**2 + se_before**2 + train_se**2 + train_se_before**2)
                if rise > self.margin and moved <= se and rise - moved > 2 * gap_se:
                    warnings.append(f"{name}: training pass rate rose by {rise:.2f} while held-out pass@1 moved by "
                                    f"{moved:+.2f} (s.e. {se:.2f}; the gap {rise - moved:.2f}, s.e. {gap_se:.2f}): "
                                    "the policy may be learning a loophole, not the task; run assay env check on "
                                    "its environment")
            self.last[name] = (train_rate, train_se, value, se)
            self.train[name] = []
        return warnings
