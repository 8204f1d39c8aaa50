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
