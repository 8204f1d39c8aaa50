"""`assay bench pipeline` on a tiny policy: every variant runs and is reported with its busy shares."""

import math

from assay.bench.pipeline import (
    VARIANTS,
    PipelineRow,
    reward_by,
    reward_table,
    run_pipeline_bench,
    seconds_to,
    step_reward,
    table,
)
from assay.core.modeling import save_model
from assay.pipeline.policy import build_policy, domain_envs
from assay.pipeline.quickstart import default_config

TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
        "model.intermediate_size=64", "model.tokenizer_corpus=50", "train.groups_per_step=3", "threads=1",
        *(f"domains.{d}.max_new_tokens=8" for d in ("arith", "codegen", "toolcalc")), "domains.toolcalc.max_turns=2"]


def test_bench_pipeline_runs_every_variant_and_reports_busy_shares(tmp_path):
    cfg = default_config(TINY)
    model, tok = build_policy(cfg, domain_envs(cfg))
    save_model(model, tok, tmp_path / "policy")
    rows = run_pipeline_bench(tmp_path / "policy", steps=2, rounds=1, overrides=TINY, held_out=2, samples=1)
    assert [r.variant for r in rows] == list(VARIANTS)
    for r in rows:
        assert len(r.seconds) == 1 and 0 < r.rollout_busy[0] <= 1.0 and 0 < r.train_busy[0] <= 1.0
        assert 0.0 <= r.pass_rate[0] <= 1.0
        assert len(r.cpu_busy) == 1 and 0.0 < r.cpu_busy[0] <= 1.0  # the run itself kept a core busy
        (curve,) = r.curves
        (final,) = r.held_out  # the run's last checkpoint, on the evaluation partition
        assert 0.0 <= final.low <= final.value <= final.high <= 1.0
        assert len(curve) == 2 and 0 < curve[0][0] <= curve[1][0] <= r.seconds[0] and 0 <= curve[1][1] <= 1
    text = table(rows)
    assert all(text.count(f"| {r.variant} |") == 3 for r in rows)  # the busy, reward and held-out tables
    assert "reward at equal wall time" in text and "steps / h" in text
    held = text.split("Held-out pass@1 of each run's final policy", 1)[1]
    assert all(f"| {r.variant} | {r.held_out[0]} |" in held for r in rows)


def test_each_variant_names_its_schedule_and_loop_whatever_the_default():
    for default in (["pipeline.mode=sync", "pipeline.online=false"], ["pipeline.mode=async", "pipeline.online=true"]):
        for name, overrides in VARIANTS.items():
            pipeline = default_config([*default, *overrides]).pipeline
            assert pipeline.mode == ("async" if name.startswith("async") else "sync"), name
            assert pipeline.online == ("online" in name), name


def test_step_reward_weights_each_domain_by_its_episodes():
    m = {"domain/a/pass_rate": 1.0, "domain/a/n": 24, "domain/b/pass_rate": 0.0, "domain/b/n": 8, "domain/c/n": 0,
         "domain/c/pass_rate": 0.5}
    assert step_reward(m) == 0.75
    assert math.isnan(step_reward({"loss": 1.0}))


def test_reward_against_wall_time_uses_a_trailing_mean():
    curve = [(1.0, 0.0), (2.0, 1.0), (3.0, 0.0), (4.0, 1.0), (5.0, 1.0)]
    assert reward_by(curve, 3.5, window=2) == 0.5  # steps ending at 2 and 3
    assert reward_by(curve, 5.0, window=2) == 1.0
    assert math.isnan(reward_by(curve, 1.5, window=2))  # no full window yet
    assert seconds_to(curve, 1.0, window=2) == 5.0  # one good step (at 2 s) is not enough
    assert seconds_to(curve, 0.5, window=2) == 2.0
    assert seconds_to(curve, 1.1, window=2) == math.inf


def test_the_reward_table_compares_each_variant_with_the_baseline_final_reward():
    slow = PipelineRow("sync", [4.0], 4, curves=[[(1.0, 0.2), (2.0, 0.4), (3.0, 0.6), (4.0, 0.6)]])
    fast = PipelineRow("async", [2.0], 4, curves=[[(0.5, 0.2), (1.0, 0.6), (1.5, 0.6), (2.0, 0.7)]])
    text = reward_table([slow, fast])
    # window 1: the target is sync's last step, 0.6, reached at 3 s by sync and 1 s by async
    assert "| sync | 0.400 | 3.0 | 1.00x |" in text and "| async | 0.700 | 1.0 | 3.00x |" in text
