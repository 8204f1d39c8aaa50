"""The evaluation's tables for the terminal: pass rates with CIs, then the other dimensions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from rich.table import Table

from assay.eval.evaluate import DomainEval
from assay.eval.horizon import horizon_columns
from assay.eval.record import Comparison, metrics


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def pass_table(results: dict[str, DomainEval], ks: Sequence[int], title: str) -> Table:
    table = Table(title=title)
    table.add_column("environment")
    for k in ks:
        table.add_column(f"pass@{k}", justify="right")
    table.add_column("by difficulty (pass rate)")
    table.add_column("infra errors", justify="right")
    for name, r in results.items():
        levels = " ".join(f"{d}:{p:.2f}" for d, p in r.by_difficulty.items())
        table.add_row(name, *(str(r.pass_at[k]) if k in r.pass_at else "-" for k in ks), levels, str(r.infra_errors))
    return table


def dimensions_table(results: dict[str, DomainEval], ks: Sequence[int], prices: tuple[float, float]) -> Table:
    table = Table(title="reliability, interaction and cost (per episode; infrastructure errors left out)")
    for col in ("environment", f"pass^{max(ks)}", "pass@1 s.e.", "rounds (mean; 1/2/3…)", "tool errors",
                "recovered", "malformed calls", "retries ok", "degraded (fallback)", "tokens prompt / completion",
                "latency p50 / p95 s", "cost"):
        table.add_column(col, justify="left" if col == "environment" else "right")
    for name, r in results.items():
        hat = r.pass_hat.get(max(ks))
        rounds = "/".join(str(r.rounds.get(i, 0)) for i in range(1, max(r.rounds, default=1) + 1))
        table.add_row(name, str(hat) if hat else "-", f"{r.pass_at[1].se:.3f}" if 1 in r.pass_at else "-",
                      f"{r.mean_rounds:.2f} ({rounds})",
                      f"{_rate(r.tool_error_rate)} of {r.tool_calls}", f"{_rate(r.recovery_rate)} of {r.with_tool_error}",
                      f"{_rate(r.malformed_rate)} of {r.call_turns}", f"{_rate(r.retry_success_rate)} of {r.retries}",
                      f"{r.degraded_calls} ({r.fallback_calls})",
                      f"{r.prompt_tokens:.0f} / {r.completion_tokens:.0f}", f"{r.latency_p50:.2f} / {r.latency_p95:.2f}",
                      f"{r.cost(*prices):.6f}")
    return table


def horizon_table(results: dict[str, DomainEval]) -> Table | None:
    """Context handling and milestones (eval/horizon.py), only the columns that apply; None when none does."""
    head, rows = horizon_columns({name: metrics(r) for name, r in results.items()}, recovery=False)
    if not head:
        return None
    table = Table(title="long horizons (per episode; infrastructure errors left out)")
    for col in ("environment", *head):
        table.add_column(col, justify="left" if col == "environment" else "right")
    for name, cells in rows.items():
        table.add_row(name, *cells)
    return table


def comparison_table(rows: list[Comparison], effect: float | None) -> Table:
    table = Table(title="B − A, paired by task (95% bootstrap CIs); MDE: the smallest effect this suite detects "
                        "with 80% power")
    for col in ("environment", "metric", "A", "B", "B − A", "paired (only A / only B)", "MDE", "verdict"):
        table.add_column(col, justify="left" if col in ("environment", "metric", "verdict") else "right")
    for c in rows:
        verdict = c.verdict
        if effect is not None and c.metric == "pass@1" and c.mde > effect:
            verdict += f"; too small a suite for {effect:g}"
        table.add_row(c.domain, c.metric, f"{c.a:.3f}", f"{c.b:.3f}", str(c.diff), f"{c.paired} ({c.only_a} / {c.only_b})",
                      f"{c.mde:.3f}", verdict)
    return table


def repeats_table(records: list[dict[str, Any]]) -> Table:
    """pass@1 of each entry in each repeat of the same tasks with other sampling seeds, and its spread."""
    table = Table(title=f"run-to-run variance: the same tasks, {len(records)} sampling seeds")
    for col in ("environment", "pass@1 per run", "mean", "sd between runs", "mean s.e. within a run"):
        table.add_column(col, justify="left" if col == "environment" else "right")
    for name in records[0]["domains"]:
        runs = [r["domains"][name]["metrics"]["pass_at"]["1"] for r in records if name in r["domains"]]
        values = np.array([e["value"] for e in runs])
        table.add_row(name, " ".join(f"{v:.3f}" for v in values), f"{values.mean():.3f}",
                      f"{values.std(ddof=1):.3f}", f"{np.mean([e['se'] for e in runs]):.3f}")
    return table
