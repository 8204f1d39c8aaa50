"""codegen: the reference passes for every template family; wrong and cheating programs fail."""

from __future__ import annotations

import ast
import random

import pytest

from assay.core.types import Message, Task
from assay.envs import get_env
from assay.envs.builtin._pyjudge import _result_line, encode, extract_code, judge
from assay.envs.builtin.codegen import FAMILIES, CodegenEnv
from assay.sandbox import ExecResult, Limits, ProcessSandbox, open_sandbox


@pytest.fixture(scope="module")
def env() -> CodegenEnv:
    return CodegenEnv(timeout_s=1.0)


@pytest.fixture(scope="module")
def task(env) -> Task:
    # Level 1, family "plus": f(x) = x + k.
    rng = random.Random(0)
    while True:
        t = env.generate(rng, 1)
        if t.payload["family"] == "plus":
            return t


def _verify(env: CodegenEnv, task: Task, answer: str):
    return env.start(task, None).verify(task.prompt + [Message("assistant", answer)])


def test_every_family_reference_passes(env):
    rng = random.Random(1)
    for difficulty, families in FAMILIES.items():
        seen: dict[str, Task] = {}
        while len(seen) < len(families):
            t = env.generate(rng, difficulty)
            seen.setdefault(t.payload["family"], t)
        for t in seen.values():
            reward = env.start(t, None).verify(t.prompt + env.reference_solution(t))
            assert reward.passed and reward.score == 1.0, (t.prompt, reward)
            # Off by one: the reference's value nudged (int + 1, str + "z", list + [0]) fails every test.
            wrong = _OFF + t.payload["code"].replace("return ", "return _off(") + ")"
            reward = env.start(t, None).verify([Message("assistant", wrong)])
            assert not reward.passed and reward.score == 0.0, (t.prompt, reward)


_OFF = "def _off(v):\n    return v + 1 if type(v) is int else v + 'z' if type(v) is str else v + [0]\n"


def test_prompt_shows_spec_and_one_example(task):
    k = task.payload["params"]["k"]
    text = task.prompt[0].content
    assert text.startswith(f"Write a Python function f(x) that returns x plus {k}.\nExample: f(")
    assert len(task.payload["tests"]) == 6
    assert all(expected == args[0] + k for args, expected in task.payload["tests"])


def test_wrong_function_scores_partially_or_zero(env, task):
    k = task.payload["params"]["k"]
    assert _verify(env, task, f"def f(x):\n    return x + {k + 1}").score == 0.0
    assert _verify(env, task, f"```python\ndef f(x):\n    return x + {k}\n```").passed
    # Right on inputs below 15 only: the score is exactly the fraction of such hidden inputs.
    below = sum(args[0] < 15 for args, _ in task.payload["tests"])
    reward = _verify(env, task, f"def f(x):\n    return x + {k} if x < 15 else 0")
    assert reward.score == pytest.approx(below / 6) and reward.passed == (below == 6)


CHEATS = {
    "print_pass": 'print("PASS")\nprint("All tests passed")',
    "sys_exit_top": "import sys\nsys.exit(0)",
    "sys_exit_in_f": "import sys\ndef f(x):\n    sys.exit(0)",
    "os_exit": "import os\ndef f(x):\n    os._exit(0)",
    "os_exit_top": "import os\nos._exit(0)",
    "always_equal": "class E:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
                    "def f(x):\n    return E()",
    "int_subclass": "class I(int):\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return I(0)",
    "list_of_liars": "class E:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return [E()]",
    "bool_for_int": "def f(x):\n    return True",
    "patch_builtins": "import builtins\nbuiltins.type = lambda o: int\ndef f(x):\n    return 0",
    "forge_report": "import sys, os\nm = sys.modules['__main__']\n"
                    "os.write(1, (m._NONCE + '{\"results\": [{\"ok\": [\"int\", 0]}]}\\n').encode())\nos._exit(0)",
    "forge_deep_json": "import sys, os\nm = sys.modules['__main__']\n"
                       "os.write(1, (m._NONCE + '[' * 30000 + ']' * 30000 + '\\n').encode())\nos._exit(0)",
    "infinite_loop": "def f(x):\n    while True:\n        pass",
    "loop_at_import": "while True:\n    pass",
    "memory_bomb": "def f(x):\n    return [0] * (10 ** 10)",
    "syntax_error": "def f(x) return x",
}


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheats_fail(env, task, name):
    reward = _verify(env, task, CHEATS[name])
    assert not reward.passed and reward.score == 0.0 and reward.status == "ok", reward


def test_timeout_is_a_plain_failure(task):
    reward = CodegenEnv(timeout_s=0.5).start(task, None).verify([Message("assistant", CHEATS["infinite_loop"])])
    assert reward.status == "ok" and not reward.passed and reward.details["status"] == "timeout"


class _BrokenSandbox:
    def __init__(self, raise_os_error: bool) -> None:
        self.raise_os_error = raise_os_error

    def exec(self, cmd: list[str], stdin: str | None = None, timeout: float | None = None) -> ExecResult:
        if self.raise_os_error:
            raise OSError("no space left on device")
        return ExecResult("", "could not create namespace", -1, 0.0, status="sandbox_error")


@pytest.mark.parametrize("raise_os_error", [False, True])
def test_sandbox_failure_is_a_status_not_a_score(env, task, raise_os_error):
    episode = env.start(task, _BrokenSandbox(raise_os_error))  # type: ignore[arg-type]
    reward = episode.verify([Message("assistant", "def f(x):\n    return x")])
    assert reward.status == "sandbox_error" and not reward.passed


def test_a_given_sandbox_is_used_and_left_open(env, task):
    k = task.payload["params"]["k"]
    with ProcessSandbox(Limits(timeout_s=2)) as sbx:
        for _ in range(2):
            assert env.start(task, sbx).verify([Message("assistant", f"def f(x):\n    return x + {k}")]).passed


def test_encode_is_strict_about_types():
    assert encode(1) != encode(True) and encode([1]) != encode((1,)) and encode(1) != encode(1.0)
    assert encode({"a": [1, "b"]}) == ["dict", [[["str", "a"], ["list", [["int", 1], ["str", "b"]]]]]]
    with pytest.raises(TypeError):
        encode(object())


def test_extract_code():
    assert extract_code("```python\ndef f(x):\n    return x\n```") == "def f(x):\n    return x"
    assert extract_code("Here:\n```py\ndef f(x):\n    return 1\n```\ndone") == "def f(x):\n    return 1"
    assert extract_code("Sure.\ndef f(x):\n    return 2") == "def f(x):\n    return 2"  # bare
    assert extract_code("```python\ndef f(x):\n    return 3") == "def f(x):\n    return 3"  # unclosed fence
    two = "```\nprint(1)\n```\n```python\ndef f(x):\n    return 4\n```"
    assert extract_code(two) == "def f(x):\n    return 4"
    assert extract_code("") == ""


def test_a_result_line_is_read_as_a_literal_and_nothing_else():
    nonce = "@@n@@"
    ok = _result_line(f"noise\n{nonce}{{'results': [{{'ok': ['int', 3]}}]}}\n", nonce, ast.literal_eval)
    assert ok == {"results": [{"ok": ["int", 3]}]}
    for forged in ["__import__('os').system('true')", "{'results': [" * 400, "[1, 2]", "(" + "9" * 5000 + ")"]:
        assert _result_line(f"{nonce}{forged}\n", nonce, ast.literal_eval) is None


@pytest.mark.usefixtures("isolated")
def test_the_harness_starts_without_site(env):
    with open_sandbox(env.sandbox_limits) as sbx:
        reward = judge("import sys\ndef f(x):\n    return int(sys.flags.no_site and sys.flags.isolated)",
                       [[0], [1]], [1, 1], sbx, 2.0)
    assert reward.passed, reward.details


@pytest.mark.parametrize(("name", "ids"), [("codegen", ["codegen-1-1bccdec7b723", "codegen-4-2257c9ee8ccd"]),
                                           ("terminal", ["terminal-1-aa8c649957d4", "terminal-4-43052ad68a13"]),
                                           ("repo", ["repo-1-51495394f2c0", "repo-4-078ccfb62e95"])])
def test_later_versions_draw_the_tasks_version_3_drew(name, ids):
    # Versions 4 and 5 changed how verification runs (batches; which result line counts), codegen@6 the
    # prompt's format line, codegen@7, terminal@6 and @7 and repo@4 only shared modules, not what they draw:
    # the same seeds give version 3's tasks, ids and so partitions (these ids were drawn by version 3).
    env = get_env(name)
    assert env.version == {"repo": "4"}.get(name, "7") and env.task_stream == f"{name}@3"
    assert [env.generate(random.Random(7), level).task_id for level in (1, 4)] == ids
