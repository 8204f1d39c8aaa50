"""The QA gate: every built-in environment passes it, and each deliberately broken environment is
caught by the gate that exists for its flaw, with the failing task's seed."""

import json
import random

import pytest
from broken_envs import AcceptsAnything, LeaksTheAnswer, Nondeterministic, RunsTheWorkspaceTests

from assay.envs import get_env
from assay.envs.qa import QAConfig, run_gate
from assay.envs.qa.store import VersionNotBumped, check_version, diff, previous_version, save
from assay.envs.registry import env_hash, env_parts, env_spec
from assay.sandbox import isolation_problem

SMALL = QAConfig(tasks_per_level=3, repeats=2, cheat_tasks_per_level=1, noisy_samples=4)


def failed_gates(report):
    return {f.gate for f in report.failures}


@pytest.mark.parametrize("name", ["arith", "toolcalc", "codegen", "terminal"])
def test_builtin_environments_pass_the_gate(name):
    report = run_gate(get_env(name), SMALL)
    assert not report.failures, [f.line() for f in report.failures]
    assert all(s["reference"] == 1.0 for s in report.levels.values())
    if isolation_problem() is not None and report.kind != "answer":  # hostile programs never run unisolated
        assert report.skipped and not report.cheaters and not report.passed
        pytest.skip(f"the namespace sandbox cannot run on this host: {isolation_problem()}")
    assert report.passed and report.cheaters and all(c["passed"] == 0 for c in report.cheaters.values())


def test_jsonl_passes_the_gate(tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"What is {i} squared?", "answer": str(i * i)})
                              for i in range(3, 40)))
    report = run_gate(get_env("jsonl", path=str(data), matcher="numeric"), SMALL)
    assert report.passed, [f.line() for f in report.failures]


def test_a_verifier_that_accepts_anything_fails_the_null_gate():
    report = run_gate(AcceptsAnything(), SMALL)
    assert "null" in failed_gates(report)
    assert any("empty answer" in f.reason and f.seed >= 0 for f in report.failures)


def test_a_prompt_that_leaks_the_answer_fails_the_leak_gate():
    report = run_gate(LeaksTheAnswer(), SMALL)
    assert "no leak" in failed_gates(report)
    assert all("Answer:" in f.reason for f in report.failures if f.gate == "no leak")
    assert failed_gates(report) <= {"no leak", "cheaters"}  # copying a number from the prompt now works too


def test_a_nondeterministic_verifier_fails_determinism():
    report = run_gate(Nondeterministic(), QAConfig(tasks_per_level=4, repeats=3, cheat_tasks_per_level=0,
                                                   noisy_samples=2))
    assert {"determinism", "reference"} <= failed_gates(report)


def test_grading_an_edited_test_file_is_caught_by_the_cheaters(isolated):
    report = run_gate(RunsTheWorkspaceTests(), QAConfig(tasks_per_level=1, repeats=1, cheat_tasks_per_level=1,
                                                        noisy_samples=1))
    caught = {f.reason for f in report.failures if f.gate == "cheaters"}
    assert any("shadow the tests" in r for r in caught), caught
    assert any("sys.exit(0)" in r for r in caught), caught


def test_the_store_locks_a_passed_version_and_diffs_against_the_previous_one(tmp_path):
    env = get_env("arith")
    report = run_gate(env, SMALL)
    save(tmp_path, report)
    check_version(tmp_path, env_spec(env), env_hash(env), env_parts(env))  # unchanged: fine
    parts = {**env_parts(env), "code assay.envs.builtin.arith": "0" * 12}
    with pytest.raises(VersionNotBumped, match="code assay.envs.builtin.arith.*bump its version"):
        check_version(tmp_path, env_spec(env), "f" * 12, parts)
    moved = tmp_path / "arith@0"
    (tmp_path / "arith@1").rename(moved)
    assert previous_version(tmp_path, "arith", "1")["env"] == "arith@1"
    assert diff(previous_version(tmp_path, "arith", "1"), report) == ["same results as arith@1"]


def test_calibration_can_measure_a_real_policy(tmp_path):
    from assay.cli import _policy_rates
    from assay.core.config import ModelConfig
    from assay.core.modeling import build_model, save_model
    from assay.core.tokenizer import train_tokenizer

    env = get_env("arith")
    tok = train_tokenizer([env.generate(random.Random(i), 1).prompt[-1].content for i in range(50)], 300)
    save_model(build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                                       max_position=256), tok), tok, tmp_path / "policy")
    report = run_gate(env, QAConfig(tasks_per_level=2, cheat_tasks_per_level=0, noisy_samples=1),
                      _policy_rates(tmp_path / "policy", env))
    # an untrained policy solves nothing, whereas the noisy reference solves most easy tasks
    assert [s["calibration pass rate"] for s in report.levels.values()] == [0.0] * 4
    assert report.levels[1]["noisy"] > 0
