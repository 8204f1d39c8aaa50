"""An episode's context as the agent loop builds it (agent.* keys): a head, the turns after it, the
plan and the notes kept outside it, and the decision each turn of what the next prompt is.

In react mode without compaction the next prompt is always the current one plus the new tool results:
one token segment, as the loop always made. A compaction, or a plan_execute turn (whose head and turns
in view change with the kind of turn), re-renders the context instead, and the loop starts a new
segment with it (Trajectory.segment_starts)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from transformers import PreTrainedTokenizerBase

from assay.agent.compaction import CompactionRule, TurnBlock, compaction_rule
from assay.agent.fallback import check_fallbacks
from assay.agent.memory import NoteStore, offered_tools
from assay.agent.modes import MODES, Plan, TurnKind, executor_task, planner_task
from assay.agent.render import observation_ids, prompt_ids
from assay.core.config import AgentConfig
from assay.core.errors import AssayError
from assay.core.types import Task, ToolSpec


@dataclass
class ContextState:
    agent: AgentConfig
    task: Task
    tools: list[ToolSpec]  # offered to acting turns: the environment's, and the memory tools
    rule: CompactionRule | None
    notes: NoteStore | None
    plan: Plan = field(default_factory=Plan)
    turns: list[TurnBlock] = field(default_factory=list)
    kind: TurnKind = "act"  # of the coming turn
    compactions: int = 0
    _heads: dict[tuple[object, ...], list[int]] = field(default_factory=dict)

    def advance_kind(self) -> None:
        self.kind = MODES[self.agent.mode](self.kind)

    def head(self, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        """The rendered system prompt and task (plan_execute: with the note of this kind of turn)."""
        key: tuple[object, ...] = ("react",)
        if self.agent.mode == "plan_execute":
            key = (self.kind, tuple(self.plan.steps), self.plan.current)
        if key not in self._heads:
            if self.agent.mode == "react":
                task = self.task if self.tools == self.task.tools else replace(self.task, tools=self.tools)
            elif self.kind == "plan":
                task = planner_task(self.task, self.plan)
            else:
                task = executor_task(self.task, self.plan, self.tools)
            self._heads[key] = prompt_ids(tokenizer, task)
        return self._heads[key]

    def in_view(self) -> list[int]:
        """Indices of the turns the coming turn sees: all of them, but a plan_execute turn (planning or
        acting) sees only those of the current subtask; the plan summarizes the rest."""
        if self.agent.mode == "plan_execute":
            return [i for i, t in enumerate(self.turns) if t.subtask == self.plan.current]
        return list(range(len(self.turns)))

    def render(self, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        return self.head(tokenizer) + [i for k in self.in_view() for i in self.turns[k].ids()]

    def next_prompt(self, tokenizer: PreTrainedTokenizerBase, segment_len: int, appended: list[int],
                    max_context: int, max_tokens: int) -> tuple[list[int], bool] | None:
        """The coming turn's context, once the last turn's results are in `turns` and the kind of turn is
        set: (ids to append to the current segment, False), or (a re-rendered context, True) to start a new
        segment with; None when even after compaction it leaves no room to sample a token."""
        rerender = self.agent.mode != "react"
        ids = self.render(tokenizer) if rerender else appended
        length = len(ids) if rerender else segment_len + len(appended)
        budget = min(int(self.agent.compact_at * max_context), max_context - max_tokens)
        if self.rule is not None and length > budget and self._compact(tokenizer, length - budget):
            ids, rerender = self.render(tokenizer), True
            length = len(ids)
        if length >= max_context:
            return None
        return ids, rerender

    def _compact(self, tokenizer: PreTrainedTokenizerBase, excess: int) -> bool:
        """Apply the rule to the turns in view; True if it changed them. A rule keeps the turns' order and may
        replace any turn or drop the oldest ones."""
        assert self.rule is not None
        view = self.in_view()
        before = [self.turns[i] for i in view]
        after = self.rule(before, excess, self.agent.keep_last,
                          lambda outputs: observation_ids(tokenizer, outputs))
        if after == before:
            return False
        if len(after) > len(before):
            raise AssayError(f"compaction rule {self.agent.compaction!r} returned more turns than it was given")
        dropped = set(view[: len(before) - len(after)])
        replaced = dict(zip(view[len(before) - len(after):], after, strict=True))
        self.turns = [replaced.get(i, t) for i, t in enumerate(self.turns) if i not in dropped]
        self.compactions += 1
        return True


def start_context(agent: AgentConfig, task: Task) -> ContextState:
    """A fresh episode's context state; the compaction rule is looked up here, so a misnamed one fails
    before anything is generated, and so is a fallback tool the task cannot use. Memory tools are offered only
    to tasks that have tools."""
    if agent.mode not in MODES:  # the config's Literal keeps this out; a hand-built AgentConfig may not
        raise AssayError(f"agent.mode: {agent.mode!r} is no mode; use one of {', '.join(MODES)}")
    memory = agent.memory and bool(task.tools)
    notes = NoteStore(agent.note_max_chars, agent.notes_max_chars) if memory else None
    tools = offered_tools(task.tools) if memory else list(task.tools)
    check_fallbacks(agent.fallback_tools, tools, task.task_id)
    state = ContextState(agent, task, tools, compaction_rule(agent.compaction), notes)
    state.kind = MODES[agent.mode](None)
    return state
