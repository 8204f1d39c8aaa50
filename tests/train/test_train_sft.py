import pytest
import torch
from train_helpers import Bigram, tiny_qwen

from assay.core import heap
from assay.core.config import TrainConfig
from assay.core.errors import AssayError
from assay.train.batching import lr_at
from assay.train.sft import length_buckets, pad_batch, sft_loss, sft_nll, sft_step, sft_train
from assay.train.trainer import GRPOTrainer

torch.set_num_threads(1)


def test_loss_by_hand_is_token_averaged_over_mask():
    torch.manual_seed(0)
    table = torch.randn(6, 6)
    lsm = table.log_softmax(-1)
    batch = [([1, 2, 3], [0, 0, 1]), ([4, 5, 1, 2, 0], [0, 1, 0, 1, 1])]  # different lengths: padded
    # masked tokens: 3 after 2; 5 after 4, 2 after 1, 0 after 2
    want = -(lsm[2, 3] + lsm[4, 5] + lsm[1, 2] + lsm[2, 0]) / 4
    assert sft_loss(Bigram(table), batch).item() == pytest.approx(want.item(), abs=1e-6)


def test_step_updates_and_returns_loss_before_step():
    model = Bigram(torch.zeros(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    loss = sft_step(model, opt, [([0, 1], [0, 1])], grad_clip=None)
    assert loss == pytest.approx(torch.log(torch.tensor(4.0)).item())  # uniform over 4 tokens
    # SGD on -log softmax(row 0)[1]: d/dlogit = softmax - onehot = (.25, -.75, .25, .25)
    assert model.table[0].tolist() == pytest.approx([-0.25, 0.75, -0.25, -0.25])
    assert model.table[1:].abs().sum().item() == 0.0


def test_length_buckets_bound_padding_and_keep_every_example():
    batch = [([1] * n, [0] + [1] * (n - 1)) for n in (9, 2, 5, 3, 12, 4)]
    buckets = length_buckets(batch, max_tokens=10)
    assert sorted(len(ids) for b in buckets for ids, _ in b) == [2, 3, 4, 5, 9, 12]
    assert [[len(ids) for ids, _ in b] for b in buckets] == [[2, 3], [4, 5], [9], [12]]  # 12 alone: over budget
    assert length_buckets(batch, 0) == [batch]


def test_bucketed_step_gives_the_one_pass_gradient():
    """Accumulating over length buckets computes the same batch-mean loss and update as one padded pass."""
    g = torch.Generator().manual_seed(0)
    batch = [(torch.randint(1, 64, (n,), generator=g).tolist(), [0] * (n // 2) + [1] * (n - n // 2))
             for n in (5, 17, 9, 30, 12, 6)]
    models = [tiny_qwen(), tiny_qwen()]
    models[1].load_state_dict(models[0].state_dict())
    losses = []
    for model, budget in zip(models, (0, 40), strict=True):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses.append(sft_step(model, opt, batch, grad_clip=None, micro_batch_tokens=budget))
    assert len(length_buckets(batch, 40)) > 2
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_bf16_step_computes_in_bf16_and_keeps_float32_weights():
    g = torch.Generator().manual_seed(1)
    batch = [(torch.randint(1, 64, (n,), generator=g).tolist(), [0] * 3 + [1] * (n - 3)) for n in (8, 20, 13)]
    models = [tiny_qwen(), tiny_qwen()]
    losses = [sft_step(m, torch.optim.SGD(m.parameters(), lr=0.1), batch, grad_clip=None, bf16=bf16)
              for m, bf16 in zip(models, (False, True), strict=True)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-2) and losses[1] != losses[0]  # bf16 rounding, same loss
    assert all(p.dtype == torch.float32 for p in models[1].parameters())
    step, drift = _max_diff(models[0], tiny_qwen()), _max_diff(models[0], models[1])
    assert 0 < drift < 0.1 * step  # the same update, up to bf16's rounding


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_the_head_runs_on_learned_tokens_alone_with_the_full_logits_gradient(bf16: bool, tied: bool):
    """sft_nll's head on the mask==1 positions only against cross entropy over the full logits."""
    g = torch.Generator().manual_seed(2)
    batch = [(torch.randint(1, 64, (n,), generator=g).tolist(), [0] * (n - 4) + [1] * 4) for n in (9, 21, 14)]
    ids, attn, mask = pad_batch(batch, torch.device("cpu"))
    models = [tiny_qwen(), tiny_qwen()]
    for m in models:
        if tied:
            m.config.tie_word_embeddings = True
            m.tie_weights()
    models[1].load_state_dict(models[0].state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        ours = sft_nll(models[0], batch)
        logits = models[1](input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="none")
        want = (nll * mask[:, 1:].reshape(-1)).sum()
    ours.backward()
    want.backward()
    tol = {"rtol": 2e-2, "atol": 2e-3} if bf16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(ours, want, **tol)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, **tol, msg=name)


@torch.no_grad()
def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_lr_schedule_by_hand():
    assert [lr_at(s, 1.0, 2, decay_steps=10) for s in (0, 1, 2, 6)] == pytest.approx([0.5, 1.0, 1.0, 0.5])
    assert lr_at(0, 0.1, 0, decay_steps=5) == pytest.approx(0.1)
    assert [lr_at(s, 1.0, 4) for s in (0, 3, 4, 100)] == [0.25, 1.0, 1.0, 1.0]  # no decay: warmup, then constant


def memorization_set() -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(4):
        prompt = [1, 10 + i]
        answer = torch.randint(20, 64, (6,), generator=g).tolist()
        out.append((prompt + answer, [0, 0] + [1] * 6))
    return out


def test_sft_memorizes_and_is_deterministic():
    data = memorization_set()
    seen = []
    losses = sft_train(
        tiny_qwen(),
        data,
        steps=60,
        batch_size=3,
        lr=1e-2,
        warmup=5,
        seed=1,
        on_step=lambda s, loss, lr: seen.append((s, lr)),
    )
    assert losses[-1] < 0.1 * losses[0]
    assert [s for s, _ in seen] == list(range(60)) and seen[4][1] == pytest.approx(1e-2)
    again = sft_train(tiny_qwen(), data, steps=5, batch_size=3, lr=1e-2, warmup=5, seed=1)
    assert again == losses[:5]
    other = sft_train(tiny_qwen(), data, steps=5, batch_size=3, lr=1e-2, warmup=5, seed=2)
    assert other != losses[:5]


def test_bad_examples_raise():
    with pytest.raises(AssayError, match="one entry per token"):
        sft_train(tiny_qwen(), [([1, 2, 3], [0, 1])], 1, 1, 1e-3, 0, 0)
    with pytest.raises(AssayError, match="no token to learn"):
        sft_train(tiny_qwen(), [([1, 2, 3], [0, 0, 0])], 1, 1, 1e-3, 0, 0)
    with pytest.raises(AssayError, match="no examples"):
        sft_train(tiny_qwen(), [], 1, 1, 1e-3, 0, 0)


def test_the_cpu_trainers_keep_freed_memory():  # core/heap.py: a step's activations are not faulted in again
    heap.keep_freed_memory.cache_clear()
    sft_train(tiny_qwen(), [([1, 2, 3, 4], [0, 0, 1, 1])], steps=1, batch_size=1, lr=1e-3, warmup=0, seed=0)
    assert heap.keep_freed_memory.cache_info().currsize == 1
    heap.keep_freed_memory.cache_clear()
    GRPOTrainer(tiny_qwen(), TrainConfig())
    assert heap.keep_freed_memory.cache_info().currsize == 1
