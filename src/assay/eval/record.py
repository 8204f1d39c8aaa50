"""Evaluation records and their comparison.

A record is a directory: `record.json` (the policy's identity, each environment's version and hash,
the settings, and per environment its metrics and per-task results) and `trajectories/` (Parquet in
the run store's schema). `compare` pairs two records task by task (by `task_id`, never by
position) and gives each metric's paired difference with a bootstrap CI, a verdict, and the
minimum effect the suite could detect."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from assay.core.atomic import atomic_write
from assay.core.errors import AssayError
from assay.core.gguf_import import PACKAGED, resolve_gguf
from assay.core.storage import TrajectoryWriter
from assay.core.types import OK, Trajectory
from assay.envs.base import Environment
from assay.eval.evaluate import DomainEval
from assay.eval.passk import Estimate, bootstrap_mean, minimum_detectable_effect, pass_at_k

RECORD = "record.json"
# Per-task metrics kept in a record and compared pairwise; pass@1 first.
TASK_METRICS = ("pass@1", "turns", "completion_tokens", "tool_errors")


def policy_identity(policy: Path) -> dict[str, str]:
    """A checkpoint is identified by the hash of its weights, not its path; a .gguf file or a packaged model's
    name (as `model.path` takes them) by the hash of its GGUF file."""
    if policy.suffix == ".gguf" or (not policy.exists() and str(policy) in PACKAGED):
        return {"kind": "gguf", "path": str(policy), "weights_sha256": _sha256([resolve_gguf(policy)])}
    weights = sorted(policy.glob("*.safetensors"))
    if not weights:
        raise AssayError(f"{policy} holds no *.safetensors weights; pass a policy directory "
                         f"(runs/NAME/policy or runs/NAME/checkpoints/step_N), a .gguf file or a packaged model "
                         f"({', '.join(PACKAGED)})")
    return {"kind": "checkpoint", "path": str(policy), "weights_sha256": _sha256(weights)}


def _sha256(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for w in files:
        with w.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _per_task(r: DomainEval) -> dict[str, dict[str, Any]]:
    by_task: dict[str, list[Trajectory]] = {}
    for t in r.trajectories:
        if t.status == OK:
            by_task.setdefault(t.task.task_id, []).append(t)
    out: dict[str, dict[str, Any]] = {}
    for task_id, passes in zip(r.task_ids, r.passes, strict=True):
        trajs = by_task[task_id]  # a task is listed only when some sample of it ran without failure
        out[task_id] = {"passes": passes, "difficulty": trajs[0].task.difficulty,
                        **{f: float(np.mean([getattr(t, f) for t in trajs])) for f in TASK_METRICS[1:]}}
    return out


def metrics(r: DomainEval, prices: tuple[float, float] = (0.0, 0.0)) -> dict[str, Any]:
    return {
        "tasks": len(r.passes), "n": r.n, "infra_errors": r.infra_errors, "mean_reward": r.mean_reward,
        "pass_at": {k: vars(e) for k, e in r.pass_at.items()}, "pass_hat": {k: vars(e) for k, e in r.pass_hat.items()},
        "by_difficulty": r.by_difficulty, "rounds": r.rounds, "mean_rounds": r.mean_rounds,
        "tool_calls": r.tool_calls, "tool_error_rate": r.tool_error_rate, "recovery_rate": r.recovery_rate,
        "episodes_with_tool_error": r.with_tool_error, "call_turns": r.call_turns,
        "malformed_rate": r.malformed_rate, "retries": r.retries, "retry_success_rate": r.retry_success_rate,
        "degraded_calls": r.degraded_calls, "fallback_calls": r.fallback_calls, "tools": r.tools,
        "peak_context_mean": r.peak_context, "peak_context_max": r.peak_context_max, "compactions": r.compactions,
        "memory_calls": r.memory_calls, "plan_turns": r.plan_turns, "milestones": r.milestones,
        "approved_calls": r.approved_calls, "denied_calls": r.denied_calls,
        "refused_calls": r.refused_calls, "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens, "latency_p50_s": r.latency_p50, "latency_p95_s": r.latency_p95,
        "cost_per_episode": r.cost(*prices), "prices_per_mtok": list(prices),
    }


def write_record(out: Path, results: dict[str, DomainEval], policy: dict[str, str], envs: dict[str, Environment],
                 settings: dict[str, Any], prices: tuple[float, float] = (0.0, 0.0)) -> Path:
    """Trajectories first, then record.json (atomically): a record.json always describes what is there."""
    from assay.envs.registry import env_hash, env_spec

    writer = TrajectoryWriter(out / "trajectories")
    seen: set[int] = set()  # an "overall" entry holds the others' trajectories again: each is written once
    for step, r in enumerate(results.values()):
        writer.write([t for t in r.trajectories if id(t) not in seen], step)
        seen.update(id(t) for t in r.trajectories)
    record = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "policy": policy, "settings": settings,
              "environments": {name: {"spec": env_spec(e), "hash": env_hash(e)} for name, e in envs.items()},
              "domains": {name: {"metrics": metrics(r, prices), "per_task": _per_task(r)} for name, r in results.items()}}
    atomic_write(out / RECORD, json.dumps(record, indent=1))
    return out / RECORD


def read_record(path: Path) -> dict[str, Any]:
    file = path / RECORD if path.is_dir() else path
    try:
        record = json.loads(file.read_text())
        record["domains"]
    except FileNotFoundError:
        raise AssayError(f"{file} not found; pass an evaluation record directory (what assay eval --out wrote)") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise AssayError(f"{file} is not a readable evaluation record ({type(e).__name__}: {e}); re-run the "
                         "evaluation") from None
    return record


@dataclass
class Comparison:
    domain: str
    metric: str
    a: float
    b: float
    diff: Estimate  # b - a, paired by task
    paired: int
    only_a: int  # tasks evaluated on one side only: reported, left out
    only_b: int
    mde: float  # minimum detectable effect at this suite size (80% power, 5% two-sided)

    @property
    def verdict(self) -> str:
        if self.paired < 2:
            return "too few paired tasks"
        if self.diff.low > 0:
            return "B higher"
        if self.diff.high < 0:
            return "B lower"
        return "no significant difference"


def _task_value(entry: dict[str, Any], metric: str) -> float:
    if metric == "pass@1":
        passes = entry["passes"]
        return pass_at_k(len(passes), sum(passes), 1)
    return float(entry[metric])


def compare(a: dict[str, Any], b: dict[str, Any], rounds: int = 2000, seed: int = 0) -> list[Comparison]:
    rows = []
    for domain in [d for d in a["domains"] if d in b["domains"]]:
        ta, tb = a["domains"][domain]["per_task"], b["domains"][domain]["per_task"]
        shared = sorted(set(ta) & set(tb))
        for metric in TASK_METRICS:
            va = np.array([_task_value(ta[t], metric) for t in shared])
            vb = np.array([_task_value(tb[t], metric) for t in shared])
            est = bootstrap_mean(vb - va, rounds, seed) if shared else Estimate(0.0, 0.0, 0.0)
            rows.append(Comparison(domain, metric, float(va.mean()) if len(va) else 0.0,
                                   float(vb.mean()) if len(vb) else 0.0, est, len(shared), len(set(ta) - set(tb)),
                                   len(set(tb) - set(ta)), minimum_detectable_effect(est.se)))
    return rows
