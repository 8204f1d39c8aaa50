import copy
import math

import pytest
import torch
from train_helpers import Bigram, random_batch, tiny_qwen, traj, with_behaviour_logprobs

from assay.core.config import LossConfig, TrainConfig
from assay.core.errors import AssayError
from assay.core.types import ROLLOUT_ERROR
from assay.train.trainer import GRPOTrainer

torch.set_num_threads(1)


def cfg(**kw) -> TrainConfig:
    loss = LossConfig(**kw.pop("loss", {}))
    return TrainConfig(**{"lr": 1e-2, **kw, "loss": loss})


def grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_micro_batches_give_the_whole_batch_gradient(aggregation):
    model = tiny_qwen()
    ref = tiny_qwen(seed=1)
    batch = random_batch(0, n_groups=3, group_size=3)
    with_behaviour_logprobs(model, batch, noise=0.4)
    loss = {"aggregation": aggregation, "kl_coef": 0.1}
    whole = GRPOTrainer(model, cfg(micro_batch=9, loss=loss), ref_model=ref).accumulate_gradients(batch)
    g_whole = grads(model)
    assert whole["clip_frac"] > 0  # the noise put some tokens outside the clip range
    for mb in (1, 2, 4):
        parts = GRPOTrainer(model, cfg(micro_batch=mb, loss=loss), ref_model=ref).accumulate_gradients(batch)
        for a, b in zip(g_whole, grads(model), strict=True):
            assert torch.allclose(a, b, atol=1e-6, rtol=0)
        for k in ("loss", "clip_frac", "entropy", "kl_ref", "mismatch"):
            assert parts[k] == pytest.approx(whole[k], abs=1e-6)


def test_loss_uses_logits_of_the_previous_token():
    torch.manual_seed(0)
    table = torch.randn(8, 8)
    lsm = table.log_softmax(-1)
    # tokens 5 -> 2 -> 7 -> 1 with tokens 7 and 1 generated; a correct trainer reads p(7|2) and p(1|7)
    t = traj([5, 2, 7, 1], [0, 0, 1, 1], 1.0, "g", logprobs=[0.0, 0.0, float(lsm[2, 7]), float(lsm[7, 1])])
    u = traj([5, 2, 7, 1], [0, 0, 1, 1], 0.0, "g", logprobs=[0.0, 0.0, float(lsm[2, 7]), float(lsm[7, 1])])
    model = Bigram(table)
    trainer = GRPOTrainer(model, cfg(loss={"per_domain_normalize": False}))
    m = trainer.accumulate_gradients([t, u])
    assert m["mismatch"] == pytest.approx(0.0, abs=1e-6)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    # a second, different completion: gradients reach exactly the rows that predicted generated tokens
    # (2 -> 7, 7 -> 1, 2 -> 3, 3 -> 4), never row 5 (predicts a prompt token) nor the last tokens' rows
    u.token_ids, u.logprobs = [5, 2, 3, 4], [0.0, 0.0, float(lsm[2, 3]), float(lsm[3, 4])]
    trainer.accumulate_gradients([t, u])
    touched = (model.table.grad.abs().sum(-1) > 0).nonzero().flatten().tolist()
    assert touched == [2, 3, 7]


def test_per_domain_mismatch():
    model = tiny_qwen()
    batch = random_batch(3, n_groups=2, group_size=2, domains=("a", "b"))
    with_behaviour_logprobs(model, batch, noise=0.0)
    for t in batch:
        if t.task.domain == "b":
            t.logprobs = [lp - 0.25 if m else 0.0 for lp, m in zip(t.logprobs, t.loss_mask, strict=True)]
    m = GRPOTrainer(model, cfg()).step(batch)
    assert m["mismatch/a"] == pytest.approx(0.0, abs=1e-5)
    assert m["mismatch/b"] == pytest.approx(0.25, abs=1e-5)
    tok = {d: sum(sum(t.loss_mask) for t in batch if t.task.domain == d) for d in "ab"}
    assert m["mismatch"] == pytest.approx(0.25 * tok["b"] / (tok["a"] + tok["b"]), abs=1e-5)
    assert m["tokens"] == tok["a"] + tok["b"] and m["skipped"] == 0.0


def test_state_round_trip_gives_identical_next_step():
    b1, b2 = random_batch(1), random_batch(2)
    model = tiny_qwen(seed=0)
    trainer = GRPOTrainer(model, cfg(weight_decay=0.1))
    with_behaviour_logprobs(model, b1, noise=0.3)
    trainer.step(b1)
    saved = copy.deepcopy(trainer.state_dict())
    with_behaviour_logprobs(model, b2, noise=0.3)
    want = trainer.step(b2)

    other = GRPOTrainer(tiny_qwen(seed=7), cfg(weight_decay=0.1))
    other.load_state_dict(saved)
    assert other.steps == 1
    got = other.step(b2)
    assert got == want
    for (n1, a), (n2, b) in zip(trainer.named_weights(), other.named_weights(), strict=True):
        assert n1 == n2 and torch.equal(a, b)


def test_updates_per_batch_reuses_rollout_logprobs():
    batch = random_batch(4)
    m1, m2 = tiny_qwen(), tiny_qwen()
    with_behaviour_logprobs(m1, batch, noise=0.2)
    twice = GRPOTrainer(m1, cfg(updates_per_batch=2))
    out = twice.step(batch)
    once = GRPOTrainer(m2, cfg(updates_per_batch=1))
    first = once.step(batch)
    once.step(batch)
    assert twice.steps == 2
    assert out["mismatch"] == first["mismatch"]  # reported from the first update only
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_warmup_scales_the_first_steps():
    batch = random_batch(4)
    trainer = GRPOTrainer(tiny_qwen(), cfg(lr=1e-2, warmup_steps=4))
    rates = []
    for _ in range(5):
        trainer.step(batch)
        rates.append(trainer.optimizer.param_groups[0]["lr"])
    assert rates == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2])


def test_nothing_to_learn_skips_the_step():
    model = tiny_qwen()
    before = copy.deepcopy(model.state_dict())
    trainer = GRPOTrainer(model, cfg())
    same = [traj([1, 2, 3], [0, 1, 1], 0.5, "g") for _ in range(4)]
    failed = [traj([1, 2, 3], [0, 1, 1], float(i), "h", status=ROLLOUT_ERROR) for i in range(2)]
    no_tokens = [traj([1, 2, 3], [0, 0, 0], float(i), "k") for i in range(2)]
    for batch in ([], same, failed, no_tokens):
        m = trainer.step(batch)
        assert m["skipped"] == 1.0 and m["optimizer_steps"] == 0.0
    assert trainer.step(failed)["infra_dropped"] == 2.0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_failed_trajectories_do_not_change_the_gradient():
    model = tiny_qwen()
    batch = random_batch(5)
    with_behaviour_logprobs(model, batch, noise=0.2)
    GRPOTrainer(model, cfg()).accumulate_gradients(batch)
    clean = grads(model)
    junk = traj([9] * 30, [0] + [1] * 29, 100.0, batch[0].group_id, status=ROLLOUT_ERROR)
    GRPOTrainer(model, cfg()).accumulate_gradients(batch + [junk])
    for a, b in zip(clean, grads(model), strict=True):
        assert torch.equal(a, b)


def test_bad_trajectories_and_config_raise():
    trainer = GRPOTrainer(tiny_qwen(), cfg())
    with pytest.raises(AssayError, match="one entry per token"):
        trainer.step([traj([1, 2, 3], [0, 1], 1.0, "g"), traj([1, 2], [0, 1], 0.0, "g")])
    with pytest.raises(AssayError, match="loss_mask\\[0\\]"):
        trainer.step([traj([1, 2], [1, 1], 1.0, "g"), traj([1, 2], [0, 1], 0.0, "g")])
    with pytest.raises(AssayError, match="reference model"):
        GRPOTrainer(tiny_qwen(), cfg(loss={"kl_coef": 0.1}))


def test_kl_to_identical_reference_is_zero_and_bf16_runs():
    model = tiny_qwen()
    batch = random_batch(6)
    with_behaviour_logprobs(model, batch, noise=0.1)
    m = GRPOTrainer(model, cfg(loss={"kl_coef": 0.5}), ref_model=copy.deepcopy(model)).step(batch)
    assert m["kl_ref"] == pytest.approx(0.0, abs=1e-7)
    before = [p.clone() for p in model.parameters()]
    m = GRPOTrainer(model, cfg(bf16=True)).step(batch)
    assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and 0 < m["mismatch"] < 0.5
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_bf16_auto_follows_the_device_and_the_decoupled_weight_corrects_its_mismatch(monkeypatch):
    import assay.core.modeling as modeling

    batch = random_batch(6)
    model = tiny_qwen()
    with_behaviour_logprobs(model, batch, noise=0.0)  # the float32 rollout's log-probs exactly
    for fast in (False, True):
        monkeypatch.setattr(modeling, "fast_bf16", lambda device, fast=fast: fast)
        assert GRPOTrainer(tiny_qwen(), cfg(bf16="auto")).bf16 is fast
    assert GRPOTrainer(tiny_qwen(), cfg(bf16=True)).bf16 and not GRPOTrainer(tiny_qwen(), cfg()).bf16
    m32 = GRPOTrainer(copy.deepcopy(model), cfg(loss={"decoupled": True})).accumulate_gradients(batch)
    m16 = GRPOTrainer(copy.deepcopy(model), cfg(bf16=True, loss={"decoupled": True})).accumulate_gradients(batch)
    assert m32["mismatch"] < 1e-5 < m16["mismatch"]  # bf16's log-probs differ from the float32 rollout's
    assert m32["is_weight_mean"] == pytest.approx(1.0, abs=1e-5) != m16["is_weight_mean"]  # and are weighted


def test_grpo_raises_reward_on_a_toy_bandit():
    """Reward 1 when the single sampled token is even: GRPO must raise p(even) from about 1/2."""
    model = tiny_qwen(seed=3)
    trainer = GRPOTrainer(model, cfg(lr=3e-2, loss={"eps_high": 0.2}))
    prompt = [1, 2, 3]
    g = torch.Generator().manual_seed(0)

    def p_even() -> float:
        with torch.no_grad():
            probs = model(input_ids=torch.tensor([prompt])).logits[0, -1].softmax(-1)
        return float(probs[0::2].sum())

    start = p_even()
    for step in range(12):
        with torch.no_grad():
            logp = model(input_ids=torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
        toks = torch.multinomial(logp.exp(), 8, replacement=True, generator=g).tolist()
        batch = [
            traj(prompt + [k], [0, 0, 0, 1], float(k % 2 == 0), f"s{step}", logprobs=[0.0, 0.0, 0.0, float(logp[k])])
            for k in toks
        ]
        trainer.step(batch)
    end = p_even()
    assert start < 0.7 and end > 0.9


def test_non_finite_gradient_skips_the_step():
    model = tiny_qwen()
    before = copy.deepcopy(model.state_dict())
    trainer = GRPOTrainer(model, cfg())
    # behaviour logprob -1000: the ratio overflows to inf, and the negative advantage keeps it unclipped
    batch = [traj([1, 2, 3], [0, 1, 1], 1.0, "g"), traj([1, 2, 4], [0, 1, 1], 0.0, "g", logprobs=[0.0, -1e3, -1e3])]
    m = trainer.step(batch)
    assert m["skipped"] == 1.0 and m["nonfinite"] == 1.0 and trainer.steps == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_selective_logprobs_give_the_full_gradient_and_metrics():
    model = tiny_qwen()
    ref = tiny_qwen(seed=1)
    batch = random_batch(0, n_groups=3, group_size=3)
    with_behaviour_logprobs(model, batch, noise=0.4)
    loss = {"kl_coef": 0.1}
    full = GRPOTrainer(model, cfg(micro_batch=4, loss=loss), ref_model=ref).accumulate_gradients(batch)
    g_full = grads(model)
    sel = GRPOTrainer(model, cfg(micro_batch=4, loss=loss, selective_logprobs=True),
                      ref_model=ref).accumulate_gradients(batch)
    for a, b in zip(g_full, grads(model), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    for k in ("loss", "clip_frac", "entropy", "kl_ref", "mismatch"):
        assert sel[k] == pytest.approx(full[k], abs=1e-6)


@pytest.mark.parametrize("micro_batch", [2, 4])
def test_a_shared_prompt_run_once_gives_the_same_gradient_and_metrics(micro_batch):
    from assay.train.trainer import Sample, _pad, micro_batches, segment_views

    # three groups of 3 sharing an 18-30 token prompt each, then two trajectories that share nothing
    batch = random_batch(0, n_groups=3, group_size=3, prompt_len=(18, 30)) + random_batch(1, 2, 1, prompt_len=(18, 30))
    model = tiny_qwen()
    with_behaviour_logprobs(model, batch, noise=0.4)
    settings = {"micro_batch": micro_batch, "selective_logprobs": True, "loss": {"decoupled": True}}
    shared = GRPOTrainer(model, cfg(**settings))
    assert shared.share_prefix
    got = shared.accumulate_gradients(batch)
    g_shared = grads(model)
    whole = GRPOTrainer(model, cfg(**settings, shared_prefix=False)).accumulate_gradients(batch)
    for a, b in zip(g_shared, grads(model), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    for k in ("loss", "clip_frac", "entropy", "mismatch", "is_weight_mean"):
        assert got[k] == pytest.approx(whole[k], abs=1e-6)

    samples = [Sample(v, 1.0) for t in batch for v in segment_views(t)]
    chunks = micro_batches(samples, micro_batch, share_prefix=True)
    groups = [{s.traj.task.task_id for s in c} for c in chunks]
    # a micro-batch never mixes two groups; the two loners go together, last, and share nothing
    assert all(len(g) == 1 for g in groups[:-1]) and groups[-1] == {"g1-0", "g1-1"}
    prefixes = [int(_pad(c, torch.device("cpu"), True)["prefix_len"]) for c in chunks]
    assert all(p >= 17 for p, c in zip(prefixes, chunks, strict=True) if len(c) > 1 and c is not chunks[-1])
    assert prefixes[-1] == 0
    assert sum(map(len, chunks)) == len(samples) and all(len(c) <= micro_batch for c in chunks)


def test_activation_checkpointing_gives_the_same_gradient():
    batch = random_batch(0, n_groups=2, group_size=3)
    model = tiny_qwen()
    with_behaviour_logprobs(model, batch, noise=0.3)
    GRPOTrainer(model, cfg(micro_batch=3)).accumulate_gradients(batch)
    plain = grads(model)
    again = tiny_qwen()
    GRPOTrainer(again, cfg(micro_batch=3, activation_checkpointing=True)).accumulate_gradients(batch)
    # transformers before 5.20 names it gradient checkpointing
    assert getattr(again, "is_activation_checkpointing", None) or again.is_gradient_checkpointing
    for a, b in zip(plain, grads(again), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_groups_after_one_system_prompt_each_run_their_whole_prompt_once():
    """Every group's prompt starts with the same system prompt: a run must end at the next group, whose prompt
    shares only that, so each micro-batch's shared prefix is its group's whole prompt, not the system prompt."""
    from assay.train.trainer import Sample, _pad, micro_batches

    system = list(range(1, 21))  # 20 tokens every prompt starts with
    batch = [traj(system + [50 + g] * 12 + [90 + k] * (2 + k), [0] * 32 + [1] * (2 + k), float(k), f"g{g}")
             for g in range(3) for k in range(3)]
    chunks = micro_batches([Sample(t, 1.0) for t in batch], 16, share_prefix=True)
    assert [{s.traj.group_id for s in c} for c in chunks] == [{"g0"}, {"g1"}, {"g2"}]
    assert [int(_pad(c, torch.device("cpu"), True)["prefix_len"]) for c in chunks] == [31, 31, 31]


def test_a_group_with_equal_rewards_is_not_run_and_the_gradient_is_the_same():
    model = tiny_qwen()
    batch = random_batch(3, n_groups=3, group_size=3)
    for i, t in enumerate(batch):  # group 0's rewards are equal (advantages exactly 0); the others' vary
        t.reward = 0.5 if i < 3 else float(i % 2)
    with_behaviour_logprobs(model, batch, noise=0.2)
    flat, rest = batch[:3], batch[3:]
    plain = cfg(loss={"per_domain_normalize": False})  # else the flat group's zeros change the domain's scale
    m_all = GRPOTrainer(model, plain).accumulate_gradients(batch)
    g_all = grads(model)
    m_rest = GRPOTrainer(model, plain).accumulate_gradients(rest)
    g_rest = grads(model)
    assert m_all["sequences_trained"] == len(rest)
    # token aggregation: the skipped group's tokens still count in the normalizer
    scale = sum(sum(t.loss_mask) for t in rest) / sum(sum(t.loss_mask) for t in batch)
    for a, b in zip(g_all, g_rest, strict=True):
        assert torch.allclose(a, b * scale, atol=1e-7, rtol=1e-5)
    for k in ("entropy", "mismatch", "clip_frac"):  # over the samples trained on
        assert m_all[k] == pytest.approx(m_rest[k], abs=1e-6)
    # a KL term pulls on every sample: none is skipped
    kl = GRPOTrainer(model, cfg(loss={"kl_coef": 0.1}), ref_model=tiny_qwen(seed=1)).accumulate_gradients(batch)
    assert kl["sequences_trained"] == len(batch) and any(sum(t.loss_mask) for t in flat)
