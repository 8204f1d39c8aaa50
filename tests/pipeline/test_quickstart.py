"""The quickstart job's flow on a miniature budget: every stage runs, the loophole watch too, and the summary
is complete."""

import json

from assay.pipeline.quickstart import default_config, run_quickstart


def test_quickstart_flow_on_a_tiny_budget(tmp_path):
    cfg = default_config([f"run_dir={tmp_path}", "threads=1", "model.hidden_size=32", "model.num_layers=1",
                          "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64",
                          "model.tokenizer_corpus=50", "sft.steps=3", "sft.batch_size=4",
                          "sft.examples_per_domain=8", "train.steps=8", "train.groups_per_step=3",
                          "eval.tasks_per_domain=4", "eval.n=2", "eval.watch_tasks=4", "eval.watch_n=2"])
    rows = run_quickstart(cfg)
    assert [r["domain"] for r in rows] == ["arith", "codegen", "toolcalc"]
    run = tmp_path / "quickstart"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["domains"] == json.loads(json.dumps(rows))
    # the evaluation tasks were checked against the run's SFT data and RL trajectories, and none is there
    assert summary["held_out"] is True and summary["overlap"].startswith("held out: 0 of")
    assert summary["start"] == "after SFT"
    assert summary["loophole_watch"]["evaluations"] == [2, 4, 6, 8]  # on by default: four checks, on the async pipeline
    assert "sft SFT data" in summary["overlap"] and "quickstart trajectories" in summary["overlap"]
    for r in rows:
        assert r["tasks"] == 4 and r["n"] == 2
        assert r["sft"]["low"] <= r["sft"]["value"] <= r["sft"]["high"]
        assert r["verdict"] in ("lift", "regression", "no significant change")
    assert (run / "sft" / "policy" / "model.safetensors").is_file()
    assert (run / "checkpoints" / "step_8" / "model.safetensors").is_file()
    page = (run / "report.html").read_text()
    assert "Held-out evaluation" in page and "<table id=summary>" in page and "Training trajectories" in page
