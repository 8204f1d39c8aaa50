"""Rollout actors on a cluster with Ray's autoscaler (its fake multi-node provider: every node a set of
Ray processes on this machine): the head offers no CPU, so the run's placement group is the demand that
makes the autoscaler start a node for it; `assay scale` to two actors mid-run makes it start a second
one; every group of every step is trained once."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from ray_checks import assert_each_group_once, use_a_token

from assay.core.config import load_config
from assay.pipeline.async_pipeline import make_pipeline
from assay.pipeline.ray_workers import request_scale

ray = pytest.importorskip("ray")
pytest.importorskip("ray.autoscaler._private.fake_multi_node.node_provider")
pytestmark = pytest.mark.slow  # a cluster whose nodes start on demand: `make test-slow` (CI runs it)



def _cluster_config(gcs_address: str, max_nodes: int) -> dict:
    """An autoscaling cluster of the fake provider: a head with no CPU, and up to `max_nodes` nodes of one CPU."""
    return {
        "cluster_name": "assay-test", "max_workers": max_nodes, "upscaling_speed": 1.0,
        "idle_timeout_minutes": 5, "head_node_type": "ray.head.default",
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": gcs_address},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            "ray.worker.cpu": {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 0,
                               "max_workers": max_nodes}},
        "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def _kill_processes_under(path: str) -> None:
    """SIGKILL every process whose command line names `path` (the cluster's temp dir): the head's
    processes and the nodes the autoscaler started, and nothing else on the machine."""
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if path.encode() in cmdline and pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _cpu_nodes() -> int:
    """Alive nodes that offer CPUs (the ones the autoscaler started)."""
    return sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0)


@pytest.fixture
def autoscaling(monkeypatch):
    temp = tempfile.mkdtemp(prefix="assay-ras-")  # short: Ray's Unix socket paths are capped
    monkeypatch.setenv("RAY_TMPDIR", temp)
    use_a_token(monkeypatch)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gcs = f"{ray.util.get_node_ip_address()}:{port}"
    config = Path(temp) / "cluster.json"
    config.write_text(json.dumps(_cluster_config(gcs, max_nodes=2)))
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    ray_cli = Path(sys.executable).parent / "ray"
    subprocess.run([str(ray_cli), "start", "--head", f"--port={port}", f"--autoscaling-config={config}",
                    "--num-cpus=0", "--include-dashboard=false", f"--temp-dir={temp}", "--disable-usage-stats"],
                   env=env, check=True, capture_output=True, timeout=120)
    yield gcs
    if ray.is_initialized():
        ray.shutdown()
    _kill_processes_under(temp)
    time.sleep(1)
    subprocess.run(["rm", "-rf", temp], check=False)


def test_the_autoscaler_starts_nodes_for_the_rollout_actors(tiny_config, tmp_path, autoscaling):
    cfg = load_config(tiny_config(name="auto"), [
        "pipeline.mode=async", "pipeline.max_staleness=1", "pipeline.workers=ray", "train.max_refill_rounds=0",
        "train.checkpoint_every=6", "pipeline.ray.rollout_workers=1", "pipeline.ray.rollout_cpus=1",
        f"pipeline.ray.address={autoscaling}", "pipeline.ray.placement_wait_s=120"])
    run_dir = tmp_path / "auto"
    ray.init(address=autoscaling)
    assert _cpu_nodes() == 0  # the head alone, with no CPU for an actor
    pipeline = make_pipeline(cfg, run_dir)  # waits for the node the placement group asks for
    real, seen = pipeline.trainer.step, {}

    def step(batch, version):
        out = real(batch, version=version)
        seen[version] = _cpu_nodes()
        if version == 2:
            request_scale(run_dir, 2)  # one more actor: one more node
        return out

    pipeline.trainer.step = step
    pipeline.run()
    assert seen[0] == 1 and seen[5] == 2  # a node started for the first actor, a second for the one added
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    log = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    assert log[0]["rollout/placement_nodes"] == 1
    assert [r["rollout/resized_to"] for r in log if "rollout/resized_to" in r] == [2]
    assert [r["rollout/placement_nodes"] for r in log if "rollout/placement_nodes" in r][-1] == 2
    assert not any("rollout/resize_refused" in r for r in log)
    assert_each_group_once(run_dir)
