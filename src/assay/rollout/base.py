"""The rollout seam: token ids in, sampled token ids and their logprobs out."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
from torch import Tensor

from assay.core.errors import AssayError
from assay.core.tokenizer import stop_token_ids


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability; 0: off
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)  # kept as the last token of the result
    stop: list[str] = field(default_factory=list)  # stop strings: the result ends with the token completing one
    seed: int | None = None


@dataclass
class GenRequest:
    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1  # samples of the same prompt (a GRPO group shares its prefix)
    session_id: str | None = None  # multi-turn: the engine may keep this session's KV
    # Seeded sampling in the engine: the index of the seed's random stream the first sample draws from
    # (the next samples take the next ones). None: its position among the call's samples of that seed.
    # Giving it makes a sample independent of which other requests share the call.
    stream: int | None = None


@dataclass
class GenResult:
    token_ids: list[int]
    # Logprob of each sampled token under the behaviour policy: log_softmax(logits / temperature),
    # after temperature and before top-k/top-p/min-p truncation (untempered for temperature 0).
    logprobs: list[float]
    finish_reason: str  # stop | length
    policy_version: int


@runtime_checkable
class RolloutBackend(Protocol):
    """What the pipeline runs rollouts on. `generate` and `update_weights` are required; `take_stats` and
    `close` have defaults, which a backend gets by subclassing this class (the built-ins do). A backend
    is made by name through the registry (`assay.rollout.factory.register_backend`)."""

    def generate(self, requests: Sequence[GenRequest]) -> list[list[GenResult]]:
        """One list of n results per request, in request order."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None: ...

    def take_stats(self) -> dict[str, float]:
        """Counters since the last call (logged as rollout/NAME each step), then reset; default none."""
        return {}

    def close(self) -> None:
        """Release what the backend holds beyond this object (a process, a device's memory); called once
        when the run or evaluation that made it ends. Default: nothing to release."""


def require_backend(backend: object, made_by: str) -> RolloutBackend:
    """`backend`, refused with the members it lacks if it is no RolloutBackend (the pipeline calls every
    member directly)."""
    if isinstance(backend, RolloutBackend):
        return backend
    missing = [m for m in _MEMBERS if not callable(getattr(backend, m, None))]
    raise AssayError(f"{made_by} made a {type(backend).__qualname__}, which lacks {', '.join(missing)} of the rollout "
                     "backend protocol; subclass assay.RolloutBackend, which gives take_stats and close their defaults")


_MEMBERS = tuple(n for n, v in vars(RolloutBackend).items() if callable(v) and not n.startswith("_"))


ResultCallback = Callable[[int, list[GenResult]], None]


@runtime_checkable
class OnlineBackend(RolloutBackend, Protocol):
    """A backend that admits requests while it runs (the native engine, vLLM): the online agent loop
    needs it, so that an episode's next turn joins the running batch."""

    def add_requests(self, requests: Sequence[GenRequest], on_done: ResultCallback | None = None) -> list[int]: ...
    def add_request(self, request: GenRequest, on_done: ResultCallback | None = None) -> int: ...
    def step(self) -> list[tuple[int, list[GenResult]]]:
        """One batched step; the requests that finished in it, with their results."""
        ...
    def abort(self, request_id: int) -> None: ...


def run_to_completion(backend: OnlineBackend, requests: Sequence[GenRequest], stalled: Callable[[], bool]
                      ) -> list[list[GenResult]]:
    """`generate` on an online backend: add the requests, step until every one finished (`stalled`: the
    backend runs nothing, yet some are unfinished, a backend bug), and abort them all after a failure so
    that nothing stays held by a request nobody will finish."""
    ids = backend.add_requests(requests)
    results: dict[int, list[GenResult]] = {}
    try:
        while len(results) < len(ids):
            results.update(backend.step())
            if len(results) < len(ids) and stalled():
                raise AssayError(f"{type(backend).__name__}: requests left unfinished with nothing running "
                                 "(a backend bug)")
    finally:
        for rid in ids:
            backend.abort(rid)
    return [results[rid] for rid in ids]


def with_prefix_hit_rate(counts: Mapping[str, float]) -> dict[str, float]:
    """Summed engine counters, with the share of prompt tokens the prefix cache served over them."""
    rate = counts.get("cached_prompt_tokens", 0.0) / max(counts.get("prompt_tokens", 0.0), 1.0)
    return {**counts, "prefix_hit_rate": rate}


def default_stop(model: Any, tokenizer: Any | None) -> list[int]:
    """Where a request without stop ids stops: the tokenizer's turn end and end of text, or without a
    tokenizer (token ids only) the model's own eos."""
    if tokenizer is not None:
        return stop_token_ids(tokenizer)
    eos = model.generation_config.eos_token_id if model.generation_config else None
    return [eos] if isinstance(eos, int) else list(eos or [])


def sample_seeds(requests: Sequence[GenRequest]) -> list[list[int | None]]:
    """A 64-bit seed per sample of each request (None when unseeded): the k-th sample of a seed in the
    call draws (seed, k), or (seed, stream + j) where the request names its stream, so that a sample
    does not depend on which other requests share the call."""
    uses: Counter[int] = Counter()
    out: list[list[int | None]] = []
    for r in requests:
        seeds: list[int | None] = []
        for j in range(r.n):
            if r.params.seed is None:
                seeds.append(None)
                continue
            k = r.stream + j if r.stream is not None else uses[r.params.seed]
            uses[r.params.seed] += 1
            hi, lo = np.random.SeedSequence([r.params.seed, k]).generate_state(2, dtype=np.uint32)
            seeds.append(int(hi) << 32 | int(lo))
        out.append(seeds)
    return out


def check_request(r: GenRequest) -> None:
    p = r.params
    if not r.prompt_ids:
        raise AssayError("generate: an empty prompt; every request needs at least one prompt token")
    if r.n < 1 or p.max_tokens < 1:
        raise AssayError(f"generate: n and max_tokens must be >= 1, got n={r.n}, max_tokens={p.max_tokens}")
    if p.temperature < 0 or not 0 < p.top_p <= 1 or p.top_k < 0 or not 0 <= p.min_p < 1:
        raise AssayError(
            f"generate: bad sampling params temperature={p.temperature} top_p={p.top_p} top_k={p.top_k} "
            f"min_p={p.min_p}; need temperature >= 0 (0 = greedy), 0 < top_p <= 1, top_k >= 0 (0 = off), "
            "0 <= min_p < 1 (0 = off)"
        )
    if any(not s for s in p.stop):
        raise AssayError("generate: an empty stop string; remove it from stop")


def stop_string_end(tokenizer: Any, completion: list[int], stops: list[str], start: int = 0) -> int | None:
    """The number of completion tokens up to and including the one that completes the first stop
    string, or None; only ends after `start` are looked at (those up to it were checked before). Each
    end decodes a window of its last tokens (a token spells at least one byte), not the whole prefix."""
    if not stops:
        return None
    window = max(len(s) for s in stops) + 4
    for end in range(start + 1, len(completion) + 1):
        text = tokenizer.decode(completion[max(0, end - window):end], skip_special_tokens=False)
        if any(s in text for s in stops):
            return end
    return None
