from __future__ import annotations

import hashlib
import inspect
import json
import random
from importlib.metadata import EntryPoint

import pytest

from assay.core.errors import AssayError, UnknownEnvironmentError
from assay.core.types import Message, Task
from assay.envs import env_hash, get_env, list_envs, register, registry
from assay.envs.builtin import _common, arith
from assay.envs.builtin.arith import ArithEnv


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made by a test vanish after it."""
    monkeypatch.setattr(registry, "environments", registry.environments.copy())


def _toy(version: str) -> type:
    class Toy:
        name = "toy"
        category = "test"
        difficulties = (1,)
        tools = ()

        def generate(self, rng: random.Random, difficulty: int) -> Task:
            return Task("toy@" + self.version, "t", difficulty, [Message("user", "hi")])

        def reference_solution(self, task: Task) -> list[Message]:
            return [Message("assistant", "hi")]

        def start(self, task, sandbox):
            raise NotImplementedError

    Toy.version = version
    Toy.__qualname__ = f"Toy_{version}"
    return Toy


def test_builtins_are_listed():
    assert list_envs() == [("arith", "4"), ("codegen", "7"), ("jsonl", "4"), ("repo", "4"), ("terminal", "7"), ("toolcalc", "4")]


def test_name_and_name_at_version_resolve():
    assert isinstance(get_env("arith"), ArithEnv) and isinstance(get_env("arith@4"), ArithEnv)
    assert get_env("codegen", timeout_s=1.5).sandbox_limits.timeout_s == 1.5


def test_unknown_name_lists_the_known_environments():
    with pytest.raises(UnknownEnvironmentError) as e:
        get_env("arithmetic")
    assert str(e.value) == "unknown environment 'arithmetic'; known environments: arith, codegen, jsonl, repo, terminal, toolcalc"


def test_unknown_version_lists_the_available_versions():
    with pytest.raises(UnknownEnvironmentError) as e:
        get_env("arith@7")
    assert str(e.value) == "environment 'arith' has no version '7'; available versions: 4"


def test_bad_env_args_name_what_the_environment_takes():
    with pytest.raises(AssayError, match=r"bad env_args \(path: Extra inputs are not permitted\); it takes no arguments"):
        get_env("arith", path="x")


def test_latest_version_is_numeric_not_lexicographic(scratch_registry):
    for v in ("2", "10", "9"):
        register(_toy(v))
    assert get_env("toy").version == "10" and get_env("toy@9").version == "9"
    assert [v for n, v in list_envs() if n == "toy"] == ["2", "9", "10"]
    with pytest.raises(UnknownEnvironmentError, match="available versions: 2, 9, 10"):
        get_env("toy@3")


def test_registering_a_different_class_under_a_taken_version_fails(scratch_registry):
    register(_toy("1"))
    other = _toy("1")
    other.__qualname__ = "Other"
    with pytest.raises(AssayError, match="'toy@1' is registered twice"):
        register(other)
    with pytest.raises(AssayError, match="lacks generate"):
        register(type("Half", (), {"name": "half", "version": "1"}))


def test_env_hash_covers_version_module_sources_and_parameters():
    def sha(text):
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    env = ArithEnv()
    parts = registry.env_parts(env)
    assert parts["code assay.envs.builtin.arith"] == sha(inspect.getsource(arith))
    assert parts["code assay.envs.builtin._common"] == sha(inspect.getsource(_common))
    expected = sha(json.dumps({"version": "4", **parts}, sort_keys=True))
    assert env_hash(env) == expected
    task = env.generate(random.Random(0), 1)
    assert task.env_hash == expected and task.env == "arith@4"
    hashes = {env_hash(get_env(n)) for n in ("arith", "codegen", "toolcalc")}
    assert len(hashes) == 3


PLUGIN = """
class PluginEnv:
    name = "plugged"
    version = "0.3"
    category = "test"
    difficulties = (1,)
    tools = ()
    def generate(self, rng, difficulty): ...
    def reference_solution(self, task): ...
    def start(self, task, sandbox): ...
"""


def test_entry_point_plugins_are_loaded(monkeypatch, scratch_registry, tmp_path):
    (tmp_path / "my_assay_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin = EntryPoint("plugged", "my_assay_plugin:PluginEnv", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "environments", registry.environments.copy(plugins=[plugin]))
    assert ("plugged", "0.3") in list_envs() and get_env("plugged").version == "0.3"
    assert len(env_hash(get_env("plugged"))) == 12  # hashed from the plugin's own source
    broken = EntryPoint("broken", "no_such_module_xyz:Env", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "environments", registry.environments.copy(plugins=[broken]))
    with pytest.raises(AssayError, match="environment plugin 'broken' .*failed to load"):
        list_envs()


class _TwinA(ArithEnv):
    name = "twin"


class _TwinB(ArithEnv):  # same module, name, version and parameters: another environment all the same
    name = "twin"


def test_two_classes_of_one_module_have_different_hashes():
    a, b = registry.env_parts(_TwinA()), registry.env_parts(_TwinB())
    assert a["class"] != b["class"] and env_hash(_TwinA()) != env_hash(_TwinB())
    assert {k for k in a if a[k] != b[k]} == {"class"}
    assert a["class"] == hashlib.sha256(f"{__name__}._TwinA".encode()).hexdigest()[:12]


def test_env_args_are_checked_against_the_constructors_typed_signature():
    """A typo'd or mistyped env_arg is one error naming it and what the environment takes; config strings
    are coerced as config values are; an environment taking **kwargs takes any name."""
    import pytest

    from assay.core.errors import AssayError
    from assay.envs.registry import check_env_args, get_env

    assert get_env("terminal", timeout_s="4").sandbox_limits.timeout_s == 4.0
    with pytest.raises(AssayError, match=r"timeout_s: Input should be a valid number.*it takes tasks_dir: .*timeout_s"):
        get_env("terminal", timeout_s="soon")
    with pytest.raises(AssayError, match=r"timeout: Extra inputs are not permitted"):
        get_env("terminal", timeout=3)
    with pytest.raises(AssayError, match=r"path: Field required"):
        get_env("jsonl")

    class Open:
        def __init__(self, size: int = 1, **extra) -> None: ...

    assert check_env_args("open", Open, {"size": "2", "colour": "red"}) == {"size": 2, "colour": "red"}
