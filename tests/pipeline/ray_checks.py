"""What the Ray tests share: a token for the clusters they start, and the check that a run trained every
group of every step once, each whole."""

import secrets
from pathlib import Path

import pandas as pd

from assay.core.storage import trajectory_shards
from assay.pipeline import ray_workers

GROUP_SIZE = {"arith": 2, "agent": 2, "no_e": 4}  # the tiny config's domains


def use_a_token(monkeypatch) -> None:
    """Token authentication for a cluster the test starts (it listens on every interface: see
    require_token_auth), read anew by this process's Ray (an earlier run's token is cached)."""
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    ray_workers.require_token_auth()


def assert_each_group_once(run_dir: Path) -> None:
    """Each step's 3 groups once, each whole: no part lost or doubled."""
    live = pd.concat(pd.read_parquet(s) for s in trajectory_shards(run_dir / "trajectories"))
    for step, rows in live.groupby("step"):
        sizes = rows.groupby(["group_id", "domain"]).size()
        assert len(sizes) == 3 and all(n == GROUP_SIZE[d] for (_, d), n in sizes.items()), (step, sizes)
