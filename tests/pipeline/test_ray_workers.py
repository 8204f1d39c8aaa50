"""Rollout workers as Ray actors on a local cluster (num_cpus=2, no dashboard): one actor samples what
the worker process samples; a run scaled to two actors mid-run splits each step and keeps every group
once; an actor killed with SIGKILL, or hung past pipeline.worker_timeout_s, mid-run is replaced in its
placement-group bundle and its part issued again; scaling down and up keeps and reuses bundles and
removes a group once it is empty; a verifier actor killed mid-run is restarted and changes nothing, one past
its timeout is restarted, one gone for good leaves its call to the caller;
the cluster refuses calls without the run's token."""

import json
import os
import signal

import pandas as pd
import pytest
import torch
from ray_checks import assert_each_group_once
from safetensors.torch import load_file

from assay.core.config import load_config
from assay.core.storage import trajectory_shards
from assay.pipeline.async_pipeline import make_pipeline
from assay.pipeline.ray_workers import request_scale

ray = pytest.importorskip("ray")

RAY = ["pipeline.mode=async", "pipeline.max_staleness=1", "pipeline.workers=ray", "pipeline.ray.num_cpus=2",
       "train.max_refill_rounds=0", "train.checkpoint_every=6"]


def _run(tiny_config, tmp_path, name, *overrides, during=None):
    cfg = load_config(tiny_config(name=name), list(overrides))
    pipeline = make_pipeline(cfg, tmp_path / name)
    if during:
        during(pipeline)
    pipeline.run()
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"], load_file(tmp_path / name / "checkpoints" / "step_6" /
                                                                   "model.safetensors")


def _untimed(record):
    return {k: v for k, v in record.items() if k != "time" and not k.startswith("rollout/") and not k.endswith("_s")}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_one_ray_actor_samples_what_the_worker_process_samples(tiny_config, tmp_path):
    process_log, process_w = _run(tiny_config, tmp_path, "process", *RAY, "pipeline.workers=process")
    ray_log, ray_w = _run(tiny_config, tmp_path, "ray1", *RAY)
    assert not ray.is_initialized()  # the run's own cluster is shut down with it
    assert _same(process_w, ray_w) and [_untimed(r) for r in process_log] == [_untimed(r) for r in ray_log]
    assert any(r.get("rollout/weight_put_gb", 0) > 0 for r in ray_log)  # each version put in the object store once


def test_a_run_scaled_to_two_actors_splits_each_step_and_replaces_a_killed_one(tiny_config, tmp_path):
    """Starts on one actor; `assay scale` asks for two after step 1; one of them is SIGKILLed during
    step 3. The run goes on at the new width and keeps each group of each step once."""
    def scale_then_kill(pipeline):
        real = pipeline.trainer.step

        def step(batch, version):
            out = real(batch, version=version)
            if version == 0:
                request_scale(tmp_path / "ray2", 2)
            if version == 2:
                assert len(pipeline.rollout.actors) == 2
                os.kill(pipeline.rollout.pids()[1], signal.SIGKILL)
            return out

        pipeline.trainer.step = step

    log, _ = _run(tiny_config, tmp_path, "ray2", *RAY, "pipeline.ray.rollout_cpus=0.5", during=scale_then_kill)
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    assert any(r.get("rollout/resized_to") == 2 for r in log)
    # one bundle in the group the run started with, one in the group the scale-up added; the killed
    # actor's replacement took its bundle
    assert [r["rollout/placement_bundles"] for r in log if "rollout/placement_bundles" in r] == [1, 2, 2]
    assert sum(r.get("rollout/worker_restarts", 0) for r in log) == 1
    assert_each_group_once(tmp_path / "ray2")


def test_scaling_a_run_that_is_not_on_ray_is_refused(tiny_config, tmp_path):
    from assay.core.errors import AssayError

    run = tmp_path / "thread"
    make_pipeline(load_config(tiny_config(name="thread"), ["train.steps=1"]), run)  # writes its config.yaml
    with pytest.raises(AssayError, match="pipeline.workers: thread; only a run with pipeline.workers: ray"):
        request_scale(run, 2)
    with pytest.raises(AssayError, match="not a run directory"):
        request_scale(tmp_path / "nowhere", 2)


@pytest.mark.slow  # minutes of Ray actors: `make test-slow` (CI runs it)
def test_a_hung_actor_is_killed_and_replaced_in_its_bundle(tiny_config, tmp_path):
    """Two actors in one placement group; one is SIGSTOPped (alive, no progress) after step 2, killed
    at pipeline.worker_timeout_s and replaced in the same bundle: no new group, each group once."""
    def freeze(pipeline):
        real = pipeline.trainer.step

        def step(batch, version):
            out = real(batch, version=version)
            if version == 2:
                os.kill(pipeline.rollout.pids()[1], signal.SIGSTOP)
            return out

        pipeline.trainer.step = step

    log, _ = _run(tiny_config, tmp_path, "hung", *RAY, "pipeline.ray.rollout_workers=2", "pipeline.ray.rollout_cpus=0.5",
                  "pipeline.worker_timeout_s=8", during=freeze)
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    assert sum(r.get("rollout/worker_restarts", 0) for r in log) >= 1  # more only if a slow machine also hit it
    assert {r["rollout/placement_bundles"] for r in log if "rollout/placement_bundles" in r} == {2}
    assert not any("rollout/workers_lost" in r for r in log)
    live = pd.concat(pd.read_parquet(s) for s in trajectory_shards(tmp_path / "hung" / "trajectories"))
    for step, rows in live.groupby("step"):
        assert rows.groupby(["group_id", "domain"]).ngroups == 3, step


@pytest.mark.slow  # minutes of Ray actors: `make test-slow` (CI runs it)
def test_scaling_down_gives_an_emptied_group_back_and_scaling_up_reuses_kept_bundles(tiny_config, tmp_path,
                                                                                     monkeypatch):
    """Start at 1 (group A), scale to 3 (group B of 2 bundles), back to 2 (B keeps the stopped actor's
    bundle), to 3 again (that bundle reused, no new group), then to 1 (B emptied and removed: its CPUs
    go back to the cluster). A width the cluster cannot hold is refused within the wait, once per
    scale file."""
    import time

    from assay.core.errors import AssayError
    from assay.pipeline import ray_workers

    cfg = load_config(tiny_config(name="widths"), [*RAY, "pipeline.ray.rollout_cpus=0.5", "train.steps=1"])
    pipeline = make_pipeline(cfg, tmp_path / "widths")
    rollout = pipeline.rollout
    try:
        def free_cpus(expected):  # the cluster's view of what is reserved is updated a moment later
            for _ in range(40):
                if ray.available_resources().get("CPU", 0) == expected:
                    return True
                time.sleep(0.25)
            return False

        assert len(rollout.groups) == 1 and free_cpus(1.5)
        rollout.resize(3)
        assert [g.bundle_count for g in rollout.groups] == [1, 2] and free_cpus(0.5)
        rollout.resize(2)
        assert len(rollout.vacant) == 1 and len(rollout.groups) == 2 and free_cpus(0.5)  # still reserved
        rollout.resize(3)
        assert not rollout.vacant and [g.bundle_count for g in rollout.groups] == [1, 2]
        assert len(set(rollout.pids())) == 3  # all serve
        rollout.resize(1)
        assert len(rollout.groups) == 1 and not rollout.vacant and free_cpus(1.5)
        assert rollout.take_stats()["placement_bundles"] == 1
        monkeypatch.setattr(ray_workers, "RESIZE_WAIT_S", 2.0)
        with pytest.raises(AssayError, match=r"cannot place a placement group of 4 bundles"):
            rollout.resize(5)  # 2.5 CPUs of 2
        assert len(rollout.groups) == 1 and len(rollout.actors) == 1 and free_cpus(1.5)
        request_scale(tmp_path / "widths", 5)
        rollout._follow_scale_file()
        t0 = time.monotonic()
        rollout._follow_scale_file()  # the same file: not tried again
        assert time.monotonic() - t0 < 1 and rollout.take_stats()["resize_refused"] == 5
    finally:
        pipeline.close_rollout()
    assert not ray.is_initialized()


def test_the_runs_own_cluster_refuses_calls_without_its_token(tiny_config, tmp_path, monkeypatch):
    """Ray's servers listen on every interface, so the cluster a run starts keeps Ray's token
    authentication on: its GCS and raylet, called on the loopback without the run's token (or with a
    wrong one), answer UNAUTHENTICATED; with the token, they answer."""
    grpc = pytest.importorskip("grpc")
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc, node_manager_pb2, node_manager_pb2_grpc

    from assay.pipeline.ray_workers import start_ray, stop_ray

    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(tiny_config(name="auth"), RAY)
    started, temp = start_ray(cfg, tmp_path / "auth")
    try:
        token = os.environ["RAY_AUTH_TOKEN"]
        gcs_port = int(ray.get_runtime_context().gcs_address.rsplit(":", 1)[1])
        raylet_port = ray.nodes()[0]["NodeManagerPort"]
        calls = {
            "gcs": lambda ch, md: gcs_service_pb2_grpc.NodeInfoGcsServiceStub(ch).GetAllNodeInfo(
                gcs_service_pb2.GetAllNodeInfoRequest(), metadata=md, timeout=10),
            "raylet": lambda ch, md: node_manager_pb2_grpc.NodeManagerServiceStub(ch).GetSystemConfig(
                node_manager_pb2.GetSystemConfigRequest(), metadata=md, timeout=10)}
        for server, port in (("gcs", gcs_port), ("raylet", raylet_port)):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                for metadata in ((), (("authorization", "Bearer " + "0" * 64),)):
                    with pytest.raises(grpc.RpcError) as refused:
                        calls[server](channel, metadata)
                    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, (server, refused.value)
                assert calls[server](channel, (("authorization", "Bearer " + token),)) is not None
    finally:
        stop_ray(started, temp)


def test_verifier_actors_change_no_verdict_one_killed_is_restarted_and_more_can_join(tiny_config, tmp_path):
    """A verifier actor of its own takes the tool-less domains' verifications from the rollout actor; it is
    SIGKILLed after step 2 and Ray starts it again; `assay scale --verifier-workers 2` after step 3 adds a
    second. The run trains what the run verifying in the rollout actor trains, to the bit."""
    seen = {}

    def kill_then_scale(pipeline):
        real = pipeline.trainer.step

        def step(batch, version):
            out = real(batch, version=version)
            actors = pipeline.rollout.verifiers.actors
            if version == 2:
                seen["before"] = ray.get(actors[0].served.remote())
                seen["pid"] = ray.get(actors[0].pid.remote())
                os.kill(seen["pid"], signal.SIGKILL)
            if version == 3:
                request_scale(tmp_path / "verifiers", 2, verifiers=True)
            if version == 5:
                seen["after"] = [ray.get(a.served.remote()) for a in actors]
                seen["new_pid"] = ray.get(actors[0].pid.remote())
            return out

        pipeline.trainer.step = step

    base_log, base_w = _run(tiny_config, tmp_path, "base", *RAY)
    v_log, v_w = _run(tiny_config, tmp_path, "verifiers", *RAY, "pipeline.ray.verifier_workers=1",
                      "pipeline.ray.verifier_cpus=0.5",  # two beside the rollout actor on two CPUs
                      during=kill_then_scale)
    assert _same(base_w, v_w) and [_untimed(r) for r in base_log] == [_untimed(r) for r in v_log]
    assert seen["before"] > 0 and seen["new_pid"] != seen["pid"]
    assert len(seen["after"]) == 2 and all(n > 0 for n in seen["after"])  # both serve
    assert [r["rollout/verifiers_resized_to"] for r in v_log if "rollout/verifiers_resized_to" in r] == [2]


def test_a_verifier_actor_past_its_timeout_is_restarted_and_one_gone_for_good_leaves_it_here(
        isolated, tiny_config, tmp_path, monkeypatch):
    """Real codegen verifications on a verifier actor: a candidate that spins past the call's timeout gets
    TimeoutError and its actor restarted (a new pid), which then serves; a call whose actor is gone for
    good is given up after the restart wait and verified where the call was made, with the same verdict."""
    import pickle
    import random

    from assay.core.types import Message
    from assay.envs.registry import generate_task, get_env
    from assay.pipeline import ray_verifiers
    from assay.pipeline.ray_workers import start_ray, stop_ray

    started, temp = start_ray(load_config(tiny_config(name="v"), RAY), tmp_path / "v")
    try:
        env = get_env("codegen")
        envs = {"code": env}
        task = generate_task(env, random.Random(0), 1)
        task.domain = "code"
        right = task.prompt + env.reference_solution(task)
        spin = task.prompt + [Message("assistant", "```python\nwhile True:\n    pass\n```")]
        pool = ray_verifiers.RayVerifiers(envs, 0.5, {}, restarts=3)
        pool.resize(1)
        assert pool.verify(task, right, timeout_s=60).passed
        first = pool.pids[0]
        with pytest.raises(TimeoutError, match="killed"):
            pool.verify(task, spin, timeout_s=1.0)  # the sandbox's own limit is 3 s
        assert pool.verify(task, right, timeout_s=60).passed
        assert ray.get(pool.actors[0].pid.remote()) != first and pool.replaced == 1
        monkeypatch.setattr(ray_verifiers, "RESTART_WAIT_S", 2.0)
        held = pickle.loads(pickle.dumps(pool)).falling_back_to(envs)  # as a rollout actor holds it
        ray.kill(pool.actors[0], no_restart=True)
        verdict = held.verify(task, right, timeout_s=60)
        assert verdict.passed and held.lost == {0}
        pool.close()
    finally:
        stop_ray(started, temp)
