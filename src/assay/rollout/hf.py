"""The baseline rollout backend: Hugging Face `model.generate`, batched, with behaviour logprobs.

Behaviour logprobs are log_softmax(logits / temperature) of each sampled token: the distribution
after temperature and before top-p/top-k truncation (for temperature 0, greedy, the untempered
log_softmax(logits)). That is the same quantity the trainer recomputes from its own forward pass,
so the two can be compared token by token. Truncation is left out on purpose: the trainer cannot
know the truncated support, and for top_p=1, top_k=0 (the RL default) the two coincide.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from contextlib import nullcontext

import torch
from torch import Tensor
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from assay.core.errors import AssayError
from assay.core.tokenizer import stop_token_ids
from assay.rollout.base import GenRequest, GenResult, RolloutBackend, SamplingParams, check_request, stop_string_end
from assay.rollout.weights import copy_weights


class HFBackend(RolloutBackend):
    """RolloutBackend on `model.generate`.

    All requests that share sampling settings (apart from max_tokens) run as one left-padded batch,
    each prompt repeated n times. A seeded request reproduces its samples for the same batch
    composition (the seed fixes the RNG stream, and rows draw from it together)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_batch: int = 256) -> None:
        if tokenizer.pad_token_id is None:
            raise AssayError("the tokenizer has no pad token; train it with assay.core.tokenizer.train_tokenizer")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch  # rows (prompts x n) per generate call, to bound memory
        self.version = 0
        self.pad_id = tokenizer.pad_token_id
        self.default_stop = stop_token_ids(tokenizer)
        self.last_stats: dict[str, float] = {}

    # -- RolloutBackend -------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenRequest]) -> list[list[GenResult]]:
        for r in requests:
            check_request(r)
        out: list[list[GenResult]] = [[] for _ in requests]
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(_group_key(r.params), []).append(i)
        t0 = time.perf_counter()
        n_tokens = 0
        was_training = self.model.training
        self.model.eval()
        try:
            for idxs in groups.values():
                rows = [(i, requests[i]) for i in idxs for _ in range(requests[i].n)]
                seed = requests[idxs[0]].params.seed
                # a seeded call must not move the caller's RNG streams: fork, seed, restore
                cuda = [d.index or 0 for d in {p.device for p in self.model.parameters()} if d.type == "cuda"]
                rng = torch.random.fork_rng(devices=cuda) if seed is not None else nullcontext()
                with rng, torch.inference_mode():
                    if seed is not None:
                        torch.manual_seed(seed)
                    for s in range(0, len(rows), self.max_batch):
                        chunk = rows[s : s + self.max_batch]
                        results = self._generate_rows([r for _, r in chunk])
                        for (i, _), res in zip(chunk, results, strict=True):
                            out[i].append(res)
                            n_tokens += len(res.token_ids)
        finally:
            self.model.train(was_training)
        self.last_stats = {"generate_s": time.perf_counter() - t0, "tokens": float(n_tokens)}
        return out

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        copy_weights(self.model, named_tensors)
        self.version = version

    # -- internals ------------------------------------------------------------------------------

    def _generate_rows(self, reqs: list[GenRequest]) -> list[GenResult]:
        params = reqs[0].params
        max_new = max(r.params.max_tokens for r in reqs)
        stop = params.stop_token_ids or self.default_stop
        device = next(self.model.parameters()).device
        width = max(len(r.prompt_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for row, r in enumerate(reqs):  # left padding: every row's last prompt token is at the same column
            ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids) :] = 1
        greedy = params.temperature == 0
        gen_cfg = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=None if greedy else params.top_k,  # 0 disables (None would mean transformers' default 50)
            min_p=None if greedy or not params.min_p else params.min_p,
            stop_strings=params.stop or None,
            max_new_tokens=max_new,
            eos_token_id=stop,
            pad_token_id=self.pad_id,
            bos_token_id=None,
            return_dict_in_generate=True,
            output_logits=True,  # raw logits, before any processor
        )
        out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen_cfg,
                                  tokenizer=self.tokenizer)
        new = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1).float()  # [rows, steps, vocab]
        if not greedy:
            logits = logits / params.temperature
        logp = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1).to(logits.device)).squeeze(-1).cpu()
        stop_set = set(stop)
        results = []
        for row, r in enumerate(reqs):
            toks = new[row].tolist()
            end, reason = min(len(toks), r.params.max_tokens), "length"
            for j, tok in enumerate(toks[:end]):
                if tok in stop_set:
                    end, reason = j + 1, "stop"
                    break
            cut = stop_string_end(self.tokenizer, toks[:end], params.stop)
            if cut is not None:
                end, reason = cut, "stop"
            results.append(GenResult(toks[:end], logp[row, :end].tolist(), reason, self.version))
        return results


def _group_key(p: SamplingParams) -> tuple:
    # max_tokens is not part of the key: a batch generates up to the largest and each row is cut to its own.
    return (p.temperature, p.top_p, p.top_k, p.min_p, tuple(sorted(p.stop_token_ids)), tuple(p.stop), p.seed)
