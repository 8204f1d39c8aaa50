"""`assay bench learning`: the quickstart over several seeds, and the table of what RL did beside SFT.

Each seed is one `assay quickstart seed=S name=NAME_sS` in its own process (the config seed changes
the SFT data, the SFT and RL sampling and the mixer; the evaluation tasks stay the same). Runs that
already have a summary.json are read, not rerun, so an interrupted bench continues where it stopped.
With --jobs 2 or more the runs go side by side, each on one torch thread unless --threads says
otherwise. The table gives, per seed, each domain's paired Δ pass@1 (RL − SFT, 95% bootstrap CI over
held-out tasks) and the mean over domains, then the mean and spread of those over the seeds, and what
moved during RL (share of groups with reward variance, entropy per token, first vs last quarter)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def machine() -> str:
    """The CPU model and the number of hardware threads: what an exact reproduction depends on."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} hardware threads"


def run_seeds(seeds: Sequence[int], name: str, run_dir: Path, overrides: Sequence[str], jobs: int,
              threads: int, log=print, preset: str = "quickstart") -> dict[int, Path]:
    """Run the quickstart for each seed that has no summary yet; returns seed -> run directory."""
    from assay.core.errors import AssayError
    from assay.core.storage import run_dir_holder

    dirs = {s: run_dir / f"{name}_s{s}" for s in seeds}
    todo = [s for s in seeds if not (dirs[s] / "summary.json").is_file()]
    if busy := {s: h for s in todo if (h := run_dir_holder(dirs[s]))}:  # a seed still running elsewhere
        raise AssayError("bench: " + "; ".join(f"{dirs[s]} is in use by a running process ({h})" for s, h in busy.items())
                         + "; wait for it to end, then run the bench again (finished seeds are reused)")
    if jobs > 1 and threads == 0:
        threads = 1  # side by side on a small machine, one thread each is the fast and reproducible choice
    running: list[tuple[int, subprocess.Popen, Any, float]] = []
    failed: list[int] = []
    while todo or running:
        while todo and len(running) < jobs:
            s = todo.pop(0)
            run_dir.mkdir(parents=True, exist_ok=True)
            logf = open(run_dir / f"{name}_s{s}.log", "w")  # closed when the run ends
            cmd = [sys.executable, "-m", "assay.cli", "quickstart", "--preset", preset, f"seed={s}", f"name={name}_s{s}",
                   f"run_dir={run_dir}", *([f"threads={threads}"] if threads else []), *overrides]
            log(f"seed {s}: {' '.join(cmd[3:])}  (log: {logf.name})")
            running.append((s, subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT), logf, time.time()))
        time.sleep(1.0)
        for item in list(running):
            s, proc, logf, t0 = item
            if proc.poll() is None:
                continue
            running.remove(item)
            logf.close()
            if proc.returncode != 0:
                failed.append(s)
            log(f"seed {s}: {'done' if proc.returncode == 0 else f'failed ({proc.returncode})'} "
                f"after {(time.time() - t0) / 60:.1f} min")
    if failed:
        raise AssayError(f"bench learning: seed(s) {failed} failed; see {run_dir}/{name}_s<seed>.log")
    return dirs


def _flat(value: Any, key: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for name, item in value.items() for k, v in _flat(item, f"{key}.{name}" if key else name).items()}
    if isinstance(value, list) and any(isinstance(v, dict) for v in value):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{key}.{i}").items()}
    return {key: value}


IGNORED = ("name", "run_dir", "threads")  # where a run went and how fast, not what it learned


def settings_drift(dirs: dict[int, Path], preset: str, overrides: Sequence[str]) -> list[str]:
    """One line per run whose recorded config differs from what the bench would run for its seed now (a
    finished seed is reused, not rerun, so a changed preset or override would otherwise mix recipes)."""
    from assay.core.config import load_recorded_config
    from assay.pipeline.quickstart import default_config

    notes = []
    for s, d in sorted(dirs.items()):
        ran = _flat(load_recorded_config(d / "config.yaml").model_dump(mode="json"))
        now = _flat(default_config([*overrides, f"seed={s}"], preset).model_dump(mode="json"))
        keys = [k for k in sorted(ran.keys() | now.keys()) if k not in IGNORED and ran.get(k) != now.get(k)]
        if keys:
            notes.append(f"seed {s} ({d}) ran with settings other than {preset}'s now: "
                         + "; ".join(f"{k} {ran.get(k)!r} (now {now.get(k)!r})" for k in keys))
    return notes


def _ci(e: dict[str, float]) -> str:
    return f"{e['value']:+.3f} [{e['low']:+.3f}, {e['high']:+.3f}]"


def _spread(xs: list[float]) -> str:
    if len(xs) < 2:
        return f"{xs[0]:+.3f}" if xs else "–"
    return f"{statistics.mean(xs):+.3f} ± {statistics.stdev(xs):.3f}"


def learning_table(summaries: dict[int, dict[str, Any]], where: str = "") -> str:
    """Markdown: one row per seed, then the mean ± standard deviation over the seeds."""
    seeds = sorted(summaries)
    domains = [r["domain"] for r in summaries[seeds[0]]["domains"]]
    head = ["seed", *(f"{d} Δ" for d in domains), "mean Δ", "start → RL (mean)", "min"]
    lines = [f"| {' | '.join(head)} |", f"|{'---|' * len(head)}"]
    per_domain: dict[str, list[float]] = {d: [] for d in domains}
    means, sfts, rls = [], [], []
    for s in seeds:
        summ = summaries[s]
        rows = {r["domain"]: r for r in summ["domains"]}
        sft = statistics.mean(r["sft"]["value"] for r in rows.values())
        rl = statistics.mean(r["rl"]["value"] for r in rows.values())
        mean = summ.get("mean") or {"value": rl - sft, "low": float("nan"), "high": float("nan")}
        minutes = summ.get("seconds", {}).get("total")
        cells = [str(s), *(_ci(rows[d]["delta"]) for d in domains), _ci(mean), f"{sft:.3f} → {rl:.3f}",
                 f"{minutes / 60:.1f}" if minutes else "–"]
        lines.append(f"| {' | '.join(cells)} |")
        for d in domains:
            per_domain[d].append(rows[d]["delta"]["value"])
        means.append(mean["value"])
        sfts.append(sft)
        rls.append(rl)
    cells = ["mean ± sd", *(_spread(per_domain[d]) for d in domains), _spread(means),
             f"{statistics.mean(sfts):.3f} → {statistics.mean(rls):.3f}", ""]
    lines.append(f"| {' | '.join(cells)} |")
    out = "\n".join(lines)
    return f"{out}\n\n{where}" if where else out


def dynamics_table(summaries: dict[int, dict[str, Any]]) -> str:
    """Markdown: per domain, averaged over seeds, what RL trained on and what moved (first → last quarter)."""
    seeds = sorted(summaries)
    training = [summaries[s].get("training") or {} for s in seeds]
    domains = sorted({d for t in training for d in t})
    if not domains:
        return ""
    head = ["domain", "groups by level (1/2/3/4)", "groups with reward variance", "entropy / token",
            "training pass by level, first → last quarter", "SFT → RL held-out pass by level"]
    lines = [f"| {' | '.join(head)} |", f"|{'---|' * len(head)}"]

    def avg(xs: list[float | None]) -> float | None:
        xs = [x for x in xs if x is not None]
        return statistics.mean(xs) if xs else None

    def fmt(x: float | None) -> str:
        return "–" if x is None else f"{x:.2f}"

    def per_level(rows: list[dict[str, Any]], levels: list[int]) -> str:
        """Each level's mean over rows (dicts keyed by level, as int or, read back from JSON, str)."""
        return "/".join(fmt(avg([r.get(str(lv), r.get(lv)) for r in rows])) for lv in levels)

    for d in domains:
        ts = [t[d] for t in training if d in t]
        levels = sorted({int(lv) for t in ts for lv in t["groups_by_level"]})
        by_level = "/".join(fmt(avg([t["groups_by_level"].get(str(lv), t["groups_by_level"].get(lv, 0.0))
                                      for t in ts])) for lv in levels)
        signal = f"{fmt(avg([t['first']['signal_share'] for t in ts]))} → {fmt(avg([t['last']['signal_share'] for t in ts]))}"
        entropy = f"{fmt(avg([t['first']['entropy'] for t in ts]))} → {fmt(avg([t['last']['entropy'] for t in ts]))}"
        first, last = ([t[phase]["pass_by_level"] for t in ts] for phase in ("first", "last"))
        evals = [r for s in seeds for r in summaries[s]["domains"] if r["domain"] == d]
        sft, rl = ([r[key] for r in evals] for key in ("sft_by_difficulty", "rl_by_difficulty"))
        lines.append(f"| {d} | {by_level} | {signal} | {entropy} | {per_level(first, levels)} → "
                     f"{per_level(last, levels)} | {per_level(sft, levels)} → {per_level(rl, levels)} |")
    return "\n".join(lines)


def read_summaries(dirs: dict[int, Path]) -> dict[int, dict[str, Any]]:
    return {s: json.loads((d / "summary.json").read_text()) for s, d in dirs.items()}


def run_learning_bench(seeds: int, name: str, run_dir: Path, overrides: Sequence[str], jobs: int, threads: int,
                       log=print, preset: str = "quickstart") -> tuple[str, dict[int, dict[str, Any]]]:
    dirs = run_seeds(list(range(seeds)), name, run_dir, overrides, jobs, threads, log, preset)
    summaries = read_summaries(dirs)
    counts = sorted({summ.get("threads") for summ in summaries.values()}, key=str)
    where = (f"Machine: {machine()}; torch threads per run: {', '.join(map(str, counts))}; "
             f"{jobs} run(s) at a time.")
    for note in (drift := settings_drift(dirs, preset, overrides)):
        log(note)
    notes = "".join(f"\n- {n}" for n in drift)
    return f"{learning_table(summaries, where)}{notes}\n\n{dynamics_table(summaries)}\n", summaries
