"""The long-horizon columns of an evaluation, one definition for the terminal table and the HTML page: context
handling (peak context, compactions, memory calls, planning turns), tool-call recovery (retries, degraded and
fallback calls) and each declared milestone's hit rate.

Only the columns that apply to a record's entries are shown: the context and recovery ones where some entry's
tasks offer tools (`DomainEval.tools`), peak context where the episodes have token ids (an endpoint's have
none), a milestone where some entry's environment declares it. A record of tool-less entries (arith) gets
none, and an entry a shown column does not apply to gets "–" in it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

NA = "–"
Metrics = Mapping[str, Any]  # one entry's record.metrics()


def _per_episode(key: str) -> Callable[[Metrics], str | None]:
    return lambda m: None if m.get(key) is None else f"{m[key]:.2f}"


def _peak(m: Metrics) -> str | None:
    return None if m.get("peak_context_mean") is None else f"{m['peak_context_mean']:.0f} / {m['peak_context_max']}"


def _retries(m: Metrics) -> str | None:
    if not m.get("tools"):
        return None
    rate = m.get("retry_success_rate")
    return f"{m['retries']} ({NA if rate is None else f'{rate:.2f}'})"


def _degraded(m: Metrics) -> str | None:
    return f"{m['degraded_calls']} ({m.get('fallback_calls', 0)})" if m.get("tools") else None


def _milestone(name: str) -> Callable[[Metrics], str | None]:
    return lambda m: None if name not in m.get("milestones", {}) else f"{m['milestones'][name]:.2f}"


def horizon_columns(entries: Mapping[str, Metrics], recovery: bool = True) -> tuple[list[str], dict[str, list[str]]]:
    """(the headers, each entry's cells) of the columns that apply to these entries' metrics; ([], …) when none
    does. `recovery`: with the retries and degraded (fallback) columns (the terminal shows those in its
    dimensions table already)."""
    columns: list[tuple[str, Callable[[Metrics], str | None]]] = [
        ("peak context mean / max (tokens)", _peak), ("compactions / episode", _per_episode("compactions")),
        ("memory calls / episode", _per_episode("memory_calls")),
        ("planning turns / episode", _per_episode("plan_turns"))]
    if recovery:
        columns += [("retries (share answered well-formed)", _retries), ("degraded calls (fallback)", _degraded)]
    names = dict.fromkeys(name for m in entries.values() for name in m.get("milestones", {}))
    columns += [(f"milestone {name} (hit rate)", _milestone(name)) for name in names]
    cells = {entry: [cell(m) for _, cell in columns] for entry, m in entries.items()}
    shown = [i for i in range(len(columns)) if any(row[i] is not None for row in cells.values())]
    return ([columns[i][0] for i in shown],
            {entry: [row[i] or NA for i in shown] for entry, row in cells.items()})
