"""The evaluation's long-horizon dimensions (peak context, compactions, memory calls, planning turns, retries,
degraded and fallback calls, milestone hit rates): the training step's definitions, in the record, and shown only
where they apply: for `repo` episodes, not for arith's."""

from __future__ import annotations

import random

import pytest
from repo_episodes import run_episodes
from rich.console import Console

from assay.bench.scripted import Replayed, ScriptedPolicy
from assay.core.types import Message
from assay.envs.builtin.arith import ArithEnv
from assay.envs.episode import start_episode
from assay.eval.evaluate import summarize_domains
from assay.eval.horizon import NA, horizon_columns
from assay.eval.record import metrics
from assay.eval.tables import horizon_table
from assay.mixer.stats import summarize as step_stats
from assay.rollout.base import SamplingParams


@pytest.fixture(scope="module")
def episodes():
    return run_episodes()


@pytest.fixture(scope="module")
def arith(episodes):
    """Real arith episodes: a scripted answer to each of four tasks, through the real loop and verifier."""
    from assay.agent.loop import run_episodes as loop

    env = ArithEnv()
    tasks = [env.generate(random.Random(i), 1) for i in range(4)]
    for t in tasks:
        t.domain = "arith"
    tok = episodes.tokenizer
    policy = ScriptedPolicy(tok, [Replayed([Message("assistant", "Answer: 3")]) for _ in tasks])
    trajs = loop(policy, [(t, start_episode(env, t)) for t in tasks], tok, SamplingParams(max_tokens=16), max_turns=1,
                 max_context=512)
    return tasks, trajs


def test_repo_entries_get_the_training_steps_numbers(episodes):
    trajs = [episodes.long, episodes.planned]
    r = summarize_domains([episodes.task], trajs, ks=(1,))["repo"]
    step = step_stats(trajs, difficulty=1, ratio=1.0)  # what training logs per step: the same definitions
    assert r.tools and (r.peak_context, r.compactions, r.memory_calls) == (step.peak_context, step.compactions,
                                                                          step.memory_calls)
    assert r.peak_context_max == max(t.peak_context for t in trajs) and r.compactions == episodes.long.compactions / 2
    assert r.plan_turns == episodes.planned.plan_turns / 2 and r.fallback_calls == 0
    assert r.milestones == step.milestones == {"reproduced": 0.5, "visible_pass": 1.0, "submitted": 1.0}
    m = metrics(r)
    assert (m["peak_context_mean"], m["compactions"], m["milestones"]) == (r.peak_context, r.compactions, r.milestones)


def test_the_columns_apply_to_repo_and_not_to_arith(episodes, arith):
    tasks, arith_trajs = arith
    assert len(arith_trajs) == 4 and all(t.status == "ok" for t in arith_trajs)
    only_arith = summarize_domains(tasks, arith_trajs, ks=(1,))
    assert not only_arith["arith"].tools and only_arith["arith"].peak_context is None
    assert horizon_columns({n: metrics(r) for n, r in only_arith.items()}) == ([], {"arith": []})
    assert horizon_table(only_arith) is None  # the terminal prints no such table for arith

    both = summarize_domains([*tasks, episodes.task], [*arith_trajs, episodes.long, episodes.planned], ks=(1,),
                             overall=True)
    head, rows = horizon_columns({n: metrics(r) for n, r in both.items()})
    assert head == ["peak context mean / max (tokens)", "compactions / episode", "memory calls / episode",
                    "planning turns / episode", "retries (share answered well-formed)", "degraded calls (fallback)",
                    "milestone reproduced (hit rate)", "milestone visible_pass (hit rate)",
                    "milestone submitted (hit rate)"]
    assert rows["arith"] == [NA] * len(head)
    r = both["repo"]
    assert rows["repo"][:2] == [f"{r.peak_context:.0f} / {r.peak_context_max}", f"{r.compactions:.2f}"]
    assert rows["repo"][-3:] == ["0.50", "1.00", "1.00"] and rows["overall"][-3:] == rows["repo"][-3:]

    console = Console(width=250, record=True)
    table = horizon_table(both)
    assert table is not None
    console.print(table)
    out = console.export_text()
    assert "milestone visible_pass" in out and "peak context" in out and "retries" not in out  # in the other table
