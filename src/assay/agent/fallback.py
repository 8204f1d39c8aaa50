"""Declared fallback tools (agent.fallback_tools): a call naming a tool the task does not offer, routed to the
tool the domain declares for that name, when the call's arguments pass that tool's schema.

Models call tools they have seen elsewhere (`edit_file` where the task has `patch`). A declared fallback turns
such a call into the call it most likely meant, as a counted degraded path; a call whose arguments do not fit the
fallback is left as it is, the usual unknown-tool error, since acting on a guessed mapping of arguments would
hide the mistake instead of degrading gracefully."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from assay.core.errors import AssayError
from assay.core.types import ToolCall, ToolSpec
from assay.envs.tools import validate_call


def check_fallbacks(fallbacks: Mapping[str, str], tools: Sequence[ToolSpec], task_id: str) -> None:
    """Refuse a declaration that could never apply to this task: a name it offers, or a fallback it does not."""
    offered = [t.name for t in tools]
    for name, tool in fallbacks.items():
        if name in offered:
            raise AssayError(f"agent.fallback_tools: {name!r} is a tool task {task_id} offers, so its calls never "
                             "fall back; declare fallbacks only for names the task does not offer")
        if tool not in offered:
            raise AssayError(f"agent.fallback_tools: {name!r} falls back to {tool!r}, which task {task_id} does not "
                             f"offer (its tools: {', '.join(offered) or 'none'}); name one of them")


def route_fallbacks(calls: Sequence[ToolCall], tools: Sequence[ToolSpec], fallbacks: Mapping[str, str]
                    ) -> tuple[list[ToolCall], list[bool]]:
    """(the calls with each routable one renamed to its fallback, which calls were routed)."""
    offered = {t.name for t in tools}
    out: list[ToolCall] = []
    routed: list[bool] = []
    for call in calls:
        tool = fallbacks.get(call.name) if call.name not in offered else None
        moved = replace(call, name=tool) if tool is not None else call
        ok = tool is not None and validate_call(moved, tools) is None
        out.append(moved if ok else call)
        routed.append(ok)
    return out, routed
