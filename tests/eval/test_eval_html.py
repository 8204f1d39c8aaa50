"""The evaluation page: written from a record, and rendered by headless Chromium with its plots decoded; a record of
real `repo` episodes with its long-horizon table and its trajectories folded turn by turn."""

import html
import re
import shutil
import subprocess

import pytest
from repo_episodes import MARKUP, run_episodes

from assay.core.config import DifficultyRange, DomainConfig
from assay.envs import get_env
from assay.eval.evaluate import eval_tasks, evaluate_tasks, summarize_domains
from assay.eval.html import write_eval_html
from assay.eval.record import write_record
from assay.pipeline.policy import build_policy, domain_envs
from assay.pipeline.quickstart import default_config
from assay.rollout.engine import Engine

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory):
    cfg = default_config(["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
                          "model.intermediate_size=64", "model.tokenizer_corpus=50"])
    model, tok = build_policy(cfg, domain_envs(cfg))
    envs = {"arith": get_env("arith"), "toolcalc": get_env("toolcalc")}
    domains = {name: DomainConfig(name=name, env=name, max_new_tokens=8, max_turns=2,
                                  difficulty=DifficultyRange(min=1, max=4, start=1)) for name in envs}
    tasks = [t for name, env in envs.items() for t in eval_tasks(env, name, 4, 0, [1, 2, 3, 4])]
    results = evaluate_tasks(Engine(model, tok), tok, envs, domains, tasks, n=4, seed=0, ks=(1, 2, 4), overall=True)
    out = tmp_path_factory.mktemp("record")
    write_record(out, results, {"kind": "checkpoint", "path": "tiny", "weights_sha256": "ab" * 32}, envs,
                 {"n": 4, "held_out": None}, (1.0, 2.0))
    return out


@pytest.fixture(scope="module")
def repo_record(tmp_path_factory):
    episodes = run_episodes()
    trajs = [episodes.long, episodes.planned]
    results = summarize_domains([episodes.task], trajs, ks=(1, 2))
    out = tmp_path_factory.mktemp("repo_record")
    write_record(out, results, {"kind": "checkpoint", "path": "scripted", "weights_sha256": "cd" * 32},
                 {"repo": episodes.env}, {"n": 2, "held_out": None})
    return out, trajs


def dump_dom(page, profile) -> str:
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--dump-dom",
                          page.as_uri()], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_the_page_holds_the_table_curves_and_trajectories(record_dir):
    page = write_eval_html(record_dir).read_text()
    assert '<table id="metrics">' in page and page.count("data:image/png;base64,") == 3
    assert page.count("<details class=traj>") == 2 * 4 * 4  # every trajectory, browsable
    assert "arith" in page and "toolcalc" in page and "overall" in page


@pytest.mark.skipif(CHROMIUM is None,  # "missing tool": CI fails it (tests/conftest.py)
                    reason="missing tool: Debian's chromium is not installed (.ci/run installs it)")
def test_chromium_renders_the_plots_and_the_table(record_dir, tmp_path):
    dom = dump_dom(write_eval_html(record_dir), tmp_path / "profile")
    body = re.search(r"<body[^>]*>", dom)
    assert body and 'data-plots-rendered="3"' in body.group(0)  # all three PNGs decoded with a size
    assert dom.count("<tr>") >= 4  # header + arith + toolcalc + overall


@pytest.mark.skipif(CHROMIUM is None,  # "missing tool": CI fails it (tests/conftest.py)
                    reason="missing tool: Debian's chromium is not installed (.ci/run installs it)")
def test_chromium_renders_a_long_repo_trajectory_turn_by_turn(repo_record, tmp_path):
    record, trajs = repo_record
    dom = dump_dom(write_eval_html(record), tmp_path / "profile")
    body = re.search(r"<body[^>]*>", dom)
    assert body and 'data-plots-rendered="3"' in body.group(0) and "pwned" not in body.group(0)  # no markup ran
    assert html.escape(MARKUP, quote=False) in dom  # the tool output's <script> is text in the document
    turns = re.findall(r'<details class="turn[^"]*" data-turn="(\d+)"( open="")?>', dom)
    assert len(turns) == sum(t.turns for t in trajs)  # one fold per turn of every trajectory
    assert [int(k) for k, opened in turns if opened] == [1, trajs[0].turns, 1, trajs[1].turns]
    assert dom.count("<button") == 2 * len(trajs)  # expand all, collapse all
    horizon = re.search(r'<table id="horizon">(.*?)</table>', dom, re.S)
    assert horizon and "milestone visible_pass" in horizon.group(1) and "compactions" in horizon.group(1)
