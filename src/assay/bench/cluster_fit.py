"""What `assay bench cluster` measures from a real run: the duration distributions its model resamples.

Everything here is read from a synchronous run's directory (`metrics.jsonl` and `trajectories/`),
nothing is assumed: per GRPO group its episodes' turns, sampled and observation tokens, tool and
verification seconds; per step its refill rounds, batch tokens, rollout and train seconds, weight
sync and the driver's time outside both; and two laws fitted by least squares, the engine's (seconds
of generation against iterations and computed tokens) and the trainer's (seconds against batch tokens,
used only where it explains the data; otherwise train times are resampled and scaled by tokens)."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from assay.core.errors import AssayError

VERIFY_THREADS = 4  # rollout.verifiers by default: the verifier threads each rollout worker runs
MIN_TRAIN_R2 = 0.5  # below this the linear train law does not describe the run: resample instead


@dataclass(frozen=True)
class Episode:
    turns: int
    tokens: int  # sampled tokens over all turns
    observed: int  # tool-observation tokens appended between turns (prefilled at the next turn)
    tool_s: float
    verify_s: float


@dataclass(frozen=True)
class Group:
    prompt: int  # prompt tokens, prefilled once for the group (its members fork the prefix)
    episodes: tuple[Episode, ...]
    domain: str = ""


@dataclass(frozen=True)
class StepRecord:
    """One measured step, resampled whole so that its figures keep their correlations."""
    rounds: tuple[float, ...]  # groups of each rollout round (0: the batch; then refills) / groups of round 0
    round_groups: tuple[tuple[Group, ...], ...]  # the groups each round actually sampled
    tokens: float  # trained tokens
    rollout_s: float
    generate_s: float  # the engine's own seconds inside rollout_s
    iterations: float  # engine iterations
    computed: float  # tokens the engine computed (prefill and decode)
    train_s: float  # trainer step, weight sync excluded
    weight_sync_s: float
    driver_s: float  # the step's time outside rollout and training (logging, monitoring, checkpoints)


@dataclass
class Fit:
    run: Path
    steps: list[StepRecord]
    groups: list[Group]  # every measured group: the pool new steps draw from
    groups_per_step: int
    group_size: int
    threads: int
    max_seqs: int  # sequences one engine runs at once
    rollout_workers: int
    verifiers: int  # verifier threads per rollout worker (rollout.verifiers)
    iteration_s: float  # engine law: seconds = iteration_s * iterations + token_s * computed tokens
    token_s: float
    engine_r2: float
    train_fixed_s: float  # train law: seconds = train_fixed_s + train_token_s * tokens (+ resampled residual)
    train_token_s: float
    train_r2: float
    train_linear: bool  # False: the law is not used; train times are resampled and scaled by tokens
    verify_load: float = 0.0  # verifications running at once during a rollout, on average (sandboxes use cores)
    round_residual_s: float = 0.0  # per round: measured rollout seconds the event model does not explain
    model_bytes: int = 0  # the policy's weights, for the all-reduce estimate

    def train_residuals(self) -> list[float]:
        return [s.train_s - self.train_fixed_s - self.train_token_s * s.tokens for s in self.steps]


def _least_squares(xs: list[tuple[float, ...]], ys: list[float]) -> tuple[list[float], float]:
    """Coefficients of ys ~ xs (no implicit intercept) and R² about the mean; normal equations, small k."""
    k = len(xs[0])
    a = [[sum(x[i] * x[j] for x in xs) for j in range(k)] for i in range(k)]
    b = [sum(x[i] * y for x, y in zip(xs, ys, strict=True)) for i in range(k)]
    for col in range(k):  # Gauss-Jordan with partial pivoting
        piv = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-300:
            raise AssayError("bench cluster: the run's steps are too few or too alike to fit a duration law; "
                             "fit from a run of more steps")
        a[col], a[piv], b[col], b[piv] = a[piv], a[col], b[piv], b[col]
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [u - f * v for u, v in zip(a[r], a[col], strict=True)]
                b[r] -= f * b[col]
    coef = [b[i] / a[i][i] for i in range(k)]
    mean = statistics.fmean(ys)
    total = sum((y - mean) ** 2 for y in ys)
    resid = sum((y - sum(c * v for c, v in zip(coef, x, strict=True))) ** 2 for x, y in zip(xs, ys, strict=True))
    return coef, 1.0 - resid / total if total > 0 else 0.0


def _groups(run: Path) -> dict[tuple[int, int], list[Group]]:
    """The run's groups by (step, round), from its live trajectory shards."""
    import pyarrow.parquet as pq

    from assay.core.storage import trajectory_shards

    shards = trajectory_shards(run / "trajectories") if (run / "trajectories").is_dir() else []
    if not shards:
        raise AssayError(f"bench cluster: {run} has no trajectories/*.parquet; give the directory of an RL run "
                         "(runs/NAME, made by assay train or assay quickstart)")
    cols = ["step", "domain", "group_id", "turns", "prompt_len", "token_ids", "loss_mask", "timings"]
    members: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for shard in shards:
        for row in pq.read_table(shard, columns=cols).to_pylist():
            members[row["group_id"]].append(row)
    out: dict[tuple[int, int], list[Group]] = defaultdict(list)
    for gid, rows in members.items():
        episodes = []
        for r in rows:
            t = json.loads(r["timings"] or "{}")
            sampled = sum(r["loss_mask"])
            episodes.append(Episode(turns=max(1, r["turns"]), tokens=sampled,
                                    observed=max(0, len(r["token_ids"]) - r["prompt_len"] - sampled),
                                    tool_s=float(t.get("tool_s", 0.0)), verify_s=float(t.get("verify_s", 0.0))))
        # group ids read s{step}a{round}/...: the round is the refill attempt that sampled the group
        head = gid.split("/", 1)[0]
        rnd = int(head.split("a", 1)[1]) if head.startswith("s") and "a" in head else 0
        out[(rows[0]["step"], rnd)].append(Group(rows[0]["prompt_len"], tuple(episodes), rows[0]["domain"] or ""))
    return out


def run_config(run: Path) -> dict[str, Any]:
    import yaml

    path = run / "config.yaml"
    if not path.is_file():
        raise AssayError(f"bench cluster: {path} not found; give a run directory (runs/NAME)")
    return yaml.safe_load(path.read_text())


def _model_bytes(run: Path, cfg: dict[str, Any]) -> int:
    for d in sorted((run / "checkpoints").glob("step_*"), reverse=True) + [Path(str(cfg["model"].get("path") or ""))]:
        f = d / "model.safetensors"
        if f.is_file():
            return f.stat().st_size
    return 0


def fit_run(run: Path) -> Fit:
    """The distributions and laws of one synchronous run. Refuses runs that cannot give them, naming why."""
    from assay.core.storage import read_metrics

    cfg = run_config(run)
    pipeline = cfg.get("pipeline") or {}
    if pipeline.get("mode", "sync") != "sync":
        raise AssayError(f"bench cluster: {run} is an {pipeline.get('mode')} run, whose rollout and trainer "
                         "overlapped on shared cores; fit from a synchronous run (pipeline.mode=sync)")
    train = [m for m in read_metrics(run) if m.get("kind") == "train"]
    need = ("rollout_s", "train_s", "rollout/generate_s", "rollout/steps", "rollout/computed_tokens", "tokens")
    train = [m for m in train if all(k in m for k in need)]
    if len(train) < 3:
        raise AssayError(f"bench cluster: {run}/metrics.jsonl has {len(train)} train steps with rollout_s, train_s "
                         "and the engine's rollout/* counters (3 needed; runs older than the step timings lack "
                         "rollout_s and train_s); fit from a run of at least 3 steps made by this Assay with "
                         "rollout.backend=engine")
    by_round = _groups(run)
    steps: list[StepRecord] = []
    for prev, m in zip([None, *train[:-1]], train, strict=True):
        rounds = sorted(r for (s, r) in by_round if s == m["step"])
        if not rounds or rounds[0] != 0:
            continue  # a step whose shard is missing: its figures cannot be paired with its groups
        base = len(by_round[(m["step"], 0)])
        # sync: the step's record is logged after rollout, training and monitoring; what remains of the
        # interval since the last record (or since the rollout began) is the driver's own time
        start = prev["time"] if prev is not None else m.get("rollout_start_s")
        interval = m["time"] - start if start is not None else m["rollout_s"] + m["train_s"]
        sync_s = float(m.get("rollout/weight_update_s", 0.0)) + float(m.get("rollout/weight_put_s", 0.0))
        steps.append(StepRecord(
            rounds=tuple(len(by_round[(m["step"], r)]) / base for r in rounds),
            round_groups=tuple(tuple(by_round[(m["step"], r)]) for r in rounds),
            tokens=float(m["tokens"]), rollout_s=float(m["rollout_s"]), generate_s=float(m["rollout/generate_s"]),
            iterations=float(m["rollout/steps"]), computed=float(m["rollout/computed_tokens"]),
            train_s=max(0.0, m["train_s"] - sync_s),  # sync.py times update_weights inside train_s
            weight_sync_s=sync_s, driver_s=max(0.0, interval - m["rollout_s"] - m["train_s"])))
    if len(steps) < 3:
        raise AssayError(f"bench cluster: {run} has {len(steps)} steps with both metrics and trajectories "
                         "(3 needed); fit from a complete run")
    (a, b), r2 = _least_squares([(s.iterations, s.computed) for s in steps], [s.generate_s for s in steps])
    if a < 0 or b < 0:  # collinear counters: fall back to one coefficient, per computed token
        (b,), r2 = _least_squares([(s.computed,) for s in steps], [s.generate_s for s in steps])
        a = 0.0
    (c0, c1), tr2 = _least_squares([(1.0, s.tokens) for s in steps], [s.train_s for s in steps])
    linear = tr2 >= MIN_TRAIN_R2 and c1 > 0 and c0 >= 0
    if not linear:  # proportional to tokens through the mean: the resampled step is then scaled by tokens
        c0, c1 = 0.0, statistics.fmean(s.train_s for s in steps) / statistics.fmean(s.tokens for s in steps)
    verify = sum(e.verify_s for s in steps for gs in s.round_groups for g in gs for e in g.episodes)
    pipe_workers = pipeline.get("workers", "thread")
    workers = int((pipeline.get("ray") or {}).get("rollout_workers", 1)) if pipe_workers == "ray" else 1
    sizes = {d["group_size"] for d in cfg["domains"]}
    return Fit(run=run, steps=steps, groups=[g for gs in by_round.values() for g in gs],
               groups_per_step=int(cfg["train"]["groups_per_step"]), group_size=max(sizes),
               threads=int(cfg.get("threads") or 1), max_seqs=int((cfg.get("rollout") or {}).get("max_seqs", 256)),
               rollout_workers=workers, verifiers=int((cfg.get("rollout") or {}).get("verifiers", VERIFY_THREADS)),
               iteration_s=a, token_s=b, engine_r2=r2, train_fixed_s=c0, train_token_s=c1,
               train_r2=tr2, train_linear=linear, verify_load=verify / sum(s.rollout_s for s in steps),
               model_bytes=_model_bytes(run, cfg))


def measured_wall(run: Path) -> tuple[str, int, float]:
    """(mode, steps, seconds from the first rollout's start to the last step's record) of a real run."""
    from assay.core.storage import read_metrics

    cfg = run_config(run)
    train = [m for m in read_metrics(run) if m.get("kind") == "train"]
    if not train or "rollout_start_s" not in train[0]:
        raise AssayError(f"bench cluster: {run}/metrics.jsonl has no rollout_start_s to time the run from; "
                         "compare against a run made by this Assay")
    p = cfg.get("pipeline") or {}
    mode = "sync" if p.get("mode", "sync") == "sync" else f"async k={p.get('max_staleness', 1)}"
    return mode, len(train), train[-1]["time"] - min(m["rollout_start_s"] for m in train if "rollout_start_s" in m)
