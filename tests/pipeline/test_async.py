"""The asynchronous pipeline: with no staleness it is the synchronous one exactly; with staleness it
samples ahead on its own thread, by exactly the allowed number of versions, and is still a function
of its seed."""

import json

import torch
from safetensors.torch import load_file

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
    import pytest

    cfg = load_config(tiny_config(name="boom"), ["pipeline.mode=async", "train.max_refill_rounds=0"])
    pipeline = make_pipeline(cfg, tmp_path / "boom")
    real = pipeline._rollout

    def failing(tasks, step, attempt):
        if step == 3:
            raise RuntimeError("sandbox pool lost")
        return real(tasks, step, attempt)

    monkeypatch.setattr(pipeline, "_rollout", failing)
    with pytest.raises(RuntimeError, match="sandbox pool lost"):
        pipeline.run()
    steps = [json.loads(line)["step"] for line in (tmp_path / "boom" / "metrics.jsonl").read_text().splitlines()]
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
