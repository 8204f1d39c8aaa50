"""Data-parallel training: two gloo ranks on this machine, each taking the gradient of half the
batch, get the gradient and metrics of one process on the whole batch, and stay identical after
their optimizer steps."""

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from train_helpers import random_batch, tiny_qwen, with_behaviour_logprobs

from assay.core.config import LossConfig, TrainConfig
from assay.train.trainer import GRPOTrainer

CFG = TrainConfig(lr=1e-2, micro_batch=2, loss=LossConfig(kl_coef=0.1, decoupled=True), updates_per_batch=2)


def _batch():
    model = tiny_qwen()
    batch = random_batch(0, n_groups=3, group_size=3)
    with_behaviour_logprobs(model, batch, noise=0.4)
    return batch


def _rank(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model = tiny_qwen()
        trainer = GRPOTrainer(model, CFG, ref_model=tiny_qwen(seed=1), data_parallel=True)
        metrics = trainer.accumulate_gradients(_batch())
        save_file({n: p.grad.contiguous() for n, p in model.named_parameters()}, f"{out}/grads{rank}.safetensors")
        trainer.step(_batch())
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{out}/weights{rank}.safetensors")
        with open(f"{out}/metrics{rank}.json", "w") as f:
            json.dump(metrics, f)
    finally:
        dist.destroy_process_group()


def test_two_ranks_get_the_gradient_of_one_process_and_stay_identical(tmp_path):
    torch.set_num_threads(1)
    single = tiny_qwen()
    expected = GRPOTrainer(single, CFG, ref_model=tiny_qwen(seed=1)).accumulate_gradients(_batch())
    mp.spawn(_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        grads = load_file(tmp_path / f"grads{rank}.safetensors")
        for name, p in single.named_parameters():
            assert torch.allclose(grads[name], p.grad, atol=1e-7, rtol=1e-4), name
        got = json.loads((tmp_path / f"metrics{rank}.json").read_text())
        assert got.keys() == expected.keys()
        for k, v in expected.items():
            assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    w0, w1 = load_file(tmp_path / "weights0.safetensors"), load_file(tmp_path / "weights1.safetensors")
    assert all(torch.equal(w0[k], w1[k]) for k in w0)  # the same summed gradient, the same step
    assert not torch.equal(w0["model.norm.weight"], single.state_dict()["model.norm.weight"])  # it did step
