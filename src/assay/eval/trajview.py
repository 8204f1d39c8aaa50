"""One trajectory as readable HTML, for the pages of `assay eval --html` and `assay report`.

A long episode (a `repo` one runs 10-40 turns) is shown turn by turn: each assistant turn with the tool
results it got is one fold, whose summary line names the turn, its calls with their main argument (a path,
a command), an error marker where a result was an error, the milestones reached there (where the
environment's declaration locates them: `Milestone.turn`), and whether it was a plan_execute planning turn;
a line before a turn marks where the context was compacted (`Trajectory.compacted_turns`). Short episodes
show every turn open, longer ones the first and the last, and buttons open or close them all. An edit is
shown as a diff: a `patch` call's search and replace as removed and added lines (difflib), a `write` as
added lines, and any text that is a unified diff coloured by its line prefixes. Long texts show their first
lines, the rest behind a fold. Everything the model or a tool wrote is escaped: it is text, never markup."""

from __future__ import annotations

import difflib
import html
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from assay.core.storage import messages_from
from assay.core.types import Message, ToolCall

CLIP_LINES = 24  # of a text (a tool result, a message, a file) shown before the rest folds away
CLIP_CHARS = 2400
OPEN_ALL = 4  # an episode of at most this many turns shows them all open; a longer one its first and last
MAIN_ARGUMENTS = ("path", "command", "key", "id", "query")  # the argument a call's summary names, first found
_HUNK = re.compile(r"^@@ -\d+(,\d+)? \+\d+(,\d+)? @@", re.M)


@dataclass
class Turn:
    number: int  # 1-based, every assistant turn counted (as Trajectory.turns)
    assistant: Message
    results: list[Message] = field(default_factory=list)  # the tool messages that followed it

    @property
    def planning(self) -> bool:
        """A plan_execute planning turn: the loop answers it with one `plan` result."""
        return bool(self.results) and all(r.name == "plan" for r in self.results)

    @property
    def errors(self) -> int:
        return sum(r.is_error for r in self.results)


def split_turns(messages: Sequence[Message]) -> tuple[list[Message], list[Turn]]:
    """The prompt (the messages before the first assistant turn) and the turns after it."""
    prompt: list[Message] = []
    turns: list[Turn] = []
    for m in messages:
        if m.role == "assistant":
            turns.append(Turn(len(turns) + 1, m))
        elif turns:
            turns[-1].results.append(m)
        else:
            prompt.append(m)
    return prompt, turns


def _e(text: object) -> str:
    return html.escape(str(text))


def _short(text: str, width: int = 60) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width and len(text.strip().splitlines()) <= 1 else line[:width].rstrip() + "…"


def _split(text: str) -> tuple[str, str]:
    """The head of a long text and the rest (""), cut at CLIP_LINES lines or about CLIP_CHARS characters."""
    lines = text.split("\n")
    head = "\n".join(lines[:CLIP_LINES])
    if len(head) > CLIP_CHARS:
        cut = head.rfind("\n", 0, CLIP_CHARS)
        head = head[: cut if cut > 0 else CLIP_CHARS]
    return head, text[len(head):].removeprefix("\n")


def _more(rest: str, body: str) -> str:
    lines = rest.count("\n") + 1
    return (f"<details class=more><summary>{lines} more line{'s' * (lines > 1)} ({len(rest)} characters)"
            f"</summary>{body}</details>")


def clipped(text: str) -> str:
    """A text as <pre>, its first lines shown and the rest behind a fold; a unified diff is coloured."""
    if is_unified_diff(text):
        return diff_block([_diff_class(line) for line in text.split("\n")])
    head, rest = _split(text)
    return f"<pre>{_e(head)}</pre>" + (_more(rest, f"<pre>{_e(rest)}</pre>") if rest else "")


def is_unified_diff(text: str) -> bool:
    return _HUNK.search(text) is not None


def _diff_class(line: str) -> tuple[str, str]:
    if line.startswith(("+++", "---", "@@", "diff ")):
        return "hunk", line
    if line.startswith("+"):
        return "add", line
    if line.startswith("-"):
        return "del", line
    return "ctx", line


def search_replace_diff(search: str, replace: str) -> list[tuple[str, str]]:
    """A search/replace edit as (class, line): the lines both share as context, the others removed and added."""
    a, b = search.split("\n"), replace.split("\n")
    lines = difflib.unified_diff(a, b, lineterm="", n=max(len(a), len(b)))
    return [_diff_class(line) for line in lines if not line.startswith(("---", "+++", "@@"))]


def diff_block(lines: Sequence[tuple[str, str]]) -> str:
    """Diff lines (class, text), one <div class=add|del|ctx|hunk> each; past CLIP_LINES the rest is folded."""

    def block(part: Sequence[tuple[str, str]]) -> str:
        return "<div class=diff>" + "".join(f"<div class={cls}>{_e(text)}</div>" for cls, text in part) + "</div>"

    if not lines:
        return "<pre>(no change)</pre>"
    head, rest = lines[:CLIP_LINES], lines[CLIP_LINES:]
    if not rest:
        return block(head)
    return block(head) + _more("\n".join(t for _, t in rest), block(rest))


def call_label(call: ToolCall) -> str:
    """The call's name and main argument, for a summary line: `read acme/cart.py`, `bash ls -R`."""
    if call.name == "plan" and isinstance(call.arguments.get("steps"), list):
        return f"plan (step {call.arguments.get('current')} of {len(call.arguments['steps'])})"
    for key in MAIN_ARGUMENTS:
        value = call.arguments.get(key)
        if isinstance(value, str) and value.strip():
            return f"{call.name} {_short(value)}"
    return call.name


def _call(call: ToolCall) -> str:
    args = call.arguments
    head = f"<div class=call><span class=lbl>call</span> <b>{_e(call.name)}</b>"
    if call.name == "patch" and isinstance(args.get("search"), str) and isinstance(args.get("replace"), str):
        return f"{head} {_e(args.get('path', ''))}{diff_block(search_replace_diff(args['search'], args['replace']))}</div>"
    if call.name == "write" and isinstance(args.get("content"), str):
        lines = args["content"].removesuffix("\n").split("\n")
        return (f"{head} {_e(args.get('path', ''))} (new content, {len(lines)} lines)"
                f"{diff_block([('add', '+' + line) for line in lines])}</div>")
    if call.name == "bash" and isinstance(args.get("command"), str):
        return f"{head}{clipped('$ ' + args['command'])}</div>"
    texts = {k: v for k, v in args.items() if isinstance(v, str) and "\n" in v}  # multi-line text: shown as text
    rest = json.dumps({k: v for k, v in args.items() if k not in texts}, ensure_ascii=False)
    inline = f" <code>{_e(rest)}</code>" if rest != "{}" and len(rest) <= 120 else ""
    block = clipped(rest) if rest != "{}" and not inline else ""
    return head + inline + block + "".join(f"<div>{_e(k)}:</div>{clipped(v)}" for k, v in texts.items()) + "</div>"


def _result(m: Message) -> str:
    name = _e(m.name or "loop")  # the loop's own messages (a retry prompt) have no tool name
    mark = " <span class=err-mark>✗ error</span>" if m.is_error else ""
    return f"<div class='tool{' err' * m.is_error}'><span class=lbl>result</span> {name}{mark}{clipped(m.content)}</div>"


def _turn_summary(turn: Turn, milestones: Sequence[str], compacted: bool) -> str:
    a = turn.assistant
    labels = [call_label(c) for c in a.tool_calls]
    if not labels:
        labels = ["malformed call"] if turn.results else [f"answer: {_short(a.content)}" if a.content.strip()
                                                         else "empty answer"]
    parts = [f"<b>turn {turn.number}</b>", _e(" · ".join(labels))]
    if turn.planning:
        parts.append("<span class=plan-mark>planning</span>")
    if turn.errors:
        parts.append(f"<span class=err-mark>✗ {'error' if turn.errors == 1 else f'{turn.errors} errors'}</span>")
    if compacted:
        parts.append("<span class=compact-mark>after compaction</span>")
    parts += [f"<span class=milestone>⚑ {_e(name)}</span>" for name in milestones]
    return " ".join(parts)


def render_turn(turn: Turn, open_: bool, milestones: Sequence[str] = (), compacted: bool = False) -> str:
    a = turn.assistant
    body = ""
    if a.reasoning:
        body += f"<details class=reasoning><summary>reasoning ({len(a.reasoning)} characters)</summary>" \
                f"{clipped(a.reasoning)}</details>"
    if a.content.strip():
        body += clipped(a.content)
    body += "".join(_call(c) for c in a.tool_calls) + "".join(_result(r) for r in turn.results)
    classes = "turn" + " err" * bool(turn.errors) + " plan" * turn.planning
    cut = (f"<div class=cut>context compacted before turn {turn.number}: the oldest tool results left what the policy "
           "saw from here on (shown here in full)</div>") if compacted else ""
    return (f"{cut}<details class='{classes}' data-turn={turn.number}{' open' * open_}>"
            f"<summary>{_turn_summary(turn, milestones, compacted)}</summary><div class=assistant>{body}</div>"
            "</details>")


def _prompt(prompt: Sequence[Message]) -> str:
    out = []
    for m in prompt:
        if m.role == "system":
            out.append(f"<details class=system><summary>system prompt ({len(m.content)} characters)</summary>"
                       f"{clipped(m.content)}</details>")
        else:
            out.append(f"<div class={_e(m.role)}><b>{_e(m.role)}</b>{clipped(m.content)}</div>")
    return "".join(out)


def _loads(value: Any, default: Any) -> Any:
    return json.loads(value) if isinstance(value, str) and value else default


def render_trajectory(row: Mapping[str, Any]) -> str:
    """One stored trajectory (a Parquet row in the run store's schema; columns a shard predates may be
    missing) as a <details class=traj>."""
    prompt, turns = split_turns(messages_from(json.loads(row["messages"])))
    milestones: dict[str, bool] = _loads(row.get("milestones"), {})
    at: dict[str, int] = _loads(row.get("reward_info"), {}).get("milestone_turns", {})
    compacted = set(_loads(row.get("compacted_turns"), []))
    verdict = "pass" if row["passed"] else "fail" if row["status"] == "ok" else row["status"]
    reached = f" · milestones {sum(milestones.values())}/{len(milestones)}" if milestones else ""
    summary = (f"step {row['step']} · {_e(row['domain'])} · level {row['difficulty']} · {_e(row['task_id'])} · "
               f"{row['turns']} turns · reward {row['reward']:.2f} ({_e(verdict)}){reached}")
    errors = row.get("tool_errors", 0)
    meta = [f"finish: {_e(row.get('finish_reason') or '?')}", f"{errors} tool error{'s' * (errors != 1)}"]
    if compacted:
        meta.append(f"compacted before turn{'s' * (len(compacted) > 1)} {', '.join(map(str, sorted(compacted)))}")
    if row.get("plan_turns"):
        meta.append(f"{row['plan_turns']} planning turns")
    if milestones:
        meta.append("milestones: " + ", ".join(
            f"<span class={'milestone' if hit else 'missed'}>{_e(name)} {'✓' if hit else '✗'}</span>"
            for name, hit in milestones.items()))
    folds = ("<button type=button onclick=\"fold(this,true)\">expand all turns</button> "
             "<button type=button onclick=\"fold(this,false)\">collapse all</button>") if len(turns) > 1 else ""
    by_turn: dict[int, list[str]] = {}
    for name, k in at.items():
        by_turn.setdefault(k, []).append(name)
    body = "".join(render_turn(t, len(turns) <= OPEN_ALL or t.number in (1, len(turns)), by_turn.get(t.number, ()),
                               t.number in compacted) for t in turns)
    return (f"<details class=traj><summary>{summary}</summary><p class=meta>{' · '.join(meta)} {folds}</p>"
            f"{_prompt(prompt)}{body}</details>")
