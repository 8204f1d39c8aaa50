"""The memory tool (agent.memory): notes the policy writes, reads and searches, kept by the agent loop for
the episode, outside the context window, so that compaction never takes them away.

The loop offers the three tools beside the environment's and answers their calls itself; the environment
never sees them. Size limits per note and in total: a note over them is refused with an error observation
the policy can act on (shorten it, or overwrite an old note), never a crash and never a reward."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from assay.core.errors import AssayError
from assay.core.types import OK, Observation, ToolCall, ToolSpec
from assay.envs.base import Episode
from assay.envs.episode import Stepped, step_episode
from assay.envs.tools import validate_call

_KEY = {"type": "string", "minLength": 1, "maxLength": 64, "description": "the note's name, e.g. failing_test"}
NOTE_WRITE = ToolSpec("note_write", "Save a note under a key (replacing any note of that key); notes stay when old "
                                    "turns leave the context.",
                      {"type": "object", "properties": {"key": _KEY, "text": {"type": "string"}},
                       "required": ["key", "text"], "additionalProperties": False})
NOTE_READ = ToolSpec("note_read", "Read the note saved under a key.",
                     {"type": "object", "properties": {"key": _KEY}, "required": ["key"],
                      "additionalProperties": False})
NOTE_SEARCH = ToolSpec("note_search", "List the notes whose key or text holds every word of the query.",
                       {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"],
                        "additionalProperties": False})
MEMORY_TOOLS = (NOTE_WRITE, NOTE_READ, NOTE_SEARCH)
MEMORY_NAMES = frozenset(t.name for t in MEMORY_TOOLS)
SEARCH_HITS = 8  # notes listed by one search
PREVIEW_CHARS = 80  # of each hit's text


def offered_tools(env_tools: Sequence[ToolSpec]) -> list[ToolSpec]:
    """The environment's tools and the memory tools after them; a name clash is refused."""
    if clash := sorted(MEMORY_NAMES & {t.name for t in env_tools}):
        raise AssayError(f"agent.memory: the environment already has a tool named {', '.join(clash)}; rename the "
                         "environment's tool or set agent.memory: false")
    return [*env_tools, *MEMORY_TOOLS]


@dataclass
class NoteStore:
    """One episode's notes."""

    note_max_chars: int
    total_max_chars: int
    notes: dict[str, str] = field(default_factory=dict)
    calls: int = 0
    errors: int = 0  # calls refused: over a limit, an unknown key, a bad call

    def used(self) -> int:
        return sum(len(t) for t in self.notes.values())

    def handle(self, call: ToolCall) -> Observation:
        self.calls += 1
        obs = self._answer(call)
        self.errors += int(obs.is_error)
        return obs

    def _answer(self, call: ToolCall) -> Observation:
        bad = validate_call(call, MEMORY_TOOLS)
        if bad is not None:
            return Observation(f"error: {bad}", is_error=True)
        args = call.arguments
        if call.name == "note_write":
            key, text = args["key"], args["text"]
            if len(text) > self.note_max_chars:
                return Observation(f"error: note {key!r} has {len(text)} characters; a note holds at most "
                                   f"{self.note_max_chars}. Nothing was saved: write a shorter note", is_error=True)
            total = self.used() - len(self.notes.get(key, "")) + len(text)
            if total > self.total_max_chars:
                return Observation(f"error: the notes would hold {total} characters; all notes together hold at "
                                   f"most {self.total_max_chars}. Nothing was saved: overwrite or shorten a note "
                                   f"(keys: {', '.join(sorted(self.notes))})", is_error=True)
            self.notes[key] = text
            return Observation(f"saved note {key!r} ({len(text)} characters; {total} of {self.total_max_chars} used)")
        if call.name == "note_read":
            key = args["key"]
            if key not in self.notes:
                known = ", ".join(sorted(self.notes)) or "none yet"
                return Observation(f"error: no note {key!r}; the notes are: {known}", is_error=True)
            return Observation(self.notes[key])
        words = args["query"].lower().split()
        hits = [k for k in sorted(self.notes) if all(w in f"{k}\n{self.notes[k]}".lower() for w in words)]
        if not hits:
            return Observation(f"no note matches {args['query']!r} ({len(self.notes)} notes)")
        lines = [f"{k}: {self.notes[k][:PREVIEW_CHARS]}" for k in hits[:SEARCH_HITS]]
        more = f"\n... and {len(hits) - SEARCH_HITS} more" if len(hits) > SEARCH_HITS else ""
        return Observation("\n".join(lines) + more)


def step_calls(episode: Episode, calls: Sequence[ToolCall], env_tools: Sequence[ToolSpec], notes: NoteStore | None,
               gate: Callable[[ToolCall], Observation | None] | None = None) -> Stepped:
    """`step_episode`, with the memory tools' calls answered from `notes` in their place in the turn, and each
    valid call to an environment tool first put to `gate` (agent.approvals): what it returns is shown in the
    call's place instead, and the call does not run."""
    if notes is None and gate is None:
        return step_episode(episode, calls, env_tools)
    out = Stepped([])
    for call in calls:
        if notes is not None and call.name in MEMORY_NAMES:
            obs = notes.handle(call)
        elif gate is not None and validate_call(call, env_tools) is None and (refused := gate(call)) is not None:
            obs = refused  # an invalid call is answered by the validator, never put to a person
        else:
            stepped = step_episode(episode, [call], env_tools)
            out.error = out.error or stepped.error
            obs = stepped.observations[0]
        out.observations.append(obs)
        if obs.status != OK or obs.done:
            break
    return out
