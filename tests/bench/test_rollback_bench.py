"""`assay bench rollback`: the scripted wrong-edit policies play as described and the table reports them."""

from assay.bench.rollback import POLICIES, run_rollback_bench, table


def test_rollback_undoes_the_wrong_edit_at_a_cost_in_rounds():
    rows = {r.policy: r for r in run_rollback_bench(tasks_per_level=1, levels=(1, 2))}
    ref, cont, back = rows["reference"], rows["wrong edit, continue"], rows["wrong edit, rollback"]
    assert all(ref.passed) and back.passed == ref.passed  # the rollback restores what the edit broke
    assert [r - 4 for r in back.rounds] == ref.rounds and [r - 2 for r in cont.rounds] == ref.rounds
    assert back.milestones["visible_pass"] == [True, True]
    out = table(list(rows.values()))
    assert all(f"| {p} | 2 |" in out for p in POLICIES) and "visible_pass" in out


def test_the_same_scripts_through_the_agent_loop_are_the_wrong_edit_rows():
    from assay.bench.countermeasures import run_countermeasures

    rows, _ = run_countermeasures(("wrong early edit",), per_level=1, levels=(1,))
    off, back = (r.trajs[0] for r in rows)
    assert back.passed and back.turns == off.turns + 2  # checkpoint and rollback
    assert back.finish_reason == off.finish_reason == "stop"
