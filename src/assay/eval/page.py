"""Pieces shared by the self-contained HTML pages (`assay eval --html`, `assay report`): matplotlib
figures embedded as PNGs, a browsable list of trajectories, and the page frame."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from assay.core.atomic import atomic_write
from assay.eval.trajview import render_trajectory

MAX_TRAJECTORIES = 300  # listed in a page; the rest stay in the Parquet shards
COLUMNS = ("step", "domain", "task_id", "difficulty", "messages", "reward", "passed", "status", "turns", "finish_reason",
           "tool_errors", "plan_turns", "compacted_turns", "milestones", "reward_info")  # what a page shows

_STYLE = ("body{font-family:sans-serif;max-width:1200px;margin:auto} table{border-collapse:collapse;font-size:13px}"
          "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right} td:first-child{text-align:left}"
          "pre{white-space:pre-wrap;margin:2px 0;background:#f6f6f6} img{margin:4px}"
          ".tool{border-left:3px solid #c63;padding-left:4px;margin:3px 0} .tool.err{border-left-color:#d00}"
          ".call{background:#eef;padding:2px 4px;margin:3px 0} .user,.system{margin:3px 0}"
          "details.traj{margin:4px 0} details.traj>summary{cursor:pointer}"
          "details.turn{border-left:3px solid #36c;margin:3px 0 3px 8px;padding-left:6px}"
          "details.turn.err{border-left-color:#d00} details.turn.plan{border-left-color:#999;background:#fafafa}"
          "details.turn>summary{cursor:pointer;font-family:monospace;font-size:13px}"
          ".more>summary,.reasoning>summary,.system>summary{cursor:pointer;color:#555;font-size:12px}"
          ".err-mark{color:#d00;font-weight:bold} .milestone{color:#080;font-weight:bold} .missed{color:#888}"
          ".plan-mark{color:#555;font-style:italic} .compact-mark{color:#a60}"
          ".cut{border-top:2px dashed #a60;color:#a60;font-size:12px;margin:6px 0 2px 8px}"
          ".meta{font-size:13px;color:#333;margin:4px 0} .lbl{color:#777;font-size:11px;text-transform:uppercase}"
          ".diff{font-family:monospace;font-size:12px;background:#f6f6f6;margin:2px 0}"
          ".diff div{white-space:pre-wrap;min-height:1.2em} .diff .add{background:#dfd}"
          ".diff .del{background:#fdd} .diff .hunk{color:#888}")
# Counts the plots that actually decoded: a check (and a test) can read it from the rendered DOM. fold() opens or
# closes every turn of one trajectory (its buttons).
_SCRIPT = ("<script>addEventListener('load',()=>{document.body.dataset.plotsRendered="
           "[...document.images].filter(i=>i.naturalWidth>0).length});"
           "function fold(b,o){for(const d of b.closest('details.traj').querySelectorAll('details.turn'))d.open=o}"
           "</script>")


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure_img(fig: Any, alt: str) -> str:
    """The figure as an <img> with the PNG inline; closes the figure."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    pyplot().close(fig)
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def trajectory_list(shards: Sequence[Path], title: str = "Trajectories") -> str:
    """Each trajectory of the shards (up to MAX_TRAJECTORIES, the last ones when there are more) as a
    collapsible item: prompt, one fold per turn with its tool calls and results, reward (eval/trajview.py)."""
    rows = []
    for s in shards:
        present = set(pq.read_schema(s).names)  # a shard written before a column was added lacks it
        rows += pq.read_table(s, columns=[c for c in COLUMNS if c in present]).to_pylist()
    shown = rows[-MAX_TRAJECTORIES:]
    more = (f"<p>{len(rows) - len(shown)} earlier ones are in the Parquet shards, not listed here.</p>"
            if len(rows) > len(shown) else "")
    return f"<h2>{html.escape(title)} ({len(rows)})</h2>" + more + "".join(render_trajectory(r) for r in shown)


def write_page(out: Path, title: str, sections: Sequence[str]) -> Path:
    atomic_write(out, f"<!doctype html><meta charset=utf-8><title>{html.escape(title)}</title>"
                      f"<style>{_STYLE}</style>{_SCRIPT}" + "\n".join(sections))
    return out
