"""The QA store: one JSON record per `assay env check` run, under <store>/<name>@<version>/.

It is also the version lock: a record holds the hash of every part of the environment it checked,
so running the gate on a changed environment under an already-checked version is refused, naming
what changed. The previous version's latest record is what a new version is compared against.

A record names the gate version that wrote it. One from an older gate is not a pass (that gate let
through what this one catches) until the environment is checked again; it still locks the parts it
hashed, so a re-check under the same version is refused if the environment's content changed, and
allowed when only the identity grew parts the older record lacks.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from assay.core.errors import AssayError
from assay.core.storage import atomic_write
from assay.envs.qa.gate import GATE_VERSION, GateReport
from assay.envs.registry import _version_key


class VersionNotBumped(AssayError):
    pass


def records(store: Path, spec: str) -> list[Path]:
    return sorted((store / spec).glob("*.json"))


def gate_version(rec: dict[str, Any]) -> int:
    return int(rec.get("gate_version", 1))  # records before gate versions were kept: 1


def passed(rec: dict[str, Any]) -> bool:
    """A pass of the current gate (an older gate's pass needs a re-check)."""
    return bool(rec.get("passed")) and gate_version(rec) >= GATE_VERSION


def latest(store: Path, spec: str, passed_only: bool = False) -> dict[str, Any] | None:
    """The newest record; with `passed_only`, the newest pass of the current gate."""
    for path in reversed(records(store, spec)):
        rec = json.loads(path.read_text())
        if passed(rec) or not passed_only:
            return rec
    return None


def previous_version(store: Path, name: str, version: str) -> dict[str, Any] | None:
    """The latest record of the highest version of `name` below `version`."""
    older = [p.name.partition("@")[2] for p in store.glob(f"{name}@*") if p.is_dir()]
    older = sorted((v for v in older if _version_key(v) < _version_key(version)), key=_version_key)
    for v in reversed(older):
        rec = latest(store, f"{name}@{v}")
        if rec is not None:
            return rec
    return None


def check_version(store: Path, spec: str, env_hash: str, parts: dict[str, str]) -> None:
    """Refuse a changed environment that kept a version that once passed the gate (a version that
    never passed may still be fixed in place)."""
    locks = [r for r in (json.loads(p.read_text()) for p in reversed(records(store, spec))) if r.get("passed")]
    rec = locks[0] if locks else None  # the newest pass, of any gate
    if rec is None or rec["hash"] == env_hash:
        return
    old = rec.get("parts", {})
    keys = set(old) | set(parts)
    if gate_version(rec) < GATE_VERSION:  # an older gate's record locks only the parts it hashed
        keys = set(old) & set(parts)
        if not any(old[k] != parts[k] for k in keys):
            return
    changed = sorted(k for k in keys if old.get(k) != parts.get(k)) or ["its version string"]
    raise VersionNotBumped(f"{spec} changed since it was checked ({rec['hash']} -> {env_hash}): "
                           f"{', '.join(changed)}; bump its version (a checked version is immutable)")


def save(store: Path, report: GateReport) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"{time.time() % 1:.6f}"[1:].replace(".", "_")
    path = store / report.env / f"{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({"time": time.time(), **report.to_json()}, indent=1, default=str))
    return path


def diff(previous: dict[str, Any] | None, report: GateReport) -> list[str]:
    """What changed against the previous version's latest record: gate outcomes and per-level rates."""
    if previous is None:
        return ["no earlier version on record"]
    lines = []
    now = report.to_json()
    for gate, status in now["gates"].items():
        before = previous.get("gates", {}).get(gate)
        if before != status:
            lines.append(f"{gate}: {before or 'absent'} -> {status}")
    for level, stats in now["levels"].items():
        old = previous.get("levels", {}).get(level, {})
        for key in ("reference", "calibration pass rate"):
            if key in stats and abs(stats[key] - old.get(key, float("nan"))) > 1e-9:
                prev = old.get(key)
                lines.append(f"level {level} {key}: {'-' if prev is None else f'{prev:.2f}'} -> {stats[key]:.2f}")
    return lines or [f"same results as {previous['env']}"]
