"""`assay bench cluster RUN`: Assay's pipeline at cluster shapes this machine does not have, simulated
(bench/cluster_model.py) on durations measured in a real synchronous run (bench/cluster_fit.py).

It prints what it fitted, then per rollout-worker count (8 to 1,024 by default; verifiers and trainer
ranks scaled by ratios) the sync and async throughput, each worker kind's idle share and the async
speed-up; `--against` runs instead compares the model at this machine's shape (the fitted run's
workers, its verifier threads, one trainer sharing the cores) with the measured wall time of real runs.
Absolute figures are for workers as fast as the measured ones (this machine's CPU engine and trainer):
the ratios (idle shares, speed-ups) are what carries to other hardware."""

from __future__ import annotations

import io
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from assay.bench.cluster_fit import Fit, measured_wall, run_config
from assay.bench.cluster_model import Result, Shape, plan_steps, run_schedule
from assay.core.errors import ConfigError

WORKERS = (8, 16, 32, 64, 128, 256, 512, 1024)
# Other systems' published async-over-sync speed-ups, printed for scale; they are not Assay's measurements.
PUBLISHED = "AReaL 2.77×, verl 2.35–2.67× (each project's published async-over-sync speed-up)"


@dataclass
class SweepRow:
    shape: Shape
    sync: Result
    asyn: Result

    @property
    def speedup(self) -> float:
        return self.sync.wall_s / self.asyn.wall_s


@dataclass
class Check:
    run: Path
    mode: str
    steps: int
    measured_s: float
    predicted_s: list[float]  # one per seed

    @property
    def error(self) -> float:
        return statistics.fmean(self.predicted_s) / self.measured_s - 1


def allreduce_s(fit: Fit, link_gbps: float) -> float:
    """Seconds of one ring all-reduce of the policy's gradients (as many bytes as its weights) over a
    link of `link_gbps`, before the 2(R-1)/R factor; a parameter of the model, not a measurement."""
    return fit.model_bytes / (link_gbps * 1e9 / 8)


def sweep(fit: Fit, workers: list[int], groups_per_step: int, verifiers_per_worker: int, workers_per_rank: int,
          k: int, steps: int, seed: int, link_gbps: float) -> list[SweepRow]:
    rows = []
    for n in workers:
        shape = Shape(workers=n, verifiers=max(1, n * verifiers_per_worker), ranks=max(1, n // workers_per_rank),
                      groups_per_step=groups_per_step, max_seqs=fit.max_seqs,
                      allreduce_s=allreduce_s(fit, link_gbps))
        plans = plan_steps(fit, shape, steps, seed)  # one plan for both modes: they differ in schedule only
        rows.append(SweepRow(shape, run_schedule(plans, shape, None), run_schedule(plans, shape, k)))
    return rows


def validate(fit: Fit, against: list[Path], cores: int, seeds: int) -> list[Check]:
    """The model at the fitted run's own shape, each real run's mode, batch and steps, beside its wall."""
    checks = []
    for run in against:
        mode, steps, wall = measured_wall(run)
        cfg = run_config(run)
        k = None if mode == "sync" else int(cfg["pipeline"].get("max_staleness", 1))
        shape = Shape(workers=fit.rollout_workers, verifiers=fit.verifiers * fit.rollout_workers, ranks=1,
                      groups_per_step=int(cfg["train"]["groups_per_step"]), max_seqs=fit.max_seqs,
                      refills=int(cfg["train"].get("max_refill_rounds", 0)) > 0 and cfg["train"].get("dynamic_sampling", True),
                      cores=cores, rollout_demand=fit.threads + fit.verify_load, train_demand=fit.threads)
        runs = [run_schedule(plan_steps(fit, shape, steps, s), shape, k).wall_s for s in range(seeds)]
        label = mode + (f", {cfg['pipeline'].get('workers', 'thread')} worker" if k is not None else "")
        checks.append(Check(run, label, steps, wall, runs))
    return checks


def _render(*tables: object) -> str:
    from rich.console import Console

    console = Console(width=200, record=True, file=io.StringIO())
    for t in tables:
        console.print(t)
    return console.export_text()


def fit_table(fit: Fit) -> object:
    from rich.table import Table

    s = fit.steps
    t = Table(title=f"fitted from {fit.run} ({len(s)} steps, {len(fit.groups)} groups, "
                    f"{fit.rollout_workers} rollout worker(s), {fit.threads} threads)")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_column("from")
    eps = sorted(e.tokens for g in fit.groups for e in g.episodes)
    t.add_row("sampled tokens per episode: median / p99 / max",
              f"{eps[len(eps) // 2]} / {eps[int(len(eps) * 0.99)]} / {eps[-1]}", "trajectories (resampled by group)")
    t.add_row("engine: s per iteration + s per computed token",
              f"{fit.iteration_s * 1e3:.2f} ms + {fit.token_s * 1e6:.1f} µs (R² {fit.engine_r2:.2f})",
              "rollout/generate_s ~ rollout/steps + rollout/computed_tokens")
    t.add_row("rollout residual per round", f"{fit.round_residual_s:+.3f} s", "rollout_s - the model at the run's shape")
    law = (f"{fit.train_fixed_s:.3f} s + {fit.train_token_s * 1e3:.3f} ms/token (R² {fit.train_r2:.2f})" if fit.train_linear
           else f"resampled, scaled by tokens (linear R² {fit.train_r2:.2f} too low)")
    t.add_row("train step", law, f"train_s ~ tokens; mean {statistics.fmean(x.train_s for x in s):.2f} s")
    t.add_row("weight sync / driver per step", f"{statistics.fmean(x.weight_sync_s for x in s) * 1e3:.1f} ms / "
              f"{statistics.fmean(x.driver_s for x in s) * 1e3:.0f} ms", "rollout/weight_update_s; step interval left over")
    t.add_row("verifications running at once in a rollout", f"{fit.verify_load:.2f}",
              "sum of verify_s / sum of rollout_s (cores they take from a colocated trainer)")
    t.add_row("refill rounds per step (mean)", f"{statistics.fmean(len(x.rounds) for x in s):.2f}", "group ids s{step}a{round}")
    return t


def sweep_table(rows: list[SweepRow], k: int, steps: int) -> object:
    from rich.table import Table

    t = Table(title=f"simulated, {steps} steps from a cold start; async = max_staleness {k}; idle = share of a worker "
                    "kind's capacity unused (sync / async)")
    for col in ("rollout workers", "verifiers", "ranks", "groups/step", "sync steps/h", "async steps/h",
                "async samples/s", "async speed-up", "rollout idle", "verifier idle", "trainer idle"):
        t.add_column(col, justify="right")
    for r in rows:
        sh = r.shape
        t.add_row(str(sh.workers), str(sh.verifiers), str(sh.ranks), str(sh.groups_per_step),
                  f"{r.sync.steps_per_hour:.0f}", f"{r.asyn.steps_per_hour:.0f}", f"{r.asyn.samples_per_s:.0f}",
                  f"{r.speedup:.2f}×", *(f"{r.sync.idle(kind):.0%} / {r.asyn.idle(kind):.0%}"
                                         for kind in ("rollout", "verifier", "trainer")))
    best = max(rows, key=lambda r: r.speedup)
    t.caption = (f"largest simulated async speed-up: {best.speedup:.2f}× at {best.shape.workers} workers. "
                 f"Published figures of other systems, for scale (theirs, not Assay's): {PUBLISHED}")
    return t


def check_table(checks: list[Check], cores: int) -> object:
    from rich.table import Table

    t = Table(title=f"the model at this machine's shape ({cores} cores shared by rollout, its verifiers and the "
                    "trainer) against real runs")
    for col in ("run", "mode", "steps", "measured s", "predicted s (mean; seeds)", "error"):
        t.add_column(col, justify="left" if col in ("run", "mode") else "right")
    for c in checks:
        t.add_row(c.run.name, c.mode, str(c.steps), f"{c.measured_s:.1f}",
                  f"{statistics.fmean(c.predicted_s):.1f} ({min(c.predicted_s):.1f}–{max(c.predicted_s):.1f})",
                  f"{c.error:+.0%}")
    if checks:
        t.caption = f"mean |error| {statistics.fmean(abs(c.error) for c in checks):.0%}"
    return t


def parse_workers(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ConfigError(f"--workers takes positive rollout-worker counts separated by commas, e.g. 8,16,32; "
                          f"got {text!r}")
    return counts


def run_cluster_bench(run: Path, workers: str, groups_per_step: int, verifiers_per_worker: int, workers_per_rank: int,
                      max_staleness: int, steps: int, seed: int, link_gbps: float, against: list[Path],
                      cores: int, seeds: int) -> str:
    from assay.bench.cluster_fit import fit_run
    from assay.bench.cluster_model import calibrate

    counts = parse_workers(workers)
    for name, value, least in (("--groups-per-step", groups_per_step, 1), ("--verifiers-per-worker", verifiers_per_worker, 1),
                               ("--workers-per-rank", workers_per_rank, 1), ("--steps", steps, 1),
                               ("--max-staleness", max_staleness, 0), ("--seeds", seeds, 1), ("--cores", cores, 0)):
        if value < least:
            raise ConfigError(f"{name} must be at least {least}, got {value}")
    if link_gbps <= 0:
        raise ConfigError(f"--link-gbps must be positive, got {link_gbps}")
    fit = calibrate(fit_run(run))
    if against:
        cores = cores or os.cpu_count() or 1
        return _render(fit_table(fit), check_table(validate(fit, against, cores, seeds), cores))
    return _render(fit_table(fit), sweep_table(sweep(fit, counts, groups_per_step, verifiers_per_worker, workers_per_rank,
                                                     max_staleness, steps, seed, link_gbps), max_staleness, steps))
