"""An evaluation record as one self-contained HTML page: the metric table (and the long-horizon columns that
apply), pass@k and pass^k curves per entry, pass rate by difficulty, and every trajectory to browse, turn by
turn (eval/trajview.py). Plots are matplotlib PNGs embedded in the page."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from assay.eval.horizon import horizon_columns
from assay.eval.page import figure_img, pyplot, trajectory_list, write_page
from assay.eval.record import read_record


def _curves(domains: dict[str, Any], key: str, title: str) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=90)
    for name, d in domains.items():
        points = sorted((int(k), e) for k, e in d["metrics"][key].items())
        ks = [k for k, _ in points]
        ax.plot(ks, [e["value"] for _, e in points], marker="o", label=name)
        ax.fill_between(ks, [e["low"] for _, e in points], [e["high"] for _, e in points], alpha=0.15)
    ax.set_xticks(sorted({int(k) for d in domains.values() for k in d["metrics"][key]}))
    ax.set_xlabel("k (samples)")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return figure_img(fig, title)


def _difficulty_bars(domains: dict[str, Any]) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=90)
    width = 0.8 / max(len(domains), 1)
    for i, (name, d) in enumerate(domains.items()):
        levels = sorted((int(k), v) for k, v in d["metrics"]["by_difficulty"].items())
        ax.bar([lv + i * width for lv, _ in levels], [v for _, v in levels], width, label=name)
    every = sorted({int(k) for d in domains.values() for k in d["metrics"]["by_difficulty"]})
    ax.set_xticks([lv + 0.4 - width / 2 for lv in every], every)  # under the middle of each level's bars
    ax.set_xlabel("difficulty level")
    ax.set_ylabel("pass rate")
    ax.set_ylim(0, 1)
    ax.set_title("pass rate by difficulty")
    ax.legend(fontsize=7)
    return figure_img(fig, "pass rate by difficulty")


def _fmt(x: Any) -> str:
    if x is None:
        return "–"
    return f"{x:.3f}" if isinstance(x, float) else html.escape(str(x))


def _metric_table(domains: dict[str, Any]) -> str:
    head = ["entry", "tasks × n", "pass@1 [95% CI]", "pass^n", "s.e.", "rounds", "tool error rate", "recovery rate",
            "tokens (prompt / completion)", "latency p50 / p95 s", "cost / episode", "infra errors"]
    rows = []
    for name, d in domains.items():
        m = d["metrics"]
        p1 = m["pass_at"].get("1") or m["pass_at"].get(1) or {}
        hat = m["pass_hat"][max(m["pass_hat"], key=int)] if m["pass_hat"] else {}
        cells = [name, f"{m['tasks']} × {m['n']}",
                 f"{_fmt(p1.get('value'))} [{_fmt(p1.get('low'))}, {_fmt(p1.get('high'))}]", _fmt(hat.get("value")),
                 _fmt(p1.get("se")), _fmt(m["mean_rounds"]), _fmt(m["tool_error_rate"]), _fmt(m["recovery_rate"]),
                 f"{m['prompt_tokens']:.0f} / {m['completion_tokens']:.0f}",
                 f"{m['latency_p50_s']:.2f} / {m['latency_p95_s']:.2f}", f"{m['cost_per_episode']:.6f}",
                 str(m["infra_errors"])]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c) if i == 0 else c}</td>" for i, c in enumerate(cells)) + "</tr>")
    return ('<table id="metrics"><tr>' + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows)
            + "</table>")


def _horizon_table(domains: dict[str, Any]) -> str:
    """Context handling, tool-call recovery and milestones: only the columns that apply (eval/horizon.py)."""
    head, rows = horizon_columns({name: d["metrics"] for name, d in domains.items()})
    if not head:
        return ""
    return ('<h3>Long horizons (per episode)</h3><table id="horizon"><tr><th>entry</th>'
            + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
            + "".join(f"<tr><td>{html.escape(name)}</td>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells)
                      + "</tr>" for name, cells in rows.items()) + "</table>")


def write_eval_html(record_dir: Path) -> Path:
    record = read_record(record_dir)
    domains = record["domains"]
    policy = record["policy"]
    settings = record["settings"]
    held_out = settings.get("held_out") or "not checked against a training run (assay eval --run)"
    sections = [
        f"<h1>Evaluation: {html.escape(settings.get('suite') or ', '.join(d for d in domains if d != 'overall'))}</h1>",
        f"<p>policy {html.escape(policy.get('path', ''))} (weights sha256 {html.escape(policy.get('weights_sha256', '')[:16])}…),"
        f" {html.escape(record['created'])}; {html.escape(held_out)}</p>",
        "<h2>Metrics</h2>", _metric_table(domains), _horizon_table(domains),
        "<h2>Curves</h2>", _curves(domains, "pass_at", "pass@k"), _curves(domains, "pass_hat", "pass^k (all k pass)"),
        _difficulty_bars(domains),
        trajectory_list(sorted((record_dir / "trajectories").glob("*.parquet"))),
        "<h2>Settings</h2><pre>" + html.escape(json.dumps({"settings": settings, "environments": record["environments"]},
                                                          indent=1)) + "</pre>",
    ]
    return write_page(record_dir / "report.html", "Assay evaluation", sections)
