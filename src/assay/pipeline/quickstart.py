"""The main job on the embedded default: build a tiny policy, SFT it, evaluate, RL-train it on
several domains with the adaptive mixer, evaluate again on the same held-out tasks, compare."""

from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from assay.core.checkpoint import latest_checkpoint
from assay.core.config import Config, build_config, load_config
from assay.core.errors import ConfigError
from assay.core.modeling import load_model
from assay.core.storage import atomic_write, prepare_run_dir, read_metrics, release_run_dir, trajectory_shards
from assay.envs.qa.enforce import record_stores
from assay.eval.evaluate import DomainEval, evaluate, paired
from assay.eval.passk import paired_difference_ci
from assay.pipeline.async_pipeline import make_pipeline
from assay.pipeline.overlap import check_overlap
from assay.pipeline.policy import domain_envs
from assay.pipeline.sft import run_sft
from assay.pipeline.ui import RunView
from assay.rollout.factory import make_backend
from assay.train.advantages import has_signal


def presets() -> list[str]:
    """The configs shipped in the package: `quickstart` (the embedded default) and the recipes beside it."""
    return sorted(f.name.removesuffix(".yaml") for f in resources.files("assay").joinpath("configs").iterdir()
                  if f.name.endswith(".yaml"))


def default_config_text(preset: str = "quickstart") -> str:
    if preset not in presets():
        raise ConfigError(f"no preset {preset!r}; the presets are {', '.join(presets())}")
    return resources.files("assay").joinpath(f"configs/{preset}.yaml").read_text()


def default_config(overrides: list[str] | tuple[str, ...] = (), preset: str = "quickstart") -> Config:
    import yaml

    return build_config(yaml.safe_load(default_config_text(preset)), overrides)


def evaluate_policy(cfg: Config, policy_dir: Path, tasks_per_domain: int | None = None, n: int | None = None,
                    **options: Any) -> dict[str, DomainEval]:
    """The policy on the evaluation partition: `cfg.eval`'s tasks per domain and samples unless given;
    `options` go to `evaluate` (ks, overall)."""
    model, tokenizer = load_model(policy_dir, cfg.model)
    backend = make_backend(cfg.rollout, model, tokenizer)
    options = {"allow_unchecked": cfg.allow_unchecked, "stores": record_stores([cfg.eval.qa_store]), **options}
    try:
        return evaluate(backend, tokenizer, domain_envs(cfg), {d.name: d for d in cfg.domains},
                        tasks_per_domain or cfg.eval.tasks_per_domain, n or cfg.eval.n, cfg.eval.seed,
                        cfg.eval.temperature, **options)
    finally:
        backend.close()  # vLLM's holds a process; the engine has nothing to close


def compare(before: dict[str, DomainEval], after: dict[str, DomainEval]) -> list[dict[str, Any]]:
    rows = []
    for name in before:
        b, a = before[name], after[name]
        diff = paired_difference_ci(*paired(b, a), k=1)
        verdict = "lift" if diff.low > 0 else "regression" if diff.high < 0 else "no significant change"
        rows.append({"domain": name, "tasks": len(b.passes), "n": b.n,
                     "sft": vars(b.pass_at[1]), "rl": vars(a.pass_at[1]), "delta": vars(diff), "verdict": verdict,
                     "sft_by_difficulty": b.by_difficulty, "rl_by_difficulty": a.by_difficulty})
    return rows


def per_task(evals: dict[str, DomainEval]) -> dict[str, dict[str, list[Any]]]:
    """Each domain's passes by task, as the summary keeps them: what pairs two runs' evaluations task by task
    (`assay bench policies` sets RL alone beside SFT then RL)."""
    return {name: {"task_ids": e.task_ids, "passes": e.passes} for name, e in evals.items()}


def mean_difference(before: dict[str, DomainEval], after: dict[str, DomainEval], rounds: int = 2000,
                    seed: int = 0) -> dict[str, float]:
    """The mean over domains of after − before pass@1, with a 95% bootstrap interval that resamples
    tasks within each domain (paired: a task's before and after move together)."""
    rng = np.random.default_rng(seed)
    value, boot = 0.0, np.zeros(rounds)
    for name in before:
        diff = np.array([sum(a) / len(a) - sum(b) / len(b)
                         for b, a in zip(*paired(before[name], after[name]), strict=True)], dtype=float)
        value += diff.mean() / len(before)
        boot += diff[rng.integers(0, len(diff), size=(rounds, len(diff)))].mean(axis=1) / len(before)
    low, high = np.percentile(boot, [2.5, 97.5])
    return {"value": float(value), "low": float(low), "high": float(high)}


def training_dynamics(run_dir: Path) -> dict[str, dict[str, Any]]:
    """What RL trained on and what moved, per domain, from the run's trajectories and metrics: the share
    of groups at each level, and for the first and the last quarter of the steps the training pass rate
    per level, the share of groups with reward variance (the only ones with a gradient) and the entropy
    per token; plus how often the curriculum changed level."""
    import pyarrow.parquet as pq

    cols = ["step", "domain", "difficulty", "group_id", "reward", "passed", "status"]
    shards = trajectory_shards(run_dir / "trajectories")
    rows = [r for shard in shards for r in pq.read_table(shard, columns=cols).to_pylist() if r["status"] == "ok"]
    metrics = read_metrics(run_dir)
    metrics = [m for m in metrics if m.get("kind") == "train"]
    if not rows or not metrics:
        return {}
    last = max(r["step"] for r in rows)
    quarter = max(1, last // 4)
    phases = {"first": lambda s: s <= quarter, "last": lambda s: s > last - quarter}
    out: dict[str, dict[str, Any]] = {}
    for name in sorted({r["domain"] for r in rows}):
        mine = [r for r in rows if r["domain"] == name]
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in mine:
            groups.setdefault(r["group_id"], []).append(r)
        levels = [g[0]["difficulty"] for g in groups.values()]
        d: dict[str, Any] = {"groups": len(groups),
                             "groups_by_level": {lv: levels.count(lv) / len(levels) for lv in sorted(set(levels))}}
        for phase, inside in phases.items():
            gs = [g for g in groups.values() if inside(g[0]["step"])]
            by_level: dict[int, list[bool]] = {}
            for g in gs:
                by_level.setdefault(g[0]["difficulty"], []).extend(r["passed"] for r in g)
            ent = [m[f"entropy/{name}"] for m in metrics if inside(m["step"]) and f"entropy/{name}" in m]
            d[phase] = {"pass_by_level": {lv: sum(p) / len(p) for lv, p in sorted(by_level.items())},
                        "signal_share": sum(has_signal([r["reward"] for r in g]) for g in gs) / len(gs) if gs else None,
                        "entropy": sum(ent) / len(ent) if ent else None}
        level_track = [m[f"domain/{name}/difficulty"] for m in metrics if f"domain/{name}/difficulty" in m]
        d["level_changes"] = sum(a != b for a, b in zip(level_track, level_track[1:], strict=False))
        out[name] = d
    return out


def loophole_watch(run_dir: Path) -> dict[str, Any]:
    """What the loophole watch did during RL: its held-out evaluations, their time, and its warnings."""
    metrics = read_metrics(run_dir)
    evals = [m for m in metrics if m.get("kind") == "eval"]
    return {"evaluations": [m["step"] for m in evals], "seconds": round(sum(m.get("heldout/seconds", 0.0) for m in evals), 1),
            "warnings": [m["loophole"] for m in metrics if m.get("kind") == "warning" and "loophole" in m]}


def describe_watch(watch: dict[str, Any], rl_seconds: float) -> str:
    if not watch["evaluations"]:
        return "loophole watch: off (eval.every: 0, or a run under 8 steps)"
    share = f", {watch['seconds'] / rl_seconds:.0%} of RL's time" if rl_seconds > 0 else ""
    said = "; ".join(watch["warnings"]) if watch["warnings"] else "no warning"
    return (f"loophole watch: held-out pass@1 at steps {', '.join(map(str, watch['evaluations']))} "
            f"({watch['seconds']:.0f} s{share}): {said}")


def summary_table(rows: list[dict[str, Any]], held_out: bool, mean: dict[str, float] | None = None,
                  start: str = "after SFT") -> Table:
    def ci(e: dict[str, float]) -> str:
        return f"{e['value']:.3f} [{e['low']:.3f}, {e['high']:.3f}]"

    where = "held-out tasks" if held_out else "evaluation tasks that are NOT held out"
    table = Table(title=f"pass@1 on {where} (95% bootstrap CIs over tasks; Δ paired)")
    for col in ("domain", "tasks × n", start, "after RL", "Δ", "verdict"):
        table.add_column(col, justify="left" if col in ("domain", "verdict") else "right")
    for r in rows:
        table.add_row(r["domain"], f"{r['tasks']} × {r['n']}", ci(r["sft"]), ci(r["rl"]), ci(r["delta"]), r["verdict"])
    if mean is not None:
        sft = sum(r["sft"]["value"] for r in rows) / len(rows)
        rl = sum(r["rl"]["value"] for r in rows) / len(rows)
        verdict = "lift" if mean["low"] > 0 else "regression" if mean["high"] < 0 else "no significant change"
        table.add_row("mean", "", f"{sft:.3f}", f"{rl:.3f}", ci(mean), verdict)
    return table


def run_quickstart(cfg: Config, console: Console | None = None) -> list[dict[str, Any]]:
    run_dir = prepare_run_dir(cfg.run_dir, cfg.name, existing="move")  # a second quickstart keeps the first
    try:
        return _quickstart(cfg, console or Console(), run_dir)
    finally:
        release_run_dir(run_dir, run_dir / "sft")


def _quickstart(cfg: Config, console: Console, run_dir: Path) -> list[dict[str, Any]]:
    sft_dir = prepare_run_dir(run_dir, "sft")
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[stage], clock = now - clock, now
    start = cfg.model.path or f"a tiny {cfg.model.arch} policy built from the config"
    noise = f", {cfg.sft.label_noise:.0%} of them deliberately wrong" if cfg.sft.label_noise else ""
    console.print(f"[bold]1/5[/] {start}: SFT on the environments' reference solutions{noise}" if cfg.sft.steps
                  else f"[bold]1/5[/] {start}, as it comes (sft.steps: 0, no imitation)")
    with RunView("sft", max(cfg.sft.steps, 1), console=console) as view:
        policy = run_sft(cfg, sft_dir, view)
    lap("sft")
    console.print(f"[bold]2/5[/] evaluating the {'SFT' if cfg.sft.steps else 'starting'} policy on held-out tasks")
    before = evaluate_policy(cfg, policy)
    lap("eval_sft")
    console.print("   " + "  ".join(f"{name}: pass@1 {r.pass_at[1]}" for name, r in before.items()))
    rl_cfg = cfg.model_copy(deep=True)
    rl_cfg.model.path = str(policy)
    rl_cfg.threads = load_config(sft_dir / "config.yaml").threads  # the count SFT resolved: one count per run
    console.print(f"[bold]3/5[/] RL: {cfg.train.steps} steps over {', '.join(d.name for d in cfg.domains)}")
    with RunView("rl", cfg.train.steps, console=console) as view:
        pipeline = make_pipeline(rl_cfg, run_dir)
        pipeline.run(view)
    lap("rl")
    final = latest_checkpoint(run_dir)
    console.print("[bold]4/5[/] evaluating the RL policy on the same held-out tasks")
    after = evaluate_policy(cfg, final)
    lap("eval_rl")
    seconds["total"] = sum(seconds.values())
    rows = compare(before, after)
    mean = mean_difference(before, after)
    overlap = check_overlap(run_dir, (t for r in before.values() for t in r.task_ids))
    watch = loophole_watch(run_dir)
    start = "after SFT" if cfg.sft.steps else "as it came"
    atomic_write(run_dir / "summary.json", json.dumps({"domains": rows, "mean": mean, "start": start,
                                                        "held_out": overlap.held_out,
                                                        "loophole_watch": watch,
                                                        "overlap": overlap.describe(), "threads": rl_cfg.threads,
                                                        "seconds": {k: round(v, 1) for k, v in seconds.items()},
                                                        "per_task": {"start": per_task(before), "final": per_task(after)},
                                                        "training": training_dynamics(run_dir)}, indent=1))
    console.print("[bold]5/5[/] report")
    console.print(summary_table(rows, overlap.held_out, mean, start))
    console.print(overlap.describe())
    console.print(describe_watch(watch, seconds["rl"]))
    from assay.eval.report import write_report

    console.print(f"report: {write_report(run_dir)}")
    return rows
