"""The environment seam: a versioned, procedurally generated source of tasks with a verifier.

The whole contract is here. Required: the attributes and methods of `Environment` and `Episode`.
Optional: the fields of `EnvHooks`, each with its default, which an environment declares by defining an
attribute (a class attribute, one set in `__init__`, or a method) of the same name; the framework reads
them only through `hooks(env)`, which refuses a name one slip away from a hook (`eval_shares`,
`sandbox_limit`) rather than silently taking the default:

- `eval_share: float` — the share of the task space held out for evaluation (default 0.2); tasks are
  assigned by a hash of their `task_id`.
- `hash_deps: tuple[str, ...]` — modules besides the class's own whose source is part of the content
  hash (default none): the helpers its generator or verifier imports. Read from the class.
- `fingerprint() -> str` — a digest of data or template files the environment loads, also hashed
  (default none).
- `secrets(task) -> list[str]` — strings that must never be readable from inside the episode's sandbox
  (the answer, hidden tests); the QA gate searches for them (default: the reference solution's final
  answer).
- `qa_kind: "answer" | "code" | "terminal"` — which cheating strategies the QA gate plays. Undeclared,
  the gate infers it from what the environment does ("terminal" with a `bash` tool, "code" with
  `sandbox_limits` or a code block in the reference's answer, else "answer") and warns; a declared kind
  that contradicts a code or terminal behaviour fails the gate.
- `sandbox_limits: Limits` — the sandbox each episode needs. Declared, the framework hands every episode
  a warm sandbox from a pool through `start(task, sandbox)` (taken on first use, given back restored when
  the episode closes), so the environment opens none of its own; undeclared (or where the host cannot
  isolate), `start` gets None and the environment opens what it needs.
- `stateless_verify: bool` — whether a fresh episode of the task verifies the final messages as the
  acting one would, so that verification may run in a verifier process (`rollout.verifier_processes`;
  default: true exactly when the environment has no tools, since then no call ever reaches
  `Episode.step`).
- `milestones: tuple[Milestone, ...]` — staged verification (`assay.envs.milestones`): the points of an
  episode where the environment can tell that work went right, each checked on the finished episode's
  messages and Reward; recorded on every trajectory and logged as hit rates, and paid for by a shaped
  reward only where a domain turns `milestone_reward` on (default none).
- `Episode.close()` (`ClosingEpisode`) — release what `start` acquired; called once on every path
  (default: nothing). A sandbox the framework handed over is the framework's to give back: leave it.
- `Observation.is_error` on a tool result counts as a tool error in the trajectory.

What the framework stamps itself, after `generate` (`registry.generate_task`): the task's `env`
(name@version) and `env_hash`; and the `seed` that produced it, when drawn for a split. Whoever
draws a task for a run (the mixer, SFT, evaluation, a suite) sets its `domain`: the name the run
gives the domain, which is not the environment's `category`. An environment sets `task_id` (from the task's content: `assay.envs.task_id`), `difficulty` (the one
asked for), `prompt`, `tools` and a hidden `payload`."""

from __future__ import annotations

import difflib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Literal, Protocol, runtime_checkable

from assay.core.errors import AssayError
from assay.core.types import Message, Observation, Reward, Task, ToolCall, ToolSpec
from assay.envs.milestones import Milestone, check_milestones
from assay.sandbox.base import Limits, Sandbox

QAKind = Literal["answer", "code", "terminal"]
DEFAULT_EVAL_SHARE = 0.2


class Episode(Protocol):
    """One task being acted on."""

    def step(self, call: ToolCall) -> Observation: ...

    def verify(self, final: list[Message]) -> Reward: ...  # runs after acting, isolated


@runtime_checkable
class ClosingEpisode(Episode, Protocol):
    """An episode that holds something (a sandbox, a process) until it is closed: the framework calls
    `close` once on every path, after verification or a failure. An episode without it holds nothing."""

    def close(self) -> None: ...


class Environment(Protocol):
    name: str
    version: str
    category: str  # free text for people ("math", "code"); a run names its own domains
    difficulties: Sequence[int]
    tools: Sequence[ToolSpec]

    def generate(self, rng: random.Random, difficulty: int) -> Task: ...

    def reference_solution(self, task: Task) -> list[Message]: ...

    def start(self, task: Task, sandbox: Sandbox | None) -> Episode: ...


@dataclass(frozen=True)
class EnvHooks:
    """The optional part of the environment contract, as `hooks(env)` resolves it: each field is a hook an
    environment may define under the same name, and its default is what an environment that does not
    gets (the module docstring says what each one means). None for `fingerprint`, `secrets` and `qa_kind`
    means undeclared; for `stateless_verify`, "true exactly when the environment has no tools"."""

    eval_share: float = DEFAULT_EVAL_SHARE
    hash_deps: tuple[str, ...] = ()
    fingerprint: Callable[[], str] | None = None
    secrets: Callable[[Task], list[str]] | None = None
    qa_kind: QAKind | None = None
    sandbox_limits: Limits | None = None
    stateless_verify: bool | None = None
    milestones: tuple[Milestone, ...] = ()


HOOKS = tuple(f.name for f in fields(EnvHooks))
_CALLABLE_HOOKS = ("fingerprint", "secrets")
# what an environment defines besides hooks: the required contract (Environment's members)
_CONTRACT = frozenset(n for n in (*Environment.__annotations__, *vars(Environment)) if not n.startswith("_"))
_SLIP = 0.8  # difflib's similarity above which a name is taken for a misspelled hook


def hooks(env: object) -> EnvHooks:
    """The hooks `env` declares, with the defaults of the ones it does not. An attribute whose name is a
    slip of a hook's (`eval_shares`, `Sandbox_limits`) is an error, not a silently ignored hook."""
    check_hook_names(env)
    declared = {}
    for name in HOOKS:
        value = getattr(env, name, None)  # the one place a hook is looked up by name
        if value is None:  # never defined, or set to None (a subclass undeclaring its base's)
            continue
        if name in _CALLABLE_HOOKS and not callable(value):
            raise AssayError(f"environment {_label(env)}: the hook {name} must be a method, got {value!r}")
        if name == "milestones":
            value = check_milestones(value, _label(env))
        declared[name] = value
    return EnvHooks(**declared)


def check_hook_names(env: object) -> None:
    """Refuse an environment (or its class) with an attribute named almost like a hook it lacks."""
    cls = env if isinstance(env, type) else type(env)
    own = () if env is cls else tuple(getattr(env, "__dict__", ()))  # set in __init__: few, and cheap to list
    slips = _slips(cls, own)
    if slips:
        said = "; ".join(f"{name!r} is no hook (did you mean {hook!r}?)" for name, hook in slips)
        raise AssayError(f"environment {_label(env)}: {said}. The hooks are {', '.join(HOOKS)} "
                         "(assay.envs.base.EnvHooks)")


@lru_cache(maxsize=1024)  # hooks(env) runs for every task and episode, on a few classes and instance layouts
def _slips(cls: type, own: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    names = {n for n in (*dir(cls), *own) if not n.startswith("_")}
    missing = [h for h in HOOKS if h not in names]  # a name near a hook the class also has is its own
    out = []
    for name in sorted(names - _CONTRACT):
        near = difflib.get_close_matches(name.lower(), missing, n=1, cutoff=_SLIP)
        if near:
            out.append((name, near[0]))
    return tuple(out)


def _label(env: object) -> str:
    cls = env if isinstance(env, type) else type(env)
    name = getattr(env, "name", None)
    return f"{name!r} ({cls.__qualname__})" if isinstance(name, str) else cls.__qualname__

