"""Pieces shared by the self-contained HTML pages (`assay eval --html`, `assay report`): matplotlib
figures embedded as PNGs, a browsable list of trajectories, and the page frame."""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from assay.core.atomic import atomic_write

MAX_TRAJECTORIES = 300  # listed in a page; the rest stay in the Parquet shards

_STYLE = ("body{font-family:sans-serif;max-width:1200px;margin:auto} table{border-collapse:collapse;font-size:13px}"
          "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right} td:first-child{text-align:left}"
          "pre{white-space:pre-wrap;margin:2px 0;background:#f6f6f6} .assistant{border-left:3px solid #36c;padding-left:4px}"
          ".tool{border-left:3px solid #c63;padding-left:4px} .call{background:#eef} img{margin:4px}")
# Counts the plots that actually decoded: a check (and a test) can read it from the rendered DOM.
_SCRIPT = ("<script>addEventListener('load',()=>{document.body.dataset.plotsRendered="
           "[...document.images].filter(i=>i.naturalWidth>0).length})</script>")


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
    collapsible item: prompt, assistant turns with their tool calls, tool observations, reward."""
    columns = ["step", "domain", "task_id", "difficulty", "messages", "reward", "passed", "status", "turns"]
    rows = [r for s in shards for r in pq.read_table(s, columns=columns).to_pylist()]
    shown = rows[-MAX_TRAJECTORIES:]
    items = []
    for r in shown:
        turns = []
        for m in json.loads(r["messages"]):
            calls = "".join(f"<pre class=call>{html.escape(c['name'])}({html.escape(json.dumps(c['arguments']))})</pre>"
                            for c in m.get("tool_calls", []))
            turns.append(f"<div class={m['role']}><b>{m['role']}</b><pre>{html.escape(m['content'])}</pre>{calls}</div>")
        verdict = "pass" if r["passed"] else "fail" if r["status"] == "ok" else r["status"]
        items.append(f"<details class=traj><summary>step {r['step']} · {html.escape(r['domain'])} · "
                     f"level {r['difficulty']} · {html.escape(r['task_id'])} · {r['turns']} turns · "
                     f"reward {r['reward']:.2f} ({verdict})</summary>{''.join(turns)}</details>")
    more = (f"<p>{len(rows) - len(shown)} earlier ones are in the Parquet shards, not listed here.</p>"
            if len(rows) > len(shown) else "")
    return f"<h2>{html.escape(title)} ({len(rows)})</h2>" + more + "".join(items)


def write_page(out: Path, title: str, sections: Sequence[str]) -> Path:
    atomic_write(out, f"<!doctype html><meta charset=utf-8><title>{html.escape(title)}</title>"
                      f"<style>{_STYLE}</style>{_SCRIPT}" + "\n".join(sections))
    return out
