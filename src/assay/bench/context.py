"""`assay bench agent --scripted`: the context countermeasures (agent.compaction, agent.memory,
agent.mode: plan_execute) switched on and off under scripted policies that provoke the failure each one
is for, on the `repo` environment's real tasks, sandboxes and verifier.

The policies know each task's reference patch (payload["solution"]); what they model is how a policy
loses its way, so what the table measures is the loop, not a model:

- overflow: the policy first reads every file of the package (a history larger than the window), then
  works through the reference steps. It can only patch text it can see: when the file's text is no longer
  in its prompt (elided by compaction) it reads the file again, or, with memory, reads back the note it
  wrote when it first read the file.
- drift: the policy attends only to the last `span` characters of its prompt. It acts on its goal when the
  goal is in view (the task's instruction; in plan_execute the current subtask); otherwise it drifts to an
  unrelated file (reads it), which pushes the goal further away, until the turns run out.

Rounds are assistant turns (planning turns included); peak context is the largest prompt plus turn of an
episode, in tokens of a tokenizer trained here on the environment's reference conversations."""

from __future__ import annotations

import random
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from assay.agent.loop import run_episodes
from assay.agent.render import assistant_ids
from assay.core.config import AgentConfig
from assay.core.tokenizer import render_messages, train_tokenizer
from assay.core.types import Message, Task, ToolCall, Trajectory
from assay.envs.episode import start_episode
from assay.envs.registry import get_env
from assay.rollout.base import GenRequest, GenResult, SamplingParams

SETTINGS: dict[str, list[tuple[str, AgentConfig]]] = {
    "overflow": [
        ("off", AgentConfig()),
        ("compaction", AgentConfig(compaction="elide_observations")),
        ("compaction + memory", AgentConfig(compaction="elide_observations", memory=True)),
    ],
    "drift": [
        ("react", AgentConfig()),
        ("react + compaction", AgentConfig(compaction="elide_observations")),
        ("plan_execute", AgentConfig(mode="plan_execute")),
    ],
}


@dataclass
class RepoScript:
    """One episode's scripted policy (see the module docstring)."""

    task: Task
    span: int | None  # characters of the prompt's end it attends to; None: all of it
    survey: bool  # read every file first
    actions: list[dict[str, Any]] = field(default_factory=list)
    done: int = 0  # actions completed
    noted: set[str] = field(default_factory=set)
    drifts: int = 0

    def __post_init__(self) -> None:
        files = sorted(self.task.payload["files"])
        first = [{"tool": "read", "arguments": {"path": p}} for p in files] if self.survey else []
        # after the survey the reference's own reads are redundant: what it needs is in the history, or gone
        self.actions = first + [dict(s) for s in self.task.payload["solution"] if not (self.survey and s["tool"] == "read")]
        self._others = [p for p in files if all(p != s["arguments"].get("path") for s in self.task.payload["solution"])]

    def decide(self, prompt: str, tools: str) -> Message:
        if "You are planning" in prompt:
            steps = [describe(a) for a in self.actions]
            return _call("plan", steps=steps, current=min(self.done + 1, len(steps)))
        view = prompt if self.span is None else prompt[-self.span:]
        sub = re.search(r"Current subtask \((\d+) of \d+\)", view)
        goal = sub is not None or self.task.prompt[-1].content[:80] in view
        if not goal:
            self.drifts += 1
            return _call("read", path=self._others[self.drifts % len(self._others)] if self._others else "README")
        k = int(sub.group(1)) - 1 if sub is not None else self.done
        act = self.actions[min(k, len(self.actions) - 1)]
        args = act["arguments"]
        if act["tool"] == "patch" and args["search"] not in prompt:  # it cannot copy text it does not see
            path = args["path"]
            if path in self.noted and '"note_read"' not in _last_call(prompt):
                return _call("note_read", key=path)
            return _call("read", path=path)
        last = _last_read(prompt)
        if last is not None and "note_write" in tools and self._wanted(last) and last not in self.noted:
            self.noted.add(last)  # write down what the patch will need, while it is in view
            return _call("note_write", key=last, text=self._snippet(last))
        self.done = max(self.done, k + 1)
        return _call(act["tool"], **args)

    def _wanted(self, path: str) -> bool:
        return any(s["tool"] == "patch" and s["arguments"]["path"] == path for s in self.task.payload["solution"])

    def _snippet(self, path: str) -> str:
        return "\n".join(s["arguments"]["search"] for s in self.task.payload["solution"]
                         if s["tool"] == "patch" and s["arguments"]["path"] == path)


def describe(action: dict[str, Any]) -> str:
    path = action["arguments"].get("path")
    return f"{action['tool']} {path}" if path else action["tool"]


def _call(name: str, **arguments: Any) -> Message:
    return Message("assistant", "", [ToolCall(name, arguments)])


def _last_call(prompt: str) -> str:
    calls = re.findall(r"<tool_call>(.*?)</tool_call>", prompt, re.S)
    return calls[-1] if calls else ""


def _last_read(prompt: str) -> str | None:
    m = re.search(r'"name":\s*"read",\s*"arguments":\s*\{"path":\s*"([^"]+)"', _last_call(prompt))
    return m.group(1) if m else None


@dataclass
class ScriptedRepoPolicy:
    """A rollout backend whose turns the episodes' scripts decide on the decoded prompt."""

    tok: PreTrainedTokenizerBase
    scripts: list[RepoScript]

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


@dataclass
class ContextRow:
    scenario: str
    setting: str
    trajs: list[Trajectory]
    drifts: int

    def line(self) -> str:
        t = self.trajs
        passed = sum(x.passed for x in t) / len(t)
        finishes = statistics.multimode([x.finish_reason for x in t])
        return (f"| {self.scenario} | {self.setting} | {passed:.2f} | {statistics.mean(x.turns for x in t):.1f} | "
                f"{statistics.mean(x.peak_context for x in t):.0f} / {max(x.peak_context for x in t)} | "
                f"{statistics.mean(x.compactions for x in t):.1f} | {statistics.mean(x.memory_calls for x in t):.1f} | "
                f"{self.drifts / len(t):.1f} | {', '.join(finishes)} |")


def bench_tokenizer(tasks: list[Task]) -> PreTrainedTokenizerBase:
    env = get_env("repo")
    corpus = [render_messages(t.prompt + env.reference_solution(t), t.tools) for t in tasks]
    return train_tokenizer(corpus, 2000)


def run_context_bench(tasks_per_level: int = 4, levels: tuple[int, ...] = (2, 4), max_context: int = 3072,
                      max_turns: int = 30, span: int = 2500, seed: int = 0) -> tuple[list[ContextRow], dict[str, Any]]:
    """Every scenario under each of its settings, on the same tasks; returns the rows and the setup."""
    env = get_env("repo")
    rng = random.Random(seed)
    tasks = [env.generate(rng, level) for level in levels for _ in range(tasks_per_level)]
    tok = bench_tokenizer([env.generate(random.Random(seed + 1000 + i), 1 + i % 4) for i in range(40)])
    params = SamplingParams(temperature=1.0, max_tokens=768)
    rows = []
    for scenario, settings in SETTINGS.items():
        for name, agent in settings:
            scripts = [RepoScript(t, span if scenario == "drift" else None, survey=True) for t in tasks]
            items = [(t, start_episode(env, t)) for t in tasks]
            trajs = run_episodes(ScriptedRepoPolicy(tok, scripts), items, tok, params, max_turns=max_turns,
                                 max_context=max_context, agent=agent)
            rows.append(ContextRow(scenario, name, trajs, sum(s.drifts for s in scripts)))
    setup = {"tasks": len(tasks), "levels": levels, "max_context": max_context, "max_turns": max_turns,
             "span": span, "vocab": len(tok)}
    return rows, setup


def context_table(rows: list[ContextRow], setup: dict[str, Any]) -> str:
    head = (f"repo tasks: {setup['tasks']} (levels {', '.join(map(str, setup['levels']))}), max_context "
            f"{setup['max_context']} tokens, max_turns {setup['max_turns']}, drift span {setup['span']} characters\n")
    lines = ["| scenario | setting | pass rate | rounds | peak context (mean / max) | compactions | memory calls "
             "| drifts | finish |", "|---|---|---|---|---|---|---|---|---|"]
    return head + "\n".join(lines + [r.line() for r in rows])
