"""Sharded training in the pipeline (`train.sharding: fsdp`): two gloo ranks of this machine, each
holding half of the model, take the steps of one unsharded process; the rollout receives whole weights;
a sharded checkpoint resumes exactly; and what is not built is refused with the fix named."""

import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from assay.core.config import build_config, load_config
from assay.core.errors import AssayError, ConfigError
from assay.pipeline.async_pipeline import make_pipeline
from assay.pipeline.train_ranks import rank_devices
from proc_threads import thread_names

RUN = ["train.steps=3", "train.checkpoint_every=3", "train.max_refill_rounds=0", "train.lr=1e-3"]
FSDP = ["train.sharding=fsdp"]
# Measured: after 3 steps the weights of 2 sharded ranks and of one unsharded process differ by at most
# 1.9e-7 on one machine's data and 2.1e-6 on another's: the ranks sum the batch's gradient in another order,
# and Adam turns that rounding into steps where a gradient is near zero. A hundredth of one step (lr 1e-3).
ATOL = 1e-5


def _record_published(pipeline) -> list[dict[str, torch.Tensor]]:
    """Every set of weights the trainer hands the rollout backend, copied."""
    real, published = pipeline.rollout.update_weights, []

    def update_weights(named_tensors, version):
        named = list(named_tensors)
        published.append({n: t.clone() for n, t in named})
        return real(named, version)

    pipeline.rollout.update_weights = update_weights
    return published


def _fail_at_step(pipeline, step: int) -> None:
    real = pipeline.train_step

    def train_step(batch, version):
        if version == step - 1:
            raise RuntimeError(f"killed at step {step}")
        return real(batch, version)

    pipeline.train_step = train_step


def _gloo_threads(wait_s: float = 5.0) -> list[str]:
    """The gloo threads still alive after up to `wait_s`: threads end a moment after the group is destroyed."""
    deadline = time.monotonic() + wait_s
    while (gloo := [name for name in thread_names() if "gloo" in name]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return gloo


def _checkpoint(tmp_path, name: str, step: int) -> dict[str, torch.Tensor]:
    return load_file(tmp_path / name / "checkpoints" / f"step_{step}" / "model.safetensors")


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_two_sharded_ranks_step_as_one_unsharded_process_and_publish_whole_weights(tiny_config, tmp_path):
    one = make_pipeline(load_config(tiny_config(name="one"), RUN), tmp_path / "one")
    start = {k: v.clone() for k, v in one.model.state_dict().items()}
    one.run()
    two = make_pipeline(load_config(tiny_config(name="two"), [*RUN, *FSDP, "train.ranks=2"]), tmp_path / "two")
    assert all(isinstance(p, DTensor) and p.to_local().numel() < p.numel()
               for p in two.trainer.model.parameters())  # rank 0 holds a shard
    published = _record_published(two)
    two.run()
    assert two.ranks is None and not torch.distributed.is_initialized()  # closed with the run
    assert _gloo_threads() == []  # rank 0's sharded trainer let the group go with it, not at exit
    a, b = _checkpoint(tmp_path, "one", 3), _checkpoint(tmp_path, "two", 3)
    assert _max_diff(a, b) <= ATOL
    assert any(not torch.allclose(start[k], a[k], atol=1e-4) for k in a)  # the steps moved the weights
    assert len(published) == 3
    for weights in published:  # whole tensors under the unsharded model's names, tied head included
        assert {n: t.shape for n, t in weights.items()} == {n: t.shape for n, t in start.items()}
    assert all(torch.equal(published[-1][k], b[k]) for k in b)  # the rollout runs what the checkpoint holds
    assert all(torch.equal(t, two.plain.state_dict()[n]) for n, t in published[-1].items())


def test_a_sharded_async_run_resumes_to_the_same_steps(tiny_config, tmp_path):
    on = ["train.max_refill_rounds=0", "train.lr=1e-2", *FSDP, "train.ranks=2", "train.checkpoint_every=2",
          "train.steps=4", "pipeline.mode=async"]  # the rollout on a thread of its own, a step ahead
    make_pipeline(load_config(tiny_config(name="straight"), on), tmp_path / "straight").run()
    half = make_pipeline(load_config(tiny_config(name="half"), on), tmp_path / "half")
    _fail_at_step(half, 3)  # after step 2's checkpoint, which holds step 3's batch sampled ahead
    with pytest.raises(RuntimeError, match="killed at step 3"):
        half.run()
    assert half.ranks is None and not torch.distributed.is_initialized()
    resumed = make_pipeline(load_config(tmp_path / "half" / "config.yaml"), tmp_path / "half", resume=True)
    assert resumed.start_step == 2
    resumed.run()
    a, b = _checkpoint(tmp_path, "straight", 4), _checkpoint(tmp_path, "half", 4)
    assert all(torch.equal(a[k], b[k]) for k in a)  # model and Adam's moments restored on both ranks' shards
    opt_a, opt_b = (torch.load(tmp_path / n / "checkpoints" / "step_4" / "trainer.pt", weights_only=True)
                    for n in ("straight", "half"))
    moments = opt_a["trainer"]["optimizer"]["state"]
    assert moments.keys() == opt_b["trainer"]["optimizer"]["state"].keys() and len(moments) == len(a)  # a param each
    assert all(torch.equal(v, opt_b["trainer"]["optimizer"]["state"][i][k]) for i, m in moments.items()
               for k, v in m.items())


@pytest.mark.slow  # minutes of Ray actors: `make test-slow` (CI runs it)
def test_sharded_ranks_as_ray_actors_checkpoint_and_resume_as_spawned_ranks_do(tiny_config, tmp_path):
    pytest.importorskip("ray")
    on = ["train.max_refill_rounds=0", "train.lr=1e-2", *FSDP, "train.ranks=2", "train.checkpoint_every=2"]
    make_pipeline(load_config(tiny_config(name="spawned"), [*on, "train.steps=3"]), tmp_path / "spawned").run()
    actors = [*on, "train.rank_workers=ray", "pipeline.ray.num_cpus=2"]
    make_pipeline(load_config(tiny_config(name="actors"), [*actors, "train.steps=2"]), tmp_path / "actors").run()
    resumed = make_pipeline(load_config(tmp_path / "actors" / "config.yaml", ["train.steps=3"]), tmp_path / "actors",
                            resume=True)  # the actors join rank 0's load, as they joined its gather at step 2
    resumed.run()
    a, b = _checkpoint(tmp_path, "spawned", 3), _checkpoint(tmp_path, "actors", 3)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sharding_over_one_rank_steps_as_the_unsharded_trainer(tiny_config, tmp_path):
    make_pipeline(load_config(tiny_config(name="plain"), RUN), tmp_path / "plain").run()
    one = make_pipeline(load_config(tiny_config(name="sharded"), [*RUN, *FSDP]), tmp_path / "sharded")
    assert isinstance(next(one.trainer.model.parameters()), DTensor) and one.trainer.world == 1
    one.run()
    assert not torch.distributed.is_initialized()
    assert _max_diff(_checkpoint(tmp_path, "plain", 3), _checkpoint(tmp_path, "sharded", 3)) <= ATOL


BASE = {"domains": [{"name": "a", "env": "arith"}]}


def test_sharding_with_lora_is_refused_with_both_keys_and_the_fix():
    with pytest.raises(ConfigError) as err:
        build_config(BASE, ["train.sharding=fsdp", "train.lora.rank=4"])
    assert "train.sharding: fsdp with train.lora.rank > 0" in str(err.value)
    assert "use train.sharding: none with LoRA, or train.lora.rank: 0" in str(err.value)
    with pytest.raises(ConfigError, match="train.sharding: Input should be 'none' or 'fsdp'"):
        build_config(BASE, ["train.sharding=zero3"])


def test_vllm_beside_a_sharded_trainer_needs_a_process_of_its_own():
    with pytest.raises(ConfigError, match=r"train.ranks > 1 \(or train.sharding: fsdp\) needs the trainer's"):
        build_config(BASE, ["rollout.backend=vllm", "train.sharding=fsdp"])
    build_config(BASE, ["rollout.backend=vllm", "train.sharding=fsdp", "pipeline.mode=async",
                        "pipeline.workers=process"])


def test_ranks_on_cuda_need_a_gpu_each(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(AssayError, match=r"train.ranks: 2 with the model on CUDA needs a GPU per rank, and 1 is "
                                         r"visible .* lower train.ranks to 1"):
        rank_devices(torch.device("cuda", 0), 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert rank_devices(torch.device("cuda", 2), 3) == [torch.device("cuda", i) for i in (2, 0, 1)]  # 0 keeps its own
    assert rank_devices(torch.device("cpu"), 3) == [torch.device("cpu")] * 3


def test_ranks_as_ray_actors_on_cuda_are_refused(tiny_config):
    pytest.importorskip("ray")
    from assay.pipeline.ray_ranks import RayRanks

    cuda_model = SimpleNamespace(parameters=lambda: iter([SimpleNamespace(is_cuda=True)]))
    cfg = load_config(tiny_config(name="ray"), ["train.ranks=2", "train.rank_workers=ray"])
    with pytest.raises(AssayError, match="with the model on CUDA use train.rank_workers: process"):
        RayRanks(cfg, cuda_model, None, 2, None)
