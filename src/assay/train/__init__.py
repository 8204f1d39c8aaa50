"""RL trainer (GRPO family), its losses and advantages, and SFT."""

from assay.train.advantages import filter_zero_variance, group_advantages
from assay.train.losses import aggregate, kl_penalty, logprobs_from_logits, policy_loss, token_logprobs
from assay.train.sft import sft_step, sft_train
from assay.train.trainer import GRPOTrainer

__all__ = [
    "GRPOTrainer",
    "aggregate",
    "filter_zero_variance",
    "group_advantages",
    "kl_penalty",
    "logprobs_from_logits",
    "policy_loss",
    "sft_step",
    "sft_train",
    "token_logprobs",
]
