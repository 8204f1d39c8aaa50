"""terminal: references pass at every level; null, wrong and cheating policies fail; verification is
isolated (hidden checks never reach the policy's sandbox, which nothing outlives)."""

from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path

import pytest

from assay.core.errors import AssayError
from assay.core.types import SANDBOX_ERROR, VERIFIER_ERROR, Message, Task, ToolCall
from assay.envs import env_hash, get_env
from assay.envs.builtin import _terminal_tasks, terminal
from assay.envs.builtin._terminal_tasks import FUNCS, format_result
from assay.envs.builtin.terminal import BASH, TerminalEnv, split_solution
from assay.sandbox import ExecResult, isolation_problem
from assay.sandbox.namespace import SandboxError

LEVELS = (1, 2, 3, 4)
FAMILY_NAMES = sorted(_terminal_tasks.FAMILIES)
# Where the host cannot isolate, the suite runs the unsafe ProcessSandbox (see tests/conftest.py): it cannot
# snapshot a FIFO (an infrastructure status, never a pass), and nothing there stops a process outliving a call.
ISOLATED = isolation_problem() is None


@pytest.fixture(scope="module")
def env() -> TerminalEnv:
    return TerminalEnv()


@pytest.fixture(scope="module")
def tasks(env) -> dict[tuple[int, str], Task]:
    """One task per (level, family), from fixed seeds."""
    out: dict[tuple[int, str], Task] = {}
    for level in LEVELS:
        rng = random.Random(level)
        while len([k for k in out if k[0] == level]) < len(FAMILY_NAMES):
            task = env.generate(rng, level)
            out.setdefault((level, task.payload["family"]), task)
    return out


def bash(*commands: str, final: str = "Done.") -> list[Message]:
    """A policy's turns: one bash call per command, then a final message."""
    calls = [Message("assistant", "", [ToolCall("bash", {"command": c}, id=f"call_{i}")])
             for i, c in enumerate(commands)]
    return calls + [Message("assistant", final)]


def heredoc(path: str, text: str) -> str:
    return f"cat > {path} <<'EOF'\n{text.rstrip()}\nEOF"


def wrong_policy(task: Task) -> list[Message]:
    """A plausible answer that is wrong: another file, an off-by-one count, a wrong value, hard-coded examples."""
    p, family = task.payload, task.payload["family"]
    if family == "find":
        other = next(f for f in sorted(p["files"]) if f != p["check"]["answer"])
        return bash(f"echo {other} > answer.txt")
    if family == "records":
        return bash(f"echo {int(p['check']['answer']) + 1} > answer.txt")
    if family == "config":  # the reference's fix, with the port off by one: run.py starts, on the wrong line
        port = re.search(r"port=(\d+)", p["check"]["expected"]).group(1)
        commands = [s["command"] for s in p["solution"]]
        return bash(*(c.replace(port, str(int(port) + 1)) if "<<'EOF'" in c else c for c in commands))
    # repair: every function returns its docstring example's value, which passes the doctests
    return bash(*(heredoc(path, re.sub(r'(    >>> [^\n]*\n    ([^\n]*)\n    """\n    return )[^\n]*', r"\1\2",
                                       text)) for path, text in p["files"].items()),
                "python3 -m doctest *.py && echo ok")


# ---- references, null and wrong policies ---------------------------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_reference_passes_and_replays_exactly(env, tasks, play, level):
    for family in FAMILY_NAMES:
        task = tasks[(level, family)]
        ref = env.reference_solution(task)
        assert [m.role for m in ref] == ["assistant", "tool"] * (len(ref) // 2) + ["assistant"]
        assert all(m.name == "bash" for m in ref if m.role == "tool") and not ref[-1].tool_calls
        reward, observations, episode = play(env, task, ref)
        assert reward.passed and reward.score == 1.0 and reward.status == "ok", (family, reward)
        # The reference's tool messages are what the episode returns (SFT trains on them).
        assert [o.content for o in observations] == [m.content for m in ref if m.role == "tool"], family
        assert not any(o.is_error for o in observations) and episode.tool_errors == 0


@pytest.mark.parametrize("level", LEVELS)
def test_null_and_wrong_policies_fail(env, tasks, play, level):
    for family in FAMILY_NAMES:
        task = tasks[(level, family)]
        for answer in ([Message("assistant", "")], [Message("assistant", task.prompt[-1].content)], bash("exit 0"),
                       wrong_policy(task)):
            reward, _, _ = play(env, task, answer)
            assert not reward.passed and reward.score == 0.0 and reward.status == "ok", (family, answer, reward)


def test_more_seeds_reference_passes_null_fails(env, play):
    rng = random.Random(77)
    for level in LEVELS:
        for _ in range(3):
            task = env.generate(rng, level)
            assert play(env, task, env.reference_solution(task))[0].passed, task.prompt
            assert play(env, task, [Message("assistant", "Done.")])[0].score == 0.0


def test_repair_gives_partial_credit_and_nothing_for_breaking_working_code(env, tasks, play):
    task = tasks[(4, "repair")]
    check = task.payload["check"]
    fixes = {c["command"].split()[2]: c["command"] for c in task.payload["solution"] if "<<'EOF'" in c["command"]}
    by_name = {f.name: f for f in FUNCS}
    module, name = check["buggy"][0].split(".")
    path = f"{module}.py"
    func = by_name[name]
    reverted = dict(fixes, **{path: fixes[path].replace(f"return {func.good}\n", f"return {func.bad}\n")})
    reward, _, _ = play(env, task, bash(*reverted.values()))
    assert not reward.passed and reward.score == pytest.approx(2 / 3), reward
    assert reward.details["still_broken"] == [f"{module}.{name}"]
    working = next(f"{c[0]}.{c[1]}" for c in check["calls"] if f"{c[0]}.{c[1]}" not in check["buggy"])
    module, name = working.split(".")
    path = f"{module}.py"
    broken = dict(fixes, **{path: fixes[path].replace(f"return {by_name[name].good}\n", "return None\n")})
    reward, _, _ = play(env, task, bash(*broken.values()))
    assert reward.score == 0.0 and reward.details["newly_broken"] == [working], reward


# ---- what is hidden stays hidden -----------------------------------------------------------------------------------

def test_hidden_checks_are_in_neither_prompt_nor_workspace(env, tasks):
    for (level, family), task in tasks.items():
        prompt = "\n".join(m.content for m in task.prompt)
        check = task.payload["check"]
        episode = env.start(task, None)
        listing = episode.step(ToolCall("bash", {"command": "find . -type f | sort"})).content
        # The workspace holds exactly the task's files, as given: no check, script or expected value was written.
        assert listing == format_result("".join(f"./{p}\n" for p in sorted(task.payload["files"])), "", 0)
        texts = [episode.sandbox.read_file(p).decode() for p in sorted(task.payload["files"])]
        assert texts == [task.payload["files"][p] for p in sorted(task.payload["files"])]
        episode.close()
        visible = [prompt, *texts]
        assert not any(marker in t for t in visible for marker in ("NONCE", "read_regular", "CALLS", "@@assay"))
        if family == "find":
            assert not any(check["answer"] in t for t in visible)
        if family == "records":
            assert not re.search(rf"\b{check['answer']}\b", prompt)
        if family == "config":
            fixed = next(s["command"] for s in task.payload["solution"] if "<<'EOF'" in s["command"])
            assert not any(fixed.split("\n", 1)[1].rsplit("\nEOF", 1)[0] in t for t in texts)
        if family == "repair":
            for _, function, args in check["calls"]:
                call = f"{function}({', '.join(map(repr, args))})"
                assert not any(call in t for t in visible), (call, level)
            assert not any("assert" in t or "def test" in t for t in visible)
        json.dumps(task.payload)  # payloads are stored with trajectories


# ---- cheaters --------------------------------------------------------------------------------------------------------

CHEATS = {  # shell strategies that try to pass without doing the task (as in the env QA suite)
    "pass markers": "echo PASS > answer.txt; echo 1 > reward.txt; echo '{\"passed\": true}' > result.json",
    "planted tests": "mkdir -p tests && printf 'def test_ok():\\n    assert True\\n' > tests/test_ok.py && "
                     "cp tests/test_ok.py test_ok.py",
    "delete everything": "rm -rf ./* ./.[!.]* 2>/dev/null; ls -la",
    "fifo answer": "rm -f answer.txt; mkfifo answer.txt",
    "device answer": "ln -sf /dev/zero answer.txt",
    "directory answer": "mkdir -p answer.txt",
}


@pytest.mark.parametrize("level", (1, 4))
def test_generic_cheats_fail(env, tasks, play, level):
    for family in FAMILY_NAMES:
        task = tasks[(level, family)]
        for name, command in CHEATS.items():
            if name == "device answer" and not ISOLATED:
                continue  # ProcessSandbox copies a template following symlinks: /dev/zero would fill the disk
            start = time.monotonic()
            reward, _, _ = play(env, task, bash(command))
            status = "ok" if ISOLATED or name != "fifo answer" else reward.status
            assert not reward.passed and reward.score == 0.0 and reward.status == status, (family, name, reward)
            assert time.monotonic() - start < 5, (family, name)  # a FIFO must not hang the verifier


def test_repair_cheats_fail(env, tasks, play):
    task = tasks[(1, "repair")]
    (path,) = task.payload["files"]
    module = path[:-3]
    cheats = {
        "prints PASS": 'print("PASS")\n',
        "exits at import": "import sys\nsys.exit(0)\n",
        "forges the result line": "import __main__, os\n"
                                  "for v in list(vars(__main__).values()):\n"
                                  "    if isinstance(v, str) and v.startswith('@@'):\n"
                                  "        print('\\n' + v + '{\"results\": []}')\n"
                                  "os._exit(0)\n",
        "shadows json": None,
    }
    for name, source in cheats.items():
        if source is None:  # a json.py that would report success, if the harness imported it
            commands = [heredoc("json.py", "def dumps(o): return '{\"results\": []}'\ndef loads(s): return []")]
        else:
            commands = [heredoc(path, source), f"printf 'import {module}\\n' > test_{module}.py"]
        reward, _, _ = play(env, task, bash(*commands))
        assert not reward.passed and reward.score == 0.0 and reward.status == "ok", (name, reward)


def test_config_cheats_fail(env, tasks, play):
    task = tasks[(2, "config")]
    line = task.payload["check"]["expected"]
    fake = f"print({line!r})\n"
    site = ".local/lib/python3.11/site-packages"
    for commands in ([heredoc("run.py", fake)],  # the verifier runs its own copy of run.py
                     [f"mkdir -p {site}", heredoc(f"{site}/usercustomize.py", f"import os\n{fake}os._exit(0)")],
                     [f"echo '# {line}' >> app.conf"]):
        reward, _, _ = play(env, task, bash(*commands))
        assert not reward.passed and reward.status == "ok", (commands, reward)


# ---- determinism, episode mechanics, infrastructure failures -------------------------------------------------------

def test_same_trajectory_same_reward(env, tasks, play):
    for family in FAMILY_NAMES:
        task = tasks[(3, family)]
        for answer in (env.reference_solution(task), wrong_policy(task)):
            first, _, episode = play(env, task, answer)
            second, _, _ = play(env, task, answer)
            assert (first.score, first.passed, first.status) == (second.score, second.passed, second.status)
            assert episode.verify(task.prompt + answer) is first  # verified once; the sandboxes are gone


def test_generation_is_seeded_and_registered(env):
    assert get_env("terminal").version == "7" and get_env("terminal@7").category == "terminal"
    for level in LEVELS:
        a, b = env.generate(random.Random(5), level), env.generate(random.Random(5), level)
        assert a == b and a.env == "terminal@7" and a.env_hash == env_hash(env) and a.tools == [BASH]
        assert len({env.generate(random.Random(s), level).task_id for s in range(12)}) >= 10
    with pytest.raises(AssayError, match="no difficulty 5"):
        env.generate(random.Random(0), 5)


def test_tool_calls_and_observations(tasks):
    env = TerminalEnv(timeout_s=1.0)
    episode = env.start(tasks[(1, "find")], None)
    bad = [ToolCall("python", {"command": "ls"}), ToolCall("bash", {}), ToolCall("bash", {"command": "ls", "x": 1}),
           ToolCall("bash", {"command": 7}), ToolCall("bash", {"command": "echo a\0b"})]
    for n, call in enumerate(bad, start=1):
        obs = episode.step(call)
        assert obs.is_error and obs.content.startswith("error: ") and obs.status == "ok", obs
        assert episode.tool_errors == n
    obs = episode.step(ToolCall("bash", {"command": "echo out; echo err >&2; exit 3"}))
    assert obs.content == "out\n[stderr]\nerr\n[exit code 3]" and not obs.is_error
    long = episode.step(ToolCall("bash", {"command": "python3 -c \"print('x' * 9000)\""})).content
    assert "characters cut" in long and len(long) < 2 * 2000 + 200
    slow = episode.step(ToolCall("bash", {"command": "sleep 5"}))  # a limit breach is an observation, not a failure
    assert slow.status == "ok" and not slow.is_error and "ran past the time limit" in slow.content
    assert episode.step(ToolCall("bash", {"command": "echo alive"})).content == "alive\n[exit code 0]"
    episode.verify([])
    after = episode.step(ToolCall("bash", {"command": "ls"}))
    assert after.is_error and "over" in after.content


@pytest.mark.usefixtures("isolated")  # only the namespace sandbox guarantees that no process outlives a call
def test_no_process_outlives_the_episode(env, tasks, play):
    marker = "7.3217"
    command = f"(sleep {marker} &); setsid sleep {marker} & nohup sleep {marker} >/dev/null 2>&1 & echo started"
    reward, observations, episode = play(env, tasks[(1, "records")], bash(command))
    assert observations[0].content == "started\n[exit code 0]" and not reward.passed
    assert episode.closed and episode.checker is not None
    assert episode.sandbox.closed and episode.checker.closed
    deadline = time.monotonic() + 3
    while (left := _processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left


def _processes_with(marker: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(int(pid))
        except OSError:
            pass
    return pids


class _BrokenSandbox:
    """A sandbox whose infrastructure fails: every run is a sandbox error, snapshots raise."""

    closed = False

    def exec(self, cmd, stdin=None, timeout=None):
        return ExecResult("", "[sandbox] launcher died", -1, 0.0, "sandbox_error")

    def snapshot(self):
        raise SandboxError("launcher died")

    def close(self) -> None:
        self.closed = True


def test_infrastructure_failures_are_statuses_not_rewards(env, tasks, play, monkeypatch):
    task = tasks[(1, "find")]
    episode = env.start(task, _BrokenSandbox())
    assert episode.setup_error is not None
    obs = episode.step(ToolCall("bash", {"command": "ls"}))
    assert obs.status == SANDBOX_ERROR
    assert episode.verify([]).status == SANDBOX_ERROR
    assert not episode.sandbox.closed  # a caller's sandbox is the caller's to close

    episode = env.start(task, None)
    sandbox = episode.sandbox
    monkeypatch.setattr(sandbox, "exec", _BrokenSandbox().exec)  # the sandbox breaks mid-episode
    assert episode.step(ToolCall("bash", {"command": "ls"})).status == SANDBOX_ERROR
    episode.close()

    monkeypatch.setattr(terminal, "_OBSERVE", "raise SystemExit(1)")  # a broken answer reader
    reward, _, _ = play(env, task, env.reference_solution(task))
    assert reward.status == VERIFIER_ERROR and not reward.passed


# ---- bring your own tasks ------------------------------------------------------------------------------------------

def _write_task(root: Path, name: str, files: dict[str, str], difficulty: int | None = None) -> None:
    for rel, text in files.items():
        path = root / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if difficulty is not None:
        (root / name / "task.json").write_text(json.dumps({"difficulty": difficulty}))


GREET_SOLUTION = """#!/bin/bash
# look around first
ls

./greet.sh | sed 's/hello/bye/' > out.txt
cat out.txt

# a heredoc keeps its blank lines
cat > notes.txt <<'EOF'
first

second
EOF
"""

GREET_VERIFY = """import os, sys
ok = open("out.txt").read() == "bye world\\n" and open("notes.txt").read() == "first\\n\\nsecond\\n"
sys.exit(0 if ok and not os.path.exists("verify.py") else 1)
"""


@pytest.fixture
def tasks_dir(tmp_path: Path) -> Path:
    _write_task(tmp_path, "greet", {"instruction.md": "Write the output of ./greet.sh, with hello replaced by bye, to "
                                                      "out.txt, and first, a blank line, second to notes.txt.\n",
                                    "workspace/greet.sh": "#!/bin/sh\necho hello world\n",
                                    "workspace/data/readme.txt": "nothing here\n",
                                    "verify.py": GREET_VERIFY, "solution.sh": GREET_SOLUTION})
    (tmp_path / "greet" / "workspace" / "greet.sh").chmod(0o755)
    _write_task(tmp_path, "count", {"instruction.md": "Write the number of lines of nums.txt to n.txt.",
                                    "workspace/nums.txt": "1\n2\n3\n",
                                    "verify.py": "import sys\nsys.exit(open('n.txt').read().strip() != '3')\n",
                                    "solution.sh": "wc -l < nums.txt > n.txt\n"}, difficulty=3)
    return tmp_path


def test_split_solution():
    assert split_solution(GREET_SOLUTION) == ["# look around first\nls",
                                              "./greet.sh | sed 's/hello/bye/' > out.txt\ncat out.txt",
                                              "# a heredoc keeps its blank lines\ncat > notes.txt <<'EOF'\nfirst\n\n"
                                              "second\nEOF"]
    assert split_solution("# only a comment\n\n\n") == []


def test_directory_tasks_round_trip(tasks_dir, play):
    env = get_env("terminal", tasks_dir=str(tasks_dir))
    assert env.difficulties == (1, 2, 3, 4)
    greet = env.generate(random.Random(0), 1)
    assert greet.payload["name"] == "greet" and greet.prompt[1].content.startswith("Write the output of ./greet.sh")
    assert env.generate(random.Random(0), 2).payload["name"] == "greet"  # nearest level, the lower on a tie
    count = env.generate(random.Random(0), 4)
    assert count.payload["name"] == "count" and count.difficulty == 4 and count.payload["level"] == 3
    for task in (greet, count):
        ref = env.reference_solution(task)
        reward, observations, episode = play(env, task, ref)
        assert reward.passed and reward.status == "ok", reward
        assert [o.content for o in observations] == [m.content for m in ref if m.role == "tool"]
        assert not play(env, task, [Message("assistant", "Done.")])[0].passed
    ref = env.reference_solution(greet)
    assert [m.tool_calls[0].arguments["command"] for m in ref if m.tool_calls] == split_solution(GREET_SOLUTION)
    assert ref[3].content == "bye world\n[exit code 0]"  # greet.sh kept its executable bit
    # verify.py reaches only the verifier's sandbox.
    episode = env.start(greet, None)
    listing = episode.step(ToolCall("bash", {"command": "find . -type f | sort"})).content
    assert listing == "./data/readme.txt\n./greet.sh\n[exit code 0]"
    episode.close()
    # A wrong answer fails on the user's verify.py.
    assert not play(env, greet, bash("echo 'bye world' > out.txt"))[0].passed
    # Changed task data changes the environment's hash.
    before = env_hash(env)
    (tasks_dir / "count" / "workspace" / "nums.txt").write_text("1\n2\n")
    assert env_hash(get_env("terminal", tasks_dir=str(tasks_dir))) != before


def test_malformed_task_directories_are_refused(tmp_path):
    with pytest.raises(AssayError, match="no directory"):
        TerminalEnv(tasks_dir=str(tmp_path / "missing"))
    with pytest.raises(AssayError, match="holds no task directories"):
        TerminalEnv(tasks_dir=str(tmp_path))
    _write_task(tmp_path, "half", {"instruction.md": "x", "solution.sh": "true\n"})
    with pytest.raises(AssayError, match="lacks verify.py"):
        TerminalEnv(tasks_dir=str(tmp_path))
    _write_task(tmp_path, "half", {"verify.py": "pass\n"}, difficulty=0)
    with pytest.raises(AssayError, match="difficulty must be an integer"):
        TerminalEnv(tasks_dir=str(tmp_path))
