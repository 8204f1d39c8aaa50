"""Sharded training (`train.sharding: fsdp`): two gloo ranks, each holding half of every weight and
optimizer moment, take the steps of one unsharded process on the same batches, hand back whole
weights and optimizer state in the unsharded layout, and continue exactly from an unsharded state."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from train_helpers import random_batch, tiny_qwen, with_behaviour_logprobs

from assay.core.config import LossConfig, TrainConfig
from assay.core.errors import AssayError
from assay.train.sharding import leave_process_group
from assay.train.trainer import GRPOTrainer
from proc_threads import thread_names

LOSS = LossConfig(kl_coef=0.1, decoupled=True)
# 9 samples over 2 ranks in micro-batches of 2: rank 0 runs 3 passes, rank 1 two and an idle one; selective
# logprobs run the head outside the model's forward, and activation checkpointing recomputes the layers
# in backward, both of which the sharded model's gather and reduce hooks must still cover (the pipeline
# tests take the plain forward)
CFG = TrainConfig(lr=1e-3, micro_batch=2, loss=LOSS, updates_per_batch=2, selective_logprobs=True,
                  activation_checkpointing=True)
SHARDED = CFG.model_copy(update={"sharding": "fsdp"})
# Measured after 4 AdamW steps: sharded vs one process at most 6.2e-7 in the weights, 7.5e-9 in Adam's
# moments (with the plain forward 9.3e-7; unsharded ranks vs one process: 7.4e-7). Splitting the batch over ranks sums the gradient in another
# order, and Adam, which divides by the gradient's scale, turns that rounding into steps of up to lr·ε/√v.
ATOL = 2e-6


def _batch(seed: int) -> list:
    batch = random_batch(seed, n_groups=3, group_size=3)
    with_behaviour_logprobs(tiny_qwen(), batch, noise=0.4, seed=seed)
    return batch


def _rank(rank: int, world: int, store: str, out: str, start: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        _steps(rank, out, start)
    finally:
        leave_process_group()  # the trainers, _steps's locals, are gone: the group ends here, not at exit
    Path(f"{out}/threads{rank}.json").write_text(json.dumps([t for t in thread_names() if "gloo" in t]))


def _steps(rank: int, out: str, start: str) -> None:
    trainer = GRPOTrainer(tiny_qwen(), SHARDED, ref_model=tiny_qwen(seed=1), data_parallel=True)
    sharded = [isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in trainer.model.parameters()]
    metrics = [trainer.step(_batch(s)) for s in (0, 1)]
    state = trainer.state_dict()  # every rank gathers; rank 0 receives
    weights = dict(trainer.named_weights())
    resumed = GRPOTrainer(tiny_qwen(seed=2), SHARDED, ref_model=tiny_qwen(seed=1), data_parallel=True)
    resumed.load_state_dict(torch.load(start, weights_only=True))  # an unsharded trainer's after 2 steps
    resumed.step(_batch(2))
    then = dict(resumed.named_weights())
    if rank == 0:
        torch.save({"state": state, "weights": weights, "then": then, "metrics": metrics,
                    "sharded": all(sharded)}, f"{out}/rank0.pt")
    else:
        with open(f"{out}/rank1.json", "w") as f:
            json.dump({"weights": len(weights), "state": len(state["model"])}, f)


def test_two_sharded_ranks_step_as_one_unsharded_process_and_resume_from_its_state(tmp_path):
    torch.set_num_threads(1)
    single = GRPOTrainer(tiny_qwen(), CFG, ref_model=tiny_qwen(seed=1))
    expected = [single.step(_batch(s)) for s in (0, 1)]
    torch.save(single.state_dict(), tmp_path / "single.pt")  # a copy: the trainer steps on
    start = torch.load(tmp_path / "single.pt", weights_only=True)
    single.step(_batch(2))
    mp.spawn(_rank, args=(2, str(tmp_path / "store"), str(tmp_path), str(tmp_path / "single.pt")), nprocs=2,
             join=True)
    got = torch.load(tmp_path / "rank0.pt", weights_only=True)
    for rank in (0, 1):  # left with the group: a gloo thread outliving it could abort the process at exit
        assert json.loads((tmp_path / f"threads{rank}.json").read_text()) == []
    assert got["sharded"]  # every parameter is a DTensor of which rank 0 holds a part
    assert json.loads((tmp_path / "rank1.json").read_text()) == {"weights": 0, "state": 0}  # whole state: rank 0 only
    for mine, theirs in zip(got["metrics"], expected, strict=True):
        assert mine.keys() == theirs.keys()
        for k, v in theirs.items():
            assert mine[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    state = got["state"]
    assert state["steps"] == 4 and state["model"].keys() == start["model"].keys()  # the unsharded layout and names
    for k, v in start["model"].items():
        assert state["model"][k].shape == v.shape and torch.allclose(state["model"][k], v, atol=ATOL, rtol=0), k
    assert state["optimizer"]["param_groups"] == start["optimizer"]["param_groups"]
    for i, moments in start["optimizer"]["state"].items():
        for name, v in moments.items():
            assert torch.allclose(state["optimizer"]["state"][i][name], v, atol=ATOL, rtol=0), (i, name)
    assert all(torch.equal(got["weights"][k], state["model"][k]) for k in state["model"])
    after = single.state_dict()["model"]
    assert all(torch.allclose(got["then"][k], after[k], atol=ATOL, rtol=0) for k in after)  # resumed: the same step
    assert not torch.allclose(after["model.norm.weight"], start["model"]["model.norm.weight"])  # it did step


def test_sharding_without_a_process_group_is_refused():
    with pytest.raises(AssayError, match="train.sharding: fsdp shards over the ranks' process group"):
        GRPOTrainer(tiny_qwen(), SHARDED, ref_model=tiny_qwen(seed=1), data_parallel=False)
