"""The domain mixer: which domains the next batch of tasks comes from, and at what difficulty.

Static mixing samples by the configured weights. Adaptive mixing moves the ratios towards the
domains where learning happens: the size of the recent pass-rate change (learning progress, either
direction) plus p(1-p), which is largest where a GRPO group is most likely to have reward variance.
A domain that is saturated (passing at its top difficulty) gets a fraction of its score; every
domain keeps at least `floor` of the batch so none is forgotten."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from assay.core.config import DomainConfig, MixerConfig
from assay.core.errors import AssayError, CheckpointError
from assay.core.types import OK, Task, Trajectory
from assay.envs.base import Environment
from assay.envs.split import draw_task
from assay.mixer.curriculum import Curriculum
from assay.mixer.stats import DomainStats, progress, seesaw_warnings, summarize

SATURATED_SCALE = 0.1  # share of its score a saturated domain keeps
UNKNOWN_UNCERTAINTY = 0.25  # p(1-p) at p=0.5: a domain not yet measured is worth exploring


def apply_floor(shares: Mapping[str, float], floor: float) -> dict[str, float]:
    """Normalize `shares` and lift each to at least `floor`, taking the difference from the others in
    proportion to their shares. A floor above 1/len(shares) is lowered to 1/len(shares)."""
    if not shares:
        return {}
    floor = min(floor, 1.0 / len(shares))
    fixed: set[str] = set()
    while True:
        free = [n for n in shares if n not in fixed]
        budget = 1.0 - floor * len(fixed)
        total = sum(shares[n] for n in free)
        out = {n: floor for n in fixed}
        for n in free:
            out[n] = budget * shares[n] / total if total > 0 else budget / len(free)
        low = [n for n in free if out[n] < floor]
        if not low:
            return {n: out[n] for n in shares}
        fixed.update(low)


def _normalized(weights: Mapping[str, float]) -> dict[str, float]:
    total = sum(weights.values())
    return {n: w / total for n, w in weights.items()}


class DomainMixer:
    """Implements the Mixer protocol. `envs` maps each DomainConfig.name to its environment; sampled
    tasks carry the configured domain name in Task.domain, which is how `update` attributes results."""

    def __init__(
        self, domains: Sequence[DomainConfig], cfg: MixerConfig, envs: Mapping[str, Environment], seed: int
    ) -> None:
        if not domains:
            raise AssayError("mixer: no domains configured; add at least one entry under `domains`")
        names = [d.name for d in domains]
        if len(set(names)) != len(names):
            raise AssayError(f"mixer: domain names must be unique, got {names}")
        missing = [n for n in names if n not in envs]
        if missing:
            raise AssayError(f"mixer: no environment given for domain(s) {missing}; pass envs keyed by domain name")
        for d in domains:
            levels = set(envs[d.name].difficulties)
            bad = [lv for lv in range(d.difficulty.min, d.difficulty.max + 1) if lv not in levels]
            if bad:
                raise AssayError(
                    f"mixer: domain {d.name!r} difficulty range [{d.difficulty.min}, {d.difficulty.max}] includes "
                    f"level(s) {bad} that environment {envs[d.name].name!r} lacks (it has {sorted(levels)}); "
                    f"set {d.name}.difficulty.min/max inside it"
                )
        if sum(d.weight for d in domains) <= 0:
            raise AssayError("mixer: all domain weights are 0; give at least one domain a positive weight")
        self.domains = {d.name: d for d in domains}
        self.cfg = cfg
        self.envs = dict(envs)
        self.rng = random.Random(seed)
        self.curricula = {d.name: Curriculum.from_config(d) for d in domains}
        self.history: dict[str, list[tuple[float, int]]] = {n: [] for n in names}  # (pass rate, level) per update
        self.decks: dict[str, list[int]] = {n: [] for n in names}  # stratified schedules' undealt levels
        self.updates = 0
        self.ratios = self._floored(_normalized({d.name: d.weight for d in domains}))

    # -- sampling --------------------------------------------------------------------------------

    def sample(self, n_groups: int, only: Collection[str] | None = None) -> list[Task]:
        """One task per GRPO group. Each domain gets floor(n·ratio) groups and the remainder is
        drawn by the fractional parts, which keeps the batch close to the ratios even when small.
        `only`: draw from these domains alone, by their ratios renormalized (none: no tasks)."""
        if n_groups < 0:
            raise AssayError(f"mixer.sample: n_groups must be >= 0, got {n_groups}")
        names = list(self.domains)
        shares = self.ratios
        if only is not None:
            total = sum(self.ratios[n] for n in names if n in only)
            if total <= 0:
                return []
            shares = {n: self.ratios[n] / total if n in only else 0.0 for n in names}
        exact = [shares[n] * n_groups for n in names]
        counts = [int(x) for x in exact]
        fracs = [x - c for x, c in zip(exact, counts, strict=True)]
        for _ in range(n_groups - sum(counts)):
            weights = fracs if sum(fracs) > 0 else [shares[n] for n in names]
            i = self.rng.choices(range(len(names)), weights=weights)[0]
            counts[i] += 1
            fracs[i] = 0.0
        plan = [n for n, c in zip(names, counts, strict=True) for _ in range(c)]
        self.rng.shuffle(plan)
        dealt = {n: self._deal(n, c) for n, c in zip(names, counts, strict=True)
                 if c and self.domains[n].difficulty.schedule == "stratified"}
        return [self._generate(name, dealt[name].pop() if name in dealt else None) for name in plan]

    def _deal(self, name: str, count: int) -> list[int]:
        """`count` levels of a stratified domain: every level `count // L` times, and the remainder from a deck
        that deals each level once before any level twice, so remainders balance across batches too."""
        cur = self.curricula[name]
        levels = list(range(cur.min_level, cur.max_level + 1))
        out = levels * (count // len(levels))
        deck = self.decks[name]
        for _ in range(count % len(levels)):
            if not deck:
                deck.extend(levels)
                self.rng.shuffle(deck)
            out.append(deck.pop())
        self.rng.shuffle(out)
        return out

    def _generate(self, name: str, dealt: int | None) -> Task:
        cur = self.curricula[name]
        level = cur.level
        difficulty = self.domains[name].difficulty
        review = difficulty.review
        if dealt is not None:
            level = dealt
        elif difficulty.schedule == "uniform":
            level = self.rng.randint(cur.min_level, cur.max_level)
        elif review and level > cur.min_level and self.rng.random() < review:  # keep the levels below in practice
            level = self.rng.randint(cur.min_level, level - 1)
        env = self.envs[name]
        task = draw_task(env, self.rng, level, "train")  # checks the difficulty it was asked for
        task.domain = name
        return task

    # -- learning from results -------------------------------------------------------------------

    def update(self, trajectories: Sequence[Trajectory]) -> DomainStats:
        """Feed one step's trajectories: advance curricula, record pass rates, move the ratios."""
        by_domain: dict[str, list[Trajectory]] = {n: [] for n in self.domains}
        for t in trajectories:
            if t.task.domain not in by_domain:
                raise AssayError(
                    f"mixer.update: trajectory of unknown domain {t.task.domain!r}; "
                    f"this mixer has {sorted(self.domains)}"
                )
            by_domain[t.task.domain].append(t)
        w = self.cfg.progress_window
        for name, trajs in by_domain.items():
            ok = [t for t in trajs if t.status == OK]
            if not ok:
                continue
            cur = self.curricula[name]
            if self.domains[name].difficulty.schedule == "curriculum":  # a uniform or stratified one never moves
                for t in ok:
                    if t.task.difficulty == cur.level:  # late results from another level do not count here
                        cur.record(t.passed)
            # the level the results came from: the most common one, ties to the higher
            level = max(Counter(t.task.difficulty for t in ok).items(), key=lambda kv: (kv[1], kv[0]))[0]
            self.history[name].append((sum(t.passed for t in ok) / len(ok), level))
            del self.history[name][: -2 * w]
        self.updates += 1
        if self.cfg.strategy == "adaptive":
            self._move_ratios()
        steps = {n: summarize(ts, self.curricula[n].level, self.ratios[n]) for n, ts in by_domain.items()}
        return DomainStats(step=self.updates, domains=steps, warnings=self.seesaw())

    def seesaw(self) -> list[str]:
        return seesaw_warnings(self.history, self.cfg.progress_window, self.cfg.seesaw_margin)

    def scores(self) -> dict[str, float]:
        """The adaptive strategy's unnormalized preference per domain (before weights and floor)."""
        w = self.cfg.progress_window
        out: dict[str, float] = {}
        for name in self.domains:
            rates = [r for r, _ in self.history[name]]
            recent = rates[-w:]
            p = sum(recent) / len(recent) if recent else None
            score = abs(progress(rates, w)) + (p * (1 - p) if p is not None else UNKNOWN_UNCERTAINTY)
            if self.curricula[name].saturated(p):
                score *= SATURATED_SCALE
            out[name] = score
        return out

    def _move_ratios(self) -> None:
        raw = {n: self.domains[n].weight * s for n, s in self.scores().items()}
        if sum(raw.values()) <= 0:
            raw = {n: d.weight for n, d in self.domains.items()}
        target = self._floored(_normalized(raw))
        s = self.cfg.smoothing
        self.ratios = self._floored({n: (1 - s) * r + s * target[n] for n, r in self.ratios.items()})

    def _floored(self, shares: Mapping[str, float]) -> dict[str, float]:
        """Static: the shares as they are. Adaptive: every domain with a positive weight keeps the
        floor; a domain weighted 0 is switched off and stays at 0."""
        if self.cfg.strategy == "static":
            return dict(shares)
        active = {n: v for n, v in shares.items() if self.domains[n].weight > 0}
        lifted = apply_floor(active, self.cfg.floor)
        return {n: lifted.get(n, 0.0) for n in shares}

    # -- checkpointing ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable and exact: floats survive JSON unchanged, so a resume is bit-identical."""
        version, internal, gauss = self.rng.getstate()
        return {
            "updates": self.updates,
            "ratios": dict(self.ratios),
            "curricula": {n: c.state_dict() for n, c in self.curricula.items()},
            "history": {n: [[r, lv] for r, lv in h] for n, h in self.history.items()},
            "rng": [version, list(internal), gauss],
            "decks": {n: list(deck) for n, deck in self.decks.items()},
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        saved = set(d["ratios"])
        if saved != set(self.domains):
            raise CheckpointError(
                f"mixer state has domains {sorted(saved)} but the config has {sorted(self.domains)}; "
                "resume with the config the run was started with"
            )
        for n, c in self.curricula.items():
            c.load_state_dict(d["curricula"][n])
        self.updates = int(d["updates"])
        self.ratios = {n: float(d["ratios"][n]) for n in self.domains}
        self.history = {n: [(float(r), int(lv)) for r, lv in d["history"][n]] for n in self.domains}
        self.decks = {n: [int(lv) for lv in d.get("decks", {}).get(n, [])] for n in self.domains}  # older: none
        version, internal, gauss = d["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
