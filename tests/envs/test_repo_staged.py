"""repo's staged verification and checkpoint/rollback: the reference reaches every milestone, null policies none,
no null policy or cheater collects milestone reward without progress, and a rollback restores the workspace
exactly, inside the workspace only."""

from __future__ import annotations

import random

import pytest

from assay.core.types import Message, Task, ToolCall
from assay.envs.base import hooks
from assay.envs.builtin.repo import CHECKPOINT_TOOLS, RepoEnv
from assay.envs.episode import close_episode, start_episode
from assay.envs.milestones import credit, reached
from assay.envs.qa.play import Replay, play, reference_policy
from assay.envs.qa.strategies import NULL_POLICIES, cheaters_for

# every file of the workspace (dotfiles too) with its digest, and the directories: what a restore must bring back
TREE = "find . -mindepth 1 -printf '%y %p\\n' | sort; find . -type f -print0 | sort -z | xargs -0 -r sha256sum"


@pytest.fixture(scope="module")
def env() -> RepoEnv:
    return RepoEnv()


@pytest.fixture(scope="module")
def tasks(env) -> dict[int, Task]:
    return {level: env.generate(random.Random(10 + level), level) for level in (1, 3)}


def _milestones(env, task, strategy, max_turns=20) -> tuple[dict[str, bool], int]:
    played = play(env, task, strategy, max_turns)
    hits = reached(hooks(env).milestones, task, played.messages, played.reward)
    return hits, credit(hooks(env).milestones, hits)


def _calls(*specs: tuple[str, dict]) -> Replay:
    return Replay("scripted", [Message("assistant", "", [ToolCall(n, a, id=f"c{i}")]) for i, (n, a) in enumerate(specs)])


@pytest.mark.parametrize("level", [1, 3])
def test_the_reference_reaches_every_milestone(env, tasks, level):
    hits, paid = _milestones(env, tasks[level], reference_policy(env, tasks[level]))
    assert hits == {"reproduced": True, "visible_pass": True, "submitted": True} and paid == 3
    first = env.reference_solution(tasks[level])[1]
    assert first.name == "run_tests" and "[exit code 1]" in first.content  # it ran the failing tests first


def test_null_policies_reach_no_milestone(env, tasks):
    for null in NULL_POLICIES:
        hits, paid = _milestones(env, tasks[1], null)
        assert not any(hits.values()) and paid == 0, null.name


def test_running_the_tests_and_submitting_collects_nothing(env, tasks):
    hits, paid = _milestones(env, tasks[1], _calls(("run_tests", {}), ("submit", {})))
    assert hits == {"reproduced": True, "visible_pass": False, "submitted": True} and paid == 0


def test_tests_the_policy_broke_itself_are_no_reproduction(env, tasks):
    task = tasks[1]
    test_file = next(p for p in task.payload["files"] if p.startswith("tests/test_"))
    hits, _ = _milestones(env, task, _calls(("write", {"path": test_file, "content": "raise SystemExit(3)\n"}),
                                            ("run_tests", {}), ("submit", {})))
    assert not hits["reproduced"] and hits["submitted"]


def test_no_cheater_collects_milestone_reward(env, tasks):
    """The QA gate's cheaters for repo (all but those that only wait out a limit), and the tool-probing ones it
    plays on answer environments (they call every tool, run_tests and submit included): none reaches a progress
    milestone, so none is paid for the process milestones it reaches either."""
    probing = [c for c in cheaters_for(env, "answer") if c.needs_tools]
    cheaters = [c for c in cheaters_for(env) if c.klass != "resources"] + probing
    assert len(probing) >= 5 and len(cheaters) >= 13
    process = set()
    for cheater in cheaters:
        hits, paid = _milestones(env, tasks[1], cheater, max_turns=8)
        assert not hits["visible_pass"] and paid == 0, (cheater.name, hits)
        process |= {name for name, hit in hits.items() if hit}
    assert process == {"reproduced", "submitted"}  # reached by probing every tool, and paid nothing for it


def _tree(episode) -> str:
    obs = episode.step(ToolCall("bash", {"command": TREE}))
    assert obs.content.endswith("[exit code 0]"), obs.content
    return obs.content


def test_rollback_restores_the_workspace_exactly(env, tasks):
    task = tasks[1]
    source = next(p for p in task.payload["files"] if not p.startswith("tests/") and "__init__" not in p)
    episode = start_episode(env, task)
    try:
        before = _tree(episode)
        saved = episode.step(ToolCall("checkpoint", {}))
        assert saved.content.startswith("checkpoint cp1 saved") and not saved.is_error
        assert not episode.step(ToolCall("write", {"path": "notes/new.txt", "content": "later\n"})).is_error
        assert not episode.step(ToolCall("bash", {"command": f"echo '# edited' >> {source}; rm -r tests"})).is_error
        assert _tree(episode) != before
        back = episode.step(ToolCall("rollback", {"id": "cp1"}))
        assert back.content.startswith("rolled back to cp1") and not back.is_error
        assert _tree(episode) == before  # the new file and directory gone, the edited file and the tests back
        gone = episode.step(ToolCall("read", {"path": "notes/new.txt"}))
        assert gone.is_error and "no file" in gone.content
        assert episode.step(ToolCall("rollback", {"id": "cp1"})).content.startswith("rolled back to cp1")  # again
        assert episode.verify([]).details["rollbacks"] == 2
    finally:
        close_episode(episode)


def test_checkpoint_misuse_is_a_clear_counted_error(env, tasks):
    episode = env.start(tasks[1], None)
    try:
        none = episode.step(ToolCall("rollback", {"id": "cp1"}))
        assert none.is_error and "no checkpoint to return to" in none.content
        ids = [episode.step(ToolCall("checkpoint", {})).content.split()[1] for _ in range(env.checkpoints)]
        assert ids == [f"cp{i}" for i in range(1, env.checkpoints + 1)]
        full = episode.step(ToolCall("checkpoint", {}))
        assert full.is_error and f"{env.checkpoints} checkpoints are kept already" in full.content
        for unknown in ("cp9", "../../etc", "/workspace", ""):
            obs = episode.step(ToolCall("rollback", {"id": unknown}))
            assert obs.is_error and f"no checkpoint {unknown!r}" in obs.content
        dropped = episode.step(ToolCall("rollback", {"id": "cp2"}))
        assert "dropped the later checkpoints cp3, cp4" in dropped.content
        assert episode.step(ToolCall("checkpoint", {})).content.startswith("checkpoint cp5 saved")  # room again
        assert episode.tool_errors == 6
    finally:
        episode.close()


def test_rollback_never_brings_hidden_tests_into_view(env, tasks):
    task = tasks[3]
    episode = env.start(task, None)
    try:
        episode.step(ToolCall("checkpoint", {}))
        episode.step(ToolCall("bash", {"command": "rm -rf ./* && mkdir -p .hidden && echo x > .hidden/y"}))
        episode.step(ToolCall("rollback", {"id": "cp1"}))
        listing = episode.step(ToolCall("bash", {"command": "cat $(find . /tmp -type f) 2>/dev/null"})).content
        assert all(secret not in listing for secret in env.secrets(task))
        assert task.payload["files"][next(iter(task.payload["files"]))].splitlines()[0] in listing  # files are back
    finally:
        episode.close()


def test_checkpoints_zero_offers_no_checkpoint_tools(env):
    plain = RepoEnv(checkpoints=0)
    task = plain.generate(random.Random(1), 1)
    assert not {t.name for t in CHECKPOINT_TOOLS} & {t.name for t in task.tools}
    assert "checkpoint" not in task.prompt[0].content
    episode = plain.start(task, None)
    try:
        obs = episode.step(ToolCall("checkpoint", {}))
        assert obs.is_error and "checkpoint" in obs.content
    finally:
        episode.close()
