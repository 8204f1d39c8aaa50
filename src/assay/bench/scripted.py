"""Scripted policies on `repo` through the real agent loop: what the long-horizon benches share.

A script decides each assistant turn on the decoded prompt, which is what a policy would see; the
environment, its sandboxes and its verifier are the real ones, and the loop runs with the countermeasure
settings a domain would give it. So a bench measures the loop and the environment, not a model.
A failure (bench/countermeasures.py) is a scripted way to go wrong and the settings it is measured under."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from assay.agent.loop import run_episodes
from assay.agent.render import assistant_ids
from assay.core.config import AgentConfig
from assay.core.tokenizer import render_messages, train_tokenizer
from assay.core.types import Message, Task, ToolCall, Trajectory
from assay.envs.builtin.repo import RepoEnv
from assay.envs.episode import start_episode
from assay.rollout.base import GenRequest, GenResult, SamplingParams


class Script(Protocol):
    def decide(self, prompt: str, tools: str) -> Message:
        """The next assistant turn, given the prompt as decoded text and its system turn (the tools offered)."""
        ...


@dataclass
class Replayed:
    """Fixed assistant turns, one per turn whatever the tool results say (the last repeats)."""

    turns: list[Message]
    done: int = 0

    def decide(self, prompt: str, tools: str) -> Message:
        self.done += 1
        return self.turns[min(self.done, len(self.turns)) - 1]


def call(name: str, **arguments: Any) -> Message:
    return Message("assistant", "", [ToolCall(name, arguments)])


def last_observation(prompt: str) -> str:
    """The newest tool result in a prompt rendered by the bench's tokenizer ("" before the first)."""
    at = prompt.rfind("<|im_start|>tool")
    return prompt[at:] if at >= 0 else ""


@dataclass
class ScriptedPolicy:
    """A rollout backend whose turns the episodes' scripts decide on the decoded prompt."""

    tok: PreTrainedTokenizerBase
    scripts: list[Script]

    def generate(self, requests: list[GenRequest]) -> list[list[GenResult]]:
        out = []
        for r in requests:
            text = self.tok.decode(r.prompt_ids, skip_special_tokens=False)
            tools = text.split("<|im_end|>", 1)[0]  # the system turn lists the tools offered
            ids = assistant_ids(self.tok, self.scripts[r.stream].decide(text, tools))[: r.params.max_tokens]
            out.append([GenResult(ids, [0.0] * len(ids), "stop", 0)])
        return out

    def update_weights(self, named_tensors: Any, version: int) -> None:
        pass


@lru_cache(maxsize=2)
def bench_tokenizer(seed: int = 0) -> PreTrainedTokenizerBase:
    """A 2000-token BPE trained on reference conversations of `repo` tasks (other than the bench's)."""
    env = RepoEnv()
    tasks = [env.generate(random.Random(seed + 1000 + i), 1 + i % 4) for i in range(40)]
    return train_tokenizer([render_messages(t.prompt + env.reference_solution(t), t.tools) for t in tasks], 2000)


@dataclass
class Setting:
    """A countermeasure setting: the loop's (a domain's tool_retries, repair_tool_calls and agent keys), or,
    where the countermeasure is the policy's own (a rollback), the script's `policy`."""

    name: str
    agent: AgentConfig = field(default_factory=AgentConfig)
    tool_retries: int = 0
    repair_tool_calls: bool = False
    policy: str = ""


@dataclass
class Failure:
    """A scripted failure: how its script is made for a task and a setting, and the settings it is run under."""

    name: str
    settings: list[Setting]
    script: Callable[[RepoEnv, Task, Setting], Script]


@dataclass
class Limits:
    max_context: int = 3072  # tokens of the bench tokenizer
    max_turns: int = 30
    max_tokens: int = 768  # per turn


def run_setting(env: RepoEnv, failure: Failure, setting: Setting, tasks: list[Task], tok: PreTrainedTokenizerBase,
                limits: Limits) -> list[Trajectory]:
    """Every task's episode under one setting of one failure, in one batch of the lockstep loop."""
    scripts = [failure.script(env, t, setting) for t in tasks]
    items = [(t, start_episode(env, t)) for t in tasks]
    return run_episodes(ScriptedPolicy(tok, scripts), items, tok, SamplingParams(temperature=1.0,
                                                                                 max_tokens=limits.max_tokens),
                        max_turns=limits.max_turns, max_context=limits.max_context, tool_retries=setting.tool_retries,
                        repair_tool_calls=setting.repair_tool_calls, agent=setting.agent)
