"""The main job on the embedded default: build a tiny policy, SFT it, evaluate, RL-train it on
several domains with the adaptive mixer, evaluate again on the same held-out tasks, compare."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from assay.core.checkpoint import latest_checkpoint
from assay.core.config import Config, build_config
from assay.core.modeling import load_model
from assay.core.storage import atomic_write, prepare_run_dir
from assay.eval.evaluate import DomainEval, evaluate
from assay.eval.passk import paired_difference_ci
from assay.pipeline.overlap import check_overlap
from assay.pipeline.policy import domain_envs
from assay.pipeline.sft import run_sft
from assay.pipeline.sync import SyncPipeline
from assay.pipeline.ui import RunView
from assay.rollout.factory import make_backend


def default_config_text() -> str:
    return resources.files("assay").joinpath("configs/quickstart.yaml").read_text()


def default_config(overrides: list[str] | tuple[str, ...] = ()) -> Config:
    import yaml

    return build_config(yaml.safe_load(default_config_text()), overrides)


def evaluate_policy(cfg: Config, policy_dir: Path) -> dict[str, DomainEval]:
    model, tokenizer = load_model(policy_dir)
    envs = domain_envs(cfg)
    return evaluate(make_backend(cfg.rollout, model, tokenizer), tokenizer, envs, {d.name: d for d in cfg.domains},
                    cfg.eval.tasks_per_domain, cfg.eval.n, cfg.eval.seed, cfg.eval.temperature)


def compare(before: dict[str, DomainEval], after: dict[str, DomainEval]) -> list[dict[str, Any]]:
    rows = []
    for name in before:
        b, a = before[name], after[name]
        diff = paired_difference_ci(b.passes, a.passes, k=1)
        verdict = "lift" if diff.low > 0 else "regression" if diff.high < 0 else "no significant change"
        rows.append({"domain": name, "tasks": len(b.passes), "n": b.n,
                     "sft": vars(b.pass_at[1]), "rl": vars(a.pass_at[1]), "delta": vars(diff), "verdict": verdict,
                     "sft_by_difficulty": b.by_difficulty, "rl_by_difficulty": a.by_difficulty})
    return rows


def summary_table(rows: list[dict[str, Any]], held_out: bool) -> Table:
    def ci(e: dict[str, float]) -> str:
        return f"{e['value']:.3f} [{e['low']:.3f}, {e['high']:.3f}]"

    where = "held-out tasks" if held_out else "evaluation tasks that are NOT held out"
    table = Table(title=f"pass@1 on {where} (95% bootstrap CIs over tasks; Δ paired)")
    for col in ("domain", "tasks × n", "after SFT", "after RL", "Δ", "verdict"):
        table.add_column(col, justify="left" if col in ("domain", "verdict") else "right")
    for r in rows:
        table.add_row(r["domain"], f"{r['tasks']} × {r['n']}", ci(r["sft"]), ci(r["rl"]), ci(r["delta"]), r["verdict"])
    return table


def run_quickstart(cfg: Config, console: Console | None = None) -> list[dict[str, Any]]:
    console = console or Console()
    run_dir = prepare_run_dir(cfg.run_dir, cfg.name)
    sft_dir = prepare_run_dir(run_dir, "sft")
    console.print(f"[bold]1/5[/] building a tiny {cfg.model.arch} policy and its tokenizer, SFT on reference solutions")
    with RunView("sft", cfg.sft.steps, console=console) as view:
        policy = run_sft(cfg, sft_dir, view)
    console.print("[bold]2/5[/] evaluating the SFT policy on held-out tasks")
    before = evaluate_policy(cfg, policy)
    console.print("   " + "  ".join(f"{name}: pass@1 {r.pass_at[1]}" for name, r in before.items()))
    rl_cfg = cfg.model_copy(deep=True)
    rl_cfg.model.path = str(policy)
    console.print(f"[bold]3/5[/] RL: {cfg.train.steps} steps over {', '.join(d.name for d in cfg.domains)}")
    with RunView("rl", cfg.train.steps, console=console) as view:
        pipeline = SyncPipeline(rl_cfg, run_dir)
        pipeline.run(view)
    final = latest_checkpoint(run_dir)
    console.print("[bold]4/5[/] evaluating the RL policy on the same held-out tasks")
    after = evaluate_policy(cfg, final)
    rows = compare(before, after)
    overlap = check_overlap(run_dir, (t for r in before.values() for t in r.task_ids))
    atomic_write(run_dir / "summary.json", json.dumps({"domains": rows, "held_out": overlap.held_out,
                                                        "overlap": overlap.describe()}, indent=1))
    console.print("[bold]5/5[/] report")
    console.print(summary_table(rows, overlap.held_out))
    console.print(overlap.describe())
    from assay.eval.report import write_report

    console.print(f"report: {write_report(run_dir)}")
    return rows
