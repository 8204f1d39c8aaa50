"""Environment regression monitoring: training's pass rates go to the QA store per version and level,
periodic held-out evaluations are logged, and a training rise without a held-out rise is flagged."""

import json
import os
import subprocess
import sys

from assay.core.config import load_config
from assay.core.paths import envqa_store
from assay.pipeline.async_pipeline import make_pipeline
from assay.pipeline.monitor import LoopholeWatch, training_summary


def test_a_training_rise_without_a_held_out_rise_is_flagged():
    watch = LoopholeWatch(margin=0.1)
    watch.observe({"a": 0.2, "b": 0.2})
    assert watch.evaluated({"a": (0.30, 0.02), "b": (0.30, 0.02)}) == []  # the first evaluation sets the baseline
    watch.observe({"a": 0.6, "b": 0.6})
    warnings = watch.evaluated({"a": (0.31, 0.02), "b": (0.50, 0.02)})  # a: only training rose; b: both rose
    assert len(warnings) == 1 and warnings[0].startswith("a: training pass rate rose by 0.40")
    watch.observe({"a": 0.62})
    assert watch.evaluated({"a": (0.30, 0.02)}) == []  # no further training rise: nothing new to flag


def test_a_rise_within_the_watch_sets_noise_is_not_flagged():
    """32 watch tasks: held-out s.e. 0.08. A training rise of 0.10 beside a held-out dip of 0.01 is noise;
    the same rise of 0.40 is not."""
    for rise, flagged in ((0.10, False), (0.40, True)):
        watch = LoopholeWatch(margin=0.05)
        watch.observe({"a": 0.50})
        watch.observe({"a": 0.52})
        watch.evaluated({"a": (0.45, 0.08)})
        watch.observe({"a": 0.51 + rise})
        watch.observe({"a": 0.51 + rise})
        assert bool(watch.evaluated({"a": (0.44, 0.08)})) is flagged


def test_training_logs_pass_rates_and_evaluates_held_out_periodically(tiny_config, tmp_path):
    cfg = load_config(tiny_config(name="mon"), ["eval.every=3", "eval.watch_tasks=2", "eval.watch_n=2"])
    make_pipeline(cfg, tmp_path / "mon").run()
    records = [json.loads(line) for line in (tmp_path / "mon" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6] and all("heldout/arith/pass@1" in r for r in evals)
    store = envqa_store()  # the home store (ASSAY_HOME is the test's own), where env show reads
    summary = training_summary(store, "arith@4")
    (h, arith), = summary.items()
    assert arith["runs"] == {"mon"} and 1 <= arith["steps"] <= 6 and sum(n for _, n in arith["levels"].values()) > 0
    shown = subprocess.run([sys.executable, "-m", "assay.cli", "env", "show", "arith", "--store", str(store)],
                           capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "250"})
    assert shown.returncode == 0 and f"training (hash {h}, 1 runs, {arith['steps']} steps)" in shown.stdout, shown.stderr


def test_the_watch_is_on_by_default_four_times_a_run_and_off_for_short_runs_and_vllm(tiny_config):
    assert load_config(tiny_config(), ["train.steps=40"]).watch_every == 10
    assert load_config(tiny_config(), ["train.steps=7"]).watch_every == 0  # too short to tell a loophole from noise
    assert load_config(tiny_config(), ["train.steps=40", "eval.every=0"]).watch_every == 0
    assert load_config(tiny_config(), ["train.steps=40", "eval.every=3"]).watch_every == 3
    vllm = load_config(tiny_config(), ["train.steps=40", "rollout.backend=vllm", "pipeline.mode=sync"])
    assert vllm.watch_every == 0  # it would evaluate in the trainer's process, beside vLLM's engine
