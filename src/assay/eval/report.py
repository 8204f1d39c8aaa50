"""`assay report`: a self-contained report.html with per-domain training curves as embedded PNGs."""

from __future__ import annotations

import base64
import html
import io
import json
from collections import defaultdict
from pathlib import Path

from assay.core.storage import atomic_write, read_metrics

PANELS = [("pass_rate", "pass rate"), ("reward_mean", "mean reward"), ("difficulty", "curriculum difficulty"),
          ("ratio", "mixer ratio"), ("completion_len", "completion tokens"), ("truncation_rate", "truncation rate"),
          ("entropy", "entropy"), ("kl_ref", "KL to reference"), ("mismatch", "trainer-engine |Δ logprob|"),
          ("tool_errors", "tool errors / trajectory")]
GLOBAL = [("loss", "loss"), ("grad_norm", "grad norm"), ("clip_frac", "clip fraction"),
          ("groups_dropped", "groups dropped")]


def _png(series: dict[str, list[tuple[int, float]]], title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3), dpi=90)
    for label, points in sorted(series.items()):
        ax.plot([s for s, _ in points], [v for _, v in points], label=label, linewidth=1.5)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _img(series: dict[str, list[tuple[int, float]]], title: str) -> str:
    return f'<img alt="{html.escape(title)}" src="data:image/png;base64,{_png(series, title)}">'


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
        sections.append(f"<h2>Evaluation</h2><pre>{html.escape(json.dumps(json.loads(summary.read_text()), indent=1))}</pre>")
    sections.append("<h2>Per domain</h2>")
    sections += [_img(per_key[k], title) for k, title in PANELS if per_key.get(k)]
    sections.append("<h2>Optimisation</h2>")
    sections += [_img(per_key[k], title) for k, title in GLOBAL if per_key.get(k)]
    page = "<!doctype html><meta charset=utf-8><title>Assay report</title>" \
           "<style>body{font-family:sans-serif;max-width:1100px;margin:auto} img{margin:4px}</style>" + "\n".join(sections)
    out = run_dir / "report.html"
    atomic_write(out, page)
    return out
