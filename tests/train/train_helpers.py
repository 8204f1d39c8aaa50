"""Tiny models and hand-built trajectories for the trainer tests."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor, nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from assay.core.types import OK, Task, Trajectory

torch.set_num_threads(1)

VOCAB = 64


def tiny_qwen(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    return Qwen2ForCausalLM(cfg).float()


class Bigram(nn.Module):
    """logits[t] depend on token t only: a model whose next-token logprobs can be read off a table."""

    def __init__(self, table: Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(table.clone())

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, use_cache: bool = False):
        return SimpleNamespace(logits=self.table[input_ids])


def task(domain: str = "a", task_id: str = "t") -> Task:
    return Task(env=f"{domain}@1", task_id=task_id, domain=domain, difficulty=1, prompt=[])


def traj(
    tokens: list[int],
    mask: list[int],
    reward: float,
    group: str,
    domain: str = "a",
    logprobs: list[float] | None = None,
    status: str = OK,
) -> Trajectory:
    return Trajectory(
        task=task(domain, group),
        messages=[],
        token_ids=tokens,
        loss_mask=mask,
        logprobs=logprobs if logprobs is not None else [0.0] * len(tokens),
        prompt_len=mask.index(1) if 1 in mask else len(mask),
        reward=reward,
        passed=reward > 0,
        status=status,
        group_id=group,
    )


def random_batch(
    seed: int, n_groups: int = 2, group_size: int = 3, domains: tuple[str, ...] = ("a", "b"),
    prompt_len: tuple[int, int] = (2, 4),
) -> list[Trajectory]:
    """Groups of varying-length trajectories: a shared prompt (`prompt_len` tokens, inclusive bounds), then a
    masked completion, sometimes followed by unmasked tool output and a second masked turn."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(n_groups):
        n_prompt = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=g))
        prompt = torch.randint(1, VOCAB, (n_prompt,), generator=g).tolist()
        for k in range(group_size):
            comp_len = int(torch.randint(1, 7, (1,), generator=g))
            comp = torch.randint(1, VOCAB, (comp_len,), generator=g).tolist()
            tokens, mask = prompt + comp, [0] * len(prompt) + [1] * comp_len
            if k % 2:
                tool = torch.randint(1, VOCAB, (2,), generator=g).tolist()
                turn = torch.randint(1, VOCAB, (3,), generator=g).tolist()
                tokens, mask = tokens + tool + turn, mask + [0, 0] + [1, 1, 1]
            reward = float(torch.rand((), generator=g)) * (10.0 if gi % 2 else 1.0)
            out.append(traj(tokens, mask, reward, f"g{seed}-{gi}", domain=domains[gi % len(domains)]))
    return out


def with_behaviour_logprobs(model: nn.Module, trajs: list[Trajectory], noise: float, seed: int = 0) -> None:
    """Set each trajectory's behaviour logprobs to the model's own plus noise on the masked tokens, so
    ratios differ from 1 and some tokens fall outside the clip range."""
    from assay.train.losses import token_logprobs

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in trajs:
            ids = torch.tensor([t.token_ids])
            logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
            jitter = noise * torch.randn(len(t.token_ids), generator=g)
            t.logprobs = [float(v + j) if m else 0.0 for v, j, m in zip(logp[0], jitter, t.loss_mask, strict=True)]
