"""`assay bench pipeline`: RL steps per second of the synchronous pipeline beside the asynchronous
one (and the online agent loop, and the rollout in a worker process), from the same policy and config,
alternating in one process."""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from assay.pipeline.async_pipeline import make_pipeline
from assay.pipeline.quickstart import default_config

VARIANTS = {
    "sync": [],
    "sync + online episodes": ["pipeline.online=true"],
    "async (staleness 1)": ["pipeline.mode=async", "pipeline.max_staleness=1"],
    "async + online episodes": ["pipeline.mode=async", "pipeline.max_staleness=1", "pipeline.online=true"],
    "async + online, rollout process": ["pipeline.mode=async", "pipeline.max_staleness=1", "pipeline.online=true",
                                        "pipeline.workers=process"],
}


@dataclass
class PipelineRow:
    variant: str
    seconds: list[float]
    steps: int

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def run_pipeline_bench(policy: Path, steps: int, rounds: int, overrides: list[str]) -> list[PipelineRow]:
    rows = {name: PipelineRow(name, [], steps) for name in VARIANTS}
    names = list(VARIANTS)
    with tempfile.TemporaryDirectory(prefix="assay-bench-pipeline-") as tmp:
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                cfg = default_config([f"model.path={policy}", f"train.steps={steps}", f"train.checkpoint_every={steps}",
                                      f"run_dir={tmp}", f"name=r{r}-{names.index(name)}", "train.max_refill_rounds=0",
                                      *overrides, *VARIANTS[name]])
                pipeline = make_pipeline(cfg, Path(tmp) / cfg.name)
                t0 = time.perf_counter()
                pipeline.run()
                rows[name].seconds.append(time.perf_counter() - t0)
    return list(rows.values())


def table(rows: list[PipelineRow]) -> str:
    base = rows[0].median
    lines = ["| pipeline | wall s for the steps (median; all) | s / step | speed-up |", "|---|---|---|---|"]
    for r in rows:
        runs = ", ".join(f"{s:.1f}" for s in r.seconds)
        lines.append(f"| {r.variant} | {r.median:.1f} ({runs}) | {r.median / r.steps:.2f} | {base / r.median:.2f}x |")
    return "\n".join(lines)
