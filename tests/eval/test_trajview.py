"""A long trajectory in the HTML pages (eval/trajview.py), from real `repo` episodes: one fold per turn, its summary
naming the calls, errors, milestones, compactions and planning turns; edits as diffs; long outputs clipped; model
and tool text escaped."""

from __future__ import annotations

import html
import re
from dataclasses import replace

import pytest
from repo_episodes import LONG_OUTPUT_LINES, MARKUP, run_episodes

from assay.core.storage import trajectory_row
from assay.envs.base import hooks
from assay.envs.milestones import mark_milestones
from assay.eval.trajview import CLIP_LINES, OPEN_ALL, render_trajectory, split_turns


@pytest.fixture(scope="module")
def episodes():
    return run_episodes()


def page(traj) -> str:
    return render_trajectory(trajectory_row(traj, 0))  # as the pages read it: a row of the run store's schema


def folds(text: str) -> list[tuple[str, int, bool, str]]:
    """(classes, turn, open, summary) of each turn fold."""
    return [(cls, int(k), bool(op), summary) for cls, k, op, summary in
            re.findall(r"<details class='([^']*)' data-turn=(\d+)( open)?><summary>(.*?)</summary>", text)]


def test_each_turn_is_one_fold_whose_summary_names_its_calls(episodes):
    long = episodes.long
    assert long.passed and long.turns > OPEN_ALL
    shown = folds(page(long))
    assert [k for _, k, _, _ in shown] == list(range(1, long.turns + 1))
    assert [k for _, k, opened, _ in shown if opened] == [1, long.turns]  # the first and the last, the rest folded
    summary = {k: s for _, k, _, s in shown}
    assert summary[1].startswith("<b>turn 1</b> run_tests")
    assert "read missing.py" in summary[2] and "✗ error" in summary[2]  # the one error result
    assert sum("✗ error" in s for s in summary.values()) == long.tool_errors == 1
    assert "patch " in summary[8] and summary[long.turns].startswith(f"<b>turn {long.turns}</b> submit")
    assert [cls for cls, k, _, _ in shown if "err" in cls.split()] == ["turn err"]
    _, turns = split_turns(long.messages)
    assert len(turns) == long.turns and sum(len(t.results) for t in turns) == sum(m.role == "tool" for m in long.messages)


def test_edits_are_diffs_with_removed_and_added_lines(episodes):
    text = page(episodes.long)
    [patch] = [c.arguments for m in episodes.long.messages for c in m.tool_calls if c.name == "patch"]
    removed = re.findall(r"<div class=del>(.*?)</div>", text)
    added = re.findall(r"<div class=add>(.*?)</div>", text)
    changed_from = [ln for ln in patch["search"].split("\n") if ln not in patch["replace"].split("\n")]
    changed_to = [ln for ln in patch["replace"].split("\n") if ln not in patch["search"].split("\n")]
    assert changed_from and all(html.escape("-" + ln) in removed for ln in changed_from)
    assert changed_to and all(html.escape("+" + ln) in added for ln in changed_to)
    assert "+# notes" in added and "+the bug" in added  # the write: its content as added lines
    # the `diff -u` the policy ran: a unified diff in a tool output, coloured by its line prefixes
    assert removed.count(html.escape("-" + changed_from[0])) == 2 and any(r.startswith("--- orig.py") for r in
                                                                           re.findall(r"<div class=hunk>(.*?)</div>", text))


def test_model_and_tool_text_stays_text(episodes):
    text = page(episodes.long)
    assert MARKUP in [m.content.split("\n")[0] for m in episodes.long.messages if m.role == "tool"]  # the tool said it
    assert "<script" not in text and html.escape(MARKUP) in text


def test_a_long_output_shows_its_first_lines_and_folds_the_rest(episodes):
    text = page(episodes.long)
    numbers = "\n".join(str(i) for i in range(1, LONG_OUTPUT_LINES + 1))
    head = "\n".join(str(i) for i in range(1, CLIP_LINES + 1))
    m = re.search(rf"<pre>{head}</pre><details class=more><summary>(\d+) more lines \(\d+ characters\)</summary>"
                  rf"<pre>{CLIP_LINES + 1}\n(.*?)</pre></details>", text, re.S)
    assert m is not None and numbers in f"{head}\n{CLIP_LINES + 1}\n{m.group(2)}"
    assert int(m.group(1)) == LONG_OUTPUT_LINES - CLIP_LINES + 1  # the rest, and the exit code line


def test_compactions_and_planning_turns_are_marked(episodes):
    long, planned = episodes.long, episodes.planned
    assert long.compacted_turns and len(long.compacted_turns) == long.compactions
    text = page(long)
    cuts = [int(k) for k in re.findall(r"<div class=cut>context compacted before turn (\d+):", text)]
    assert cuts == long.compacted_turns
    assert [k for _, k, _, s in folds(text) if "after compaction" in s] == long.compacted_turns
    assert planned.passed and planned.plan_turns >= 2
    shown = folds(page(planned))
    marked = [k for cls, k, _, s in shown if "plan" in cls.split() and "planning" in s]
    assert len(marked) == planned.plan_turns and marked == list(range(1, 2 * planned.plan_turns, 2))  # every other


def test_milestones_show_per_episode_and_at_the_turn_a_declaration_locates(episodes):
    long = episodes.long
    text = page(long)
    assert long.milestones == {"reproduced": True, "visible_pass": True, "submitted": True}
    assert "milestones 3/3" in text
    mark_milestones([long], {"repo": hooks(episodes.env).milestones})  # repo@3 locates reproduced and submitted
    turns = long.reward_info["milestone_turns"]
    assert turns["submitted"] == long.turns and 1 <= turns["reproduced"] < long.turns and "visible_pass" not in turns
    shown = folds(page(long))
    assert [k for _, k, _, s in shown if "⚑ submitted" in s] == [long.turns]
    assert [k for _, k, _, s in shown if "⚑ reproduced" in s] == [turns["reproduced"]]
    unlocated = tuple(replace(m, turn=None) for m in hooks(episodes.env).milestones)
    del long.reward_info["milestone_turns"]
    mark_milestones([long], {"repo": unlocated})
    assert "milestone_turns" not in long.reward_info and "⚑" not in page(long)


def test_a_shard_from_before_the_new_columns_still_lists(episodes, tmp_path):
    import pyarrow.parquet as pq

    from assay.core.storage import TrajectoryWriter
    from assay.eval.page import trajectory_list

    shard = TrajectoryWriter(tmp_path).write([episodes.long], 3)
    pq.write_table(pq.read_table(shard).drop(["compacted_turns", "milestones", "plan_turns"]), shard)
    text = trajectory_list([shard])
    assert text.startswith("<h2>Trajectories (1)</h2>") and len(folds(text)) == episodes.long.turns
    assert "<div class=cut>" not in text and "milestones" not in text  # what the shard does not hold is not shown
