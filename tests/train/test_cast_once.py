import copy

import torch
from torch import nn
from train_helpers import random_batch, tiny_qwen, with_behaviour_logprobs

from assay.core.config import LoraConfig, TrainConfig
from assay.train.cast_once import CastOnceLinear, cast_frozen_linears
from assay.train.lora import with_lora
from assay.train.trainer import GRPOTrainer

torch.set_num_threads(1)
autocast = torch.autocast("cpu", dtype=torch.bfloat16)


def frozen_pair(seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(seed)
    plain = nn.Linear(24, 40).requires_grad_(False)
    cast = copy.deepcopy(plain)
    assert cast_frozen_linears(cast) == 1 and type(cast) is CastOnceLinear
    return plain, cast


def test_a_frozen_linear_under_autocast_gives_what_autocast_gives_from_one_cast():
    plain, cast = frozen_pair()
    x = torch.randn(5, 24, requires_grad=True)
    outs, grads = [], []
    for layer in (plain, cast):
        with autocast:
            y = layer(x)
        y.float().square().sum().backward()
        outs.append(y)
        grads.append(x.grad.clone())
        x.grad = None
    assert outs[1].dtype == torch.bfloat16 and torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
    with autocast:
        first = cast.cast_weight(torch.bfloat16)
        cast(x)
    assert cast.cast_weight(torch.bfloat16) is first  # made once
    # a weight changed in place (a loaded checkpoint) is cast again
    state = {k: v + 1.0 for k, v in plain.state_dict().items()}
    plain.load_state_dict(state)
    cast.load_state_dict(state)
    assert cast.cast_weight(torch.bfloat16) is not first
    with autocast:
        assert torch.equal(plain(x), cast(x))
    # without autocast, and once the weight trains, it is a plain float32 linear
    assert torch.equal(plain(x), cast(x)) and cast(x).dtype == torch.float32
    cast.weight.requires_grad_(True)
    with autocast:
        cast(x).float().sum().backward()
    assert cast.weight.grad is not None


def test_only_frozen_plain_linears_are_cast_and_the_state_dict_is_unchanged():
    model = with_lora(tiny_qwen(), LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    frozen = [m for m in model.modules() if type(m) is nn.Linear and not m.weight.requires_grad]
    assert cast_frozen_linears(model) == len(frozen) > 0
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear) and m.weight.requires_grad)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_bf16_lora_step_is_the_same_with_the_frozen_weights_cast_once(monkeypatch):
    batch = random_batch(2, n_groups=3, group_size=3)
    base = tiny_qwen()
    with_behaviour_logprobs(base, batch, noise=0.2)
    cfg = TrainConfig(lr=1e-2, bf16=True, selective_logprobs=True, lora={"rank": 4, "alpha": 8.0})
    results = []
    for cast in (True, False):
        if not cast:
            monkeypatch.setattr("assay.train.trainer.cast_frozen_linears", lambda m: 0)
        torch.manual_seed(0)  # the same adapters
        model = with_lora(copy.deepcopy(base), cfg.lora)
        m = GRPOTrainer(model, cfg).accumulate_gradients(batch)
        assert any(type(x) is CastOnceLinear for x in model.modules()) == cast
        results.append((m, [p.grad.clone() for p in model.parameters() if p.requires_grad]))
    (m_cast, g_cast), (m_plain, g_plain) = results
    assert m_cast["loss"] == m_plain["loss"]
    for a, b in zip(g_cast, g_plain, strict=True):
        assert torch.equal(a, b)
