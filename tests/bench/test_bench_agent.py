"""`assay bench agent` on a tiny policy: both loops run, agree, and are reported side by side."""

from assay.bench.agent import run_agent_bench, table
from assay.core.modeling import save_model
from assay.pipeline.policy import build_policy, domain_envs
from assay.pipeline.quickstart import default_config


def test_bench_agent_runs_both_loops_on_the_same_tasks(tmp_path):
    cfg = default_config(["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
                          "model.intermediate_size=64", "model.tokenizer_corpus=50", "domains.arith.max_new_tokens=8",
                          "domains.codegen.max_new_tokens=8", "domains.toolcalc.max_new_tokens=8"])
    model, tok = build_policy(cfg, domain_envs(cfg))
    save_model(model, tok, tmp_path / "policy")
    rows = run_agent_bench(cfg, tmp_path / "policy", tasks_per_domain=2, n=2, rounds=2)
    assert [r.mode for r in rows] == ["lockstep", "online"]
    assert all(len(r.seconds) == 2 and r.tokens > 0 for r in rows)
    assert rows[1].agree == 1.0 and rows[0].tokens == rows[1].tokens  # a tiny batch: the very same tokens
    text = table(rows)
    assert "| lockstep |" in text and "| online |" in text and "1.00x" in text
