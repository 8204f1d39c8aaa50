"""repo: generated packages are deterministic and sound (the reference patch fixes them, the workspace as given
fails), episodes confine the file tools to the workspace, and hidden tests never reach the policy."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from assay.core.types import Message, Task, ToolCall
from assay.envs import env_hash, get_env
from assay.envs.base import hooks
from assay.envs.builtin import _repo_gen as gen
from assay.envs.builtin.repo import SUBMITTED, TOOLS, RepoEnv, format_read, plan_diff
from assay.envs.episode import close_episode, start_episode, step_episode
from assay.envs.qa.play import Replay, play, reference_policy

LEVELS = (1, 2, 3, 4, 5)
FILES = {1: (3, 4), 2: (5, 6), 3: (5, 6), 4: (8, 15), 5: (8, 11)}  # files in the workspace, tests included
_MODULES = {m.name: m for s in gen.STACKS for m in s.modules}


@pytest.fixture(scope="module")
def env() -> RepoEnv:
    return RepoEnv()


@pytest.fixture(scope="module")
def tasks(env) -> dict[int, Task]:
    return {level: env.generate(random.Random(level), level) for level in LEVELS}


def outcomes(payload: dict, files: dict[str, str]) -> list[bool]:
    """Whether each visible and hidden test passes on `files`, run here (as the generator runs the package)."""
    tests = payload["visible"] + payload["hidden"]
    sources = {n: files[f"{payload['pkg']}/{n}.py"].replace(f"from {payload['pkg']}.", "from $pkg.")
               for n in payload["modules"]}
    got = gen.evaluate([_MODULES[n] for n in payload["modules"]], {}, {}, [e for e, _ in tests], replaced=sources)
    return ["ok" in r and r["ok"] == want for r, (_, want) in zip(got, tests, strict=True)]


def patched(payload: dict, only: int | None = None) -> dict[str, str]:
    """The workspace after the reference's patches and diffs (`only`: just that one of them)."""
    files = dict(payload["files"])
    edits = [s for s in payload["solution"] if s["tool"] in ("patch", "apply_diff")]
    for s in edits if only is None else edits[only:only + 1]:
        a = s["arguments"]
        if s["tool"] == "apply_diff":
            writes, _ = plan_diff(a["diff"], files.get)
            files.update(writes)
            continue
        assert files[a["path"]].count(a["search"]) == 1
        files[a["path"]] = files[a["path"]].replace(a["search"], a["replace"])
    return files


def calls(*specs: tuple[str, dict]) -> list[Message]:
    return [Message("assistant", "", [ToolCall(name, args, id=f"call_{i}")]) for i, (name, args) in enumerate(specs)]


# ---- generation -------------------------------------------------------------------------------------------------------

def test_generation_is_deterministic_varied_and_sized(env):
    for level in LEVELS:
        a, b = env.generate(random.Random(7), level), env.generate(random.Random(7), level)
        assert (a.task_id, a.payload, a.prompt) == (b.task_id, b.payload, b.prompt)
        drawn = [env.generate(random.Random(s), level) for s in range(30)]
        assert len({t.task_id for t in drawn}) == 30
        assert len({t.payload["pkg"] for t in drawn}) >= 5 and len({tuple(t.payload["faults"]) for t in drawn}) >= 6
        lo, hi = FILES[level]
        assert all(lo <= len(t.payload["files"]) <= hi for t in drawn), Counter(len(t.payload["files"]) for t in drawn)
        kinds = Counter(f.split(":")[-1] for t in drawn for f in t.payload["faults"])
        if level == 1:
            assert set(kinds) <= {"op", "off"}
        if level == 2:
            assert "case" not in kinds and {"swap", "import"} & set(kinds)
        if level == 3:
            assert all(t.payload["kind"] == "feature" and "NotImplementedError" in t.prompt[1].content for t in drawn)
        if level == 4:
            assert all(len(t.payload["faults"]) == 2 for t in drawn) and kinds["case"] == 30
            assert all(any(p.endswith("_old.py") for p in t.payload["files"]) for t in drawn)
        if level == 5:
            assert all(t.payload["kind"] == "refactor" and "rename the function" in t.prompt[1].content for t in drawn)
            assert all(e.endswith(".__dict__") for t in drawn for e, _ in t.payload["hidden"][-1:])


@pytest.mark.parametrize("level", LEVELS)
def test_reference_patch_fixes_and_the_workspace_fails(env, level):
    """Host-side, over many seeds: every test passes after the reference's patches, and the workspace as
    given fails a visible test and a hidden one; at level 4 each fault alone is caught by a hidden test."""
    for seed in range(25):
        p = env.generate(random.Random(seed), level).payload
        assert all(outcomes(p, patched(p))), (level, seed, p["faults"])
        before = outcomes(p, p["files"])
        n = len(p["visible"])
        assert not all(before[:n]) and not all(before[n:]), (level, seed)
        if level == 4:
            for i in range(2):
                assert not all(outcomes(p, patched(p, only=i))[n:]), (seed, "one fault of two fixed must fail")


# ---- episodes -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_reference_passes_and_the_untouched_workspace_fails(env, tasks, level):
    task = tasks[level]
    ref = env.reference_solution(task)
    got = play(env, task, reference_policy(env, task), 8)
    assert got.reward.passed and got.reward.score == 1.0, got.reward
    assert got.observations == [m.content for m in ref if m.role == "tool"]  # the reference's observations are real
    assert got.observations[-1] == SUBMITTED and got.observations[-2].endswith("passed\n[exit code 0]")
    for policy in (Replay("done", [Message("assistant", "Done.")]), Replay("submit", calls(("submit", {})))):
        lazy = play(env, task, policy, 8)
        assert lazy.reward.status == "ok" and not lazy.reward.passed and lazy.reward.score == 0.0


def test_hidden_tests_never_reach_the_policy(env, tasks):
    for task in tasks.values():
        hidden = env.secrets(task)
        assert len(hidden) == len(task.payload["hidden"]) + 1
        shown = [m.content for m in task.prompt] + list(task.payload["files"].values())
        shown += [m.content for m in env.reference_solution(task) if m.role == "tool"]
        dump = "find . /tmp -type f -exec cat {} + 2>/dev/null; env"
        got = play(env, task, Replay("look", calls(*[(s["tool"], s["arguments"]) for s in task.payload["solution"]
                                                    if s["tool"] != "submit"], ("bash", {"command": dump}))), 12)
        shown += got.observations
        assert "def test_" in got.observations[-1]  # the dump did read the visible tests
        text = "\n".join(shown)
        assert not [s for s in hidden if s in text]


def test_file_tools_stay_in_the_workspace(env, tasks):
    task = tasks[2]
    module = task.payload["solution"][0]["arguments"]["path"]
    episode = env.start(task, None)
    try:
        def step(name: str, **args: object):
            return episode.step(ToolCall(name, args))

        assert "is absolute" in step("read", path="/etc/passwd").content
        assert "climbs out with '..'" in step("read", path="tests/../../etc/passwd").content
        assert "climbs out" in step("write", path="../x.py", content="x").content
        step("bash", command="ln -s /etc out && ln -s /tmp tmplink && mkfifo pipe")
        for name, args in (("read", {"path": "out/passwd"}), ("write", {"path": "tmplink/x", "content": "x"}),
                           ("patch", {"path": "out/hostname", "search": "a", "replace": "b"})):
            obs = step(name, **args)
            assert obs.is_error and "through a symbolic link" in obs.content, obs
        assert step("bash", command="ls /tmp").content == "[exit code 0]"  # the refused write wrote nothing
        assert "not a regular file" in step("read", path="pipe").content  # and did not block
        assert "is a directory" in step("read", path=task.payload["pkg"]).content
        assert "no file 'nope.py'" in step("read", path="nope.py").content
        # inside the workspace they work, and the path may name a new directory
        assert step("write", path="notes/a.txt", content="one\ntwo\n").content == "wrote notes/a.txt: 2 lines"
        assert step("read", path="notes/a.txt", start=2).content == "notes/a.txt: lines 2-2 of 2\n   2  two"
        assert step("read", path=module, start=1, end=2).content.startswith(f"{module}: lines 1-2 of ")
        assert "start must be at most 2" in step("read", path="notes/a.txt", start=5).content
        assert episode.tool_errors == 10
    finally:
        episode.close()


def test_patch_errors_say_what_to_do(env, tasks):
    task = tasks[1]
    step = task.payload["solution"][1]["arguments"]
    episode = env.start(task, None)
    try:
        missing = episode.step(ToolCall("patch", {"path": step["path"], "search": "not in the file", "replace": "x"}))
        assert missing.is_error and "search text not found" in missing.content and "indentation" in missing.content
        numbered = format_read(step["path"], task.payload["files"][step["path"]]).split("\n")[1]
        with_numbers = episode.step(ToolCall("patch", {"path": step["path"], "search": numbered, "replace": "x"}))
        assert "without read's line numbers" in with_numbers.content
        twice = episode.step(ToolCall("patch", {"path": step["path"], "search": "def ", "replace": "def  "}))
        assert twice.is_error and "occurs" in twice.content and "include surrounding lines" in twice.content
        empty = step_episode(episode, [ToolCall("patch", {"path": step["path"], "search": "", "replace": "x"})],
                             task.tools).observations[0]
        assert empty.is_error and "search" in empty.content
        done = episode.step(ToolCall("patch", dict(step)))
        assert not done.is_error and done.content.startswith(f"patched {step['path']}: lines ")
        assert episode.verify([]).passed
    finally:
        episode.close()


def test_editing_the_tests_or_a_stale_copy_wins_nothing(env, tasks):
    task = tasks[4]
    p = task.payload
    test_path = next(f for f in p["files"] if f.startswith("tests/"))
    gutted = "import unittest\n\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n"
    cheat = play(env, task, Replay("gut", calls(("write", {"path": test_path, "content": gutted}), ("run_tests", {}),
                                                ("submit", {}))), 8)
    assert cheat.observations[1] == "1 tests: 1 passed\n[exit code 0]" and not cheat.reward.passed
    # the reference's patches applied to the stale copy that nothing imports
    stale = [dict(s["arguments"], path=s["arguments"]["path"].replace(".py", "_old.py"))
             for s in p["solution"] if s["tool"] == "patch" and
             s["arguments"]["path"].replace(".py", "_old.py") in p["files"]]
    assert stale
    wrong = play(env, task, Replay("stale", calls(*[("patch", a) for a in stale], ("submit", {}))), 8)
    assert not any("error" in o for o in wrong.observations[:len(stale)]) and not wrong.reward.passed


def test_episode_steps_as_the_agent_loop_does(env, tasks):
    """Scripted tool calls through the loop's own functions (a pooled sandbox, schema validation, close)."""
    task = tasks[3]
    assert hooks(env).sandbox_limits is not None and hooks(env).qa_kind == "terminal"
    episode = start_episode(env, task)
    try:
        bad = step_episode(episode, [ToolCall("read", {"file": "x"}), ToolCall("run_tests", {"verbose": True})],
                           task.tools)
        assert [o.is_error for o in bad.observations] == [True, True]
        assert "invalid" in bad.observations[0].content and "additional properties" in bad.observations[1].content.lower()
        first = step_episode(episode, [ToolCall("run_tests", {})], task.tools).observations[0]
        assert "NotImplementedError" in first.content and "[exit code 1]" in first.content
        script = [ToolCall(s["tool"], s["arguments"]) for s in task.payload["solution"]]
        stepped = step_episode(episode, [*script, ToolCall("bash", {"command": "true"})], task.tools)
        assert stepped.observations[-1].done and len(stepped.observations) == len(script)  # submit ends the turn
        after = episode.step(ToolCall("bash", {"command": "true"}))
        assert after.is_error and "episode is over" in after.content
        assert episode.verify([]).passed
    finally:
        close_episode(episode)


def test_registered_versioned_and_hashed(env):
    assert type(get_env("repo@4")) is RepoEnv and get_env("repo").version == "4"
    assert env_hash(env) == env_hash(RepoEnv()) and len(env_hash(env)) == 12
    assert env_hash(RepoEnv(timeout_s=5.0)) != env_hash(env)
    assert {t.name for t in TOOLS} == {"bash", "read", "write", "patch", "apply_diff", "run_tests", "submit"}
    assert [t.name for t in env.tools] == [t.name for t in TOOLS] + ["checkpoint", "rollback"]
    assert env_hash(RepoEnv(checkpoints=0)) != env_hash(env) and RepoEnv(checkpoints=0).tools == TOOLS
    assert "assay.envs.builtin._repo_gen" in hooks(env).hash_deps


def test_apply_diff_is_all_or_nothing_and_stays_in_the_workspace(env, tasks):
    task = tasks[5]
    diff = next(s["arguments"]["diff"] for s in task.payload["solution"] if s["tool"] == "apply_diff")
    first = diff.split("\n", 1)[0][len("--- a/"):]
    episode = env.start(task, None)
    try:
        def step(name: str, **args: object):
            return episode.step(ToolCall(name, args))

        def files() -> str:
            return step("bash", command="find . -type f | sort | xargs md5sum").content

        as_given = files()
        # the first file's hunks apply, a later one does not: nothing is written
        broken = diff + "--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-a\n+b\n"
        assert "no file 'nope.py'" in step("apply_diff", diff=broken).content
        bad_hunk = diff + f"--- a/{first}\n+++ b/{first}\n@@ -1 +1 @@\n-not there\n+x\n"
        assert "does not apply" in step("apply_diff", diff=bad_hunk).content
        assert "no file headers" in step("apply_diff", diff="rename everything please").content
        for path in ("/etc/passwd", "../x.py"):
            obs = step("apply_diff", diff=f"--- /dev/null\n+++ {path}\n@@ -0,0 +1 @@\n+x\n")
            assert obs.is_error and ("absolute" in obs.content or "climbs out" in obs.content)
        step("bash", command="ln -s /etc out")
        obs = step("apply_diff", diff="--- a/out/hostname\n+++ b/out/hostname\n@@ -1 +1 @@\n-a\n+b\n")
        assert obs.is_error and "through a symbolic link" in obs.content
        step("bash", command="rm out")
        assert files() == as_given and episode.tool_errors == 6
        # new, deleted and changed files in one diff
        made = step("apply_diff", diff="--- /dev/null\n+++ b/notes.txt\n@@ -0,0 +1,2 @@\n+one\n+two\n")
        assert made.content == "applied the diff: notes.txt created (1 hunk, +2 lines)"
        assert "exists already" in step("apply_diff", diff="--- /dev/null\n+++ notes.txt\n@@ -0,0 +1 @@\n+x\n").content
        gone = step("apply_diff", diff="--- a/notes.txt\n+++ /dev/null\n@@ -1,2 +0,0 @@\n-one\n-two\n")
        assert gone.content.startswith("applied the diff: notes.txt deleted") and files() == as_given
        done = step("apply_diff", diff=diff)
        assert not done.is_error and done.content.startswith(f"applied the diff: {first} changed")
        assert episode.verify([]).passed
    finally:
        episode.close()
