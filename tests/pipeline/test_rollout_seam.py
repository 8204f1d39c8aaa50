"""The pipeline's seams: one Rollout protocol (thread, process and Ray implementations) and one Ranks
protocol (spawned and Ray ranks), declared with the same members and signatures, and an asynchronous
pipeline that drives the thread and process kinds through the same calls."""

from __future__ import annotations

import inspect
import json
import os
import typing
from collections.abc import Iterable, Sequence

import pytest
from torch import Tensor

from assay.core.config import PipelineConfig, load_config
from assay.core.types import Task, Trajectory
from assay.pipeline.async_pipeline import AsyncPipeline
from assay.pipeline.ranks import Ranks
from assay.pipeline.ray_ranks import RayRanks
from assay.pipeline.ray_workers import RayRollout
from assay.pipeline.rollout import ROLLOUTS, Rollout, ThreadRollout
from assay.pipeline.train_ranks import TrainRanks
from assay.pipeline.worker import RolloutWorker


def _members(protocol: type) -> list[str]:
    return [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]


def _check_implements(cls: type, protocol: type) -> None:
    """Every member of `protocol` on `cls` with the same parameters (names, kinds, defaults): a caller
    holding the protocol may call any implementation the same way."""
    assert issubclass(cls, protocol), f"{cls.__name__} lacks a member of {protocol.__name__}"
    for name in _members(protocol):
        want = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(protocol, name)).parameters.values()]
        have = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(cls, name)).parameters.values()]
        assert have == want, f"{cls.__name__}.{name}{have} is not {protocol.__name__}.{name}{want}"


@pytest.mark.parametrize("cls", [ThreadRollout, RolloutWorker, RayRollout])
def test_each_kind_of_rollout_implements_the_protocol(cls):
    _check_implements(cls, Rollout)


@pytest.mark.parametrize("cls", [TrainRanks, RayRanks])
def test_each_kind_of_trainer_ranks_implements_the_protocol(cls):
    _check_implements(cls, Ranks)


def test_the_check_catches_a_member_that_differs():
    class Stray:  # rollout's parameters renamed, close without its wait
        def rollout(self, batch, step, attempt): ...
        def update_weights(self, named_tensors, version): ...
        def take_stats(self): ...
        def close(self): ...

    class Short:  # no take_stats
        def rollout(self, tasks, step, attempt): ...
        def update_weights(self, named_tensors, version): ...
        def close(self, wait_s=30): ...

    with pytest.raises(AssertionError, match=r"Stray\.rollout"):
        _check_implements(Stray, Rollout)
    with pytest.raises(AssertionError, match="Short lacks a member of Rollout"):
        _check_implements(Short, Rollout)


def test_every_configurable_kind_has_an_implementation():
    kinds = typing.get_args(PipelineConfig.model_fields["workers"].annotation)
    assert sorted(ROLLOUTS) == sorted(kinds) == ["process", "ray", "thread"]


REAL_MAKE_ROLLOUT = AsyncPipeline.make_rollout


class Recorded:
    """A Rollout around another one, recording the calls the pipeline makes (delegating each)."""

    def __init__(self, inner: Rollout) -> None:
        self.inner, self.calls = inner, []

    def rollout(self, tasks: Sequence[Task], step: int, attempt: int) -> list[Trajectory]:
        self.calls.append(("rollout", step, attempt, len(tasks)))
        return self.inner.rollout(tasks, step, attempt)

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        self.calls.append(("update_weights", version))
        self.inner.update_weights(named_tensors, version)

    def take_stats(self) -> dict[str, float]:
        self.calls.append(("take_stats",))
        return self.inner.take_stats()

    def close(self, wait_s: float = 30) -> None:
        self.calls.append(("close",))
        self.inner.close(wait_s)


def _recorded_run(tiny_config, tmp_path, monkeypatch, workers: str) -> tuple[Recorded, str, list[dict]]:
    made: list[Recorded] = []
    real = REAL_MAKE_ROLLOUT

    def make_rollout(self) -> Rollout:
        made.append(Recorded(real(self)))
        return made[-1]

    monkeypatch.setattr(AsyncPipeline, "make_rollout", make_rollout)
    name = f"seam_{workers}"
    cfg = load_config(tiny_config(name=name), ["pipeline.mode=async", "pipeline.max_staleness=1", "train.steps=3",
                                               "train.checkpoint_every=3", f"pipeline.workers={workers}"])
    pipeline = AsyncPipeline(cfg, tmp_path / name)
    inner = type(made[0].inner).__name__
    pipeline.run()
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return made[0], inner, [r for r in records if r["kind"] == "train"]


def test_the_pipeline_drives_the_thread_and_process_kinds_through_the_same_calls(tiny_config, tmp_path, monkeypatch):
    thread, thread_kind, thread_log = _recorded_run(tiny_config, tmp_path, monkeypatch, "thread")
    process, process_kind, process_log = _recorded_run(tiny_config, tmp_path, monkeypatch, "process")
    assert (thread_kind, process_kind) == ("ThreadRollout", "RolloutWorker")
    assert thread.calls == process.calls  # one code path: the same calls, in the same order
    assert thread.calls[0] == ("update_weights", 0) and thread.calls[-1] == ("close",)
    assert [c for c in thread.calls if c[0] == "rollout" and c[2] == 0] == [("rollout", s, 0, 3) for s in (1, 2, 3)]
    assert [r["step"] for r in thread_log] == [r["step"] for r in process_log] == [1, 2, 3]
    assert [r["loss"] for r in thread_log] == [r["loss"] for r in process_log]  # and they sample alike


def test_a_closed_thread_rollout_refuses_further_use(tiny_config, tmp_path):
    from assay.core.modeling import build_model
    from assay.core.tokenizer import train_tokenizer
    from assay.envs.registry import get_env
    from assay.pipeline.policy import reference_corpus
    from assay.rollout.hf import HFBackend

    cfg = load_config(tiny_config(name="closed"))
    envs = {"arith": get_env("arith")}
    tokenizer = train_tokenizer(reference_corpus(envs, 20, 0), cfg.model.vocab_size)
    rollout = ThreadRollout(cfg, HFBackend(build_model(cfg.model, tokenizer), tokenizer), tokenizer, envs)
    assert isinstance(rollout, Rollout) and rollout.take_stats() == {}
    rollout.close()
    rollout.close()  # twice is harmless
    with pytest.raises(Exception, match="the rollout was closed while the rollout thread still used it"):
        rollout.update_weights([], version=1)


PLUGIN = '''
import os
from pathlib import Path

from assay.rollout.factory import resolve_backend


def counted_engine(cfg, model, tokenizer):
    """A user's backend: Assay's engine, built by the plugin's factory, which says in which process."""
    with open(os.environ["ASSAY_TEST_PLUGIN_LOG"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    return resolve_backend("engine")(cfg, model, tokenizer)
'''


def test_a_plugin_backend_runs_in_the_worker_process(tiny_config, tmp_path, monkeypatch):
    """Installed by an entry point only (nothing registers it in the worker), it is built and sampled there."""
    site = tmp_path / "site"
    (site / "assay_counted_engine-0.1.dist-info").mkdir(parents=True)
    (site / "assay_counted_engine.py").write_text(PLUGIN)
    (site / "assay_counted_engine-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: assay-counted-engine\nVersion: 0.1\n")
    (site / "assay_counted_engine-0.1.dist-info" / "entry_points.txt").write_text(
        "[assay.rollout_backends]\ncounted = assay_counted_engine:counted_engine\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("ASSAY_TEST_PLUGIN_LOG", str(tmp_path / "built.log"))
    from assay.rollout import factory

    monkeypatch.setattr(factory, "backends", factory.backends.copy())  # lists the plugin afresh, leaves no trace
    cfg = load_config(tiny_config(name="plugin"), ["pipeline.mode=async", "train.steps=2", "train.checkpoint_every=2",
                                                   "pipeline.workers=process", "rollout.backend=counted"])
    AsyncPipeline(cfg, tmp_path / "plugin").run()
    pids = [int(p) for p in (tmp_path / "built.log").read_text().split()]
    assert pids and os.getpid() not in pids  # built in the worker process, not here
    steps = [json.loads(line) for line in (tmp_path / "plugin" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["kind"] == "train"] == [1, 2]
