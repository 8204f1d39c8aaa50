"""The malformed-calls failure of `assay bench agent --scripted`, and its countermeasures: bounded retries with
the validator's message (domain tool_retries), repair of calls that do not parse (repair_tool_calls) and
declared fallback tools (agent.fallback_tools).

The policy plays the task's reference (run the tests, read, patch, run the tests, submit), but writes a
share of its calls as models get them wrong, each in one of `KINDS`, in turn: near-JSON (trailing commas,
single quotes, bare keys), the call fenced in a ```json block, a required argument left out, an argument of
the wrong type, or a tool named as another framework names it (`edit_file` for `patch`). Shown the retry
prompt, it sends that call again, well formed; shown a plain error, it goes on with its next step as if the
call had run, so a lost patch fails the task. Which calls are botched depends only on the task and `SHARE`,
so every setting sees the same mistakes."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from assay.agent.loop import RETRY_PROMPT
from assay.bench.scripted import Failure, Setting, last_observation
from assay.core.config import AgentConfig
from assay.core.tokenizer import TOOL_CALL_END, TOOL_CALL_START
from assay.core.types import Message, Task, ToolCall
from assay.envs.builtin.repo import RepoEnv

SHARE = 0.5  # of the calls botched at their first attempt
KINDS = ("trailing comma", "single quotes", "bare keys", "code fence", "missing argument", "wrong type",
         "other tool name")
ALIASES = {"patch": "edit_file", "read": "read_file", "bash": "shell", "run_tests": "test", "submit": "finish"}
FALLBACKS = {alias: tool for tool, alias in ALIASES.items()}  # what a domain would declare for them


def botch(c: ToolCall, kind: str) -> str | None:
    """The call's text between the call tags, written wrong in this way; None where the call has nothing to get
    wrong that way (a tool without arguments has none to leave out)."""
    body = {"name": c.name, "arguments": c.arguments}
    if kind == "trailing comma":
        return json.dumps(body)[:-2] + ",},}" if c.arguments else json.dumps(body)[:-1] + ",}"
    if kind == "single quotes":
        return _quoted(body, "'")
    if kind == "bare keys":
        return _quoted(body, '"', bare_keys=True)
    if kind == "code fence":
        return f"```json\n{json.dumps(body)}\n```"
    if kind == "missing argument":
        return json.dumps({**body, "arguments": dict(list(c.arguments.items())[:-1])}) if c.arguments else None
    if kind == "wrong type":  # the first argument as a one-item list
        first = next(iter(c.arguments), None)
        return None if first is None else json.dumps({**body, "arguments": {**c.arguments,
                                                                             first: [c.arguments[first]]}})
    if kind == "other tool name":
        return json.dumps({**body, "name": ALIASES[c.name]}) if c.name in ALIASES else None
    raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")


def _quoted(value: Any, quote: str, bare_keys: bool = False) -> str:
    """JSON with strings in `quote` (escaped within), keys bare if asked: what a model trained on Python or
    JavaScript literals writes."""
    if isinstance(value, dict):
        items = (f"{k if bare_keys else _quoted(k, quote)}: {_quoted(v, quote, bare_keys)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_quoted(v, quote, bare_keys) for v in value) + "]"
    if isinstance(value, str):
        chars = ("\\" + ch if ch == quote else ch if ch in "\"'" else json.dumps(ch)[1:-1] for ch in value)
        return quote + "".join(chars) + quote
    return json.dumps(value)


@dataclass
class MalformedScript:
    """One episode's policy (see the module docstring)."""

    actions: list[ToolCall]
    kinds: list[str | None]  # per action: how its first attempt is botched; None: well formed
    done: int = 0
    pending: ToolCall | None = None  # the botched call, until the next turn

    def decide(self, prompt: str, tools: str) -> Message:
        botched, self.pending = self.pending, None
        if botched is not None and RETRY_PROMPT in last_observation(prompt):
            return Message("assistant", "", [botched])
        if self.done == len(self.actions):
            return Message("assistant", "Done.")
        c, kind = self.actions[self.done], self.kinds[self.done]
        self.done += 1
        if kind is None:
            return Message("assistant", "", [c])
        self.pending = c
        return Message("assistant", f"{TOOL_CALL_START}{botch(c, kind)}{TOOL_CALL_END}")  # written as sampled


def malformed_script(env: RepoEnv, task: Task, setting: Setting) -> MalformedScript:
    actions = [c for m in env.reference_solution(task) if m.role == "assistant" for c in m.tool_calls]
    rng = random.Random(task.task_id)
    turn = rng.randrange(len(KINDS))  # kinds go round (those that apply to the call), from the task's own place
    kinds: list[str | None] = []
    for c in actions:
        fits = [k for k in KINDS if botch(c, k) is not None]
        kinds.append(fits[turn % len(fits)] if rng.random() < SHARE else None)
        turn += kinds[-1] is not None
    return MalformedScript(actions, kinds)


RETRY, REPAIR, FALLBACK = 2, True, AgentConfig(fallback_tools=FALLBACKS)
MALFORMED = Failure("malformed calls", [
    Setting("off"),
    Setting("retry", tool_retries=RETRY),
    Setting("repair", repair_tool_calls=REPAIR),
    Setting("retry + repair", tool_retries=RETRY, repair_tool_calls=REPAIR),
    Setting("repair + fallback", FALLBACK, repair_tool_calls=REPAIR),
    Setting("retry + repair + fallback", FALLBACK, tool_retries=RETRY, repair_tool_calls=REPAIR),
], malformed_script)
