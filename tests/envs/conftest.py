"""Shared helpers for the environment tests: replay an assistant trajectory through an episode."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from assay.core.types import Message, Observation, Reward, Task
from assay.envs.base import Environment

Played = tuple[Reward, list[Observation], object]


def _play(env: Environment, task: Task, answer: list[Message]) -> Played:
    """Step every tool call the assistant messages make, then verify the whole conversation."""
    episode = env.start(task, None)
    observations = []
    for msg in answer:
        if msg.role == "assistant":
            observations += [episode.step(call) for call in msg.tool_calls]
    return episode.verify(task.prompt + answer), observations, episode


@pytest.fixture
def play() -> Callable[[Environment, Task, list[Message]], Played]:
    return _play


@pytest.fixture
def jsonl_file(tmp_path: Path) -> Callable[[list[object]], str]:
    def write(records: list[object], name: str = "data.jsonl") -> str:
        path = tmp_path / name
        path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
        return str(path)

    return write
