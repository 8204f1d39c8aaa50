"""Canary deployments: the sequential test's error rates and speed (simulated), and real servers: a broken
candidate (an untrained policy, whose answers the client's check fails) rolled back automatically, a healthy
one (the same weights) promoted, sticky sessions, feedback refusals, a manual rollback as a pointer flip, and
`assay serve --canary` with a golden-suite gate."""

import copy
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_helpers import drive, golden_records, served_url, versions

from assay.core.errors import AssayError
from assay.serve.canary import CanaryConfig, bucket, decide, radius


def simulate(p_stable: float, p_candidate: float, cfg: CanaryConfig, horizon: int, rng: random.Random,
             every: int = 1) -> tuple[str, int]:
    """Requests routed at cfg.share, each with a verdict, the test read after every `every` verdicts;
    (decision, requests served when it was taken)."""
    s, c = [0, 0], [0, 0]
    for n in range(1, horizon + 1):
        if rng.random() < cfg.share:
            c[0] += rng.random() < p_candidate
            c[1] += 1
        else:
            s[0] += rng.random() < p_stable
            s[1] += 1
        if n % every == 0 and (d := decide((s[0], s[1]), (c[0], c[1]), cfg)) != "continue":
            return d, n
    return "continue", horizon


def test_the_confidence_sequence_narrows_and_covers():
    assert radius(0, 0.025, 1.0) == 1.0
    widths = [radius(n, 0.025, 1.0) for n in (10, 100, 1000, 10000)]
    assert widths == sorted(widths, reverse=True) and widths[-1] < 0.03
    rng = random.Random(1)
    misses = 0
    for _ in range(200):  # a rate of 0.7 leaves the sequence (at any of 2000 looks) in far fewer than 2.5% of runs
        k = 0
        for n in range(1, 2001):
            k += rng.random() < 0.7
            if abs(k / n - 0.7) > radius(n, 0.025, 1.0):
                misses += 1
                break
    assert misses <= 5


def test_broken_candidates_are_rolled_back_fast_and_healthy_ones_are_not():
    """The numbers the README states: share 0.1, alpha 0.05, margin 0.1, stable success rate 0.9."""
    cfg = CanaryConfig(share=0.1, alpha=0.05, margin=0.1)
    rng = random.Random(0)
    broken = [simulate(0.9, 0.0, cfg, 5000, rng) for _ in range(100)]
    assert all(d == "rollback" for d, _ in broken)
    assert sorted(n for _, n in broken)[94] <= 150  # 95% of always-failing candidates go within 150 requests
    worse = [simulate(0.9, 0.6, cfg, 5000, rng, every=5) for _ in range(60)]
    assert all(d == "rollback" for d, _ in worse) and sorted(n for _, n in worse)[56] <= 1200
    healthy = [simulate(0.9, 0.9, cfg, 15000, rng, every=10) for _ in range(20)]
    assert sum(d == "rollback" for d, _ in healthy) <= 1  # alpha bounds it at 5%; the mixture is conservative
    assert sum(d == "promote" for d, _ in healthy) >= 18
    assert sorted(n for _, n in healthy)[10] <= 8000  # median requests to promotion


def test_a_bad_canary_configuration_is_named():
    with pytest.raises(AssayError, match="--share 1.5"):
        CanaryConfig(share=1.5)
    with pytest.raises(AssayError, match="--alpha"):
        CanaryConfig(alpha=0)


def test_a_broken_candidate_is_rolled_back_automatically(deploy, babbler, tmp_path):
    server, d, _ = deploy(babbler, record=tmp_path / "deployment.json", share=0.5, margin=0.3, min_feedback=10)
    served = drive(server.url, d, limit=200)
    stable_rate = sum(ok for v, ok in served if v == 1) / max(1, sum(v == 1 for v, _ in served))
    assert stable_rate >= 0.8 and not any(ok for v, ok in served if v == 2)
    assert d.decision == "rollback" and d.current == 1 and d.candidate is None
    rollback = d.history[-1]
    assert rollback["event"] == "rollback" and rollback["requests"] <= 64, d.history  # within 64 requests
    assert rollback["interval"][1] < 0
    # the pointer is flipped: every session, the candidate's included, is answered by version 1 now
    assert set(versions(server.url, range(100, 116))) == {1}
    record = json.loads((tmp_path / "deployment.json").read_text())
    assert record["current"] == 1 and [v["hash"] for v in record["versions"]] == [s.version.hash for s in
                                                                                  d.states.values()]
    assert record["versions"][0]["hash"] != record["versions"][1]["hash"]
    assert record["versions"][1]["verdicts"] >= 1 and record["versions"][1]["mean_latency_s"] > 0


def test_a_healthy_candidate_is_promoted_and_a_rollback_is_a_pointer_flip(deploy, policy, tmp_path):
    server, d, cand = deploy(copy.deepcopy(policy), share=0.5, margin=0.5, min_feedback=10)
    assert cand.version.hash == d.states[1].version.hash  # the same weights: a healthy candidate
    served = drive(server.url, d, limit=200)
    assert d.decision == "promote" and d.current == 2, d.status()
    promoted = d.history[-1]
    assert promoted["event"] == "promote" and promoted["requests"] <= 200 and promoted["interval"][0] > -0.5
    assert versions(server.url, range(300, 306)) == [2] * 6
    with httpx.Client(base_url=server.url, timeout=60) as c:
        flipped = c.post("/v1/deployment/rollback").json()
        assert flipped["current"] == 1 and flipped["history"][-1]["event"] == "flip"
        status = c.get("/v1/deployment").json()
        assert [v["number"] for v in status["versions"]] == [1, 2]
        assert status["promotion"] == "live feedback only" and status["golden"] is None  # no --golden
        assert status["versions"][1]["requests"] == sum(v == 2 for v, _ in served) + 6
    assert versions(server.url, range(300, 306)) == [1] * 6


def test_sessions_are_sticky_and_bad_feedback_is_refused(deploy, policy):
    server, d, _ = deploy(copy.deepcopy(policy), share=0.3)
    keys = [k for k in range(40) if bucket(f"user-{k}") < 0.3][:3] + [k for k in range(40)
                                                                      if bucket(f"user-{k}") >= 0.3][:3]
    first = versions(server.url, keys)
    assert first == [2, 2, 2, 1, 1, 1] and versions(server.url, keys) == first
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.post("/v1/feedback", json={"id": "chatcmpl-nope", "success": True}).status_code == 404
        bad = c.post("/v1/feedback", json={"id": "x", "success": "yes"})
        assert bad.status_code == 400 and "success" in bad.json()["error"]["message"]
        assert c.post("/v1/feedback", content=b"{").status_code == 400


def test_assay_serve_with_a_canary_keeps_both_versions_with_their_hashes(policy, babbler, tok, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from assay.core.modeling import save_model
    from assay.serve.session_log import read_sessions
    from assay.serve.sessions import weights_hash

    save_model(policy, tok, tmp_path / "stable")
    save_model(babbler, tok, tmp_path / "candidate")
    # a golden suite too small to tell them apart: it blocks promotion, and both versions serve
    golden = golden_records(tmp_path, tmp_path / "stable", tmp_path / "candidate", lambda who, env, i: [True], tasks=1)
    proc = subprocess.Popen([sys.executable, "-m", "assay.cli", "serve", str(tmp_path / "stable"), "--port", "0",
                             "--canary", str(tmp_path / "candidate"), "--share", "0.5", "--deployment",
                             str(tmp_path / "deployment.json"), "--log", str(tmp_path / "log"), "--golden",
                             str(golden)],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    output = []
    try:
        url = served_url(proc, output, 240)
        answered = versions(url, range(12), str(tmp_path / "stable"))
        assert set(answered) == {1, 2}
        status = httpx.get(f"{url}/v1/deployment", timeout=30).json()
        assert [(v["number"], v["hash"]) for v in status["versions"]] == [(1, weights_hash(policy)),
                                                                         (2, weights_hash(babbler))]
        assert status["current"] == 1 and status["candidate"] == 2 and status["config"]["share"] == 0.5
        assert status["golden"]["verdict"] == "underpowered" and status["golden"]["tasks"] == 2
    finally:
        proc.send_signal(signal.SIGINT)
        output.append(proc.communicate(timeout=60)[0])
    assert proc.returncode == 0, "".join(output)
    assert "canary: version 2" in "".join(output) and "may not be promoted: the golden suite" in "".join(output)
    assert json.loads((tmp_path / "deployment.json").read_text())["versions"][1]["hash"] == weights_hash(babbler)
    assert [t.policy_version for t in read_sessions(str(tmp_path / "log"))] == answered


def test_a_slower_candidate_is_rolled_back_even_when_its_answers_are_right(deploy, policy, monkeypatch):
    """The same weights, so the verdicts cannot tell them apart; the candidate's engine is slowed, and the latency
    guard rolls it back."""
    import time

    server, d, cand = deploy(copy.deepcopy(policy), share=0.5, margin=0.1, min_feedback=10, latency_slo_s=1.0)
    engine = cand.batcher.engine
    step = engine.step

    def slow_step():  # 0.15 s a token: the candidate's answers (7 tokens or more) miss 1 s
        time.sleep(0.15)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    served = drive(server.url, d, limit=160)
    assert d.decision == "rollback" and d.current == 1 and d.candidate is None, d.status()
    rollback = d.history[-1]
    assert rollback["event"] == "rollback" and rollback["reason"].startswith("latency: ") and rollback["interval"][1] >= 0
    assert sum(v == 2 for v, _ in served) >= 10 and rollback["requests"] <= 120  # fast, on latency alone
    status = d.status()["versions"]
    assert status[0]["canary_within_latency"] > 0.8 and status[1]["canary_within_latency"] == 0.0

    with pytest.raises(AssayError, match="--latency-slo"):
        CanaryConfig(latency_slo_s=0)
    with pytest.raises(AssayError, match="--cost-budget"):
        CanaryConfig(cost_budget_tokens=0)


def test_the_guards_hold_a_promotion_until_latency_is_shown_within_the_margin():
    """Simulated: equal success, equal latency; with a latency objective the promotion waits for its evidence
    too, and a candidate outside the objective twice as often as the stable one is rolled back."""
    from assay.serve.canary import Deployment, VersionStats

    class State:  # what a Deployment reads of a served version
        def __init__(self, n):
            self.version = type("V", (), {"number": n})()
            self.observers, self.route = [], None

    def run(p_within_candidate: float, seed: int) -> tuple[str, int]:
        rng = random.Random(seed)
        cfg = CanaryConfig(share=0.5, margin=0.1, min_feedback=10, latency_slo_s=1.0)
        d = Deployment({1: State(1), 2: State(2)}, 1, 2, cfg, stats={1: VersionStats(), 2: VersionStats()})
        for n in range(1, 20001):
            number = 2 if rng.random() < 0.5 else 1
            st = d.stats[number]
            st.canary_requests += 1
            st.canary_within["latency"] = st.canary_within.get("latency", 0) + \
                (rng.random() < (p_within_candidate if number == 2 else 0.9))
            st.canary_verdicts += 1
            st.canary_successes += rng.random() < 0.9
            d._test()
            if d.decision != "continue":
                return d.decision, n
        return d.decision, n

    healthy = [run(0.9, s) for s in range(5)]
    assert all(dec == "promote" for dec, _ in healthy)
    slow = [run(0.45, s) for s in range(5)]
    assert all(dec == "rollback" for dec, _ in slow) and max(n for _, n in slow) <= 400


def verified_suite(tmp_path, url: str):
    """A jsonl suite whose answers are what the served policy answers greedily: its verifier (exact match) passes
    the policy and fails anything else."""
    import httpx
    import yaml

    from assay.envs import env_hash, get_env

    prompts = [f"What is {a}+{7 * a % 50}?" for a in range(0, 80, 5)]
    with httpx.Client(base_url=url, timeout=60) as c:
        answers = [c.post("/v1/chat/completions", json={"model": "tiny-calc", "temperature": 0, "max_tokens": 16,
                                                        "messages": [{"role": "user", "content": p}]}
                          ).json()["choices"][0]["message"]["content"].removeprefix("Answer: ") for p in prompts]
    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in zip(prompts, answers, strict=True)))
    suite = tmp_path / "verified.yaml"
    suite.write_text(yaml.safe_dump({"name": "verified", "entries": [
        {"env": "jsonl@4", "env_args": {"path": str(data)}, "tasks": len(prompts), "levels": [1],
         "hash": env_hash(get_env("jsonl", path=str(data)))}]}))
    return suite


def drive_tasks(url: str, d, tasks, limit: int) -> list[int]:
    """Requests naming the suite's tasks, from distinct sessions, no client feedback; the version of each."""
    def one(k: int) -> int:
        task = tasks[k % len(tasks)]
        with httpx.Client(base_url=url, timeout=60) as c:
            r = c.post("/v1/chat/completions", headers={"X-Session-Id": f"user-{k}"}, json={
                "model": "tiny-calc", "temperature": 0, "max_tokens": 16, "metadata": {"assay_task": task.task_id},
                "messages": [{"role": m.role, "content": m.content} for m in task.prompt]})
            assert r.status_code == 200, r.text
            return int(r.headers["x-assay-version"])

    out, k = [], 0
    while d.decision == "continue" and k < limit:
        with ThreadPoolExecutor(4) as pool:
            out += pool.map(one, range(k, k + 8))
        k += 8
        time.sleep(0.2)  # the verdicts arrive on the verifier's threads
    return out


def test_requests_naming_suite_tasks_are_graded_by_their_verifier(deploy, serve, policy, babbler, tmp_path):
    from assay.serve.verify import attach_verifier, suite_verifier

    suite = verified_suite(tmp_path, serve().url)
    broken, d, _ = deploy(babbler, share=0.5, margin=0.3, min_feedback=10)
    verifier = suite_verifier(suite)
    attach_verifier(verifier, d)
    tasks = [t for t, _ in verifier.tasks.values()]
    try:
        drive_tasks(broken.url, d, tasks, limit=200)
        assert d.decision == "rollback" and d.history[-1]["interval"][1] < 0, d.status()
        stable = d.status()["versions"][0]
        assert stable["verdicts"] >= 5 and stable["success_rate"] == 1.0  # the stable policy's own answers
        with httpx.Client(base_url=broken.url, timeout=60) as c:
            ask = {"model": "tiny-calc", "messages": [{"role": "user", "content": "What is 1+1?"}]}
            unknown = c.post("/v1/chat/completions", json={**ask, "metadata": {"assay_task": "nope"}})
            assert unknown.status_code == 400 and "no single-turn task of the suite verified" in unknown.text
            other = c.post("/v1/chat/completions", json={**ask, "metadata": {"assay_task": tasks[0].task_id}})
            assert other.status_code == 400 and "not task" in other.text
    finally:
        verifier.close()
    healthy, d2, _ = deploy(copy.deepcopy(policy), share=0.5, margin=0.3, min_feedback=10)
    verifier = suite_verifier(suite)
    attach_verifier(verifier, d2)
    try:
        drive_tasks(healthy.url, d2, tasks, limit=400)
        assert d2.decision == "promote" and d2.current == 2, d2.status()
        assert verifier.verified >= 20 and verifier.failures == 0
    finally:
        verifier.close()
