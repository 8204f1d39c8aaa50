"""FSDP (`train.sharding: fsdp`): torch's fully_shard (FSDP2) over the ranks' process group, so each
rank holds a shard of every parameter, gradient and optimizer moment instead of the whole model.

A sharded model's forward and backward are collectives (each layer's weights are all-gathered for
its forward and its gradient reduce-scattered after backward), and so is reading or writing its full
weights: every function here that takes a sharded model must run on every rank at once, in the same
order. The full state comes back on rank 0 only (on the CPU), in the layout an unsharded model's
`state_dict` and optimizer `state_dict` have, so checkpoints do not depend on the sharding."""

from __future__ import annotations

import gc
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, _redistribute
from torch.distributed.tensor._collective_utils import MeshTopoInfo
from torch.optim import Optimizer

from assay.train.losses import selective_token_logprobs

SELECTIVE = "selective_token_logprobs"  # the sharded model's method for train.selective_logprobs
GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0's CPU only
SCATTER = StateDictOptions(full_state_dict=True)  # every rank passes the whole state, keeps its shard


def shard(model: nn.Module) -> nn.Module:
    """Shard `model` in place: each decoder layer (the model's `_no_split_modules`) is one unit whose
    weights are gathered only while it runs, the root holds the rest (embeddings, head, final norm)."""
    layer_types = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in layer_types:
            fully_shard(module)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # the loss is already divided by the whole batch's tokens: gradients are summed, not averaged;
            # a plain sum is also the reduction gloo has (it lacks the pre-scaled sum FSDP uses otherwise)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    # selective logprobs run the decoder and the output head without the root's forward, which is what
    # gathers the root's weights (embeddings, head) and later reduces their gradients: as a method of
    # the root registered with FSDP, it runs inside those hooks
    setattr(model, SELECTIVE, types.MethodType(selective_token_logprobs, model))
    register_fsdp_forward_method(model, SELECTIVE)
    return model


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def local(t: Tensor) -> Tensor:
    """This rank's part of a sharded tensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_value(t: Tensor) -> float:
    """A scalar that may be a DTensor (clip_grad_norm_ over sharded gradients returns one), as a float."""
    return float(t.full_tensor() if isinstance(t, DTensor) else t)


def full_model_state(model: nn.Module) -> dict[str, Tensor]:
    """The whole weights under their unsharded names, on rank 0 (other ranks get {}). Collective."""
    return get_model_state_dict(model, options=GATHER)


def full_optimizer_state(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The whole optimizer state keyed as `optimizer.state_dict()` keys it (by parameter index), on
    rank 0 (other ranks get {}). Collective."""
    by_name = get_optimizer_state_dict(model, optimizer, options=GATHER)
    if not by_name:
        return {}
    index = {name: i for i, name in enumerate(_param_names(model, optimizer))}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]]
    return {"state": {index[n]: s for n, s in by_name["state"].items()}, "param_groups": groups}


def load_full_state(model: nn.Module, optimizer: Optimizer, weights: dict[str, Tensor],
                    optim_state: dict[str, Any]) -> None:
    """Load a whole (unsharded) model and optimizer state, which every rank passes; each keeps its
    shard. Collective."""
    set_model_state_dict(model, weights, options=SCATTER)
    names = _param_names(model, optimizer)
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in optim_state["param_groups"]]
    by_name = {"state": {names[i]: s for i, s in optim_state["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, by_name, options=SCATTER)


def _param_names(model: nn.Module, optimizer: Optimizer) -> list[str]:
    """The optimizer's parameters by name, in the order its own state_dict numbers them."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]


def leave_process_group() -> None:
    """Destroy the process group so that its gloo threads end here. DTensor's caches (sharding
    propagation, redistribution plans, mesh topology) keep the device mesh, and through it the group,
    alive after `destroy_process_group`; freed only in the interpreter's teardown, its threads were
    destroyed while joinable in about one exit in ten ("terminate called without an active
    exception", SIGABRT) after all work was written. Drop the trainer holding sharded weights first."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()
    gc.collect()  # the mesh sits in reference cycles
    if dist.is_initialized():
        dist.destroy_process_group()
