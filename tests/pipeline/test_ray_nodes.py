"""Rollout actors in placement groups on a real two-node Ray cluster on this machine
(`ray.cluster_utils.Cluster`: a head and a second node, one or two CPUs each, its own processes):
the second node is removed mid-run and the run completes, each group of each step trained once, on
the remaining node when it has room for a replacement, and with one actor fewer when it has none."""

import faulthandler
import json
import os
import shutil
import tempfile
import time

import pytest
from ray_checks import assert_each_group_once, use_a_token

from assay.core.config import load_config
from assay.core.errors import AssayError
from assay.pipeline import ray_workers
from assay.pipeline.async_pipeline import make_pipeline

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")
pytestmark = pytest.mark.slow  # a multi-node cluster per test: `make test-slow` (CI runs it)

RAY = ["pipeline.mode=async", "pipeline.max_staleness=1", "pipeline.workers=ray", "train.max_refill_rounds=0",
       "train.checkpoint_every=6", "pipeline.ray.rollout_workers=2", "pipeline.ray.rollout_cpus=1",
       "pipeline.ray.placement=spread"]


@pytest.fixture
def two_nodes(monkeypatch):
    """A head node with `head_cpus` CPUs and a second node with one; torn down after the test."""
    use_a_token(monkeypatch)
    made: list = []

    def start(head_cpus: int, head_resources: dict | None = None, second_resources: dict | None = None):
        temp = tempfile.mkdtemp(prefix="assay-ray-")  # short: Ray's Unix socket paths are capped
        # Cluster writes the head's address under Ray's default temp dir (/tmp/ray, absent on a fresh
        # machine): keep it in this test's own
        monkeypatch.setenv("RAY_TMPDIR", temp)
        os.makedirs(os.path.join(temp, "ray"), exist_ok=True)
        cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={
            "num_cpus": head_cpus, "resources": head_resources or {}, "include_dashboard": False, "temp_dir": temp,
            # a lost node is declared dead after ~2 s instead of Ray's ~15 s of missed health checks
            "_system_config": {"health_check_period_ms": 500, "health_check_timeout_ms": 500,
                               "health_check_failure_threshold": 4}})
        made.append((cluster, temp))
        second = cluster.add_node(num_cpus=1, resources=second_resources or {})
        cluster.wait_for_nodes()
        return cluster, second

    faulthandler.dump_traceback_later(180)  # a run that stops making progress shows where it waits
    yield start
    faulthandler.cancel_dump_traceback_later()
    if ray.is_initialized():
        ray.shutdown()
    for cluster, temp in made:
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def _run_losing_the_node(tiny_config, tmp_path, cluster, second, name):
    cfg = load_config(tiny_config(name=name), [*RAY, f"pipeline.ray.address={cluster.address}"])
    pipeline = make_pipeline(cfg, tmp_path / name)
    real, seen = pipeline.trainer.step, {}

    def step(batch, version):
        out = real(batch, version=version)
        if version == 2:  # the rollout thread is sampling ahead meanwhile
            backend = pipeline.rollout
            seen["nodes"] = {ray.util.placement_group_table(g)["bundles_to_node_id"][i] for g, i in backend.slots}
            cluster.remove_node(second, allow_graceful=False)
        return out

    pipeline.trainer.step = step
    pipeline.run()
    assert not ray.is_initialized()  # the driver left the cluster at the end
    assert seen["nodes"] == {cluster.head_node.node_id, second.node_id}  # spread: one actor on each node
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    log = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    assert log[0]["rollout/placement_bundles"] == 2 and log[0]["rollout/placement_nodes"] == 2
    assert_each_group_once(tmp_path / name)
    return log


def test_a_lost_node_leaves_the_run_going_with_one_actor_fewer(tiny_config, tmp_path, two_nodes, monkeypatch):
    """One CPU per node: the lost actor's bundle has nowhere to go, so its replacement is not placed
    within the wait and the other actor takes its parts; the run goes on at width 1."""
    monkeypatch.setattr(ray_workers, "RESIZE_WAIT_S", 6.0)
    cluster, second = two_nodes(head_cpus=1)
    log = _run_losing_the_node(tiny_config, tmp_path, cluster, second, "lost")
    assert sum(r.get("rollout/workers_lost", 0) for r in log) == 1
    assert sum(r.get("rollout/worker_restarts", 0) for r in log) == 1  # the one attempted
    assert [r["rollout/resized_to"] for r in log if "rollout/resized_to" in r] == [1]
    assert [r["rollout/placement_nodes"] for r in log if "rollout/placement_nodes" in r][-1] == 1


def test_a_lost_nodes_actor_is_replaced_on_the_node_left(tiny_config, tmp_path, two_nodes):
    """Two CPUs on the head: Ray re-places the lost bundle there and the replacement starts in it."""
    cluster, second = two_nodes(head_cpus=2)
    log = _run_losing_the_node(tiny_config, tmp_path, cluster, second, "moved")
    assert sum(r.get("rollout/worker_restarts", 0) for r in log) == 1
    assert not any("rollout/workers_lost" in r or "rollout/resized_to" in r for r in log)
    assert [r["rollout/placement_nodes"] for r in log if "rollout/placement_nodes" in r][-1] == 1


def test_a_placement_the_cluster_cannot_make_is_refused_in_time(tiny_config, tmp_path, two_nodes):
    """strict_spread asks for a node per actor: three actors on two nodes cannot start, and say why
    within the wait (`pipeline.ray.placement_wait_s`) instead of waiting on."""
    cluster, _ = two_nodes(head_cpus=1)
    cfg = load_config(tiny_config(name="strict"), [*RAY, "pipeline.ray.rollout_workers=3", "pipeline.ray.placement"
                                                   "=strict_spread", f"pipeline.ray.address={cluster.address}",
                                                   "pipeline.ray.placement_wait_s=3"])
    with pytest.raises(AssayError, match=r"cannot place a placement group of 3 bundles .*STRICT_SPREAD.* within 3 s"):
        make_pipeline(cfg, tmp_path / "strict")
    assert not ray.is_initialized()


def test_a_lost_nodes_verifier_leaves_verification_to_the_rollout_actor(tiny_config, tmp_path, two_nodes):
    """Custom resources place the rollout actor on the head and the verifier actor on the second node; the
    second node is removed after step 2, so the verifier cannot start again anywhere: the calls it held
    go back to the rollout actor, the driver drops it before the next rollout, and the run trains what a
    run without verifier actors trains, to the bit."""
    import torch
    from safetensors.torch import load_file

    cluster, second = two_nodes(head_cpus=1, head_resources={"rollout_node": 1},
                                second_resources={"verifier_node": 1})
    common = ["pipeline.mode=async", "pipeline.max_staleness=1", "pipeline.workers=ray", "train.max_refill_rounds=0",
              "train.checkpoint_every=6", "pipeline.ray.rollout_workers=1", "pipeline.ray.rollout_cpus=1",
              "pipeline.ray.rollout_resources={rollout_node: 1}", f"pipeline.ray.address={cluster.address}"]

    def run(name, *overrides, during=None):
        pipeline = make_pipeline(load_config(tiny_config(name=name), [*common, *overrides]), tmp_path / name)
        if during:
            during(pipeline)
        pipeline.run()
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return ([r for r in records if r["kind"] == "train"],
                load_file(tmp_path / name / "checkpoints" / "step_6" / "model.safetensors"))

    def lose_the_second_node(pipeline):
        real = pipeline.trainer.step

        def step(batch, version):
            out = real(batch, version=version)
            if version == 2:
                cluster.remove_node(second, allow_graceful=False)
                # its processes linger on this machine a moment: go on once the verifier no longer answers
                verifier, deadline = pipeline.rollout.verifiers.actors[0], time.monotonic() + 60
                while time.monotonic() < deadline:
                    try:
                        ray.get(verifier.pid.remote(), timeout=1)
                        time.sleep(0.2)
                    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                        break
            return out

        pipeline.trainer.step = step

    def untimed(r):
        return {k: v for k, v in r.items() if k != "time" and not k.startswith("rollout/") and not k.endswith("_s")}

    base_log, base_w = run("here")
    lost_log, lost_w = run("lost", "pipeline.ray.verifier_workers=1", "pipeline.ray.verifier_cpus=1",
                           "pipeline.ray.verifier_resources={verifier_node: 1}", during=lose_the_second_node)
    assert [untimed(r) for r in base_log] == [untimed(r) for r in lost_log]
    assert base_w.keys() == lost_w.keys() and all(torch.equal(base_w[k], lost_w[k]) for k in base_w)
    assert sum(r.get("rollout/verifiers_lost", 0) for r in lost_log) == 1

