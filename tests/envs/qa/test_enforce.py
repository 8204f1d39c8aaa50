"""The gate, enforced: an environment version without a passing record of the current gate is refused by
training and evaluation, naming the command that checks it; an override is recorded."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from broken_envs import AcceptsAnything

import assay
from assay.core.types import Message, Task, Trajectory
from assay.envs import get_env
from assay.envs.qa import QAConfig, run_gate
from assay.envs.qa.enforce import (
    PACKAGED_RECORDS,
    UNCHECKED_KEY,
    UncheckedEnvironment,
    mark_unchecked,
    passing_record,
    record_stores,
    require_checked,
)
from assay.envs.qa.gate import GATE_VERSION
from assay.envs.qa.store import save
from assay.envs.registry import env_hash


def test_an_unchecked_environment_is_refused_naming_the_command_that_checks_it(tmp_path):
    env = AcceptsAnything()
    with pytest.raises(UncheckedEnvironment, match=(
            rf"^environment broken-accepts-anything@4 \(hash {env_hash(env)}, domain 'd'\) has no passing record "
            rf"of QA gate v{GATE_VERSION}: check it with `assay env check broken-accepts-anything@4 --env-arg x=1`, "
            r"or run it unchecked \(recorded\) with --allow-unchecked broken-accepts-anything")):
        require_checked({"d": env}, stores=[tmp_path], env_args={"d": {"x": 1}})


@pytest.mark.parametrize("allow", ["broken-accepts-anything", "broken-accepts-anything@4", "d"])
def test_an_override_by_name_version_or_domain_is_returned_for_the_run_to_record(tmp_path, allow):
    env = AcceptsAnything()
    assert require_checked({"d": env}, [allow], [tmp_path]) == {"d": f"broken-accepts-anything@4 {env_hash(env)}"}


def test_a_failed_or_stale_record_is_no_pass_and_a_passing_one_is(tmp_path):
    env = get_env("arith")
    report = run_gate(env, QAConfig(tasks_per_level=2, repeats=1, cheat_tasks_per_level=1, noisy_samples=1,
                                    flake_rate=0.5))
    assert report.passed
    save(tmp_path, report)
    assert passing_record(env, [tmp_path])["hash"] == env_hash(env)
    rec = next((tmp_path / "arith@4").glob("*.json"))
    for stale in ({"gate_version": GATE_VERSION - 1}, {"passed": False}, {"hash": "0" * 12}):
        rec.write_text(json.dumps({**report.to_json(), **stale}))
        assert passing_record(env, [tmp_path]) is None, stale


@pytest.mark.parametrize("name", ["arith", "codegen", "toolcalc", "terminal"])
def test_the_builtins_records_ship_in_the_package(name):
    """The quickstart's environments train from an installed wheel anywhere: their records are package data."""
    assert passing_record(get_env(name), [PACKAGED_RECORDS]) is not None
    assert record_stores()[-1] == PACKAGED_RECORDS


def test_an_overridden_domains_trajectories_carry_the_override():
    task = Task(env="x@1", task_id="t", difficulty=1, prompt=[Message("user", "hi")], domain="d")
    other = Task(env="y@1", task_id="u", difficulty=1, prompt=[Message("user", "hi")], domain="e")
    trajs = [Trajectory(task=t, messages=[], token_ids=[], loss_mask=[], logprobs=[], prompt_len=0) for t in (task, other)]
    mark_unchecked(trajs, {"d": "x@1 abc"})
    assert trajs[0].reward_info == {UNCHECKED_KEY: "x@1 abc"} and trajs[1].reward_info == {}


def test_assay_train_refuses_an_unchecked_environment_in_one_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2+2?", "answer": "4"}) + "\n")
    config = tmp_path / "c.yaml"
    config.write_text(f"name: x\nrun_dir: {tmp_path}\ndomains:\n  - name: qa\n    env: jsonl\n"
                      f"    env_args: {{path: {data}}}\n")
    src = str(Path(assay.__file__).parents[1])  # this checkout's assay, from another working directory
    out = subprocess.run([sys.executable, "-m", "assay.cli", "train", str(config)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300, env={**os.environ, "PYTHONPATH": src})
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("error: environment jsonl@4") and f"`assay env check jsonl@4 --env-arg path={data}`" in line
    assert "--allow-unchecked jsonl" in line
