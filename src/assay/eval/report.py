"""`assay report`: a self-contained report.html with the held-out table, a timeline of what the
rollout and the trainer did when, per-domain training curves as embedded PNGs and the last training
trajectories to browse."""

from __future__ import annotations

import html
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from assay.core.storage import read_metrics, trajectory_shards
from assay.eval.page import figure_img, pyplot, trajectory_list, write_page

PANELS = [("pass_rate", "pass rate"), ("reward_mean", "mean reward"), ("difficulty", "curriculum difficulty"),
          ("ratio", "mixer ratio"), ("completion_len", "completion tokens"), ("truncation_rate", "truncation rate"),
          ("entropy", "entropy"), ("kl_ref", "KL to reference"), ("mismatch", "trainer-engine |Δ logprob|"),
          ("tool_errors", "tool errors / trajectory"), ("malformed_rate", "malformed tool-call turns (share)"),
          ("retry_success_rate", "tool-call retries answered well-formed"), ("staleness", "staleness (policy versions)"),
          ("is_weight", "importance weight, truncated (decoupled)")]
GLOBAL = [("loss", "loss"), ("grad_norm", "grad norm"), ("clip_frac", "clip fraction"),
          ("groups_dropped", "groups dropped"), ("is_truncated", "share of tokens truncated (decoupled)")]


def _img(series: dict[str, list[tuple[int, float]]], title: str, colors: dict[str, str]) -> str:
    fig, ax = pyplot().subplots(figsize=(5, 3), dpi=90)
    for label, points in sorted(series.items()):
        color = colors.setdefault(label, f"C{len(colors) % 10}")  # one colour per domain on every panel
        ax.plot([s for s, _ in points], [v for _, v in points], label=label, color=color, linewidth=1.5)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=7)
    return figure_img(fig, title)


def _timeline(records: list[dict[str, Any]]) -> str:
    """When the rollout and the trainer worked, step by step, on the run's wall clock; with their busy
    shares (above 100% together where they overlapped). Empty for runs that did not log it."""
    spans = {w: [(r[f"{w}_start_s"], r[f"{w}_s"]) for r in records if f"{w}_start_s" in r] for w in ("rollout", "train")}
    if not spans["rollout"] or not spans["train"]:
        return ""
    t0 = min(start for w in spans.values() for start, _ in w)
    wall = max(start + d for w in spans.values() for start, d in w) - t0
    fig, ax = pyplot().subplots(figsize=(10, 1.8), dpi=90)
    for row, (worker, color) in enumerate((("rollout", "C0"), ("train", "C1"))):
        ax.broken_barh([(start - t0, d) for start, d in spans[worker]], (row - 0.4, 0.8), facecolor=color,
                       edgecolor="white", linewidth=1)  # a gap between steps
    ax.set_yticks([0, 1], ["rollout", "trainer"])
    ax.set_xlabel("seconds since the first step began")
    ax.set_title("what each worker did when")
    busy = {w: sum(d for _, d in spans[w]) / max(wall, 1e-9) for w in spans}
    return (f"<h2>Timeline</h2>{figure_img(fig, 'timeline')}<p>Over {wall:.0f} s: rollout busy "
            f"{busy['rollout']:.0%}, trainer busy {busy['train']:.0%}.</p>")


def _ci(e: dict[str, float]) -> str:
    return f"{e['value']:.3f} [{e['low']:.3f}, {e['high']:.3f}]"


def _summary(summary: dict[str, Any]) -> str:
    """The quickstart's held-out table (SFT against RL, paired Δ), then the whole summary, folded."""
    rows = "".join(f"<tr><td>{html.escape(d['domain'])}</td><td>{d['tasks']} × {d['n']}</td><td>{_ci(d['sft'])}</td>"
                   f"<td>{_ci(d['rl'])}</td><td>{_ci(d['delta'])}</td><td>{html.escape(d['verdict'])}</td></tr>"
                   for d in summary.get("domains", []))
    start = html.escape(summary.get("start", "after SFT"))  # "as it came" where RL started without SFT
    table = (f"<table id=summary><tr><th>domain</th><th>tasks × samples</th><th>{start}</th><th>after RL</th>"
             f"<th>Δ (paired, 95%)</th><th>verdict</th></tr>{rows}</table>" if rows else "")
    overlap = f"<p>{html.escape(str(summary['overlap']))}</p>" if "overlap" in summary else ""
    watch = summary.get("loophole_watch")
    if watch and watch["evaluations"]:
        said = "; ".join(watch["warnings"]) or "no warning"
        overlap += (f"<p>loophole watch: held-out pass@1 at steps {', '.join(map(str, watch['evaluations']))}: "
                    f"{html.escape(said)}</p>")
    return (f"<h2>Held-out evaluation</h2>{table}{overlap}<details><summary>summary.json</summary><pre>"
            f"{html.escape(json.dumps(summary, indent=1))}</pre></details>")


def write_report(run_dir: Path) -> Path:
    records = [r for r in read_metrics(run_dir) if r.get("kind") == "train"]
    per_key: dict[str, dict[str, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        for key, value in r.items():
            if not isinstance(value, (int, float)) or key in ("step", "time"):
                continue
            parts = key.split("/")
            if parts[0] == "domain" and len(parts) == 3:  # domain/<name>/<metric>, from the mixer
                per_key[parts[2]][parts[1]].append((r["step"], value))
            elif len(parts) == 2:  # <metric>/<name>, from the trainer
                per_key[parts[0]][parts[1]].append((r["step"], value))
            else:
                per_key[key]["all"].append((r["step"], value))
    sections = [f"<h1>Assay run {html.escape(run_dir.name)}</h1>",
                f"<p>{len(records)} training steps recorded in {html.escape(str(run_dir / 'metrics.jsonl'))}.</p>"]
    summary = run_dir / "summary.json"
    if summary.is_file():
        sections.append(_summary(json.loads(summary.read_text())))
    sections.append(_timeline(records))
    sections.append("<h2>Per domain</h2>")
    colors: dict[str, str] = {}
    sections += [_img(per_key[k], title, colors) for k, title in PANELS if per_key.get(k)]
    sections += [_img(per_key[k], f"reward term {k[len('term_'):]}", colors) for k in sorted(per_key)
                 if k.startswith("term_")]  # shaped rewards (domains[].rewards), one panel per term
    sections.append("<h2>Optimisation</h2>")
    sections += [_img(per_key[k], title, colors) for k, title in GLOBAL if per_key.get(k)]
    sections.append(trajectory_list(trajectory_shards(run_dir / "trajectories"), "Training trajectories"))
    return write_page(run_dir / "report.html", f"Assay run {run_dir.name}", sections)
