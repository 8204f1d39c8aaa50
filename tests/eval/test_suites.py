"""Pinned suites: the shipped ones load and match today's environments; a suite runs on several
policies through the CLI; a malformed or stale suite is one clear line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from assay.core.errors import ConfigError
from assay.core.modeling import save_model
from assay.envs.split import eval_share, split_of
from assay.eval.record import read_record
from assay.eval.suite import load_suite, pin, resolve_entries, suite_domains, suite_tasks
from assay.pipeline.policy import build_policy, domain_envs
from assay.pipeline.quickstart import default_config

SUITES = sorted((Path(__file__).parents[2] / "suites").glob("*.yaml"))


def assay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "assay.cli", *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "COLUMNS": "250"})


@pytest.mark.parametrize("path", SUITES, ids=[p.stem for p in SUITES])
def test_shipped_suites_are_pinned_to_todays_environments(path):
    suite, sha = load_suite(path)
    envs = resolve_entries(suite)  # refuses an environment that changed under its pinned version
    tasks = suite_tasks(suite, envs)
    assert len({t.task_id for t in tasks}) == len(tasks) and len(sha) == 64
    assert all(split_of(t.task_id, eval_share(envs[t.domain])) == "eval" for t in tasks)
    assert tasks == suite_tasks(suite, envs)  # the same tasks every time
    if suite.name == "golden":
        assert 20 <= len(tasks) <= 50 and len(envs) >= 3
    domains = suite_domains(suite, envs)
    assert all(d.max_turns == suite.limits.max_turns and d.time_limit_s == suite.limits.time_s for d in domains.values())
    if suite.name == "terminal":
        assert suite.limits.time_s == 300


def _write(tmp_path, text, name="s.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, match", [
    ("name: x\nentries: []\n", "entries"),
    ("name: x\nentries:\n  - env: arith\n    tasks: 2\n", "pin a version"),
    ("name: x\nentries:\n  - env: arith@4\n    tasks: 2\n    seeds: [1]\n", "either tasks"),
    ("name: x\nentrees: []\n", "entrees"),
    ("name: x\nentries:\n  - env: arith@4\n    tasks: 2\n  - env: arith@4\n    tasks: 3\n", "distinct names"),
    ("name: [unclosed\n", "not valid YAML"),
    ("name: x\nentries:\n  - env: arith@4\n    hash: 012345\n    tasks: 2\n", "quote the hash"),
])
def test_malformed_suites_are_named(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_suite(_write(tmp_path, text))


def test_a_changed_environment_is_refused_naming_the_changed_parts_and_pin_records_the_hash(tmp_path):
    import json

    from assay.envs import get_env
    from assay.envs.registry import env_parts

    store = tmp_path / "envqa"
    (store / "arith@4").mkdir(parents=True)
    old_parts = {**env_parts(get_env("arith@4")), "params": "from-before"}
    (store / "arith@4" / "rec.json").write_text(json.dumps({"hash": "000000000000", "parts": old_parts}))
    path = _write(tmp_path, "name: x\nentries:\n  - env: arith@4\n    hash: '000000000000'\n    tasks: 2\n")
    with pytest.raises(ConfigError, match=r"arith@4 changed since it was pinned .*changed: params\)"):
        resolve_entries(load_suite(path)[0], store=store)
    changes = pin(path)
    assert len(changes) == 1 and changes[0].startswith("arith@4: 000000000000 -> ")
    assert resolve_entries(load_suite(path)[0])  # pinned now
    assert pin(path) == []  # already pinned: nothing to write
    unpinned = _write(tmp_path, "name: x\nentries:\n  - env: arith@4\n    tasks: 2\n", "u.yaml")
    with pytest.raises(ConfigError, match="pins no hash"):
        resolve_entries(load_suite(unpinned)[0])


def test_a_suite_runs_on_two_policies_and_compares_them(tmp_path):
    cfg = default_config(["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
                          "model.intermediate_size=64", "model.tokenizer_corpus=50"])
    policies = []
    for seed in (0, 1):
        model, tok = build_policy(cfg.model_copy(update={"seed": seed}), domain_envs(cfg))
        save_model(model, tok, tmp_path / f"p{seed}" / "policy")
        policies += ["--policy", str(tmp_path / f"p{seed}" / "policy")]
    suite = _write(tmp_path, "name: tiny\nsamples: 2\nlimits: {max_turns: 2, max_new_tokens: 8}\nentries:\n"
                             "  - env: arith@4\n    levels: [2]\n    tasks: 3\n"
                             "  - env: toolcalc@4\n    seeds: [5, 6]\n    levels: [1]\n")
    assert pin(suite)
    out = assay("eval", str(suite), *policies, "--out", str(tmp_path / "rec"))
    assert out.returncode == 0, out.stderr
    assert "paired by task" in out.stdout and "overall" in out.stdout
    a, b = (read_record(tmp_path / "rec" / f"{i}_policy") for i in (0, 1))
    assert a["settings"]["suite"] == "tiny" and len(a["settings"]["suite_sha256"]) == 64
    assert a["policy"]["weights_sha256"] != b["policy"]["weights_sha256"]
    assert set(a["domains"]) == {"arith@4", "toolcalc@4", "overall"}
    assert set(a["domains"]["arith@4"]["per_task"]) == set(b["domains"]["arith@4"]["per_task"])  # the same tasks
    assert a["domains"]["overall"]["metrics"]["tasks"] == 5
    bad = assay("eval", str(suite))
    assert bad.returncode != 0 and bad.stderr.strip().splitlines() == [
        f"error: a suite runs on policies: assay eval {suite} --policy DIR [--policy DIR ...] or --endpoint URL "
        "--model NAME"]
