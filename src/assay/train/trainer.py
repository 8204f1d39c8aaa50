"""The GRPO-family trainer: advantages, micro-batched clipped-surrogate loss, one AdamW step.

Gradients accumulate over micro-batches, each loss divided by the whole batch's token (or sequence)
count, so the accumulated gradient is the whole-batch gradient whatever `micro_batch` is.
With `train.sharding: fsdp` the model and the KL reference are sharded over the ranks (train/sharding.py)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from assay.core.config import TrainConfig
from assay.core.errors import AssayError
from assay.core.heap import keep_freed_memory_on
from assay.core.modeling import bf16_enabled
from assay.core.types import Trajectory
from assay.train.advantages import group_advantages
from assay.train.batching import adamw, check_sequence, lr_at, pad_tokens, right_pad, set_lr
from assay.train.cast_once import cast_frozen_linears
from assay.train.lora import is_lora, merged_weights
from assay.train.losses import (
    aggregate,
    importance_weight,
    kl_penalty,
    policy_loss,
    selective_token_logprobs,
    shareable_prefix,
    token_logprobs,
)
from assay.train.sharding import (
    SELECTIVE,
    full_model_state,
    full_optimizer_state,
    full_value,
    load_full_state,
    shard,
)

MIN_SHARED_PREFIX = 16  # tokens: below this the prefix's own forward call saves too little to be worth it


@dataclass
class Sample:
    traj: Trajectory  # one segment of a trajectory: the context one or more of its turns were prompted with
    advantage: float
    source: int = 0  # the trajectory's index in the batch


def segment_views(t: Trajectory) -> list[Trajectory]:
    """The trajectory as the sequences the policy saw: itself when it kept one context, else one view per
    segment (Trajectory.segments) that sampled anything, each scored on its own, so every sampled token is
    scored on exactly the context it was sampled in."""
    if not t.segment_starts:
        return [t]
    return [replace(t, token_ids=t.token_ids[a:b], loss_mask=t.loss_mask[a:b], logprobs=t.logprobs[a:b],
                    segment_starts=[]) for a, b in t.segments() if any(t.loss_mask[a:b])]


@dataclass
class DomainSums:
    """Per domain, summed over its completion tokens: what the trainer reports per domain."""

    mismatch: float = 0.0  # |trainer logprob - behaviour logprob|
    entropy: float = 0.0
    kl_ref: float = 0.0
    is_weight: float = 0.0  # truncated importance weight (decoupled objective only)
    tokens: float = 0.0

    def add(self, mismatch: float, entropy: float, kl_ref: float, is_weight: float, tokens: float) -> None:
        self.mismatch += mismatch
        self.entropy += entropy
        self.kl_ref += kl_ref
        self.is_weight += is_weight
        self.tokens += tokens


def _check(i: int, t: Trajectory) -> None:
    check_sequence(f"trajectory {i} (task {t.task.task_id!r})", t.token_ids, t.loss_mask, logprobs=t.logprobs)


def _pad(samples: Sequence[Sample], device: torch.device, share_prefix: bool = False) -> dict[str, Tensor]:
    """Right-pad a micro-batch; with `share_prefix`, the leading tokens its sequences share (a group's
    prompt) as "prefix_len", which the forward pass runs once (losses.selective_token_logprobs)."""
    ids, masks = [s.traj.token_ids for s in samples], [s.traj.loss_mask for s in samples]
    input_ids, attn, mask = pad_tokens(ids, masks)
    old = right_pad([s.traj.logprobs for s in samples], torch.float32)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    prefix = shareable_prefix(ids, masks) if share_prefix and len(samples) > 1 else 0
    out = {"input_ids": input_ids, "attention_mask": attn, "mask": mask, "old": old, "adv": adv}
    # a count, not data: it stays on the host, so reading it never waits for the device
    return {**{k: v.to(device) for k, v in out.items()},
            "prefix_len": torch.tensor(prefix if prefix >= MIN_SHARED_PREFIX else 0)}


def _shared_tokens(a: Sample, b: Sample) -> int:
    return shareable_prefix([a.traj.token_ids, b.traj.token_ids], [a.traj.loss_mask, b.traj.loss_mask])


def micro_batches(samples: Sequence[Sample], size: int, share_prefix: bool) -> list[list[Sample]]:
    """Consecutive micro-batches of at most `size` samples. With `share_prefix`, a run of samples that share
    a prompt (a group's, kept together in the batch) is never mixed with another, so that each of its
    micro-batches runs the prompt once; samples that share none are batched together after the runs. A run
    ends where the next sample shares less with it than its members do (another group's prompt after the same
    system prompt), so each group runs its whole prompt once, not only what every group has in common."""
    if not share_prefix:
        return [list(samples[lo : lo + size]) for lo in range(0, len(samples), size)]
    runs: list[list[Sample]] = []
    shared = 0  # what the last run's members have in common, once it has two
    for s in samples:
        common = _shared_tokens(runs[-1][0], s) if runs else 0
        if common >= MIN_SHARED_PREFIX and (len(runs[-1]) == 1 or common >= shared):
            runs[-1].append(s)
            shared = common
        else:
            runs.append([s])
    loose = [r[0] for r in runs if len(r) == 1]
    return [run[lo : lo + size] for run in [*(r for r in runs if len(r) > 1), loose] for lo in range(0, len(run), size)]


def staleness_metrics(trajs: Sequence[Trajectory], version: int) -> dict[str, float]:
    """How many policy versions behind `version` each trajectory was sampled: mean, max, a histogram
    (staleness_hist/K = share of trajectories K versions old) and the mean per domain."""
    ages = [version - t.policy_version for t in trajs]
    out = {"staleness_mean": sum(ages) / len(ages), "staleness_max": float(max(ages))}
    for k in sorted(set(ages)):
        out[f"staleness_hist/{k}"] = ages.count(k) / len(ages)
    by_domain: dict[str, list[int]] = defaultdict(list)
    for t, a in zip(trajs, ages, strict=True):
        by_domain[t.task.domain].append(a)
    out |= {f"staleness/{d}": sum(a) / len(a) for d, a in sorted(by_domain.items())}
    return out


class GRPOTrainer:
    """Implements the Trainer protocol for GRPO, Dr. GRPO, RLOO and DAPO's clip-higher/token-level loss."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, ref_model: nn.Module | None = None,
                 temperature: float = 1.0, data_parallel: bool = False) -> None:
        if cfg.loss.kl_coef > 0 and ref_model is None:
            raise AssayError("train.loss.kl_coef > 0 needs a frozen reference model; pass ref_model or set kl_coef=0")
        self.model = model
        self.cfg = cfg
        self.ref_model = ref_model
        self.temperature = temperature  # the rollout's: ratios compare the distribution actually sampled
        if ref_model is not None:
            ref_model.eval().requires_grad_(False)
        keep_freed_memory_on(next(model.parameters()).device)  # a step's activations stay for the next
        if cfg.activation_checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:  # transformers before 5.20 (the version vLLM's CPU build takes) has only the older name
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # Data parallel (torch.distributed, initialized by the caller): every rank holds the whole
        # batch, computes advantages and normalizers over it, takes the gradient of its share of the
        # samples, and the summed gradients are the whole batch's; every rank then takes the same step.
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if data_parallel else (0, 1)
        # Sharded (train/sharding.py), each rank's step updates its shard of the weights and optimizer
        # state, and backward itself sums the gradients (reduce-scatter), not an all-reduce here. `full`:
        # the whole weights on rank 0's CPU, gathered by every rank at once whenever they change, so
        # that publishing them to the rollout or a checkpoint needs no other rank.
        self.sharded = cfg.sharding == "fsdp"
        self.full: dict[str, Tensor] = {}
        if self.sharded:
            if not (data_parallel and dist.is_initialized()):
                raise AssayError("train.sharding: fsdp shards over the ranks' process group, and there is none: "
                                 "the pipeline starts one (with train.ranks: 1 too); elsewhere initialize "
                                 "torch.distributed and pass data_parallel=True")
            # the whole weights as they start, read before sharding: no other rank needs to take part yet
            # (a rank builds its trainer before rank 0 does)
            self.full = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()} if self.rank == 0 else {}
            shard(model)
            if ref_model is not None:
                shard(ref_model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        # a recomputed layer would add the prefix's keys to the cache twice; sharded passes take no prefix
        self.share_prefix = (cfg.shared_prefix and cfg.selective_logprobs and not cfg.activation_checkpointing
                             and not self.sharded)
        self.bf16 = bf16_enabled(cfg.bf16, self.device)
        if self.bf16 and not self.sharded:  # frozen weights (a LoRA base, a reference model) cast to bf16 once
            for m in (model, ref_model):
                if m is not None:
                    cast_frozen_linears(m)
        self.optimizer = adamw(self.params, cfg.lr, cfg.betas, cfg.weight_decay)
        self.steps = 0  # optimizer steps taken

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- the update ------------------------------------------------------------------------------

    def prepare(self, batch: Sequence[Trajectory]) -> list[Sample]:
        """Advantages for the batch, one sample per segment of each trajectory (all with its advantage);
        trajectories with a failed status are dropped here."""
        lc = self.cfg.loss
        adv = group_advantages(batch, lc.kind, lc.std_normalize, lc.per_domain_normalize)
        samples = []
        for i, (t, a) in enumerate(zip(batch, adv, strict=True)):
            if a is not None:
                _check(i, t)
                samples += [Sample(view, a, i) for view in segment_views(t)]
        return samples

    def step(self, batch: Sequence[Trajectory], version: int | None = None) -> dict[str, float]:
        """One rollout batch: `updates_per_batch` optimizer steps on it. A batch with nothing to learn
        from (no ok trajectory, no generated token, every advantage 0 and no KL term) takes no step
        and reports skipped=1; so does a non-finite gradient norm, which also reports nonfinite=1.
        `version` is the policy version of the weights being trained: with it, the batch's staleness
        (versions between the sampling weights and these) is reported, overall and per domain.
        Sharded, every rank calls it with the same batch."""
        before = self.steps
        out = self._update(batch, version)
        if self.sharded and self.steps != before:  # every rank took the same steps: all gather, or none
            self.full = full_model_state(self.model)
        return out

    def _update(self, batch: Sequence[Trajectory], version: int | None) -> dict[str, float]:
        samples = self.prepare(batch)
        tokens = sum(sum(s.traj.loss_mask) for s in samples)
        kept = len({s.source for s in samples})
        base = {"trajectories": float(kept), "infra_dropped": float(len(batch) - kept),
                "sequences": float(len(samples))}
        base["tokens"] = float(tokens)
        if version is not None and samples:
            base |= staleness_metrics([s.traj for s in samples], version)
        no_signal = all(s.advantage == 0.0 for s in samples) and self.cfg.loss.kl_coef == 0
        if not samples or tokens == 0 or no_signal:
            return {**base, "skipped": 1.0, "optimizer_steps": float(self.steps)}
        totals: dict[str, float] = defaultdict(float)
        first: dict[str, float] = {}
        prox: list[Tensor] | None = None
        for u in range(self.cfg.updates_per_batch):
            m, prox = self._accumulate(samples, prox)
            if u == 0:  # trainer vs behaviour and per-domain figures: taken before the weights move
                first = {k: v for k, v in m.items() if "/" in k or k == "mismatch"}
            m = {k: v for k, v in m.items() if k not in first}
            m["grad_norm"] = full_value(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip))
            if not math.isfinite(m["grad_norm"]):  # one bad step would poison the weights and Adam's moments
                self.optimizer.zero_grad(set_to_none=True)
                return {**base, **m, **first, "skipped": 1.0, "nonfinite": 1.0, "optimizer_steps": float(self.steps)}
            set_lr(self.optimizer, lr_at(self.steps, self.cfg.lr, self.cfg.warmup_steps))
            self.optimizer.step()
            self.steps += 1
            for k, v in m.items():
                totals[k] += v
        means = {k: v / self.cfg.updates_per_batch for k, v in totals.items()}
        return {**base, **means, **first, "skipped": 0.0, "optimizer_steps": float(self.steps)}

    def accumulate_gradients(self, batch: Sequence[Trajectory]) -> dict[str, float]:
        """Fill .grad with the batch's loss gradient (no optimizer step); returns the step's metrics."""
        return self._accumulate(self.prepare(batch))[0]

    def _accumulate(self, samples: Sequence[Sample], prox: list[Tensor] | None = None
                    ) -> tuple[dict[str, float], list[Tensor] | None]:
        """Gradients and metrics of one pass over the batch. With the decoupled objective, the
        proximal logprobs per micro-batch: taken in the first pass (the weights as the batch arrived,
        so exactly this pass's logprobs) and passed back in for the batch's later updates."""
        cfg, lc = self.cfg, self.cfg.loss
        taken: list[Tensor] = []
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        n_tokens = float(sum(sum(s.traj.loss_mask) for s in samples))
        n_seqs = float(sum(1 for s in samples if any(s.traj.loss_mask)))
        normalizer = n_tokens if lc.aggregation == "token" else n_seqs
        # A sample whose advantage is 0 (all of a group whose rewards are equal) adds exactly nothing to the
        # gradient unless a KL term pulls on it: its pass is skipped. Its tokens still count in the
        # normalizer above, so the gradient is the same; the metrics below cover the samples trained on.
        trained = samples if lc.kl_coef > 0 else [s for s in samples if s.advantage != 0.0]
        n_trained = float(sum(sum(s.traj.loss_mask) for s in trained))
        sums: dict[str, float] = defaultdict(float)
        per_domain: dict[str, DomainSums] = defaultdict(DomainSums)
        chunks = micro_batches(trained[self.rank :: self.world], cfg.micro_batch, self.share_prefix)
        for c, chunk in enumerate(chunks):
            b = _pad(chunk, self.device, self.share_prefix)
            mask = b["mask"]
            logp, entropy = self._logprobs(self.model, b)  # fp32 logprobs, even under bf16 autocast
            anchor = None
            if lc.decoupled:
                anchor = logp.detach() if prox is None else prox[c]
                taken.append(anchor)
            loss, pm = policy_loss(logp, b["old"], b["adv"], mask, lc.eps_low, lc.eps_high, lc.aggregation, normalizer,
                                   logp_prox=anchor, is_cap=lc.is_cap)
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
                if k == "is_weight_max":
                    sums[k] = max(sums[k], v)
                else:
                    sums[k] += v * tok
            sums["entropy"] += (entropy * mask).sum().item()
            gap = ((logp.detach() - b["old"]).abs() * mask).sum(-1)
            ent = (entropy.detach() * mask).sum(-1)
            kls = kl_tok if lc.kl_coef > 0 else torch.zeros_like(gap)
            isw = ((importance_weight(anchor, b["old"], mask, lc.is_cap)[0] * mask).sum(-1) if anchor is not None
                   else torch.zeros_like(gap))
            for s, row in zip(chunk, torch.stack([gap, ent, kls, isw, mask.sum(-1)], -1).tolist(), strict=True):
                per_domain[s.traj.task.domain].add(*row)
        if self.sharded:  # rank 0 has the most samples; each rank runs as many forward/backward collectives
            most = math.ceil(len(trained[:: self.world]) / cfg.micro_batch)
            for _ in range(most - len(chunks)):
                self._idle_pass(samples[:1])
        if self.world > 1:
            self._all_reduce(sums, per_domain, sorted({s.traj.task.domain for s in samples}))
        out = {"loss": sums["loss"], "sequences_trained": float(len(trained))}
        for k in ("clip_frac", "approx_kl", "ratio_mean", "entropy", "kl_ref"):
            out[k] = sums[k] / max(n_trained, 1.0)
        if lc.decoupled:
            out |= {"is_weight_mean": sums["is_weight_mean"] / max(n_trained, 1.0), "is_weight_max": sums["is_weight_max"],
                    "is_truncated": sums["is_truncated"] / max(n_trained, 1.0)}
        out["mismatch"] = sum(a.mismatch for a in per_domain.values()) / max(n_trained, 1.0)
        for domain, acc in sorted(per_domain.items()):
            if acc.tokens:
                out[f"mismatch/{domain}"] = acc.mismatch / acc.tokens
                out[f"entropy/{domain}"] = acc.entropy / acc.tokens
                out[f"kl_ref/{domain}"] = acc.kl_ref / acc.tokens
                if lc.decoupled:
                    out[f"is_weight/{domain}"] = acc.is_weight / acc.tokens
        return out, (taken if lc.decoupled else None)

    def _idle_pass(self, chunk: Sequence[Sample]) -> None:
        """A forward and backward that adds nothing to the gradient, for a rank with fewer micro-batches
        than rank 0: a sharded model's passes are collectives that every rank must join."""
        b = _pad(chunk, self.device)
        logp, _ = self._logprobs(self.model, b)
        if self.cfg.loss.kl_coef > 0:  # the reference is sharded too
            assert self.ref_model is not None
            with torch.no_grad():
                self._logprobs(self.ref_model, b)
        (logp.sum() * 0.0).backward()

    def _all_reduce(self, sums: dict[str, float], per_domain: dict[str, DomainSums], domains: list[str]) -> None:
        """Sum the ranks' gradients (unless sharded: backward reduce-scattered them) and metric sums in
        place (the largest importance weight: max)."""
        if not self.sharded:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
        keys = ["loss", "clip_frac", "approx_kl", "ratio_mean", "entropy", "kl_ref", "is_weight_mean", "is_truncated"]
        fields = list(DomainSums.__dataclass_fields__)
        flat = [sums[k] for k in keys] + [getattr(per_domain[d], f) for d in domains for f in fields]
        # on the model's device: nccl (CUDA) reduces only tensors there
        total = torch.tensor(flat, dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        biggest = torch.tensor([sums["is_weight_max"]], dtype=torch.float64, device=self.device)
        dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
        values = iter(total.tolist())
        sums.update({k: next(values) for k in keys}, is_weight_max=float(biggest))
        for d in domains:
            per_domain[d] = DomainSums(**{f: next(values) for f in fields})

    def _logprobs(self, model: nn.Module, b: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            if self.cfg.selective_logprobs:
                if self.sharded:  # within FSDP's forward hooks (train/sharding.py)
                    return getattr(model, SELECTIVE)(b["input_ids"], b["attention_mask"], b["mask"], self.temperature)
                return selective_token_logprobs(model, b["input_ids"], b["attention_mask"], b["mask"], self.temperature,
                                                prefix_len=int(b["prefix_len"]))
            return token_logprobs(model, b["input_ids"], b["attention_mask"], self.temperature)

    # -- weights and checkpoints -----------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The model's tensors in Hugging Face layout (state_dict names, tied weights included), detached;
        with LoRA, the plain model's, each adapter folded into its weight. Sharded: the whole weights as
        the last change left them, on rank 0 (other ranks have none)."""
        if self.sharded:
            yield from self.full.items()
            return
        if is_lora(self.model):
            yield from merged_weights(self.model)
            return
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and step count. Like torch's own, the tensors are live references: save or
        copy the dict before the next step. Sharded, the whole (unsharded) state, in the same layout,
        on rank 0: every rank calls it at once (it gathers the optimizer state)."""
        if self.sharded:
            return {"model": dict(self.full), "optimizer": full_optimizer_state(self.model, self.optimizer),
                    "steps": self.steps}
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Sharded, every rank calls it at once with the whole state, and keeps its shard."""
        if self.sharded:
            load_full_state(self.model, self.optimizer, d["model"], d["optimizer"])
            self.full = full_model_state(self.model)
        else:
            self.model.load_state_dict(d["model"])
            self.optimizer.load_state_dict(d["optimizer"])
        self.steps = int(d["steps"])
