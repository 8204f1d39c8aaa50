"""`assay bench agent`: the lockstep agent loop beside the online one (episodes advancing on their
own), on the same policy, tasks and seeds, alternating in one process; the ratio is what to read.

Lockstep runs each domain in turn and every turn waits for the slowest episode and for the tools of
all; online runs every domain's episodes in one engine batch, tool calls and verification overlapping
generation. Both sample the same tokens up to float rounding (the table gives the share of
trajectories that came out identical, the lowest over the rounds)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from assay.agent.groups import collect
from assay.core.config import Config
from assay.core.modeling import load_model
from assay.eval.evaluate import eval_tasks
from assay.pipeline.policy import domain_envs
from assay.rollout.factory import make_backend


@dataclass
class AgentRow:
    mode: str
    seconds: list[float]
    tokens: int
    agree: float = 1.0  # share of trajectories whose tokens equal the lockstep loop's (float rounding aside: 1)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def run_agent_bench(cfg: Config, policy: Path, tasks_per_domain: int, n: int, rounds: int) -> list[AgentRow]:
    model, tokenizer = load_model(policy)
    envs = domain_envs(cfg)
    domains = {d.name: d for d in cfg.domains}
    tasks = [t for d in cfg.domains for t in eval_tasks(envs[d.name], d.name, tasks_per_domain, cfg.eval.seed,
                                                         d.difficulty.levels(envs[d.name].difficulties))]
    rows = {mode: AgentRow(mode, [], 0) for mode in ("lockstep", "online")}
    for r in range(rounds):
        seen = {}
        for mode in (("lockstep", "online") if r % 2 == 0 else ("online", "lockstep")):
            backend = make_backend(cfg.rollout, model, tokenizer)
            t0 = time.perf_counter()
            trajs = collect(backend, tokenizer, envs, domains, tasks, samples=n, temperature=cfg.rollout.temperature,
                            seed=r, online=mode == "online")
            rows[mode].seconds.append(time.perf_counter() - t0)
            rows[mode].tokens = sum(t.completion_tokens for t in trajs)
            seen[mode] = [t.token_ids for t in trajs]
        same = [a == b for a, b in zip(seen["lockstep"], seen["online"], strict=True)]
        rows["online"].agree = min(rows["online"].agree, sum(same) / len(same))
    return list(rows.values())


def table(rows: list[AgentRow]) -> str:
    base = rows[0].median
    lines = ["| loop | wall s (median; all) | tokens/s | speed-up | trajectories equal to lockstep's |",
             "|---|---|---|---|---|"]
    for r in rows:
        runs = ", ".join(f"{s:.1f}" for s in r.seconds)
        lines.append(f"| {r.mode} | {r.median:.1f} ({runs}) | {r.tokens / r.median:.0f} | {base / r.median:.2f}x "
                     f"| {r.agree:.3f} |")
    return "\n".join(lines)
