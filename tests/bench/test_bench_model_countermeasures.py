"""`assay bench agent POLICY --countermeasures`: a real (tiny, untrained) policy's own repo episodes under each
countermeasure setting, through the engine and the agent loop, in the scripted table's columns."""

import torch

from assay.bench.countermeasures import MODEL_SETTINGS, run_model_countermeasures, table
from assay.bench.scripted import Limits, bench_tokenizer
from assay.core.config import ModelConfig
from assay.core.modeling import build_model, save_model
from assay.core.types import OK


def test_a_policy_runs_its_own_episodes_under_every_setting(tmp_path):
    tok = bench_tokenizer(0)
    torch.manual_seed(0)
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                                    max_position=4096), tok)
    save_model(model, tok, tmp_path / "babbler")
    limits = Limits(max_context=3072, max_turns=3, max_tokens=24)
    rows, setup = run_model_countermeasures(tmp_path / "babbler", per_level=1, levels=(2,), limits=limits, threads=1)
    assert [r.setting for r in rows] == [s.name for s in MODEL_SETTINGS]
    for r in rows:
        [t] = r.trajs
        assert t.status == OK and not t.passed, r.setting  # a random policy never solves a repo task
        assert 0 < t.peak_context <= limits.max_context and 1 <= t.turns and t.finish_reason, r.setting
    text = table(rows, setup)
    for s in MODEL_SETTINGS:
        assert f"| none injected (babbler) | {s.name} | 0.00 |" in text


def test_scripted_and_countermeasures_together_are_refused(tmp_path):
    from typer.testing import CliRunner

    from assay.cli import app

    result = CliRunner().invoke(app, ["bench", "agent", "--scripted", "--countermeasures"], env={"COLUMNS": "300"})
    assert result.exit_code == 2 and "pass one of them" in result.output
