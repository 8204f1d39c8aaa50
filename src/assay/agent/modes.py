"""Agent modes (agent.mode): which kind of turn comes next, and what each kind is shown.

react: every turn acts, on one context that grows (Assay's loop as it always was).
plan_execute: a planning turn before every acting turn. The planner sees the task, the plan so far and the
acting turns of the current subtask, and answers with the `plan` tool: the subtasks in order and the one
to work on now (moving on, or staying).
The plan is kept by the loop (the episode state), not in the context. An acting turn sees the task, a
note naming the current subtask with a one-paragraph summary of the plan, and only the turns that served
that subtask: no planning turns and no earlier subtasks' history, so the goal stays in view."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from assay.core.types import Message, Observation, Task, ToolCall, ToolSpec
from assay.envs.tools import validate_call

TurnKind = Literal["act", "plan"]
MAX_STEPS = 32  # a long-horizon task's steps, one a turn or more

PLAN_TOOL = ToolSpec("plan", "Write the task list: the steps in order, and the number of the step to work on now "
                             "(steps before it are done).",
                     {"type": "object",
                      "properties": {"steps": {"type": "array", "items": {"type": "string", "minLength": 1},
                                               "minItems": 1, "maxItems": MAX_STEPS},
                                     "current": {"type": "integer", "minimum": 1}},
                      "required": ["steps", "current"], "additionalProperties": False})


@dataclass
class Plan:
    """The task list a planning turn wrote, outside the context."""

    steps: list[str] = field(default_factory=list)
    current: int = 0  # 1-based; 0: no plan yet
    updates: int = 0

    def summary(self) -> str:
        """One paragraph: each step with its state."""
        if not self.steps:
            return "No plan yet."
        parts = [f"{i}. {s} ({'done' if i < self.current else 'current' if i == self.current else 'to do'})"
                 for i, s in enumerate(self.steps, 1)]
        return f"Plan, step {self.current} of {len(self.steps)}: " + "; ".join(parts) + "."

    def subtask(self) -> str:
        return self.steps[self.current - 1] if self.steps else ""

    def apply(self, calls: Sequence[ToolCall], error: str | None) -> Observation:
        """A planning turn's calls: the first valid `plan` call replaces the plan; anything else is an error
        result (the plan stays as it was)."""
        if error is not None or not calls:
            why = error or "the planning turn called no tool"
            return Observation(f"error: {why}; call plan(steps, current). The plan is unchanged.", is_error=True)
        call = calls[0]
        bad = validate_call(call, [PLAN_TOOL])
        if bad is None and call.arguments["current"] > len(call.arguments["steps"]):
            bad = f"plan: current is {call.arguments['current']}, but there are {len(call.arguments['steps'])} steps"
        if bad is None and len(calls) > 1:
            bad = "a planning turn makes one plan call"
        if bad is not None:
            return Observation(f"error: {bad}. The plan is unchanged.", is_error=True)
        self.steps, self.current = list(call.arguments["steps"]), int(call.arguments["current"])
        self.updates += 1
        return Observation(self.summary())


def planner_task(task: Task, plan: Plan) -> Task:
    """What a planning turn is prompted with (the turns so far follow it)."""
    note = (f"You are planning, not acting. {plan.summary()} The current step's turns follow. Call plan with the "
            "whole task list and the number of the step to work on now.")
    return replace(task, prompt=[*task.prompt, Message("user", note)], tools=[PLAN_TOOL])


def executor_task(task: Task, plan: Plan, tools: Sequence[ToolSpec]) -> Task:
    """What an acting turn is prompted with (the current subtask's turns follow it)."""
    note = (f"Current subtask ({plan.current} of {len(plan.steps)}): {plan.subtask()}\n{plan.summary()}"
            if plan.steps else "No plan yet: work on the task directly.")
    return replace(task, prompt=[*task.prompt, Message("user", note)], tools=list(tools))


def _react(last: TurnKind | None) -> TurnKind:
    return "act"


def _plan_execute(last: TurnKind | None) -> TurnKind:
    return "act" if last == "plan" else "plan"


# agent.mode -> the kind of the next turn, given the last one's (None: the first turn)
MODES: dict[str, Callable[[TurnKind | None], TurnKind]] = {"react": _react, "plan_execute": _plan_execute}
