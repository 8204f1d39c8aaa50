"""Act out a task with a scripted policy, at the level of messages, and verify it.

The QA gate's policies (the reference, null policies, cheaters) are strategies: given the task and
the conversation so far, the next assistant message. `play` runs one through a fresh episode the
way the agent loop does (tool calls validated against their schema, then stepped), and returns
the conversation and the Reward; an infrastructure failure is the Reward's status, as in training.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from assay.core.types import OK, VERIFIER_ERROR, Message, Reward, Task
from assay.envs.base import Environment
from assay.envs.episode import close_episode, step_episode
from assay.sandbox.base import Sandbox


class Strategy(Protocol):
    name: str

    def act(self, task: Task, history: list[Message]) -> Message: ...


@dataclass
class Played:
    messages: list[Message]
    reward: Reward
    observations: list[str]


def play(env: Environment, task: Task, strategy: Strategy, max_turns: int = 8, sandbox: Sandbox | None = None,
         watch: Callable[[str], None] | None = None) -> Played:
    """`sandbox` is what `start` gets (None: the environment opens its own); `watch(when)` runs after
    start and after every step, while the policy could still read what the episode left there."""
    episode = env.start(task, sandbox)
    if watch is not None:
        watch("after start")
    messages = list(task.prompt)
    seen: list[str] = []
    status = OK
    for _ in range(max_turns):
        msg = strategy.act(task, messages)
        messages.append(msg)
        if not msg.tool_calls:
            break
        ended = False
        for call in msg.tool_calls:  # one at a time, so the watch sees the workspace after each step
            stepped = step_episode(episode, [call], task.tools)
            obs = stepped.observations[0]
            messages.append(Message("tool", obs.content or stepped.error, name=call.name, is_error=obs.is_error))
            seen.append(obs.content)
            if watch is not None:
                watch(f"after step {len(seen)}")
            if obs.status != OK or obs.done:
                status, ended = obs.status, True
                break
        if ended:
            break
    if status != OK:
        close_episode(episode)
        return Played(messages, Reward(0.0, False, status=status), seen)
    try:
        reward = episode.verify(messages)
    except Exception as e:
        reward = Reward(0.0, False, details={"error": f"{type(e).__name__}: {e}"}, status=VERIFIER_ERROR)
    close_episode(episode)
    return Played(messages, reward, seen)


@dataclass
class Replay:
    """The assistant turns of a fixed conversation, in order (tool results are produced afresh)."""

    name: str
    turns: list[Message]

    def act(self, task: Task, history: list[Message]) -> Message:
        done = sum(1 for m in history[len(task.prompt):] if m.role == "assistant")
        return self.turns[min(done, len(self.turns) - 1)] if self.turns else Message("assistant", "")


def reference_policy(env: Environment, task: Task) -> Replay:
    return Replay("reference", [m for m in env.reference_solution(task) if m.role == "assistant"])
