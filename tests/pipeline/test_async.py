"""The asynchronous pipeline: with no staleness it is the synchronous one exactly; with staleness it
samples ahead on its own thread, by exactly the allowed number of versions, and is still a function
of its seed."""

import json

import pytest
import torch
from safetensors.torch import load_file

from assay.core.checkpoint import list_checkpoints
from assay.core.config import load_config
from assay.pipeline.async_pipeline import AsyncPipeline, make_pipeline
from assay.pipeline.sync import SyncPipeline


def _run(tiny_config, tmp_path, name, *overrides):
    cfg = load_config(tiny_config(name=name), ["train.max_refill_rounds=0", "train.checkpoint_every=6", *overrides])
    pipeline = make_pipeline(cfg, tmp_path / name)
    pipeline.run()
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    weights = load_file(tmp_path / name / "checkpoints" / "step_6" / "model.safetensors")
    return pipeline, [r for r in records if r["kind"] == "train"], weights


def _untimed(record):
    return {k: v for k, v in record.items() if k != "time" and not k.startswith("rollout/") and not k.endswith("_s")}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_no_staleness_is_the_synchronous_pipeline(tiny_config, tmp_path):
    sync, sync_log, sync_w = _run(tiny_config, tmp_path, "sync")
    asyn, async_log, async_w = _run(tiny_config, tmp_path, "async0", "pipeline.mode=async", "pipeline.max_staleness=0")
    assert type(sync) is SyncPipeline and type(asyn) is AsyncPipeline
    assert _same(sync_w, async_w)
    for a, b in zip(sync_log, async_log, strict=True):  # every figure but timings
        assert b.pop("staleness") == 0
        assert _untimed(a) == _untimed(b)


def test_staleness_one_samples_a_version_ahead_and_is_reproducible(tiny_config, tmp_path):
    _, log, weights = _run(tiny_config, tmp_path, "a1", "pipeline.mode=async", "pipeline.max_staleness=1")
    assert [r["staleness"] for r in log] == [0, 1, 1, 1, 1, 1]  # step s trains on weights of version s - 2
    _, again, weights_again = _run(tiny_config, tmp_path, "a1b", "pipeline.mode=async", "pipeline.max_staleness=1")
    assert [_untimed(r) for r in log] == [_untimed(r) for r in again] and _same(weights, weights_again)
    _, sync_log, sync_w = _run(tiny_config, tmp_path, "s1")
    assert not _same(weights, sync_w)  # stale samples do change the run


def test_a_failure_on_the_rollout_thread_ends_the_run_with_its_error(tiny_config, tmp_path, monkeypatch):
    cfg = load_config(tiny_config(name="boom"), ["pipeline.mode=async", "train.max_refill_rounds=0"])
    pipeline = make_pipeline(cfg, tmp_path / "boom")
    real = pipeline.rollout.rollout

    def failing(tasks, step, attempt):
        if step == 3:
            raise RuntimeError("sandbox pool lost")
        return real(tasks, step, attempt)

    monkeypatch.setattr(pipeline.rollout, "rollout", failing)
    with pytest.raises(RuntimeError, match="sandbox pool lost"):
        pipeline.run()
    steps = [r["step"] for line in (tmp_path / "boom" / "metrics.jsonl").read_text().splitlines()
             if (r := json.loads(line))["kind"] == "train"]  # a warning record names the unchecked test domain
    assert steps == [1, 2]  # what was trained before the failure is recorded


def test_stale_batches_report_their_age_and_the_decoupled_objective_its_weights(tiny_config, tmp_path):
    _, log, _ = _run(tiny_config, tmp_path, "dec", "pipeline.mode=async", "pipeline.max_staleness=1",
                     "train.loss.decoupled=true", "train.updates_per_batch=2")
    trained = [r for r in log if not r["skipped"]]
    assert trained
    for r in trained:
        assert r["staleness_mean"] == r["staleness"] == r["staleness_max"]  # one sampling version per batch
        assert r[f"staleness_hist/{r['staleness']}"] == 1.0
        assert 0 < r["is_weight_mean"] <= 2.0 and r["is_weight_max"] > 0 and 0 <= r["is_truncated"] <= 1
        assert any(k.startswith("is_weight/") for k in r) and any(k.startswith("staleness/") for k in r)


def test_refills_keep_async_equal_to_sync_at_no_staleness_and_reproducible_with_staleness(tiny_config, tmp_path):
    refill = ["train.max_refill_rounds=2"]
    _, sync_log, sync_w = _run(tiny_config, tmp_path, "rs", *refill)
    _, async_log, async_w = _run(tiny_config, tmp_path, "ra0", "pipeline.mode=async", "pipeline.max_staleness=0",
                                 *refill)
    assert _same(sync_w, async_w)
    assert [_untimed(r) | {"staleness": 0} for r in sync_log] == [_untimed(r) for r in async_log]
    import pandas as pd

    groups = set(pd.read_parquet(tmp_path / "ra0" / "trajectories")["group_id"])
    assert any("a1/" in g for g in groups)  # refills did run: groups from attempt 1
    _, a, wa = _run(tiny_config, tmp_path, "ra1", "pipeline.mode=async", "pipeline.max_staleness=1", *refill)
    _, b, wb = _run(tiny_config, tmp_path, "ra1b", "pipeline.mode=async", "pipeline.max_staleness=1", *refill)
    assert [_untimed(r) for r in a] == [_untimed(r) for r in b] and _same(wa, wb)


def test_refills_come_only_from_the_domains_whose_groups_paid(tiny_config, tmp_path):
    """train.refill_min_yield=1: a domain that dropped any group in a step gets none of its refills."""
    import pandas as pd

    from assay.train.advantages import has_signal

    _run(tiny_config, tmp_path, "pay", "train.max_refill_rounds=2", "train.refill_min_yield=1.0")
    rows = pd.read_parquet(tmp_path / "pay" / "trajectories")
    rows["attempt"] = rows["group_id"].str.extract(r"^s\d+a(\d+)/")[0].astype(int)
    checked = 0
    for _, step in rows.groupby("step"):
        for attempt in sorted(set(step["attempt"]) - {0}):
            before = step[step["attempt"] < attempt]
            signal = before.groupby("group_id").agg(domain=("domain", "first"),
                                                    varies=("reward", lambda r: has_signal(list(r))))
            paid = set(signal.groupby("domain")["varies"].all().loc[lambda v: v].index)
            assert set(step[step["attempt"] == attempt]["domain"]) <= paid
            checked += 1
    assert checked  # refills ran, from domains that paid
    dropped = any(not has_signal(list(g["reward"])) for _, g in rows.groupby("group_id"))
    assert dropped  # and groups were dropped, so the limit had domains to leave out


def test_a_worker_process_samples_what_the_rollout_thread_samples(tiny_config, tmp_path):
    """The worker process runs the same rollout on its own copy of the weights: with no staleness it is
    the synchronous pipeline exactly, with staleness 1 the threaded async pipeline exactly."""
    _, sync_log, sync_w = _run(tiny_config, tmp_path, "sync")
    _, p0_log, p0_w = _run(tiny_config, tmp_path, "p0", "pipeline.mode=async", "pipeline.max_staleness=0",
                           "pipeline.workers=process")
    assert _same(sync_w, p0_w)
    assert [_untimed(r) for r in sync_log] == [{k: v for k, v in _untimed(r).items() if k != "staleness"}
                                               for r in p0_log]
    _, t1_log, t1_w = _run(tiny_config, tmp_path, "t1", "pipeline.mode=async", "pipeline.max_staleness=1",
                           "train.max_refill_rounds=1")
    _, p1_log, p1_w = _run(tiny_config, tmp_path, "p1", "pipeline.mode=async", "pipeline.max_staleness=1",
                           "train.max_refill_rounds=1", "pipeline.workers=process", "pipeline.online=true")
    assert [r["staleness"] for r in p1_log] == [0, 1, 1, 1, 1, 1]
    assert all(r["rollout/prompt_tokens"] > 0 for r in p1_log)  # the worker's engine counters come back
    _, t1o_log, t1o_w = _run(tiny_config, tmp_path, "t1o", "pipeline.mode=async", "pipeline.max_staleness=1",
                             "train.max_refill_rounds=1", "pipeline.online=true")
    assert _same(p1_w, t1o_w) and [_untimed(r) for r in p1_log] == [_untimed(r) for r in t1o_log]
    assert not _same(t1_w, sync_w)


def _kill_worker_during(pipeline, version):
    """SIGKILL the worker process while the trainer trains on the weights of `version`."""
    import os
    import signal

    real = pipeline.trainer.step

    def step_then_kill(batch, version):
        out = real(batch, version=version)
        if version == kill_at:
            os.kill(pipeline.rollout.proc.pid, signal.SIGKILL)
        return out

    kill_at = version
    pipeline.trainer.step = step_then_kill


def test_a_killed_worker_process_is_replaced_and_its_request_issued_again(tiny_config, tmp_path):
    """SIGKILL of the worker mid-run: a new one starts from the last weights sent, the request it held
    runs again, and the run ends as if nothing had happened (each step once, the same weights)."""
    on = ["pipeline.mode=async", "pipeline.workers=process"]
    _, log, weights = _run(tiny_config, tmp_path, "calm", *on)
    cfg = load_config(tiny_config(name="kill"), ["train.max_refill_rounds=0", "train.checkpoint_every=6", *on])
    pipeline = make_pipeline(cfg, tmp_path / "kill")
    first = pipeline.rollout.proc
    _kill_worker_during(pipeline, 2)
    pipeline.run()
    records = [json.loads(line) for line in (tmp_path / "kill" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6] and first.exitcode == -9
    assert sum(r.get("rollout/worker_restarts", 0) for r in train) == 1
    again = load_file(tmp_path / "kill" / "checkpoints" / "step_6" / "model.safetensors")
    assert _same(weights, again)
    assert [_untimed(r) for r in log] == [{k: v for k, v in _untimed(r).items() if k != "rollout/worker_restarts"}
                                          for r in train]


@pytest.mark.slow
def test_a_hung_worker_process_is_killed_and_replaced(tiny_config, tmp_path):
    import os
    import signal

    on = ["pipeline.mode=async", "pipeline.workers=process"]
    _, log, weights = _run(tiny_config, tmp_path, "calm", *on)
    cfg = load_config(tiny_config(name="hang"), ["train.max_refill_rounds=0", "train.checkpoint_every=6",
                                                 "pipeline.worker_timeout_s=8", *on])
    pipeline = make_pipeline(cfg, tmp_path / "hang")
    real = pipeline.trainer.step

    def step_then_freeze(batch, version):
        out = real(batch, version=version)
        if version == 2:
            os.kill(pipeline.rollout.proc.pid, signal.SIGSTOP)  # alive, and making no progress
        return out

    pipeline.trainer.step = step_then_freeze
    pipeline.run()
    records = [json.loads(line) for line in (tmp_path / "hang" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert sum(r.get("rollout/worker_restarts", 0) for r in train) >= 1  # more only if a slow machine also hit it
    assert _same(weights, load_file(tmp_path / "hang" / "checkpoints" / "step_6" / "model.safetensors"))


def test_a_worker_that_keeps_dying_ends_the_run_with_what_it_trained_recorded(tiny_config, tmp_path):
    import pytest

    from assay.core.errors import AssayError

    cfg = load_config(tiny_config(name="kill"), ["pipeline.mode=async", "pipeline.workers=process",
                                                 "pipeline.worker_restarts=0", "train.max_refill_rounds=0",
                                                 "train.checkpoint_every=2"])
    pipeline = make_pipeline(cfg, tmp_path / "kill")
    _kill_worker_during(pipeline, 2)
    with pytest.raises(AssayError, match=r"worker process died \(exit code -9\).*--resume"):
        pipeline.run()
    steps = [r["step"] for line in (tmp_path / "kill" / "metrics.jsonl").read_text().splitlines()
             if (r := json.loads(line))["kind"] == "train"]  # a warning record names the unchecked test domain
    assert steps[:3] == [1, 2, 3]
    resumed = make_pipeline(load_config(tmp_path / "kill" / "config.yaml", []), tmp_path / "kill", resume=True)
    # the last checkpoint: step 2's (step 4's waits for the batch of step 5, which the dead worker never sent)
    assert resumed.start_step == 2 and list_checkpoints(tmp_path / "kill" / "checkpoints") == [2]
    resumed.run()
    assert (tmp_path / "kill" / "checkpoints" / "step_6").is_dir()


def test_process_workers_need_the_async_pipeline():
    import pytest

    from assay.core.config import PipelineConfig

    with pytest.raises(ValueError, match="needs mode: async"):
        PipelineConfig(workers="process")


def test_a_worker_whose_environments_cannot_reach_a_new_process_is_refused_with_the_fix(tiny_config, tmp_path):
    import pytest

    from assay.core.errors import AssayError
    from assay.pipeline.worker import RolloutWorker

    class LocalEnv:  # defined in a function: a new process cannot import it
        name = "local"

    cfg = load_config(tiny_config(name="local"), ["pipeline.mode=async", "pipeline.workers=process"])
    pipeline = make_pipeline(load_config(tiny_config(name="ok"), []), tmp_path / "ok")
    with pytest.raises(AssayError, match="could not start.*importable module.*__main__.*or set pipeline.workers: thread"):
        RolloutWorker(cfg, pipeline.model, pipeline.tokenizer, {"local": LocalEnv()})


def test_verifier_processes_change_no_verdict(tiny_config, tmp_path, monkeypatch):
    """The tiny config's tool-less domains (arith, no_e) verify in two processes of their own and its
    toolcalc domain on the rollout's threads: the run is the one that verifies every episode in the
    rollout, and the processes are gone when it ends."""
    from assay.envs import verifiers

    pools, domains = [], []
    real = verifiers.VerifierProcesses

    def kept(*args, **kwargs):
        pool = real(*args, **kwargs)
        inner = pool.verify
        pool.verify = lambda task, *a, **k: (domains.append(task.domain), inner(task, *a, **k))[1]
        pools.append(pool)
        return pool

    monkeypatch.setattr(verifiers, "VerifierProcesses", kept)
    _, log, w = _run(tiny_config, tmp_path, "here")
    _, vlog, vw = _run(tiny_config, tmp_path, "procs", "rollout.verifier_processes=2")
    assert _same(w, vw) and [_untimed(r) for r in log] == [_untimed(r) for r in vlog]
    assert len(pools) == 1 and pools[0].n == 2 and pools[0].closed and pools[0].replaced == 0
    assert set(domains) == {"arith", "no_e"}  # toolcalc's verdict reads its episode: verified in the rollout
    assert not any(v.process.is_alive() for v in pools[0].all)


def test_the_evaluations_backend_is_closed_with_the_rollout(tiny_config, tmp_path, monkeypatch):
    cfg = load_config(tiny_config(name="evals"), ["pipeline.mode=async", "pipeline.max_staleness=1",
                                                  "train.max_refill_rounds=0", "eval.every=3", "eval.watch_tasks=2"])
    pipeline = make_pipeline(cfg, tmp_path / "evals")
    made, closed = [], []
    real_make = pipeline.make_backend

    def recording(model):
        backend = real_make(model)
        monkeypatch.setattr(backend, "close", lambda: closed.append(backend))
        made.append(backend)
        return backend

    monkeypatch.setattr(pipeline, "make_backend", recording)
    pipeline.run()
    assert len(made) == 1 and closed == made  # one backend for both watch evaluations, closed at the end
