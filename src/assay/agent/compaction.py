"""Context compaction (agent.compaction): declared rules that shed the oldest turns' tokens when an episode's
context nears max_context, found by name in a registry.

The context is a head (the system prompt and the task, as rendered) and the turns after it, each kept as
the ids the policy sampled and the ids of the tool results it was shown. A rule returns new turns; the
head and the last `keep_last` turns are never touched. The loop then renders the new context and starts a
new token segment with it, so the trainer scores every turn on exactly the context the policy saw: a
compaction never rewrites tokens already sampled (Trajectory.segments)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from assay.core.errors import AssayError
from assay.core.types import Message


@dataclass(frozen=True)
class TurnBlock:
    """One assistant turn in the context and the tool results shown after it."""

    sampled: tuple[int, ...]  # as sampled
    names: tuple[str, ...]  # the tool that answered each result ("" for the loop's own messages, e.g. a retry)
    outputs: tuple[str, ...]  # the results as shown
    shown: tuple[int, ...]  # their ids as shown, ending with the next generation prompt
    elided: bool = False
    subtask: int = 0  # plan_execute: the plan step it served (0: none)

    def ids(self) -> list[int]:
        return [*self.sampled, *self.shown]

    def __len__(self) -> int:
        return len(self.sampled) + len(self.shown)


RenderObservation = Callable[[list[str]], list[int]]  # tool results -> their ids (agent.render.observation_ids)
# (turns, tokens to shed, turns to keep at the end, renderer) -> new turns; the loop counts what was shed
CompactionRule = Callable[[Sequence[TurnBlock], int, int, RenderObservation], list[TurnBlock]]


MESSAGE_RULES = ("elide_observations", "drop_turns")  # the rules `compact_messages` applies
_STUB = re.compile(r"\[\S* ?output elided: \d+ characters\]")


def stub(name: str, output: str) -> str:
    """What an elided tool result becomes: one line naming the tool and the size."""
    return f"[{name or 'message'} output elided: {len(output)} characters]"


def elide_observations(turns: Sequence[TurnBlock], excess: int, keep_last: int, render: RenderObservation
                       ) -> list[TurnBlock]:
    """The oldest turns' tool results, oldest first, each replaced by a one-line stub per result, until
    `excess` tokens are shed or only the last `keep_last` turns are left whole. The calls stay as sampled."""
    out = list(turns)
    for i in range(max(0, len(out) - keep_last)):
        if excess <= 0:
            break
        t = out[i]
        if t.elided or not t.outputs:
            continue
        stubs = tuple(stub(n, o) for n, o in zip(t.names, t.outputs, strict=True))
        new = replace(t, outputs=stubs, shown=tuple(render(list(stubs))), elided=True)
        excess -= len(t) - len(new)
        out[i] = new
    return out


def drop_turns(turns: Sequence[TurnBlock], excess: int, keep_last: int, render: RenderObservation
               ) -> list[TurnBlock]:
    """The oldest turns leave the context whole (call and results), oldest first, until `excess` tokens
    are shed or only the last `keep_last` turns are left."""
    out = list(turns)
    while excess > 0 and len(out) > keep_last:
        excess -= len(out.pop(0))
    return out


COMPACTION_RULES: dict[str, CompactionRule] = {"elide_observations": elide_observations, "drop_turns": drop_turns}
NONE = "none"


def register_compaction(name: str, rule: CompactionRule) -> None:
    """Make a rule available as `agent.compaction: NAME`."""
    if name == NONE or name in COMPACTION_RULES:
        raise AssayError(f"a compaction rule named {name!r} exists already; pick another name")
    COMPACTION_RULES[name] = rule


def compaction_rule(name: str) -> CompactionRule | None:
    """The rule named by agent.compaction (None for `none`)."""
    if name == NONE:
        return None
    if name not in COMPACTION_RULES:
        known = ", ".join([NONE, *sorted(COMPACTION_RULES)])
        raise AssayError(f"agent.compaction: {name!r} is no compaction rule; the known ones are {known} "
                         "(register others with assay.agent.compaction.register_compaction)")
    return COMPACTION_RULES[name]


def compact_messages(messages: Sequence[Message], head: int, rule: str, keep_last: int) -> list[Message] | None:
    """The message-level form of a built-in rule, for a policy behind an endpoint (there are no token ids, and
    the server reports only the prompt's total): every turn after the `head` messages but the last `keep_last`
    is compacted at once, `elide_observations` stubbing its tool results, `drop_turns` dropping it whole (its
    call and results together, as the chat API needs). None when nothing is left to shed."""
    if rule not in MESSAGE_RULES:
        raise AssayError(f"agent.compaction: {rule!r} has no message-level form for endpoint evaluation; use one of "
                         f"{', '.join(MESSAGE_RULES)}")
    starts = [i for i in range(head, len(messages)) if messages[i].role == "assistant"]
    old = starts[:max(0, len(starts) - keep_last)]
    if not old:
        return None
    end = starts[len(old)] if len(old) < len(starts) else len(messages)
    if rule == "drop_turns":
        return [*messages[:head], *messages[end:]]
    out = list(messages)
    for i in range(old[0], end):
        m = out[i]
        if m.role == "tool" and not _STUB.fullmatch(m.content):
            out[i] = replace(m, content=stub(m.name or "", m.content))
    return None if out == list(messages) else out

