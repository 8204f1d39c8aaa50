"""The environment registry: `name` or `name@version` -> an Environment instance.

Built-in environments register themselves on import (`@register`); third-party ones are found
through the `assay.environments` entry-point group, each entry point naming an Environment class.
`env_hash` fingerprints an environment's code, parameters and data (`env_parts` names each part),
so a changed environment whose version was not bumped is caught by `assay env check`."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import random
import sys
import typing
from dataclasses import is_dataclass
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any, TypeVar

from assay.core.errors import AssayError, UnknownEnvironmentError
from assay.core.registry import Registry, qualname
from assay.core.types import Task
from assay.envs.base import Environment, check_hook_names, hooks

ENTRY_POINT_GROUP = "assay.environments"
# category, difficulties and tools may be set per instance (jsonl takes its category as an argument)
_REQUIRED = ("name", "version", "generate", "reference_solution", "start")

_class_parts: dict[type, dict[str, str]] = {}

T = TypeVar("T", bound=type)


def _adopt(registry: Registry[type], ep: EntryPoint, cls: object) -> None:
    """A plugin's entry point names an Environment class, which carries its own name and version (the
    entry point's name is only a label)."""
    if not isinstance(cls, type):
        raise registry.plugin_error(ep, "must name an Environment class")
    register(cls)


# keyed by "name@version"; the built-ins register when assay.envs.builtin is imported, on first lookup
environments: Registry[type] = Registry("environment", "environments", ENTRY_POINT_GROUP, _adopt,
                                        builtins="assay.envs.builtin", fix="bump the version or rename one",
                                        unknown=UnknownEnvironmentError)


def register(cls: T) -> T:
    """Class decorator: make `cls` resolvable as `cls.name@cls.version`."""
    missing = [a for a in _REQUIRED if not hasattr(cls, a)]
    if missing:
        raise AssayError(f"environment class {cls.__qualname__} lacks {', '.join(missing)}; see assay.envs.base")
    check_hook_names(cls)  # a misspelled class-level hook fails here, not as a silent default later
    environments.add(f"{cls.name}@{cls.version}", cls)
    return cls


def _version_key(version: str) -> tuple[tuple[int, Any], ...]:
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in version.split("."))


def _registered() -> list[tuple[str, str]]:
    """Every (name, version) registered, the built-ins and every plugin loaded first."""
    environments.load_all()
    return [(name, version) for name, _, version in (key.rpartition("@") for key in environments.entries())]


def list_envs() -> list[tuple[str, str]]:
    """Every registered (name, version), sorted by name then version."""
    return sorted(_registered(), key=lambda k: (k[0], _version_key(k[1])))


def resolve(spec: str) -> type:
    """The class for `name` (its latest version) or `name@version`."""
    name, _, version = spec.strip().partition("@")
    registered = _registered()
    versions = sorted((v for n, v in registered if n == name), key=_version_key)
    if not versions:
        known = ", ".join(sorted({n for n, _ in registered})) or "none"
        raise UnknownEnvironmentError(f"unknown environment {name!r}; known environments: {known}")
    if not version:
        version = versions[-1]
    if version not in versions:
        raise UnknownEnvironmentError(f"environment {name!r} has no version {version!r}; "
                                      f"available versions: {', '.join(versions)}")
    return environments.get(f"{name}@{version}")


def get_env(spec: str, **env_args: Any) -> Environment:
    """An instance of the environment `spec` names, built with `env_args` (e.g. jsonl's path), checked
    against its constructor's typed signature first: the constructor is the declaration of its arguments."""
    cls = resolve(spec)
    return cls(**check_env_args(spec, cls, env_args))


def check_env_args(spec: str, cls: type, env_args: dict[str, Any]) -> dict[str, Any]:
    """`env_args` validated (and coerced, as config values are: "3" for a float) against the parameters and
    type hints of `cls`'s constructor; one error naming every bad argument and what the environment takes."""
    from pydantic import ConfigDict, ValidationError, create_model

    signature = inspect.signature(cls)
    params = [p for p in signature.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    try:
        hints = typing.get_type_hints(cls.__init__) if cls.__init__ is not object.__init__ else {}
    except Exception:  # a hint that names what only a type checker imports: check names, not types
        hints = {}
    fields = {p.name: (hints.get(p.name, Any), ... if p.default is p.empty else p.default) for p in params}
    open_ended = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())  # **kwargs takes any name
    model = create_model(f"{cls.__name__}Args", __config__=ConfigDict(extra="allow" if open_ended else "forbid"),
                         **fields)
    try:
        checked = model.model_validate(env_args)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'env_args'}: {err['msg']}" for err in e.errors())
        takes = ", ".join(f"{name}: {getattr(t, '__name__', t)}" for name, (t, _) in fields.items()) or "no arguments"
        raise AssayError(f"environment {spec!r}: bad env_args ({problems}); it takes {takes}") from None
    return {name: checked.__dict__.get(name, value) for name, value in env_args.items()}


def env_spec(env: Environment) -> str:
    return f"{env.name}@{env.version}"


def generate_task(env: Environment, rng: random.Random, difficulty: int) -> Task:
    """`env.generate`, then `stamped`."""
    return stamped(env, env.generate(rng, difficulty), difficulty)


def stamped(env: Environment, task: Task, difficulty: int) -> Task:
    """A generated task with the identity the framework owns rather than each environment: its `env`
    (name@version) and `env_hash` are stamped here, so an environment cannot leave them empty or
    stale. The task must carry a content `task_id` (the train/eval split hashes it) and the difficulty
    it was asked for."""
    where = f"environment {env_spec(env)}: generate(rng, {difficulty})"
    if not isinstance(task, Task):
        raise AssayError(f"{where} returned {type(task).__name__}, not an assay Task")
    if not task.task_id:
        raise AssayError(f"{where} returned a task without a task_id; derive one from the task's content "
                         "(assay.task_id does)")
    if task.difficulty != difficulty:
        raise AssayError(f"{where} returned a task of difficulty {task.difficulty}; generate() must honour the "
                         "difficulty argument")
    task.env, task.env_hash = env_spec(env), env_hash(env)
    return task


def env_parts(env: Environment) -> dict[str, str]:
    """What an environment's identity is made of, each part hashed on its own so a change can be
    named: its class (module and qualified name: two classes of one module are two environments),
    the source of its module and the modules it names in `hash_deps` (code, generator, verifier), its
    parameters (public scalar and dataclass attributes, e.g. limits or a matcher), and its
    `fingerprint()` if it has one (data and template files it loads)."""
    cls, declared = type(env), hooks(env)
    if cls not in _class_parts:  # hash_deps from the class, like the code it names
        _class_parts[cls] = {"class": _sha(qualname(cls)),
                             **{f"code {m}": _sha(_module_source(m, cls))
                                for m in (cls.__module__, *hooks(cls).hash_deps)}}
    parts = dict(_class_parts[cls])
    params = {k: repr(v) for k, v in sorted(vars(env).items())
              if not k.startswith("_") and (isinstance(v, (str, int, float, bool, Path, type(None))) or is_dataclass(v))}
    parts["params"] = _sha(repr(params))
    if declared.fingerprint is not None:
        parts["data"] = _sha(str(declared.fingerprint()))
    return parts


def env_hash(env: Environment) -> str:
    """The first 12 hex chars of sha256 over the version and every part of `env_parts`."""
    return _sha(json.dumps({"version": str(env.version), **env_parts(env)}, sort_keys=True))


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _module_source(module: str, cls: type) -> str:
    try:
        return inspect.getsource(sys.modules[module] if module in sys.modules else importlib.import_module(module))
    except (OSError, TypeError, ImportError):  # no source on disk (a REPL, exec): the class name is all we have
        return qualname(cls)
