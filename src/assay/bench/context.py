"""The context failures of `assay bench agent --scripted` and the countermeasures for them (agent.compaction,
agent.memory, agent.mode: plan_execute), as scripted policies on the `repo` environment's real tasks.

The policies know each task's reference patch (payload["solution"]); what they model is how a policy
loses its way, so what the table measures is the loop, not a model:

- overflow: the policy first reads every file of the package (a history larger than the window), then
  works through the reference steps. It can only patch text it can see: when the file's text is no longer
  in its prompt (elided by compaction) it reads the file again, or, with memory, reads back the note it
  wrote when it first read the file.
- drift: the policy attends only to the last `DRIFT_SPAN` characters of its prompt. It acts on its goal when
  the goal is in view (the task's instruction; in plan_execute the current subtask); otherwise it drifts to an
  unrelated file (reads it), which pushes the goal further away, until the turns run out."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from assay.bench.scripted import Failure, Setting, call
from assay.core.config import AgentConfig
from assay.core.types import Message, Task
from assay.envs.builtin.repo import RepoEnv

DRIFT_SPAN = 2500  # characters of the prompt's end the drifting policy attends to


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
            return call("plan", steps=steps, current=min(self.done + 1, len(steps)))
        view = prompt if self.span is None else prompt[-self.span:]
        sub = re.search(r"Current subtask \((\d+) of \d+\)", view)
        goal = sub is not None or self.task.prompt[-1].content[:80] in view
        if not goal:
            self.drifts += 1
            return call("read", path=self._others[self.drifts % len(self._others)] if self._others else "README")
        k = int(sub.group(1)) - 1 if sub is not None else self.done
        act = self.actions[min(k, len(self.actions) - 1)]
        args = act["arguments"]
        if act["tool"] == "patch" and args["search"] not in prompt:  # it cannot copy text it does not see
            path = args["path"]
            if path in self.noted and '"note_read"' not in _last_call(prompt):
                return call("note_read", key=path)
            return call("read", path=path)
        last = _last_read(prompt)
        if last is not None and "note_write" in tools and self._wanted(last) and last not in self.noted:
            self.noted.add(last)  # write down what the patch will need, while it is in view
            return call("note_write", key=last, text=self._snippet(last))
        self.done = max(self.done, k + 1)
        return call(act["tool"], **args)

    def _wanted(self, path: str) -> bool:
        return any(s["tool"] == "patch" and s["arguments"]["path"] == path for s in self.task.payload["solution"])

    def _snippet(self, path: str) -> str:
        return "\n".join(s["arguments"]["search"] for s in self.task.payload["solution"]
                         if s["tool"] == "patch" and s["arguments"]["path"] == path)


def describe(action: dict[str, Any]) -> str:
    path = action["arguments"].get("path")
    return f"{action['tool']} {path}" if path else action["tool"]


def _last_call(prompt: str) -> str:
    calls = re.findall(r"<tool_call>(.*?)</tool_call>", prompt, re.S)
    return calls[-1] if calls else ""


def _last_read(prompt: str) -> str | None:
    m = re.search(r'"name":\s*"read",\s*"arguments":\s*\{"path":\s*"([^"]+)"', _last_call(prompt))
    return m.group(1) if m else None


def overflow_script(env: RepoEnv, task: Task, setting: Setting) -> RepoScript:
    return RepoScript(task, None, survey=True)


def drift_script(env: RepoEnv, task: Task, setting: Setting) -> RepoScript:
    return RepoScript(task, DRIFT_SPAN, survey=True)


OVERFLOW = Failure("overflow", [
    Setting("off"),
    Setting("compaction", AgentConfig(compaction="elide_observations")),
    Setting("compaction + memory", AgentConfig(compaction="elide_observations", memory=True)),
], overflow_script)
DRIFT = Failure("drift", [
    Setting("off"),
    Setting("compaction", AgentConfig(compaction="elide_observations")),
    Setting("plan_execute", AgentConfig(mode="plan_execute")),
], drift_script)
