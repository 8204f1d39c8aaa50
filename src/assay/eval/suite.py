"""Pinned evaluation suites: a YAML file of environment entries a team evaluates every policy on.

```yaml
name: golden
samples: 4                 # per task
seed: 0                    # draws the tasks of entries given by count
limits: {max_turns: 5, max_new_tokens: 64, max_context: 1024, temperature: 1.0, time_s: 120}
entries:
  - env: arith@2           # name@version: a suite pins the version ...
    hash: 8f239d2fe25f     # ... and the content hash it was checked at (assay eval pin SUITE.yaml)
    levels: [2, 3]
    tasks: 8               # distinct evaluation-partition tasks, shared among the levels
  - env: terminal@7
    hash: ...
    env_args: {tasks_dir: my_tasks}   # a directory of terminal tasks
    split: all             # every task in it (only for tasks that are never trained on)
    seeds: [1, 2, 3]       # explicit seeds instead of a count: each draws one task per level
```

An environment that changed under its pinned version is refused, naming the changed parts."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from assay.core.config import AgentConfig, DifficultyRange, DomainConfig
from assay.core.errors import ConfigError
from assay.core.paths import envqa_store
from assay.core.types import Task
from assay.envs.base import Environment
from assay.envs.registry import generate_task
from assay.envs.split import draw_distinct, draw_task


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SuiteLimits(_Strict):
    max_turns: int = Field(5, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    max_context: int = Field(1024, ge=1)
    temperature: float = Field(1.0, ge=0)
    time_s: float | None = Field(None, gt=0)  # wall-clock budget per episode (None: none)
    tool_retries: int = Field(0, ge=0)  # as the domain keys of that name: evaluate as the policy was trained
    repair_tool_calls: bool = False
    agent: AgentConfig = Field(default_factory=AgentConfig)  # the domain key agent: mode, memory, compaction


class SuiteEntry(_Strict):
    env: str
    hash: str | None = None
    name: str | None = None  # how the entry is reported; default: the env spec
    env_args: dict[str, Any] = Field(default_factory=dict)
    levels: list[int] | None = None  # default: all the environment's levels
    tasks: int | None = Field(None, ge=1)
    seeds: list[int] | None = None
    split: Literal["eval", "all"] = "eval"

    @field_validator("hash", mode="before")
    @classmethod
    def _text(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, str):  # YAML reads an all-digit hash as a number
            raise ValueError("quote the hash, e.g. hash: '012345678901' (YAML reads digits as a number)")
        return v

    @model_validator(mode="after")
    def _check(self) -> SuiteEntry:
        if "@" not in self.env:
            raise ValueError(f"entry {self.env!r}: pin a version, e.g. {self.env}@1")
        if (self.tasks is None) == (self.seeds is None):
            raise ValueError(f"entry {self.env!r}: give either tasks (a count) or seeds (a list), not both or neither")
        return self

    @property
    def label(self) -> str:
        return self.name or self.env


class Suite(_Strict):
    name: str
    samples: int = Field(4, ge=1)
    seed: int = 0
    limits: SuiteLimits = SuiteLimits()
    entries: list[SuiteEntry] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> Suite:
        labels = [e.label for e in self.entries]
        if len(set(labels)) != len(labels):
            raise ValueError(f"entries must have distinct names (give `name:` to repeats), got {labels}")
        return self


def load_suite(path: Path) -> tuple[Suite, str]:
    """The suite and the sha256 of its file (a record names the exact suite it ran)."""
    if not path.is_file():
        raise ConfigError(f"suite file {str(path)!r} not found; pass a YAML suite (see suites/ for examples)")
    text = path.read_bytes()
    try:
        return Suite.model_validate(yaml.safe_load(text) or {}), hashlib.sha256(text).hexdigest()
    except yaml.YAMLError as e:
        raise ConfigError(f"suite {path}: not valid YAML ({e.__class__.__name__}); fix the syntax") from None
    except ValidationError as err:
        problems = []
        for e in sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden"):  # a misspelling explains the rest
            where = ".".join(str(p) for p in e["loc"]) or "suite"
            problems.append(f"unknown key {where!r} (check its spelling)" if e["type"] == "extra_forbidden"
                            else f"{where}: {e['msg']}")
        raise ConfigError(f"suite {path}: {'; '.join(problems)}") from None


def resolve_entries(suite: Suite, store: Path | None = None) -> dict[str, Environment]:
    """Each entry's environment, refused if its content changed under the pinned version. `store`: the QA
    store whose records name the changed parts (default: the home's, where `assay env check` writes)."""
    from assay.envs.registry import env_hash, env_parts, get_env

    envs = {}
    for entry in suite.entries:
        env = get_env(entry.env, **entry.env_args)
        now = env_hash(env)
        if entry.hash is None:
            raise ConfigError(f"suite {suite.name}: entry {entry.label} pins no hash; pin the current one ({now}) "
                              "with `assay eval pin SUITE.yaml`")
        if now != entry.hash:
            changed = _changed_parts(store or envqa_store(), entry, env_parts(env))
            raise ConfigError(f"suite {suite.name}: {entry.env} changed since it was pinned ({entry.hash} -> {now}; "
                              f"{changed}); bump the environment's version or re-pin the suite deliberately")
        envs[entry.label] = env
    return envs


def _changed_parts(store: Path, entry: SuiteEntry, parts: dict[str, str]) -> str:
    """The parts that differ from the QA record of the pinned hash, when the QA store has one."""
    for path in sorted((store / entry.env).glob("*.json")) if (store / entry.env).is_dir() else []:
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if rec.get("hash") == entry.hash:
            old = rec.get("parts", {})
            changed = sorted(k for k in set(old) | set(parts) if old.get(k) != parts.get(k))
            return "changed: " + ", ".join(changed)
    return "now made of " + ", ".join(f"{k} {v}" for k, v in parts.items())


def suite_tasks(suite: Suite, envs: dict[str, Environment]) -> list[Task]:
    tasks = []
    for entry in suite.entries:
        env = envs[entry.label]
        levels = entry.levels or list(env.difficulties)
        bad = [lv for lv in levels if lv not in env.difficulties]
        if bad:
            raise ConfigError(f"suite {suite.name}: entry {entry.label} asks for levels {bad}; "
                              f"{entry.env} has {list(env.difficulties)}")
        split = "eval" if entry.split == "eval" else None
        if entry.seeds is not None:
            drawn = [_one(env, random.Random(f"suite:{seed}:{entry.label}"), level, split)
                     for seed in entry.seeds for level in levels]
        else:
            per_level = [entry.tasks // len(levels) + (i < entry.tasks % len(levels)) for i in range(len(levels))]
            drawn = [t for level, k in zip(levels, per_level, strict=True) if k
                     for t in _distinct(env, random.Random(f"suite:{suite.seed}:{entry.label}:{level}"), level, split, k)]
        for t in drawn:
            t.domain = entry.label
        tasks += drawn
    return tasks


def _one(env: Environment, rng: random.Random, level: int, split: str | None) -> Task:
    return draw_task(env, rng, level, split) if split else generate_task(env, rng, level)


def _distinct(env: Environment, rng: random.Random, level: int, split: str | None, count: int) -> list[Task]:
    if split:
        return draw_distinct(env, rng, level, split, count)
    seen: dict[str, Task] = {}
    for _ in range(count * 20):  # the whole space when it is smaller than the count
        task = generate_task(env, rng, level)
        seen.setdefault(task.task_id, task)
        if len(seen) == count:
            break
    return list(seen.values())


def suite_domains(suite: Suite, envs: dict[str, Environment]) -> dict[str, DomainConfig]:
    lim = suite.limits
    out = {}
    for entry in suite.entries:
        levels = sorted(entry.levels or envs[entry.label].difficulties)
        out[entry.label] = DomainConfig(name=entry.label, env=entry.env, env_args=entry.env_args,
                                        max_new_tokens=lim.max_new_tokens,
                                        max_turns=lim.max_turns, max_context=lim.max_context,
                                        time_limit_s=lim.time_s, tool_retries=lim.tool_retries,
                                        repair_tool_calls=lim.repair_tool_calls, agent=lim.agent,
                                        difficulty=DifficultyRange(min=levels[0], max=levels[-1], start=levels[0]))
    return out


def pin(path: Path) -> list[str]:
    """Write each entry's current content hash into the suite file; returns what changed."""
    from assay.envs.registry import env_hash, get_env

    suite, _ = load_suite(path)
    data = yaml.safe_load(path.read_text())
    changes = []
    for raw, entry in zip(data["entries"], suite.entries, strict=True):
        now = env_hash(get_env(entry.env, **entry.env_args))
        if raw.get("hash") != now:
            changes.append(f"{entry.label}: {raw.get('hash')} -> {now}")
            raw["hash"] = now
    if changes:
        from assay.core.atomic import atomic_write

        atomic_write(path, yaml.safe_dump(data, sort_keys=False))
    return changes
