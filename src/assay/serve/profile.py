"""Serving profiles: how one policy is run behind the API. A profile is a value found by name in a registry,
so another (a faster one: quantized weights, speculative decoding, a latency-first batch) is one more
`register_profile` call, with nothing else of the server to change."""

from __future__ import annotations

from dataclasses import dataclass

from assay.core.errors import AssayError
from assay.rollout.engine import EngineConfig


@dataclass(frozen=True)
class ServeProfile:
    name: str
    summary: str  # one line for --help and the log
    engine: EngineConfig  # the engine's cache, per-step token budget and speculative decoding
    max_batch: int  # sequences in the engine's batch at once; more requests wait in the bounded queue


_PROFILES: dict[str, ServeProfile] = {}


def register_profile(profile: ServeProfile) -> ServeProfile:
    if profile.name in _PROFILES:
        raise AssayError(f"serve profile {profile.name!r} is registered already")
    _PROFILES[profile.name] = profile
    return profile


def profile_names() -> list[str]:
    return sorted(_PROFILES)


def get_profile(name: str) -> ServeProfile:
    if name not in _PROFILES:
        raise AssayError(f"--profile {name!r} is no serving profile; the known ones are {', '.join(profile_names())}")
    return _PROFILES[name]


STANDARD = register_profile(ServeProfile(
    "standard", "the engine as training runs it: the policy's own float weights, no speculation",
    EngineConfig(), max_batch=EngineConfig().max_seqs))

# Latency first at light load, throughput under it. While few sequences run every decode step is the C step:
# on int8 weights up to the rows where the int8 kernel beat the float32 one as the engine started
# (EngineConfig.int8_rows), on the dequantized float32 weights past them; more requests join the batch rather
# than wait in the queue, and those steps run oneDNN on the dequantized weights, standard's GEMM (capping the
# batch at 8 queued the rest: at 32 clients a 2.7 s median time to first token, 0.86x standard's tokens/s;
# docs/experiments.md). A step budget of 256 tokens (a joining prompt's prefill stalls the decoding sequences for
# at most that many tokens a step; the scheduler runs every decode first), and prompt-lookup drafts of 3 tokens
# while at most 2 sequences run (2 x (1 + 3) rows: a verifying step stays within the C kernels' 8 rows), drafted
# only from a match of 2 tokens or more (a 1-token match drafted often and was mostly rejected), and only as long
# as the engine's verifying steps, timed as it starts, say pays (none on a Zen 4 without AMX, where verifying 3
# drafted tokens cost 3.8 plain steps). The LM head is int8 too: measured +0.0004 nats/token of KL for ~15% more
# speed.
FAST = register_profile(ServeProfile(
    "fast", "latency first: weight-only int8 linears and LM head, prompt-lookup speculative decoding while the "
            "batch is small",
    EngineConfig(weights="int8", int8_head=True, speculative_tokens=3, speculative_max_batch=2,
                 speculative_min_ngram=2, max_batched_tokens=256),
    max_batch=STANDARD.max_batch))
