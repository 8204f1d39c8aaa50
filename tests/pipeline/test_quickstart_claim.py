"""The quickstart's claim, guarded on a shortened run whose outcome is known: a policy that passes a task
about half the time at random is lifted by RL, and the report says so; with a learning rate too small to move
the weights the same run reports no change. Either assertion fails when RL, evaluation or the paired
comparison breaks."""

import json

import pytest
import yaml

from assay.core.config import build_config
from assay.pipeline.quickstart import default_config, run_quickstart


def _no_e_run(tmp_path, lr: float, name: str):
    """A tiny random policy (no SFT) on one jsonl domain: say anything without the letter e. Untrained, it
    passes about half its samples, so every group has reward variance and RL has a signal from step one."""
    records = tmp_path / "no_e.jsonl"
    records.write_text("\n".join(json.dumps({"prompt": f"Say anything without a lowercase vowel ({i}).",
                                             "answer": "[^aeiou]*", "reference": "zz"}) for i in range(400)))
    data = yaml.safe_load(yaml.safe_dump(default_config().model_dump(mode="json")))
    data.update(name=name, run_dir=str(tmp_path), threads=1, allow_unchecked=["no_e"])
    data["model"].update(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                         tokenizer_corpus=50)
    data["domains"] = [{"name": "no_e", "env": "jsonl", "group_size": 8, "max_new_tokens": 6,
                        "env_args": {"path": str(records), "matcher": "regex"}}]
    data["sft"].update(steps=0)
    data["train"].update(steps=20, groups_per_step=8, lr=lr, checkpoint_every=20)
    data["eval"].update(tasks_per_domain=48, n=4, every=0)
    return run_quickstart(build_config(data))


def test_rl_lifts_a_policy_with_signal_and_the_report_says_so(tmp_path):
    (row,) = _no_e_run(tmp_path, lr=1e-2, name="lift")
    assert row["verdict"] == "lift" and row["delta"]["low"] > 0.3, row  # measured: +0.62 [+0.55, +0.69]
    summary = json.loads((tmp_path / "lift" / "summary.json").read_text())
    assert summary["held_out"] and "SFT data" not in summary["overlap"]  # sft.steps: 0 trained on nothing
    assert summary["start"] == "as it came" and "<th>as it came</th>" in (tmp_path / "lift" / "report.html").read_text()
    start, final = (summary["per_task"][k]["no_e"] for k in ("start", "final"))  # what bench policies pairs
    assert start["task_ids"] == final["task_ids"] and len(start["passes"]) == 48


@pytest.mark.slow
def test_the_same_run_without_learning_reports_no_change(tmp_path):
    (row,) = _no_e_run(tmp_path, lr=1e-12, name="still")
    assert row["verdict"] == "no significant change" and abs(row["delta"]["value"]) < 0.05, row
