"""`assay bench pipeline`: RL steps per second of the synchronous pipeline beside the asynchronous
one (and the online agent loop, the rollout in a worker process, verification in processes of its
own), from the same policy and config,
alternating in one process. Beside each variant's wall time: the share of it the rollout and the
trainer were busy (their sum above 100% is the overlap), the share of the machine's CPU time that was
busy (overlap can only fill idle cores: at a busy share b, no schedule runs more than 1/b times
faster), and the training pass rate it reached; then, on the same runs, the training reward each variant
had reached by the time the fastest finished and the wall time each took to reach the baseline's
final reward (a trailing mean over a quarter of the steps, so that one lucky step does not count); and,
with `held_out`, each run's final policy evaluated on the evaluation partition, outside the timed runs
(a faster variant that ends as well reached the same reward sooner)."""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from assay.bench.cpu_stat import cpu_ticks
from assay.core.checkpoint import latest_checkpoint
from assay.core.config import Config
from assay.core.storage import read_metrics
from assay.eval.passk import Estimate
from assay.pipeline.async_pipeline import make_pipeline
from assay.pipeline.quickstart import default_config, evaluate_policy

# Each variant names its schedule and its loop: the runs start from the quickstart's config, whose own
# choices (online episodes, async) must not decide what a variant measures.
SYNC, ASYNC = ["pipeline.mode=sync"], ["pipeline.mode=async", "pipeline.max_staleness=1"]
LOCKSTEP, ONLINE = ["pipeline.online=false"], ["pipeline.online=true"]
VARIANTS = {
    "sync": SYNC + LOCKSTEP,
    "sync + online episodes": SYNC + ONLINE,
    "async (staleness 1)": ASYNC + LOCKSTEP,
    "async + online episodes": ASYNC + ONLINE,
    "async + online, rollout process": ASYNC + ONLINE + ["pipeline.workers=process"],
    "sync + online, verifier processes": SYNC + ONLINE + ["rollout.verifier_processes=2"],
    "async + online, verifier processes": ASYNC + ONLINE + ["rollout.verifier_processes=2"],
}


@dataclass
class PipelineRow:
    variant: str
    seconds: list[float]
    steps: int
    rollout_busy: list[float] = field(default_factory=list)  # share of the wall time spent sampling
    train_busy: list[float] = field(default_factory=list)  # share spent in trainer steps
    pass_rate: list[float] = field(default_factory=list)  # mean step reward over the second half of the steps
    cpu_busy: list[float] = field(default_factory=list)  # the machine's busy share of CPU time (every process)
    curves: list[list[tuple[float, float]]] = field(default_factory=list)  # per run: (s since start, step reward)
    held_out: list[Estimate] = field(default_factory=list)  # per run: the final policy's held-out pass@1

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def run_pipeline_bench(policy: Path, steps: int, rounds: int, overrides: list[str],
                       variants: list[str] | None = None, held_out: int = 0, samples: int = 4) -> list[PipelineRow]:
    """`variants`: a subset of VARIANTS by name (default: all); the first is the speed-up's baseline.
    `held_out`: evaluation tasks per domain for each run's final policy, `samples` each (0: none)."""
    names = variants or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        from assay.core.errors import AssayError

        raise AssayError(f"bench pipeline: unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    rows = {name: PipelineRow(name, [], steps) for name in names}
    with tempfile.TemporaryDirectory(prefix="assay-bench-pipeline-") as tmp:
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                cfg = default_config([f"model.path={policy}", f"train.steps={steps}", f"train.checkpoint_every={steps}",
                                      f"run_dir={tmp}", f"name=r{r}-{names.index(name)}", "train.max_refill_rounds=0",
                                      *overrides, *VARIANTS[name]])
                pipeline = make_pipeline(cfg, Path(tmp) / cfg.name)
                t0, start, cpu0 = time.perf_counter(), time.time(), cpu_times()
                pipeline.run()
                wall, cpu1 = time.perf_counter() - t0, cpu_times()
                row, train = rows[name], [m for m in read_metrics(Path(tmp) / cfg.name) if m["kind"] == "train"]
                row.seconds.append(wall)
                if cpu0 and cpu1:
                    row.cpu_busy.append(1 - (cpu1[1] - cpu0[1]) / max(1, cpu1[0] - cpu0[0]))
                row.rollout_busy.append(sum(m["rollout_s"] for m in train) / wall)
                row.train_busy.append(sum(m["train_s"] for m in train) / wall)
                curve = [(m["time"] - start, step_reward(m)) for m in train]
                row.curves.append(curve)
                row.pass_rate.append(statistics.fmean(r for _, r in curve[len(curve) // 2:]))
                if held_out:
                    row.held_out.append(held_out_pass_rate(cfg, latest_checkpoint(Path(tmp) / cfg.name), held_out,
                                                           samples))
    return list(rows.values())


def held_out_pass_rate(cfg: Config, policy: Path, tasks_per_domain: int, samples: int) -> Estimate:
    """pass@1 over every domain's evaluation tasks (the same tasks and seed for every run)."""
    return evaluate_policy(cfg, policy, tasks_per_domain, samples, ks=(1,), overall=True)["overall"].pass_at[1]


def step_reward(m: dict) -> float:
    """A train step's pass rate over all its domains' episodes (each domain's rate weighted by its count)."""
    domains = [k[:-len("/n")] for k in m if k.startswith("domain/") and k.endswith("/n")]
    # a domain whose episodes all failed to run (infrastructure errors) has no pass rate
    n = {d: m[f"{d}/n"] for d in domains if m[f"{d}/n"] and f"{d}/pass_rate" in m}
    return sum(m[f"{d}/pass_rate"] * c for d, c in n.items()) / sum(n.values()) if n else math.nan


def trailing(curve: list[tuple[float, float]], window: int) -> list[tuple[float, float]]:
    """(time a step ended, the mean reward of the `window` steps up to it), from the window's first full step."""
    return [(curve[i][0], statistics.fmean(r for _, r in curve[i + 1 - window:i + 1]))
            for i in range(window - 1, len(curve))]


def reward_by(curve: list[tuple[float, float]], seconds: float, window: int) -> float:
    """The trailing reward of the last step that ended within `seconds` (nan if none had)."""
    done = [r for t, r in trailing(curve, window) if t <= seconds]
    return done[-1] if done else math.nan


def seconds_to(curve: list[tuple[float, float]], target: float, window: int) -> float:
    """When the trailing reward first reached `target` (inf if it never did)."""
    return next((t for t, r in trailing(curve, window) if r >= target), math.inf)


def cpu_times() -> tuple[int, int] | None:
    """(all, idle) CPU time of the whole machine so far, in clock ticks (None where there is no /proc/stat)."""
    ticks = cpu_ticks()
    return None if ticks is None else (sum(ticks.values()), ticks["idle"] + ticks["iowait"])


def table(rows: list[PipelineRow]) -> str:
    base = rows[0].median
    lines = ["| pipeline | wall s for the steps (median; all) | steps / h | speed-up | rollout busy | trainer busy "
             "| machine CPU busy | training pass rate, second half |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        runs = ", ".join(f"{s:.1f}" for s in r.seconds)
        busy = f"{statistics.mean(r.cpu_busy):.0%}" if r.cpu_busy else "n/a"
        lines.append(f"| {r.variant} | {r.median:.1f} ({runs}) | {r.steps * 3600 / r.median:.0f} | {base / r.median:.2f}x "
                     f"| {statistics.mean(r.rollout_busy):.0%} | {statistics.mean(r.train_busy):.0%} | {busy} "
                     f"| {statistics.mean(r.pass_rate):.3f} |")
    return "\n".join(lines) + "\n\n" + reward_table(rows)


def reward_table(rows: list[PipelineRow]) -> str:
    """Reward against wall time: each variant's reward when the fastest variant's median run ended, and its
    time to the baseline's final reward (medians over rounds)."""
    window = max(1, rows[0].steps // 4)
    cutoff = min(r.median for r in rows)
    target = statistics.median(trailing(c, window)[-1][1] for c in rows[0].curves)
    lines = [f"Training reward, a trailing mean over {window} steps: at {cutoff:.1f} s (the fastest variant's "
             f"median), and the seconds to {target:.3f} (the baseline's final):", "",
             "| pipeline | reward at equal wall time | s to the baseline's final reward | speed-up to it |",
             "|---|---|---|---|"]
    base = statistics.median(seconds_to(c, target, window) for c in rows[0].curves)
    for r in rows:
        reached = [x for x in (reward_by(c, cutoff, window) for c in r.curves) if not math.isnan(x)]
        at = statistics.median(reached) if reached else math.nan
        to = statistics.median(seconds_to(c, target, window) for c in r.curves)
        lines.append(f"| {r.variant} | {at:.3f} | {to:.1f} | {base / to:.2f}x |" if math.isfinite(to) else
                     f"| {r.variant} | {at:.3f} | not reached | - |")
    if rows[0].held_out:
        lines += ["", "Held-out pass@1 of each run's final policy (95% interval; runs in round order):", "",
                  "| pipeline | held-out pass@1 | wall s |", "|---|---|---|"]
        lines += [f"| {r.variant} | {', '.join(str(e) for e in r.held_out)} | "
                  f"{', '.join(f'{x:.1f}' for x in r.seconds)} |" for r in rows]
    return "\n".join(lines)
