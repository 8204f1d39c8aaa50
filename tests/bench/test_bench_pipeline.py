"""`assay bench pipeline` on a tiny policy: every variant runs and is reported with its busy shares."""

from assay.bench.pipeline import VARIANTS, run_pipeline_bench, table
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
    rows = run_pipeline_bench(tmp_path / "policy", steps=2, rounds=1, overrides=TINY)
    assert [r.variant for r in rows] == list(VARIANTS)
    for r in rows:
        assert len(r.seconds) == 1 and 0 < r.rollout_busy[0] <= 1.0 and 0 < r.train_busy[0] <= 1.0
        assert 0.0 <= r.pass_rate[0] <= 1.0
        assert len(r.cpu_busy) == 1 and 0.0 < r.cpu_busy[0] <= 1.0  # the run itself kept a core busy
    text = table(rows)
    assert all(f"| {r.variant} |" in text for r in rows)
