"""The golden-suite gate on a canary's promotion: records of both served policies on one pinned suite, written by
the evaluation's writer with known results, become a verdict; a deployment rolls a worse candidate back at once,
promotes an equal one only when the live test does, and lets an underpowered suite block promotion; records that
are not of one suite, or not of the served policies, are refused, naming the mismatch. Given the suite file,
`assay serve` evaluates both policies itself (`assay eval`'s records, reused on the next start) before it
serves; a missing, malformed or stale suite is refused before any model loads."""

import copy
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from serve_helpers import drive, golden_records, served_url, verified_suite, versions
from typer.testing import CliRunner

from assay.cli import app
from assay.core.errors import AssayError
from assay.core.modeling import save_model
from assay.envs import env_hash, env_spec, get_env
from assay.eval.record import policy_identity, read_record
from assay.serve.canary import CanaryConfig
from assay.serve.golden import golden_dir, golden_gate, load_gate, pick_records
from assay.serve.profile import FAST, STANDARD
from assay.serve.server import ServeOptions, golden_gate_of


@pytest.fixture(scope="module")
def twin(policy):
    """The fixture's policy with one weight moved by 1e-6: other weights (another hash), the same answers."""
    twin = copy.deepcopy(policy)
    with torch.no_grad():
        next(twin.parameters()).view(-1)[0] += 1e-6
    return twin


@pytest.fixture(scope="module")
def dirs(policy, twin, babbler, tok, tmp_path_factory):
    """The stable policy, its twin and the untrained babbler saved as checkpoint directories."""
    root = tmp_path_factory.mktemp("policies")
    for name, model in (("stable", policy), ("twin", twin), ("babbler", babbler)):
        save_model(model, tok, root / name)
    return root


def same(who, env, i):  # both policies alike: tasks 0 and 3 of each environment fail
    return [i % 3 != 0, True]


def worse_on_arith(who, env, i):
    return [False, False] if who == "candidate" and env == "arith@4" else [True, True]


def noisy(who, env, i):  # the candidate wins one task and loses one in each environment: no loss on average
    flip = (who == "candidate") and i in (0, 1)
    return [(i % 2 == 0) != flip] * 2


def test_the_gate_fails_a_significant_loss_and_passes_an_equal_candidate(dirs, tmp_path):
    worse = golden_records(tmp_path / "worse", dirs / "stable", dirs / "babbler", worse_on_arith)
    gate = load_gate([worse], dirs / "stable", dirs / "babbler", "float32", 0.3, 0.05)
    assert gate.verdict == "fail" and gate.reason.startswith("significantly worse on arith@4 (pass@1 1.000 -> 0.000")
    assert [r.env for r in gate.rows] == ["arith@4", "toolcalc@4", "all tasks"] and gate.tasks == 16
    assert "toolcalc@4" not in gate.reason  # no loss there

    equal = golden_records(tmp_path / "equal", dirs / "stable", dirs / "twin", noisy)
    gate = load_gate([equal], dirs / "stable", dirs / "twin", "float32", 0.5, 0.05)
    assert gate.verdict == "pass" and gate.allows_promotion, gate
    assert gate.rows[-1].diff == 0 and 0 < gate.mde <= 0.5 and gate.rows[-1].low > -0.5
    # the records are matched to the versions by weights, not by order: given swapped, the same gate
    (s, _), (c, _) = pick_records(sorted((equal).iterdir(), reverse=True), dirs / "stable", dirs / "twin")
    assert s.name == "0_stable" and c.name == "1_twin"
    # the same evidence, a smaller margin: 16 tasks detect a loss of mde, not 0.2
    tight = load_gate([equal], dirs / "stable", dirs / "twin", "float32", 0.2, 0.05)
    assert tight.verdict == "underpowered" and not tight.allows_promotion
    assert tight.tasks_needed > 16 and f"about {tight.tasks_needed} tasks are needed" in tight.reason


def test_a_loss_the_suite_neither_shows_nor_rules_out_is_inconclusive(dirs, tmp_path):
    records = golden_records(tmp_path, dirs / "stable", dirs / "twin", tasks=16,
                             passes=lambda who, env, i: [not (who == "candidate" and env == "arith@4" and i < 3)] * 2)
    gate = load_gate([records], dirs / "stable", dirs / "twin", "float32", 0.15, 0.05)
    assert gate.verdict == "inconclusive" and not gate.allows_promotion, gate
    assert gate.mde <= 0.15 and gate.rows[-1].low <= -0.15 < gate.rows[-1].diff < 0 <= gate.rows[-1].high


def test_identical_results_on_few_tasks_are_underpowered(dirs, tmp_path):
    """Zero spread has a standard error of 0 at any size; fewer than ln(alpha)/ln(1 - margin) tasks still cannot
    rule out the margin."""
    few = golden_records(tmp_path, dirs / "stable", dirs / "twin", same, tasks=2)
    gate = load_gate([few], dirs / "stable", dirs / "twin", "float32", 0.3, 0.05)
    assert gate.mde == 0 and gate.verdict == "underpowered" and gate.tasks_needed == 9, gate  # ln .05 / ln .7 = 8.4
    enough = load_gate([few], dirs / "stable", dirs / "twin", "float32", 0.6, 0.05)
    assert enough.verdict == "pass"


def test_records_of_other_suites_tasks_or_policies_are_refused(dirs, tmp_path):
    equal = golden_records(tmp_path / "a", dirs / "stable", dirs / "twin", same)
    other = golden_records(tmp_path / "b", dirs / "stable", dirs / "twin", same, tasks=6)
    with pytest.raises(AssayError, match="differ in suite_sha256"):
        load_gate([equal / "0_stable", other / "1_twin"], dirs / "stable", dirs / "twin", "float32", 0.3, 0.05)
    with pytest.raises(AssayError, match="no --golden record evaluated the candidate policy .*babbler"):
        load_gate([equal], dirs / "stable", dirs / "babbler", "float32", 0.3, 0.05)
    with pytest.raises(AssayError, match="evaluated float32 weights, and this profile serves int8"):
        load_gate([equal], dirs / "stable", dirs / "twin", "int8", 0.3, 0.05)
    with pytest.raises(AssayError, match="--golden .*nothing: no evaluation record there"):
        load_gate([tmp_path / "nothing"], dirs / "stable", dirs / "twin", "float32", 0.3, 0.05)
    # a task every sample of which failed on infrastructure is missing from one record
    lost = golden_records(tmp_path / "c", dirs / "stable", dirs / "twin",
                          lambda who, env, i: [] if who == "candidate" and i == 5 else [True, True])
    with pytest.raises(AssayError, match="environment arith@4: the golden records hold other tasks"):
        load_gate([lost], dirs / "stable", dirs / "twin", "float32", 0.3, 0.05)
    # an environment changed between the evaluations
    stable, twin = (json.loads((equal / d / "record.json").read_text()) for d in ("0_stable", "1_twin"))
    twin["environments"]["toolcalc@4"]["hash"] = "0123456789ab"
    with pytest.raises(AssayError, match="environment toolcalc@4 differs between the golden records"):
        golden_gate(stable, twin, 0.3, 0.05)
    # an evaluation on the evaluation partition, not a pinned suite; an endpoint's record vouches for no weights
    del twin["settings"]["suite_sha256"]
    with pytest.raises(AssayError, match="candidate is not an evaluation of a pinned suite"):
        golden_gate(stable, twin, 0.3, 0.05)
    endpoint = tmp_path / "endpoint"
    shutil.copytree(equal / "1_twin", endpoint)
    record = json.loads((endpoint / "record.json").read_text())
    record["policy"] = {"kind": "endpoint", "url": "http://127.0.0.1:8000/v1", "model": "twin"}
    (endpoint / "record.json").write_text(json.dumps(record))
    with pytest.raises(AssayError, match="endpoint twin at .* cannot vouch"):
        load_gate([equal / "0_stable", endpoint], dirs / "stable", dirs / "twin", "float32", 0.3, 0.05)
    # the serve options: a gate needs a canary, and the profile's weights are what the records must have run
    with pytest.raises(AssayError, match="--golden gates a canary's promotion"):
        golden_gate_of(dirs / "stable", ServeOptions(golden=(equal,)), STANDARD)
    with pytest.raises(AssayError, match="--weights int8"):
        golden_gate_of(dirs / "stable", ServeOptions(golden=(equal,), canary=dirs / "twin"), FAST)
    assert golden_gate_of(dirs / "stable", ServeOptions(canary=dirs / "twin"), STANDARD) is None


def test_a_candidate_worse_on_the_golden_suite_is_rolled_back_at_start(deploy, babbler, dirs, tmp_path):
    gate = load_gate([golden_records(tmp_path, dirs / "stable", dirs / "babbler", worse_on_arith)],
                     dirs / "stable", dirs / "babbler", "float32", 0.3, 0.05)
    server, d, _ = deploy(babbler, record=tmp_path / "deployment.json", gate=gate, share=0.5)
    assert d.current == 1 and d.candidate is None and d.decision == "rollback"
    assert set(versions(server.url, range(12))) == {1}  # the candidate's sessions included
    status = httpx.get(f"{server.url}/v1/deployment", timeout=30).json()
    assert [e["event"] for e in status["history"]] == ["start", "rollback"]
    assert status["history"][-1]["reason"].startswith("golden suite golden: significantly worse on arith@4")
    assert status["golden"]["verdict"] == "fail" and status["promotion"] == "live feedback and the golden suite " \
                                                                            "golden (fail)"
    assert json.loads((tmp_path / "deployment.json").read_text())["history"][-1]["event"] == "rollback"


def test_an_equal_candidate_is_promoted_only_when_the_live_test_promotes(deploy, twin, dirs, tmp_path):
    gate = load_gate([golden_records(tmp_path, dirs / "stable", dirs / "twin", noisy)], dirs / "stable",
                     dirs / "twin", "float32", 0.5, 0.05)
    assert gate.verdict == "pass"
    server, d, _ = deploy(twin, gate=gate, share=0.5, margin=0.5, min_feedback=10)
    assert d.current == 1 and d.candidate == 2 and d.decision == "continue"  # the gate alone promotes nothing
    drive(server.url, d, limit=200)
    assert d.decision == "promote" and d.current == 2, d.status()
    assert [e["event"] for e in d.history] == ["start", "promote"] and d.history[-1]["interval"][0] > -0.5


def test_an_underpowered_suite_blocks_promotion(deploy, twin, dirs, tmp_path):
    gate = load_gate([golden_records(tmp_path, dirs / "stable", dirs / "twin", noisy, tasks=2)], dirs / "stable",
                     dirs / "twin", "float32", 0.5, 0.05)
    assert gate.verdict == "underpowered"
    server, d, _ = deploy(twin, gate=gate, share=0.5, margin=0.5, min_feedback=10)
    drive(server.url, d, limit=200, until=lambda: d.history[-1]["event"] == "promotion_blocked")
    blocked = d.history[-1]
    assert blocked["event"] == "promotion_blocked" and blocked["interval"][0] > -0.5  # the live test would promote
    assert blocked["reason"].startswith("golden suite golden underpowered: the suite's 4 tasks")
    assert d.current == 1 and d.candidate == 2 and d.decision == "continue"
    status = httpx.get(f"{server.url}/v1/deployment", timeout=30).json()
    assert status["golden"]["tasks_needed"] == gate.tasks_needed > 4


def test_assay_serve_refuses_a_golden_record_of_another_policy_before_loading(dirs, tmp_path):
    records = golden_records(tmp_path, dirs / "stable", dirs / "twin", same)
    out = CliRunner().invoke(app, ["serve", str(dirs / "stable"), "--canary", str(dirs / "babbler"), "--port", "0",
                                   "--golden", str(records)])
    assert isinstance(out.exception, AssayError), out.output
    assert str(out.exception).startswith("no --golden record evaluated the candidate policy")


@pytest.fixture
def answers_suite(serve, tmp_path):
    """A pinned jsonl suite of the stable policy's greedy answers (16 tasks, 2 greedy samples each: the policy
    passes every one, the babbler none), with a passing QA record in this test's home, as `assay eval` requires.
    The tiny policy answers 6 or 14 to most sums, so the gate's null test (another task's answer passes) rightly
    fails this data: the record is written by hand, vouching for it as a checked environment would be."""
    from assay.core.paths import envqa_store
    from assay.envs import env_hash, get_env
    from assay.envs.qa.gate import GATE_VERSION

    suite = verified_suite(tmp_path, serve().url, "all", samples=2,
                           limits={"max_turns": 1, "max_new_tokens": 16, "temperature": 0})
    store = envqa_store() / "jsonl@4"
    store.mkdir(parents=True)
    (store / "vouched.json").write_text(json.dumps({
        "hash": env_hash(get_env("jsonl@4", path=str(tmp_path / "answers.jsonl"))), "passed": True,
        "gate_version": GATE_VERSION}))
    return suite


def test_assay_serve_evaluates_a_golden_suite_and_rolls_a_worse_candidate_back_before_serving(dirs, answers_suite,
                                                                                              tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "assay.cli", "serve", str(dirs / "stable"), "--port", "0",
                             "--canary", str(dirs / "babbler"), "--share", "0.5", "--golden", str(answers_suite)],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    output = []
    try:
        url = served_url(proc, output, 300)
        status = httpx.get(f"{url}/v1/deployment", timeout=30).json()
        assert status["golden"]["verdict"] == "fail" and status["golden"]["rows"][-1]["stable"] == 1.0, status
        assert [e["event"] for e in status["history"]] == ["start", "rollback"] and status["candidate"] is None
        assert set(versions(url, range(8), str(dirs / "stable"))) == {1}  # the candidate's sessions included
    finally:
        proc.send_signal(signal.SIGINT)
        output.append(proc.communicate(timeout=60)[0])
    text = "".join(output)
    assert proc.returncode == 0, text
    assert text.count("golden suite verified: evaluating the") == 2, text
    records = [status["golden"]["stable_record"], status["golden"]["candidate_record"]]
    assert all(r.startswith(str(golden_dir() / "verified-")) and f"into {r}" in text for r in records)
    assert text.index("fails the golden suite verified") < text.index("serving ")  # the verdict came first


def test_an_equal_candidate_on_a_golden_suite_is_promoted_only_when_the_live_test_promotes(
        deploy, twin, dirs, answers_suite, tmp_path, caplog, monkeypatch):
    options = ServeOptions(golden=(answers_suite,), canary=dirs / "twin",
                           canary_config=CanaryConfig(share=0.5, margin=0.5, min_feedback=10))
    with caplog.at_level(logging.INFO, "assay.serve.golden"):
        gate = golden_gate_of(dirs / "stable", options, STANDARD)
    assert gate.verdict == "pass" and gate.rows[-1].stable == gate.rows[-1].candidate == 1.0, gate
    assert caplog.text.count("evaluating the") == 2
    # the records are `assay eval`'s: the command on the same suite and policy writes the same settings and results
    out = CliRunner().invoke(app, ["eval", str(answers_suite), "--policy", str(dirs / "stable"), "--out",
                                   str(tmp_path / "by-eval")])
    assert out.exit_code == 0, out.output
    served, by_eval = read_record(Path(gate.stable_record)), read_record(tmp_path / "by-eval")
    for key in ("policy", "settings", "environments"):
        assert served[key] == by_eval[key], key
    assert served["domains"]["jsonl@4"]["per_task"] == by_eval["domains"]["jsonl@4"]["per_task"]
    # a second start reuses both records: nothing is evaluated again
    monkeypatch.setattr("assay.eval.run.evaluate_plan", lambda *a, **k: pytest.fail("evaluated again"))
    hashed = []  # and each policy's weights are hashed once: a large model's take seconds
    monkeypatch.setattr("assay.serve.golden.policy_identity", lambda p: hashed.append(p) or policy_identity(p))
    caplog.clear()
    with caplog.at_level(logging.INFO, "assay.serve.golden"):
        assert golden_gate_of(dirs / "stable", options, STANDARD) == gate
    assert caplog.text.count("is reused (same suite sha256, settings and weights sha256)") == 2
    assert sorted(hashed) == [dirs / "stable", dirs / "twin"]
    server, d, _ = deploy(twin, gate=gate, share=0.5, margin=0.5, min_feedback=10)
    assert d.current == 1 and d.candidate == 2 and d.decision == "continue"  # the gate alone promotes nothing
    drive(server.url, d, limit=200)
    assert d.decision == "promote" and d.current == 2, d.status()


def test_a_missing_malformed_or_stale_golden_suite_is_one_line_before_any_model_loads(dirs, tmp_path, monkeypatch):
    monkeypatch.setattr("assay.core.modeling.load_model", lambda *a, **k: pytest.fail("a model loaded"))

    def refusal(*golden) -> str:
        out = CliRunner().invoke(app, ["serve", str(dirs / "stable"), "--canary", str(dirs / "twin"), "--port", "0",
                                       *(x for g in golden for x in ("--golden", str(g)))])
        assert isinstance(out.exception, AssayError), out.output
        return str(out.exception)

    assert refusal(tmp_path / "nope.yaml") == f"suite file {str(tmp_path / 'nope.yaml')!r} not found; pass a YAML " \
                                              "suite (see suites/ for examples)"
    (tmp_path / "bad.yaml").write_text("name: [")
    assert "bad.yaml: not valid YAML" in refusal(tmp_path / "bad.yaml")
    (tmp_path / "stale.yaml").write_text("name: stale\nentries:\n- {env: arith@4, tasks: 4, hash: '0123456789ab'}\n")
    assert "arith@4 changed since it was pinned (0123456789ab -> " in refusal(tmp_path / "stale.yaml")
    records = golden_records(tmp_path / "records", dirs / "stable", dirs / "twin", same)
    assert refusal(tmp_path / "stale.yaml", records).startswith("--golden takes one pinned suite file")
    # an environment with no passing QA record: serve has no override to offer, so it names only the check
    data = tmp_path / "unchecked.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2+2?", "answer": "4"}) + "\n")
    env = get_env("jsonl", path=str(data))
    (tmp_path / "unchecked.yaml").write_text(yaml.safe_dump({"name": "unchecked", "entries": [
        {"env": env_spec(env), "env_args": {"path": str(data)}, "tasks": 1, "levels": [1], "split": "all",
         "hash": env_hash(env)}]}))
    said = refusal(tmp_path / "unchecked.yaml")
    assert said.startswith(f"--golden {tmp_path / 'unchecked.yaml'}: environment {env_spec(env)} (hash ") and \
        said.endswith(f"gates promotion on checked environments only: check it with `assay env check {env_spec(env)} "
                      f"--env-arg path={data}`") and "--allow-unchecked" not in said, said


def test_a_second_deployment_waits_for_the_golden_evaluation_under_way(tmp_path, caplog):
    import threading
    import time

    from assay.serve.golden import _locked

    order = []

    def second() -> None:
        with _locked(tmp_path / "suite"):
            order.append("second")

    with caplog.at_level(logging.INFO, "assay.serve.golden"):
        with _locked(tmp_path / "suite"):
            waiting = threading.Thread(target=second)
            waiting.start()
            for _ in range(200):
                if "waiting for it" in caplog.text:
                    break
                time.sleep(0.05)
            order.append("first")
        waiting.join(10)
    assert "another process is evaluating into" in caplog.text and order == ["first", "second"]
