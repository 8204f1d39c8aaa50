"""The gate, enforced: training and evaluation run an environment version only if its content hash
has a passing record of the current gate, unless the run names it in `allow_unchecked`.

Records are looked up in the stores a run names (`eval.qa_store`), in the home's store (`$ASSAY_HOME/envqa`,
by default ~/.assay/envqa: where `assay env check` writes by default, whatever the working directory) and
in the records shipped inside the package (the built-ins', so an installed wheel trains them anywhere). An override is never silent: the run's config keeps it, and every
trajectory of that domain carries `reward_info["qa_unchecked"]`."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from assay.core.errors import AssayError
from assay.core.paths import envqa_store
from assay.core.types import Trajectory
from assay.envs.base import Environment
from assay.envs.qa.gate import GATE_VERSION
from assay.envs.qa.store import passed, records
from assay.envs.registry import env_hash, env_spec

# The built-ins' records, package data: `assay env check NAME --store` this directory to add one.
PACKAGED_RECORDS = Path(__file__).parent / "records"
UNCHECKED_KEY = "qa_unchecked"  # the reward_info key an overridden domain's trajectories carry


class UncheckedEnvironment(AssayError):
    def __init__(self, problem: str, check: str, override: str) -> None:
        super().__init__(f"{problem}: check it with `{check}`, or {override}")
        self.problem, self.check = problem, check  # for a caller that allows no override


def record_stores(extra: Iterable[str | Path | None] = ()) -> list[Path]:
    """Where passing records are looked for: the given stores, the home's store, then the packaged records."""
    return list(dict.fromkeys([*(Path(s) for s in extra if s), envqa_store(), PACKAGED_RECORDS]))


def _old_store_hint() -> str:
    """Records in ./envqa, where `assay env check` wrote before the home existed, are no longer searched:
    say so when there is one here."""
    old = Path("envqa")
    if not old.is_dir() or old.resolve() == envqa_store().resolve():
        return ""
    return (f" ({old.resolve()} holds QA records, which are no longer searched: move them into {envqa_store()}, "
            f"or name that store in eval.qa_store)")


def passing_record(env: Environment, stores: Sequence[Path]) -> dict[str, Any] | None:
    """A pass of the current gate for exactly this content hash, from any store."""
    spec, digest = env_spec(env), env_hash(env)
    for store in stores:
        for path in reversed(records(store, spec)):
            try:
                rec = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if passed(rec) and rec.get("hash") == digest:
                return rec
    return None


def _allowed(allow: Collection[str], domain: str, env: Environment) -> bool:
    return bool({domain, str(env.name), env_spec(env)} & set(allow))


def require_checked(envs: Mapping[str, Environment], allow: Collection[str] = (),
                    stores: Sequence[Path] | None = None,
                    env_args: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, str]:
    """Refuse the first environment (by domain) with no passing record that `allow` does not name (by
    environment name, NAME@VERSION or domain); return {domain: "NAME@VERSION HASH"} of those allowed
    to run unchecked, for the run to record."""
    stores = record_stores() if stores is None else stores
    unchecked = {}
    for domain, env in envs.items():
        if passing_record(env, stores) is not None:
            continue
        spec = env_spec(env)
        if _allowed(allow, domain, env):
            unchecked[domain] = f"{spec} {env_hash(env)}"
            continue
        check = f"assay env check {spec}" + "".join(f" --env-arg {k}={v}" for k, v in (env_args or {}).get(domain, {}).items())
        raise UncheckedEnvironment(
            f"environment {spec} (hash {env_hash(env)}, domain {domain!r}) has no passing record of QA gate "
            f"v{GATE_VERSION}", check, f"run it unchecked (recorded) with --allow-unchecked {env.name} "
            f"(config: allow_unchecked: [{env.name}]){_old_store_hint()}")
    return unchecked


def mark_unchecked(trajs: Iterable[Trajectory], unchecked: Mapping[str, str]) -> None:
    """Stamp each trajectory of an unchecked domain, so its shards say what it was trained on."""
    if not unchecked:
        return
    for t in trajs:
        if t.task.domain in unchecked:
            t.reward_info[UNCHECKED_KEY] = unchecked[t.task.domain]
