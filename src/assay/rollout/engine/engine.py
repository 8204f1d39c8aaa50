"""The native rollout engine: continuous batching over a paged, prefix-cached KV cache.

`Engine` is a RolloutBackend. Requests with the same prompt (the n samples of one request, or the
G members of a GRPO group submitted as separate requests) are prefilled once: the first becomes
the leader, the others wait and fork from it when its prefill is done (full blocks shared by
reference, the last partial block copied) and draw their first token from the leader's logits.
A multi-turn session needs no id: its previous turn's blocks stay in the prefix cache (the last,
partly filled one included), so the next turn computes only its new tokens.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from assay.core.errors import AssayError
from assay.core.heap import keep_freed_memory_on
from assay.rollout.base import (
    GenRequest,
    GenResult,
    ResultCallback,
    RolloutBackend,
    SamplingParams,
    check_request,
    default_stop,
    run_to_completion,
    sample_seeds,
    stop_string_end,
    with_prefix_hit_rate,
)
from assay.rollout.engine import cpu_kernel
from assay.rollout.engine.block_manager import BlockManager
from assay.rollout.engine.model import PagedModel
from assay.rollout.engine.model_runner import ModelRunner
from assay.rollout.engine.sampler import sample
from assay.rollout.engine.scheduler import Scheduler
from assay.rollout.engine.sequence import Sequence, Status
from assay.rollout.engine.speculative import DraftCosts, acceptance, draft_length, propose, verify
from assay.rollout.weights import copy_weights

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    block_size: int = 16
    kv_cache_bytes: int = 512 * 2**20
    max_batched_tokens: int = 2048  # tokens computed per step (decodes + prefill chunks)
    max_seqs: int = 256  # sequences running at once
    speculative_tokens: int = 0  # prompt-lookup draft length; 0: off
    speculative_max_batch: int = 4  # speculate only while at most this many sequences run
    speculative_ngram: int = 3  # longest n-gram looked up for a draft
    speculative_min_ngram: int = 1  # shortest: a longer match drafts less often and is accepted more often
    # draft the length expected to pay most on this machine, from verifying steps timed as the engine starts and
    # each sequence's acceptance so far (none where none pays); False: every draft as long as it can be
    speculative_adaptive: bool = True
    gemm: str = "auto"  # auto: oneDNN on prepacked weights where it runs (float32, CPU); torch: torch.mm
    # int8: weight-only int8 per output feature for the layers' linears; bf16: bf16 GEMMs for them (onednn.py)
    weights: str = "float32"
    int8_head: bool = False  # with weights int8, the LM head too (float32 otherwise)
    # with weights int8, the most rows the int8 kernel computes (more: the float32 kernel on the dequantized weights,
    # then oneDNN); 0: the most at which it beat the float32 kernel as the engine started, layers and head each
    int8_rows: int = 0
    warm_up: bool = True  # one throwaway step of max_batched_tokens as the engine starts (see _warm_up)


@dataclass
class _Request:
    group: list[Sequence]
    on_done: ResultCallback | None


class Engine(RolloutBackend):
    """One scheduler for the engine's lifetime: `add_requests` admits requests at any time (they join
    the running batch at the next step), `step` runs one batched forward and returns the requests
    that finished in it (and hands each to its callback), `abort` drops one. `generate` is the
    blocking RolloutBackend call built on them."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None,
                 config: EngineConfig | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        if cfg.block_size < 1 or cfg.max_batched_tokens < 1 or cfg.max_seqs < 1:
            raise AssayError(f"engine: block_size, max_batched_tokens and max_seqs must be >= 1, got {cfg}")
        if cfg.weights == "int8" and not 0 <= cfg.int8_rows <= cpu_kernel.int8_rows():
            raise AssayError(f"engine: int8_rows {cfg.int8_rows} is not 0 (timed as the engine starts) or 1 to the "
                             f"int8 kernel's {cpu_kernel.int8_rows()} rows")
        num_blocks = cfg.kv_cache_bytes // PagedModel.bytes_per_block(model, cfg.block_size)
        if num_blocks < 1:
            raise AssayError(f"engine: a KV cache of {cfg.kv_cache_bytes} bytes holds no block of "
                             f"{PagedModel.bytes_per_block(model, cfg.block_size)} bytes; raise rollout.kv_cache_mb")
        self.model = PagedModel(model, num_blocks, cfg.block_size, cfg.gemm, cfg.weights, cfg.int8_head,
                                cfg.int8_rows)
        self.runner = ModelRunner(self.model)
        self.blocks = BlockManager(num_blocks, cfg.block_size)
        self.sched = Scheduler(self.blocks, cfg.max_batched_tokens, cfg.max_seqs)
        self.tokenizer = tokenizer
        self.version = 0
        self.default_stop = default_stop(model, tokenizer)
        self.last_stats: dict[str, float] = {}  # of the last generate call
        self.totals: Counter[str] = Counter()  # summed over steps until take_stats
        self.spec_counts: Counter[str] = Counter()  # draft tokens proposed and accepted
        self._requests: dict[int, _Request] = {}
        self._next_request = self._next_seq = 0
        self._ended: set[int] = set()  # requests with a sequence that finished in the current step
        keep_freed_memory_on(self.model.device)
        if cfg.warm_up:
            self._warm_up()
        self.draft_costs: DraftCosts | None = None  # timed as the engine starts where drafts are adaptive
        if cfg.speculative_tokens and cfg.speculative_adaptive:
            self.draft_costs = self._time_drafts()
            log.info("engine: a step verifying 0 to %d drafted tokens of one sequence takes %s plain decode steps "
                     "here", cfg.speculative_tokens, self.draft_costs.relative(1))

    # -- online API -----------------------------------------------------------------------------

    def add_requests(self, requests: Seq[GenRequest], on_done: ResultCallback | None = None) -> list[int]:
        """Queue requests; returns their ids. Identical prompts among them are prefilled once, and
        sequences that share a seed among them draw distinct streams (give requests added in separate
        calls distinct seeds). `on_done(request_id, results)` is called as each request finishes."""
        for r in requests:
            check_request(r)
            self._check_fits(r)
        ids = []
        for group in self._sequences(requests):
            rid = self._next_request
            self._next_request += 1
            for seq in group:
                seq.request = rid
                if seq.leader is None:
                    self.sched.add(seq)
            self._requests[rid] = _Request(group, on_done)
            self.totals["prompt_tokens"] += sum(s.num_prompt for s in group)
            ids.append(rid)
        return ids

    def add_request(self, request: GenRequest, on_done: ResultCallback | None = None) -> int:
        return self.add_requests([request], on_done)[0]

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[tuple[int, list[GenResult]]]:
        """One batched forward over the running sequences; the requests it finished, with results."""
        if self.sched.idle:
            return []
        t0 = time.perf_counter()
        cached, preempted = self.sched.cached_tokens, self.sched.preemptions
        # the forward reads the parameters and calls no module, so the model's train/eval mode (dropout)
        # cannot reach it: no toggling, which walked every module twice a step
        computed = self._step(self.sched)
        done = []
        for rid in sorted(self._ended):
            req = self._requests[rid]
            if all(s.status is Status.FINISHED for s in req.group):
                del self._requests[rid]
                results = [GenResult(s.completion, s.logprobs, s.finish_reason, self.version) for s in req.group]
                self.totals["tokens"] += sum(len(r.token_ids) for r in results)
                done.append((rid, results))
                if req.on_done is not None:
                    req.on_done(rid, results)
        self._ended.clear()
        self.totals.update(generate_s=time.perf_counter() - t0, computed_tokens=computed, steps=1,
                           cached_prompt_tokens=self.sched.cached_tokens - cached,
                           preemptions=self.sched.preemptions - preempted)
        return done

    def partial(self, request_id: int) -> list[GenResult] | None:
        """What a request has sampled so far, one result per sample (its finish reason "" while the sample
        runs), for a caller that streams tokens as they come; None for an unknown or delivered request.
        Read between steps: a step's speculative drafts are gone by its end."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        return [GenResult(s.completion, list(s.logprobs), s.finish_reason, self.version) for s in req.group]

    def abort(self, request_id: int) -> None:
        """Drop a request: its sequences stop and free their blocks. Unknown or finished ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.group:
            if seq.status is Status.FINISHED:
                continue
            if seq in self.sched.waiting:
                self.sched.waiting.remove(seq)
            elif seq in self.sched.running:
                self.sched.running.remove(seq)
            if seq.leader is not None and seq in seq.leader.followers:
                seq.leader.followers.remove(seq)
            for f in seq.followers:  # another request's sequence waiting on this prefill prefills itself
                if f.request != request_id:
                    f.leader = None
                    self.sched.add(f, front=True)
            seq.followers = []
            if seq.block_table:
                self.blocks.release(seq, keep_partial=False)
            seq.status, seq.finish_reason = Status.FINISHED, "abort"

    # -- RolloutBackend -------------------------------------------------------------------------

    def generate(self, requests: Seq[GenRequest]) -> list[list[GenResult]]:
        before = Counter(self.totals)
        results = run_to_completion(self, requests, stalled=lambda: self.sched.idle)
        stats = with_prefix_hit_rate({k: self.totals[k] - before[k] for k in self.totals})
        stats["draft_proposed"] = float(self.spec_counts["proposed"])
        stats["draft_accepted"] = float(self.spec_counts["accepted"])
        self.spec_counts.clear()
        self.last_stats = {k: float(v) for k, v in stats.items()}
        return results

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Copy new weights in place (nothing is reallocated) and drop the prefix cache, whose K/V
        belong to the old weights. Sequences still running continue under the new weights."""
        t0 = time.perf_counter()
        copy_weights(self.model.hf, named_tensors)
        self.blocks.reset_cache()
        self.version = version
        self.last_stats["weight_update_s"] = time.perf_counter() - t0
        self.totals["weight_update_s"] += self.last_stats["weight_update_s"]

    def take_stats(self) -> dict[str, float]:
        """Counters summed since the last call (generate time, tokens, prefix-cache hits,
        preemptions, weight-update time), with the prefix hit rate over them; then reset."""
        t, self.totals = with_prefix_hit_rate(self.totals), Counter()
        return t

    # -- internals ------------------------------------------------------------------------------

    def _warm_up(self) -> None:
        """A step as large as the scheduler makes, on throwaway tokens, before the first request: its
        activations grow the heap to a step's peak once (kept for reuse: `keep_freed_memory`), and the
        first-call costs of the kernels and thread pools are paid here. Nothing of it stays cached, and
        greedy, it draws from no random stream."""
        n = min(self.config.max_batched_tokens, self.model.max_positions - 1,
                len(self.blocks.blocks) * self.config.block_size - 1)
        if n < 1:
            return
        self.generate([GenRequest([0] * n, SamplingParams(temperature=0, max_tokens=1))])
        self.blocks.reset_cache()
        self.take_stats()
        self.last_stats = {}

    def _time_drafts(self, context: int = 64, reps: int = 5) -> DraftCosts:
        """`DraftCosts` of this machine: each step the way `_step` verifies drafts (b sequences, 1 + k rows each,
        the logits of every row), on throwaway sequences of `context` cached tokens; the fastest of `reps`
        alternated calls. Nothing stays cached and nothing is sampled."""
        cfg = self.config
        longest = cfg.speculative_tokens + 1
        context = max(1, min(context, self.model.max_positions - longest - 1))
        seqs = [Sequence(-1 - i, [0] * (context + longest), context, SamplingParams(temperature=0), frozenset(), None)
                for i in range(cfg.speculative_max_batch)]
        seconds: list[tuple[float, ...]] = []
        try:
            for s in seqs:
                if not self.blocks.reserve(s, len(s.tokens)):
                    raise AssayError("engine: the KV cache cannot hold the sequences that time speculative drafts; "
                                     "raise rollout.kv_cache_mb or lower speculative_max_batch")
                self.runner.run([(s, context)], [s])  # the context the drafts attend to
                s.num_computed = context
            for b in range(1, len(seqs) + 1):
                best = [float("inf")] * longest
                for _ in range(reps):  # the lengths in turn, so a burst of load on the machine hits them alike
                    for k in range(longest):
                        t0 = time.perf_counter()
                        self.runner.run([(s, k + 1) for s in seqs[:b]], seqs[:b], {id(s): k + 1 for s in seqs[:b]})
                        if self.model.device.type == "cuda":  # the step's kernels, not their launch
                            torch.cuda.synchronize(self.model.device)
                        best[k] = min(best[k], time.perf_counter() - t0)
                seconds.append(tuple(best))
        finally:
            for s in seqs:
                self.blocks.release(s, keep_partial=False)
        return DraftCosts(tuple(seconds))

    def _sequences(self, requests: Seq[GenRequest]) -> list[list[Sequence]]:
        leaders: dict[tuple[int, ...], Sequence] = {}
        out: list[list[Sequence]] = []
        for r, streams in zip(requests, sample_seeds(requests), strict=True):  # each sample's own stream
            group = []
            stop = frozenset(r.params.stop_token_ids or self.default_stop)
            for stream in streams:
                seq = Sequence(self._next_seq, list(r.prompt_ids), len(r.prompt_ids), r.params, stop, stream)
                self._next_seq += 1
                key = tuple(r.prompt_ids)
                if key in leaders:
                    seq.leader = leaders[key]
                    leaders[key].followers.append(seq)
                else:
                    leaders[key] = seq
                group.append(seq)
            out.append(group)
        return out

    def _check_fits(self, r: GenRequest) -> None:
        longest = min(len(r.prompt_ids) + r.params.max_tokens, self.model.max_positions)
        need = -(-longest // self.config.block_size)
        if len(r.prompt_ids) >= self.model.max_positions:
            raise AssayError(f"generate: a prompt of {len(r.prompt_ids)} tokens leaves no room in the model's "
                             f"{self.model.max_positions} positions; shorten it")
        if need > len(self.blocks.blocks):
            raise AssayError(f"generate: a sequence of up to {longest} tokens needs {need} KV blocks, the cache "
                             f"has {len(self.blocks.blocks)}; raise rollout.kv_cache_mb or lower max_tokens")

    def _step(self, sched: Scheduler) -> int:
        drafts = self._draft(sched)
        plan = sched.schedule()
        if not plan:
            raise AssayError("engine: nothing could be scheduled (the KV cache is too small for the waiting "
                             "sequence); raise rollout.kv_cache_mb")
        done = [seq for seq, n in plan if n == seq.num_uncomputed]
        spans = {id(s): len(drafts[id(s)]) + 1 for s in done if id(s) in drafts}
        logits = self.runner.run(plan, done, spans)
        for seq, n in plan:
            if id(seq) not in drafts:
                self.blocks.computed(seq, seq.num_computed + n)
        rows, samplers = [], []
        row = 0
        for seq in done:
            if id(seq) in drafts:
                self._accept(sched, seq, drafts[id(seq)], logits[row:row + spans[id(seq)]])
                row += spans[id(seq)]
                continue
            rows.append(row)
            samplers.append(seq)
            for f in seq.followers:  # prefilled once; each follower forks and samples its own first token
                if f.status is Status.WAITING and not f.block_table:
                    full = len(sched.running) >= self.config.max_seqs
                    copy = None if full else self.blocks.fork(seq, f)
                    if copy is None:  # no room or no block: it waits and prefills from the cached prefix
                        f.leader = None
                        sched.add(f, front=True)
                        continue
                    if copy[0] >= 0:
                        self.model.copy_block(*copy)
                    sched.cached_tokens += f.num_prompt
                    sched.start(f)
                    rows.append(row)
                    samplers.append(f)
            seq.followers = []
            row += 1
        tokens, logprobs = sample(logits[rows], [s.params for s in samplers], [s.stream for s in samplers],
                                  [len(s.tokens) for s in samplers])
        for seq, tok, lp in zip(samplers, tokens, logprobs, strict=True):
            self._emit(sched, seq, [tok], [lp])
        return sum(n for _, n in plan)

    def _draft(self, sched: Scheduler) -> dict[int, list[int]]:
        """Prompt-lookup drafts, appended to their sequences for this step, when the batch is small:
        every running sequence decoding, nothing waiting, and blocks enough that no one is preempted."""
        cfg = self.config
        running = sched.running
        if not cfg.speculative_tokens or sched.waiting or not 0 < len(running) <= cfg.speculative_max_batch:
            return {}
        if any(s.num_uncomputed != 1 for s in running):
            return {}
        drafts = {}
        for seq in running:
            room = min(cfg.speculative_tokens, seq.params.max_tokens - len(seq.completion) - 1,
                       self.model.max_positions - len(seq.tokens) - 1)
            draft = propose(seq.tokens, cfg.speculative_ngram, room, cfg.speculative_min_ngram)
            if draft:
                drafts[id(seq)] = draft
        if drafts and self.draft_costs is not None:  # the length expected to pay most on this machine
            k = draft_length([acceptance(s.draft_accepted, s.draft_rejected) for s in running],
                             [len(drafts.get(id(s), ())) for s in running], self.draft_costs.seconds[len(running) - 1])
            drafts = {i: d[:k] for i, d in drafts.items()} if k else {}
        need = sum(2 + len(d) // self.config.block_size for d in drafts.values()) + len(running)
        if not drafts or self.blocks.num_free < need:  # a preemption would strand a draft: do not risk it
            return {}
        for seq in running:
            if id(seq) in drafts:
                seq.tokens += drafts[id(seq)]
                self.blocks.reserve(seq, len(seq.tokens))
        self.spec_counts.update(proposed=sum(len(d) for d in drafts.values()))
        return drafts

    def _accept(self, sched: Scheduler, seq: Sequence, draft: list[int], logits: Tensor) -> None:
        """Verify a drafted sequence: keep the accepted draft tokens and the drawn one."""
        base = len(seq.tokens) - len(draft)  # position of the first draft token
        del seq.tokens[base:]
        out, lps = verify(logits, draft, seq.params, seq.stream, base)
        self.spec_counts.update(accepted=len(out) - 1)
        seq.draft_accepted += len(out) - 1
        seq.draft_rejected += len(out) <= len(draft)
        # K/V stand for the sampled token and the accepted draft; the rejected tail's are dropped
        self._emit(sched, seq, out, lps, computed_to=seq.num_computed + len(out))

    def _emit(self, sched: Scheduler, seq: Sequence, tokens: list[int], logprobs: list[float],
              computed_to: int | None = None) -> None:
        """Append sampled tokens one by one (the first that ends the sequence ends it), record
        what is now in the cache, and release a finished sequence."""
        reason = ""
        for tok, lp in zip(tokens, logprobs, strict=True):
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            reason = self._finish_reason(seq, tok)
            if reason:
                break
        if computed_to is not None:
            self.blocks.computed(seq, min(computed_to, len(seq.tokens) - 1))
        if reason:
            seq.finish_reason = reason
            sched.finish(seq)
            self.blocks.release(seq, keep_partial=True)
            self._ended.add(seq.request)

    def _finish_reason(self, seq: Sequence, tok: int) -> str:
        if tok in seq.stop_ids:
            return "stop"
        if seq.params.stop and self.tokenizer is not None:  # checked every token: only the last end is new
            if stop_string_end(self.tokenizer, seq.completion, seq.params.stop, len(seq.completion) - 1):
                return "stop"
        if len(seq.completion) >= seq.params.max_tokens or len(seq.tokens) >= self.model.max_positions:
            return "length"
        return ""
