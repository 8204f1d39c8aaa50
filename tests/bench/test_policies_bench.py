"""`assay bench policies`: the four policies paired task by task, the seed's verdict, and refusals."""

import json

import pytest

from assay.bench.policies import ARMS, policies_table, policy_evals, run_policies_bench
from assay.core.config import dump_config
from assay.core.errors import AssayError
from assay.pipeline.quickstart import default_config

TASKS = [f"t{i}" for i in range(40)]


def evals(rates: dict[str, float], tasks=TASKS) -> dict:
    """Per domain, tasks of 4 samples where the first `rate` share of the tasks pass every sample."""
    return {d: {"task_ids": list(tasks), "passes": [[i < round(rate * len(tasks))] * 4 for i in range(len(tasks))]}
            for d, rate in rates.items()}


def arms(base, rl, sft, sft_rl, sft_tasks=TASKS):
    rl_alone = {"start": "as it came", "per_task": {"start": evals(base), "final": evals(rl)}}
    with_sft = {"start": "after SFT", "per_task": {"start": evals(sft, sft_tasks), "final": evals(sft_rl, sft_tasks)}}
    return rl_alone, with_sft


def test_rl_after_sft_above_sft_on_every_domain_beats_imitation():
    table = policies_table({0: arms({"a": 0.0, "b": 0.1}, {"a": 0.0, "b": 0.4}, {"a": 0.5, "b": 0.3},
                                    {"a": 0.8, "b": 0.6})})
    assert "| 0 | a | 0.000 [0.000, 0.000] | 0.000 [0.000, 0.000] | 0.500" in table
    assert "| 0 | mean | 0.050 | 0.200 | 0.400 | 0.700 | +0.300 [" in table
    assert "seed 0: RL beats imitation" in table


def test_one_domain_below_sft_is_no_win_even_when_the_mean_rises():
    table = policies_table({0: arms({"a": 0.0, "b": 0.0}, {"a": 0.0, "b": 0.0}, {"a": 0.2, "b": 0.8},
                                    {"a": 1.0, "b": 0.4})})
    assert "seed 0: RL does not beat imitation" in table


def test_arms_that_measured_different_tasks_are_refused():
    rl_alone, with_sft = arms({"a": 0.1}, {"a": 0.2}, {"a": 0.3}, {"a": 0.4}, sft_tasks=[f"u{i}" for i in range(40)])
    with pytest.raises(AssayError, match="different a tasks"):
        policy_evals(rl_alone, with_sft)


def test_an_sft_arm_without_sft_is_refused():
    rl_alone, with_sft = arms({"a": 0.1}, {"a": 0.2}, {"a": 0.3}, {"a": 0.4})
    with pytest.raises(AssayError, match="ran no SFT"):
        policy_evals(rl_alone, {**with_sft, "start": "as it came"})


def test_finished_runs_are_read_and_paired_by_seed(tmp_path):
    for s in range(2):
        for arm, summary in zip(("rl", "sft"), arms({"a": 0.1}, {"a": 0.2 + 0.1 * s}, {"a": 0.3}, {"a": 0.5}),
                                strict=True):
            (tmp_path / f"pb_{arm}_s{s}").mkdir()
            (tmp_path / f"pb_{arm}_s{s}" / "summary.json").write_text(json.dumps(summary))
            cfg = default_config([*ARMS[arm], f"seed={s}"], "smollm2_sft")
            (tmp_path / f"pb_{arm}_s{s}" / "config.yaml").write_text(dump_config(cfg))
    logged = []
    text, pairs = run_policies_bench(2, "pb", tmp_path, [], jobs=1, threads=0, log=logged.append)
    assert not logged and sorted(pairs) == [0, 1]  # nothing was started, and every run has the preset's settings
    seed1 = next(line for line in text.splitlines() if line.startswith("| 1 | a |"))
    assert [c.split(" [")[0] for c in seed1.split(" | ")[2:6]] == ["0.100", "0.300", "0.300", "0.500"], seed1
