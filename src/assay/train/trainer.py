"""The GRPO-family trainer: advantages, micro-batched clipped-surrogate loss, one AdamW step.

Gradients accumulate over micro-batches, each loss divided by the whole batch's token (or sequence)
count, so the accumulated gradient is the whole-batch gradient whatever `micro_batch` is."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from assay.core.config import TrainConfig
from assay.core.errors import AssayError
from assay.core.types import Trajectory
from assay.train.advantages import group_advantages
from assay.train.losses import aggregate, kl_penalty, policy_loss, token_logprobs

PAD_ID = 0  # any id works: padded positions are masked out of attention and loss


@dataclass
class Sample:
    traj: Trajectory
    advantage: float


def _check(i: int, t: Trajectory) -> None:
    n = len(t.token_ids)
    where = f"trajectory {i} (task {t.task.task_id!r})"
    if n == 0:
        raise AssayError(f"{where} has no tokens; drop empty trajectories before training")
    if len(t.loss_mask) != n or len(t.logprobs) != n:
        raise AssayError(
            f"{where}: token_ids, loss_mask and logprobs must have one entry per token, "
            f"got {n}, {len(t.loss_mask)}, {len(t.logprobs)}"
        )
    if t.loss_mask[0]:
        raise AssayError(
            f"{where}: loss_mask[0] is 1, but the first token has no prediction; it must be a prompt token"
        )


def _pad(samples: Sequence[Sample], device: torch.device) -> dict[str, Tensor]:
    """Right-pad a micro-batch."""
    width = max(len(s.traj.token_ids) for s in samples)
    ids = torch.full((len(samples), width), PAD_ID, dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.float32)
    old = torch.zeros((len(samples), width), dtype=torch.float32)
    for row, s in enumerate(samples):
        n = len(s.traj.token_ids)
        ids[row, :n] = torch.tensor(s.traj.token_ids, dtype=torch.long)
        attn[row, :n] = 1
        mask[row, :n] = torch.tensor(s.traj.loss_mask, dtype=torch.float32)
        old[row, :n] = torch.tensor(s.traj.logprobs, dtype=torch.float32)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    out = {"input_ids": ids, "attention_mask": attn, "mask": mask, "old": old, "adv": adv}
    return {k: v.to(device) for k, v in out.items()}


class GRPOTrainer:
    """Implements the Trainer protocol for GRPO, Dr. GRPO, RLOO and DAPO's clip-higher/token-level loss."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, ref_model: nn.Module | None = None,
                 temperature: float = 1.0) -> None:
        if cfg.loss.kl_coef > 0 and ref_model is None:
            raise AssayError("train.loss.kl_coef > 0 needs a frozen reference model; pass ref_model or set kl_coef=0")
        self.model = model
        self.cfg = cfg
        self.ref_model = ref_model
        self.temperature = temperature  # the rollout's: ratios compare the distribution actually sampled
        if ref_model is not None:
            ref_model.eval().requires_grad_(False)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.steps = 0  # optimizer steps taken

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- the update ------------------------------------------------------------------------------

    def prepare(self, batch: Sequence[Trajectory]) -> list[Sample]:
        """Advantages for the batch; trajectories with a failed status are dropped here."""
        lc = self.cfg.loss
        adv = group_advantages(batch, lc.kind, lc.std_normalize, lc.per_domain_normalize)
        samples = []
        for i, (t, a) in enumerate(zip(batch, adv, strict=True)):
            if a is not None:
                _check(i, t)
                samples.append(Sample(t, a))
        return samples

    def step(self, batch: Sequence[Trajectory]) -> dict[str, float]:
        """One rollout batch: `updates_per_batch` optimizer steps on it. A batch with nothing to learn
        from (no ok trajectory, no generated token, every advantage 0 and no KL term) takes no step
        and reports skipped=1; so does a non-finite gradient norm, which also reports nonfinite=1."""
        samples = self.prepare(batch)
        tokens = sum(sum(s.traj.loss_mask) for s in samples)
        base = {"trajectories": float(len(samples)), "infra_dropped": float(len(batch) - len(samples))}
        base["tokens"] = float(tokens)
        no_signal = all(s.advantage == 0.0 for s in samples) and self.cfg.loss.kl_coef == 0
        if not samples or tokens == 0 or no_signal:
            return {**base, "skipped": 1.0, "optimizer_steps": float(self.steps)}
        totals: dict[str, float] = defaultdict(float)
        first: dict[str, float] = {}
        for u in range(self.cfg.updates_per_batch):
            m = self._accumulate(samples)
            if u == 0:  # trainer vs behaviour and per-domain figures: taken before the weights move
                first = {k: v for k, v in m.items() if "/" in k or k == "mismatch"}
            m = {k: v for k, v in m.items() if k not in first}
            m["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip))
            if not math.isfinite(m["grad_norm"]):  # one bad step would poison the weights and Adam's moments
                self.optimizer.zero_grad(set_to_none=True)
                return {**base, **m, **first, "skipped": 1.0, "nonfinite": 1.0, "optimizer_steps": float(self.steps)}
            self._set_lr()
            self.optimizer.step()
            self.steps += 1
            for k, v in m.items():
                totals[k] += v
        means = {k: v / self.cfg.updates_per_batch for k, v in totals.items()}
        return {**base, **means, **first, "skipped": 0.0, "optimizer_steps": float(self.steps)}

    def _set_lr(self) -> None:
        """Linear warmup: Adam's first updates move every weight by about lr whatever the gradient's
        size, so a fresh optimizer on a noisy RL gradient starts small."""
        warm = self.cfg.warmup_steps
        rate = self.cfg.lr * min(1.0, (self.steps + 1) / warm) if warm else self.cfg.lr
        for group in self.optimizer.param_groups:
            group["lr"] = rate

    def accumulate_gradients(self, batch: Sequence[Trajectory]) -> dict[str, float]:
        """Fill .grad with the batch's loss gradient (no optimizer step); returns the step's metrics."""
        return self._accumulate(self.prepare(batch))

    def _accumulate(self, samples: Sequence[Sample]) -> dict[str, float]:
        cfg, lc = self.cfg, self.cfg.loss
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        n_tokens = float(sum(sum(s.traj.loss_mask) for s in samples))
        n_seqs = float(sum(1 for s in samples if any(s.traj.loss_mask)))
        normalizer = n_tokens if lc.aggregation == "token" else n_seqs
        sums: dict[str, float] = defaultdict(float)
        # per domain: |mismatch| sum, entropy sum, KL-to-reference sum, tokens
        per_domain: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
        for lo in range(0, len(samples), cfg.micro_batch):
            chunk = samples[lo : lo + cfg.micro_batch]
            b = _pad(chunk, self.device)
            mask = b["mask"]
            logp, entropy = self._logprobs(self.model, b)  # fp32 logprobs, even under bf16 autocast
            loss, pm = policy_loss(logp, b["old"], b["adv"], mask, lc.eps_low, lc.eps_high, lc.aggregation, normalizer)
            if lc.kl_coef > 0:
                assert self.ref_model is not None
                with torch.no_grad():
                    ref_logp, _ = self._logprobs(self.ref_model, b)
                kl = kl_penalty(logp, ref_logp, mask)
                loss = loss + lc.kl_coef * aggregate(kl, mask, lc.aggregation, normalizer)
                kl_tok = (kl.detach() * mask).sum(-1)
                sums["kl_ref"] += kl_tok.sum().item()
            loss.backward()
            tok = mask.sum().item()
            sums["loss"] += loss.item()  # each micro-batch loss is already divided by the batch total
            for k, v in pm.items():
                sums[k] += v * tok
            sums["entropy"] += (entropy * mask).sum().item()
            gap = ((logp.detach() - b["old"]).abs() * mask).sum(-1)
            ent = (entropy.detach() * mask).sum(-1)
            kls = kl_tok if lc.kl_coef > 0 else torch.zeros_like(gap)
            for s, row in zip(chunk, torch.stack([gap, ent, kls, mask.sum(-1)], -1).tolist(), strict=True):
                acc = per_domain[s.traj.task.domain]
                for i, v in enumerate(row):
                    acc[i] += v
        out = {"loss": sums["loss"]}
        for k in ("clip_frac", "approx_kl", "ratio_mean", "entropy", "kl_ref"):
            out[k] = sums[k] / max(n_tokens, 1.0)
        out["mismatch"] = sum(a[0] for a in per_domain.values()) / max(n_tokens, 1.0)
        for domain, (gap_sum, ent_sum, kl_sum, n) in sorted(per_domain.items()):
            if n:
                out[f"mismatch/{domain}"] = gap_sum / n
                out[f"entropy/{domain}"] = ent_sum / n
                out[f"kl_ref/{domain}"] = kl_sum / n
        return out

    def _logprobs(self, model: nn.Module, b: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16):
            return token_logprobs(model, b["input_ids"], b["attention_mask"], self.temperature)

    # -- weights and checkpoints -----------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The model's tensors in Hugging Face layout (state_dict names, tied weights included), detached."""
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and step count. Like torch's own, the tensors are live references: save or
        copy the dict before the next step."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.model.load_state_dict(d["model"])
        self.optimizer.load_state_dict(d["optimizer"])
        self.steps = int(d["steps"])
