"""`assay eval` writes a record in many dimensions; `assay eval compare` pairs two records by task."""

import os
import subprocess
import sys

import pandas as pd
import pytest

from assay.core.errors import AssayError
from assay.core.modeling import save_model
from assay.eval.passk import pass_hat_k
from assay.eval.record import compare, read_record
from assay.pipeline.policy import build_policy, domain_envs
from assay.pipeline.quickstart import default_config


def assay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "assay.cli", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "250"})


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    cfg = default_config(["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
                          "model.intermediate_size=64", "model.tokenizer_corpus=50"])
    model, tok = build_policy(cfg, domain_envs(cfg))
    out = tmp_path_factory.mktemp("policy")
    save_model(model, tok, out)
    return out


def test_pass_hat_k_is_the_chance_that_all_k_pass():
    assert pass_hat_k(4, 4, 3) == 1.0 and pass_hat_k(4, 2, 3) == 0.0 and pass_hat_k(4, 3, 2) == pytest.approx(0.5)


def test_eval_writes_a_record_and_compare_pairs_by_task(policy, tmp_path):
    common = ["--env", "arith", "--env", "toolcalc", "--tasks", "6", "--n", "2", "--max-new-tokens", "8",
              "--price-prompt", "1.0", "--price-completion", "2.0"]
    a = assay("eval", str(policy), *common, "--out", str(tmp_path / "a"))
    assert a.returncode == 0, a.stderr
    for heading in ("pass@1", "pass^2", "rounds", "tool errors", "latency", "record:"):
        assert heading in a.stdout, heading
    record = read_record(tmp_path / "a")
    assert len(record["policy"]["weights_sha256"]) == 64
    assert record["environments"]["arith"]["spec"] == "arith@4" and record["environments"]["arith"]["hash"]
    m = record["domains"]["toolcalc"]["metrics"]
    assert m["tasks"] == 6 and m["n"] == 2 and set(m["pass_at"]) == {"1", "2"} and set(m["pass_hat"]) == {"1", "2"}
    assert m["cost_per_episode"] == pytest.approx((m["prompt_tokens"] + 2 * m["completion_tokens"]) / 1e6)
    assert sum(m["rounds"].values()) == 12 and m["latency_p95_s"] >= m["latency_p50_s"] > 0
    per_task = record["domains"]["arith"]["per_task"]
    assert len(per_task) == 6 and all(len(v["passes"]) == 2 for v in per_task.values())
    trajs = pd.read_parquet(tmp_path / "a" / "trajectories")
    assert len(trajs) == 24 and set(trajs["task_id"]) >= set(per_task)

    b = assay("eval", str(policy), *common, "--seed", "7", "--out", str(tmp_path / "b"))
    assert b.returncode == 0, b.stderr
    rows = compare(record, read_record(tmp_path / "b"))
    arith = [r for r in rows if r.domain == "arith" and r.metric == "pass@1"][0]
    # another seed draws other tasks (a small level may repeat one): only tasks in both records are paired
    assert arith.paired + arith.only_a == arith.paired + arith.only_b == 6 and arith.paired <= 2
    same = compare(record, record)
    assert {r.domain for r in same} == {"arith", "toolcalc", "overall"}
    assert all(r.paired == len(record["domains"][r.domain]["per_task"]) and r.diff.value == 0
               and r.verdict == "no significant difference" for r in same)
    out = assay("eval", "compare", str(tmp_path / "a"), str(tmp_path / "a"), "--effect", "0.01")
    assert out.returncode == 0, out.stderr
    assert "paired by task" in out.stdout and "too small a suite" not in out.stdout  # zero spread: MDE 0


def test_bad_records_and_policies_are_one_line(policy, tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "record.json").write_text("{not json")
    for args in (("eval", "compare", str(tmp_path / "nothing"), str(tmp_path / "broken")),
                 ("eval", "compare", str(tmp_path / "broken"), str(tmp_path / "broken")),
                 ("eval", str(tmp_path), "--env", "arith")):
        out = assay(*args)
        lines = out.stderr.strip().splitlines()
        assert out.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), (args, out.stderr)
    with pytest.raises(AssayError, match="not a readable evaluation record"):
        read_record(tmp_path / "broken")


def test_repeats_evaluate_the_same_tasks_with_other_sampling_seeds(policy, tmp_path):
    out = assay("eval", str(policy), "--env", "arith", "--tasks", "4", "--n", "2", "--max-new-tokens", "8",
                "--repeats", "2", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "run-to-run variance" in out.stdout and "sd between runs" in out.stdout
    first, second = (read_record(tmp_path / f"repeat_{r}") for r in (0, 1))
    assert first["settings"]["seed"] + 1 == second["settings"]["seed"]
    assert set(first["domains"]["arith"]["per_task"]) == set(second["domains"]["arith"]["per_task"])
