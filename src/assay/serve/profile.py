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
