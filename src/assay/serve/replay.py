"""`assay replay LOG --policy X`: the logged sessions sampled again by policy X, and where the outcomes differ.

Each logged request is asked again as it was served: a chat request's messages and tools (the tool results
the client sent included) through X's own chat template, a completion request's prompt tokens as logged,
with the logged sampling settings (temperature, top_p, max_tokens, stop strings, seed). A greedy or seeded
choice is deterministic: the k-th choice of prompt p of a seeded request draws the seed's stream p*n + k, as
the server drew it, so replaying a log on the policy that wrote it reproduces every such choice. An unseeded
sampled choice is random: its differences are counted apart and prove nothing.

An outcome is what the client read: the text (content and reasoning), the tool calls (names and arguments)
and the finish reason (stop, length, tool_calls)."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from assay.agent.render import prompt_ids
from assay.core.chat_format import chat_format
from assay.core.errors import AssayError
from assay.core.types import Task, Trajectory
from assay.rollout.base import GenRequest, GenResult, SamplingParams
from assay.rollout.engine import Engine, EngineConfig
from assay.serve.output import Reading, View, decode, read, text_tokens
from assay.serve.sessions import api_finish

KINDS = ("text", "tool_calls", "finish")


@dataclass(frozen=True)
class Outcome:
    text: str
    reasoning: str | None
    calls: tuple[tuple[str, str], ...]  # (name, arguments as sorted JSON)
    finish: str


@dataclass
class Difference:
    request_id: str
    choice: int  # index in the response
    kinds: list[str]  # of KINDS
    logged: Outcome
    replayed: Outcome
    deterministic: bool


@dataclass
class ReplayReport:
    choices: int = 0
    deterministic: int = 0
    differences: list[Difference] = field(default_factory=list)

    def counts(self, deterministic: bool) -> Counter[str]:
        return Counter(k for d in self.differences if d.deterministic == deterministic for k in d.kinds)

    def differing(self, deterministic: bool) -> int:
        return sum(1 for d in self.differences if d.deterministic == deterministic)


def _outcome(text: str, reasoning: str | None, calls: list, finish: str) -> Outcome:
    return Outcome(text, reasoning, tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in calls), finish)


def logged_outcome(t: Trajectory) -> Outcome:
    turn = t.messages[-1]
    return _outcome(turn.content, turn.reasoning, turn.tool_calls, t.task.payload["finish"])


def _request(t: Trajectory, tokenizer: PreTrainedTokenizerBase, max_positions: int, stop_ids: frozenset[int],
             n: int) -> tuple[GenRequest, Reading]:
    p = t.task.payload
    s = p["sampling"]
    if p["route"] == "chat":
        ids = prompt_ids(tokenizer, Task(env="serve", task_id=t.task.task_id, difficulty=0, prompt=t.task.prompt,
                                         tools=t.task.tools))
        fmt = chat_format(tokenizer)
        how = Reading(tuple(s["stop"]), fmt.think_tags, fmt.tool_calls if t.task.tools else None)
    else:
        ids = t.token_ids[:t.prompt_len]
        if max(ids) >= len(tokenizer):
            raise AssayError(f"request {t.task.task_id}: its prompt holds token id {max(ids)}, outside the replaying "
                             f"policy's vocabulary of {len(tokenizer)}; replay completion requests on a policy with "
                             "the logged policy's tokenizer")
        how = Reading(tuple(s["stop"]))
    room = max_positions - len(ids)
    if room < 1:
        raise AssayError(f"request {t.task.task_id}: its prompt of {len(ids)} tokens does not fit the replaying "
                         f"policy's {max_positions} positions")
    params = SamplingParams(temperature=s["temperature"], top_p=s["top_p"], max_tokens=min(s["max_tokens"], room),
                            stop_token_ids=sorted(stop_ids), stop=list(s["stop"]), seed=s["seed"])
    return GenRequest(ids, params, n=n, stream=p["prompt_index"] * n if s["seed"] is not None else None), how


def replay(sessions: list[Trajectory], model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
           engine: EngineConfig | None = None) -> ReplayReport:
    """Sample every logged request again on `model` and compare each choice's outcome with the logged one."""
    for t in sessions:
        if t.task.env != "serve" or "sampling" not in t.task.payload:
            raise AssayError(f"trajectory {t.task.task_id} is no served request (env {t.task.env!r}); replay reads "
                             "the log of assay serve --log")
    groups: dict[tuple[str, int], list[Trajectory]] = defaultdict(list)
    for t in sessions:
        groups[(t.task.task_id, t.task.payload["prompt_index"])].append(t)
    eng = Engine(model.eval(), tokenizer, engine or EngineConfig())
    stop_ids = frozenset(eng.default_stop)
    keys = list(groups)
    asked = []
    for key in keys:
        choices = sorted(groups[key], key=lambda t: t.task.payload["choice"])
        groups[key] = choices
        asked.append(_request(choices[0], tokenizer, eng.model.max_positions, stop_ids, len(choices)))
    results: list[list[GenResult]] = eng.generate([r for r, _ in asked]) if asked else []
    report = ReplayReport()
    for key, (_, how), rs in zip(keys, asked, results, strict=True):
        for t, r in zip(groups[key], rs, strict=True):
            view: View = read(decode(tokenizer, text_tokens(r, stop_ids)), how, final=True,
                              stopped=r.finish_reason == "stop")
            again = _outcome(view.content, view.reasoning, view.calls, api_finish(r, view))
            before = logged_outcome(t)
            s = t.task.payload["sampling"]
            deterministic = s["temperature"] == 0 or s["seed"] is not None
            report.choices += 1
            report.deterministic += deterministic
            kinds = [k for k, differs in zip(KINDS, ((before.text, before.reasoning) != (again.text, again.reasoning),
                                                     before.calls != again.calls, before.finish != again.finish),
                                             strict=True) if differs]
            if kinds:
                index = t.task.payload["prompt_index"] * t.task.payload["sampling"]["n"] + t.task.payload["choice"]
                report.differences.append(Difference(t.task.task_id, index, kinds, before, again, deterministic))
    return report


def _clip(text: str, width: int = 60) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[:width - 1] + "…"


def format_report(report: ReplayReport, show: int = 20) -> str:
    """Counts first, then up to `show` differing choices (deterministic ones first)."""
    det, rand = report.deterministic, report.choices - report.deterministic
    lines = [f"{report.choices} choices replayed: {det} deterministic (greedy or seeded), {rand} sampled unseeded"]
    for label, which, total in (("deterministic", True, det), ("sampled unseeded", False, rand)):
        if total:
            c = report.counts(which)
            lines.append(f"  {label}: {report.differing(which)} of {total} differ (text {c['text']}, tool calls "
                         f"{c['tool_calls']}, finish reason {c['finish']})")
    ordered = sorted(report.differences, key=lambda d: not d.deterministic)
    for d in ordered[:show]:
        lines.append(f"- {d.request_id} choice {d.choice}{'' if d.deterministic else ' (unseeded)'}: "
                     f"{', '.join(d.kinds)}")
        if "text" in d.kinds:
            lines.append(f"    logged:   {_clip(d.logged.text)!s}")
            lines.append(f"    replayed: {_clip(d.replayed.text)!s}")
        if "tool_calls" in d.kinds:
            lines.append(f"    calls: {list(d.logged.calls)} -> {list(d.replayed.calls)}")
        if "finish" in d.kinds:
            lines.append(f"    finish: {d.logged.finish} -> {d.replayed.finish}")
    if len(ordered) > show:
        lines.append(f"... and {len(ordered) - show} more (--show N)")
    return "\n".join(lines)
