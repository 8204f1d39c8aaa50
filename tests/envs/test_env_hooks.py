"""The optional hooks of the environment contract: declared in `EnvHooks`, read through `hooks(env)`,
and a misspelled one is an error rather than a silent default."""

from __future__ import annotations

import random

import pytest

from assay.core.errors import AssayError
from assay.core.types import Message, Task
from assay.envs import registry
from assay.envs.base import HOOKS, ClosingEpisode, EnvHooks, hooks
from assay.envs.episode import close_episode, start_episode
from assay.envs.registry import env_parts, get_env, list_envs, register
from assay.envs.split import eval_share
from assay.envs.verifiers import verifies_anywhere
from assay.sandbox.base import Limits


class _Plain:
    """The required contract and no hook."""

    name = "plain"
    version = "1"
    category = "test"
    difficulties = (1,)
    tools = ()

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        return Task("plain@1", f"plain-{rng.random()}", difficulty, [Message("user", "hi")])

    def reference_solution(self, task: Task) -> list[Message]:
        return [Message("assistant", "hi")]

    def start(self, task, sandbox):
        return _Episode()


class _Episode:
    closed = 0

    def step(self, call):
        raise NotImplementedError

    def verify(self, final):
        raise NotImplementedError

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def scratch_registry(monkeypatch):
    monkeypatch.setattr(registry, "environments", registry.environments.copy())


def test_an_environment_without_hooks_gets_every_default():
    assert hooks(_Plain()) == EnvHooks()
    assert eval_share(_Plain()) == 0.2 and verifies_anywhere(_Plain())
    assert "data" not in env_parts(_Plain())


def test_declared_hooks_are_read_from_the_class_the_instance_and_methods():
    class Declares(_Plain):
        eval_share = 0.5
        qa_kind = "answer"
        stateless_verify = False

        def __init__(self) -> None:
            self.sandbox_limits = Limits(timeout_s=2)

        def fingerprint(self) -> str:
            return "data-v1"

        def secrets(self, task: Task) -> list[str]:
            return ["hidden"]

    env = Declares()
    got = hooks(env)
    assert (got.eval_share, got.qa_kind, got.stateless_verify, got.sandbox_limits) == (0.5, "answer", False,
                                                                                        Limits(timeout_s=2))
    assert got.fingerprint() == "data-v1" and got.secrets(None) == ["hidden"]
    assert "data" in env_parts(env) and not verifies_anywhere(env)


@pytest.mark.parametrize("slip, hook", [("eval_shares", "eval_share"), ("sandbox_limit", "sandbox_limits"),
                                        ("Qa_Kind", "qa_kind"), ("hash_dep", "hash_deps"),
                                        ("finger_print", "fingerprint"), ("stateless_verifies", "stateless_verify")])
def test_a_misspelled_hook_fails_loudly_naming_the_hook(slip, hook):
    env = _Plain()
    setattr(env, slip, None)  # set on the instance (as __init__ would)
    with pytest.raises(AssayError, match=rf"'plain' \(_Plain\): '{slip}' is no hook \(did you mean '{hook}'\?\)"):
        hooks(env)
    with pytest.raises(AssayError, match="did you mean"):
        eval_share(env)  # every reader of a hook goes through hooks(env)


def test_a_misspelled_class_level_hook_is_refused_at_registration(scratch_registry):
    bad = type("Misspelled", (_Plain,), {"name": "misspelled", "eval_shares": 0.5})
    with pytest.raises(AssayError, match="'eval_shares' is no hook"):
        register(bad)
    register(type("Spelled", (_Plain,), {"name": "spelled", "eval_share": 0.5}))


def test_a_name_near_a_hook_the_environment_also_has_is_its_own():
    class Both(_Plain):
        secrets_file = "s.json"  # not near enough to be taken for a slip

        def secrets(self, task):
            return []

        secret = "its own: the environment declares secrets too"

    assert hooks(Both()).secrets is not None


def test_a_method_hook_that_is_not_callable_is_refused():
    env = _Plain()
    env.fingerprint = "abc"
    with pytest.raises(AssayError, match="the hook fingerprint must be a method"):
        hooks(env)


def test_the_builtins_declare_their_hooks_and_no_slip():
    names = [n for n, _ in list_envs() if n != "jsonl"]  # jsonl needs a path
    got = {n: hooks(get_env(n)) for n in names}
    assert {n: h.qa_kind for n, h in got.items()} == {"arith": "answer", "codegen": "code", "repo": "terminal",
                                                     "terminal": "terminal", "toolcalc": "answer"}
    assert got["codegen"].sandbox_limits is not None and got["arith"].sandbox_limits is None
    assert got["terminal"].secrets is not None and got["terminal"].fingerprint is not None
    assert got["repo"].secrets is not None and got["repo"].sandbox_limits is not None
    assert all(h.hash_deps for h in got.values())


def test_every_hook_is_named_in_the_base_modules_contract():
    import assay.envs.base as base

    assert all(f"`{h}" in base.__doc__ for h in HOOKS)


def test_an_episode_that_closes_is_closed_and_one_that_does_not_is_left():
    episode = start_episode(_Plain(), None)
    assert isinstance(episode, ClosingEpisode)
    close_episode(episode)
    assert episode.closed == 1

    class Holds:  # nothing to release: no close
        def step(self, call): ...
        def verify(self, final): ...

    assert not isinstance(Holds(), ClosingEpisode)
    close_episode(Holds())
