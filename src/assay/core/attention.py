"""`model.attn_implementation: auto`: transformers' SDPA, except where plain matmul-softmax-matmul attention is
faster: bfloat16 on the CPU, at a training micro-batch's size.

There torch's SDPA backward ran at a fraction of the math's speed: a GRPO group of 8 completions of 128 tokens
after a 72-token prompt (SmolLM2-135M's 9 heads, bf16 autocast, one thread) took 42 ms a layer in SDPA's
forward and backward and 29 ms as matmuls, and a LoRA training step 30.9 s against 25.0 s (medians, with
each group's prompt run once; docs/experiments.md K2). The math keeps the whole score matrix for the
backward, so past `MATH_MAX_SCORES` (where SDPA caught up anyway) the call goes to SDPA, which does not.
Float32 always goes to SDPA: there the math was slower. Registered with transformers' attention interface,
so the model's own layers call it."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

AUTO = "assay_auto"  # the name transformers knows it by (`model.attn_implementation: auto`)
MATH_MAX_SCORES = 1 << 22  # batch x heads x queries x keys; the math was as fast as SDPA at 4-6 million here


def auto_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                   dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention signature: query [B, H, Q, D], key and value [B, Hkv, K, D], a boolean mask
    [B, 1, Q, K] (True: attend) or None (causal, nothing padded: SDPA's causal kernel); out [B, Q, H, D]."""
    B, H, Q, _ = query.shape
    # under autocast the rotary embedding hands over float32 queries, and the matmuls still run in bfloat16
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    if (query.device.type != "cpu" or dtype != torch.bfloat16 or attention_mask is None
            or attention_mask.dtype != torch.bool or dropout or kwargs.get("softcap") is not None
            or B * H * Q * key.shape[2] > MATH_MAX_SCORES):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = H // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    # the most negative finite value, not -inf: a row with nothing to attend to (none in a right-padded batch)
    # stays finite, as in transformers' eager attention
    scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


AttentionInterface.register(AUTO, auto_attention)
AttentionMaskInterface.register(AUTO, sdpa_mask)  # the boolean masks SDPA takes


def implementation(name: str) -> str:
    """`model.attn_implementation` as transformers knows it."""
    return AUTO if name == "auto" else name
