"""`assay bench learning`: the per-seed table, its mean ± sd row, and reuse of finished runs."""

import json

from assay.bench.learning import learning_table, machine, run_learning_bench
from assay.core.config import dump_config
from assay.pipeline.quickstart import default_config


def summary(seed: int, deltas: dict[str, float]) -> dict:
    rows = []
    for d, x in deltas.items():
        rows.append({"domain": d, "tasks": 4, "n": 2, "sft": {"value": 0.5, "low": 0.4, "high": 0.6},
                     "rl": {"value": 0.5 + x, "low": 0.4 + x, "high": 0.6 + x},
                     "delta": {"value": x, "low": x - 0.05, "high": x + 0.05},
                     "sft_by_difficulty": {"1": 0.9, "2": 0.1}, "rl_by_difficulty": {"1": 0.9, "2": 0.1 + x}})
    mean = sum(deltas.values()) / len(deltas)
    training = {d: {"groups": 10, "groups_by_level": {"1": 0.5, "2": 0.5}, "level_changes": 0,
                    "first": {"pass_by_level": {"1": 0.8, "2": 0.1}, "signal_share": 0.4, "entropy": 0.3},
                    "last": {"pass_by_level": {"1": 0.9, "2": 0.2}, "signal_share": 0.5, "entropy": 0.2}}
                for d in deltas}
    return {"domains": rows, "mean": {"value": mean, "low": mean - 0.02, "high": mean + 0.02}, "threads": 1,
            "seconds": {"total": 600.0}, "training": training}


def test_table_has_a_row_per_seed_and_the_spread():
    table = learning_table({0: summary(0, {"a": 0.1, "b": 0.0}), 1: summary(1, {"a": 0.3, "b": 0.2})})
    lines = table.splitlines()
    assert lines[0].startswith("| seed | a Δ | b Δ | mean Δ")
    assert lines[2].startswith("| 0 | +0.100 [+0.050, +0.150] | +0.000")
    assert "| mean ± sd | +0.200 ± 0.141 | +0.100 ± 0.141 | +0.150 ± 0.141 |" in table


def test_finished_runs_are_read_not_rerun_and_a_changed_recipe_is_named(tmp_path):
    for s in range(2):
        (tmp_path / f"lb_s{s}").mkdir()
        (tmp_path / f"lb_s{s}" / "summary.json").write_text(json.dumps(summary(s, {"a": 0.1 * s, "b": 0.1})))
        # seed 1 ran before the preset's learning rate changed; name, run_dir and threads never count
        changed = ["train.lr=0.5"] if s else []
        cfg = default_config([f"seed={s}", f"name=elsewhere_{s}", "run_dir=/elsewhere", "threads=3", *changed])
        (tmp_path / f"lb_s{s}" / "config.yaml").write_text(dump_config(cfg))
    logged = []
    text, summaries = run_learning_bench(2, "lb", tmp_path, [], jobs=2, threads=0, log=logged.append)
    assert sorted(summaries) == [0, 1]  # nothing was started
    assert "groups with reward variance" in text and "0.40 → 0.50" in text and machine() in text
    now = default_config().train.lr
    assert logged == [f"seed 1 ({tmp_path / 'lb_s1'}) ran with settings other than quickstart's now: "
                      f"train.lr 0.5 (now {now!r})"]
    assert f"- {logged[0]}" in text
