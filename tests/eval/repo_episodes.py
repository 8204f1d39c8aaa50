"""Real `repo` episodes for the page tests: scripted policies (bench/scripted.py, bench/context.py) through the real
agent loop, sandboxes and verifier, on one level-1 task. `long` touches every kind of turn the page shows: an error
result, a tool output holding markup, a long output, a write, a patch, a unified diff in a tool output, compactions;
`planned` runs in plan_execute mode."""

from __future__ import annotations

import random
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from assay.bench.context import RepoScript
from assay.bench.scripted import Failure, Limits, Replayed, Setting, call, run_setting
from assay.core.config import AgentConfig
from assay.core.tokenizer import render_messages, train_tokenizer
from assay.core.types import Task, Trajectory
from assay.envs.base import hooks
from assay.envs.builtin.repo import RepoEnv
from assay.envs.milestones import mark_milestones

MARKUP = "<script>document.body.dataset.pwned='1'</script>"
LONG_OUTPUT_LINES = 120
LIMITS = Limits(max_context=2200, max_tokens=256)  # room for the task; the long outputs make it compact


@dataclass
class Episodes:
    env: RepoEnv
    task: Task
    long: Trajectory
    planned: Trajectory
    tokenizer: PreTrainedTokenizerBase


def run_episodes(seed: int = 3) -> Episodes:
    env = RepoEnv()
    task = env.generate(random.Random(seed), 1)
    task.domain = "repo"
    tok = train_tokenizer([render_messages(t.prompt + env.reference_solution(t), t.tools)
                           for t in (task, env.generate(random.Random(seed + 1), 2))], 600)
    ref = [m for m in env.reference_solution(task) if m.role == "assistant"]  # run_tests, read, patch, run_tests, submit
    path = next(m.tool_calls[0].arguments["path"] for m in ref if m.tool_calls[0].name == "patch")
    turns = [ref[0], call("read", path="missing.py"), call("bash", command=f"echo \"{MARKUP}\""),
             call("bash", command=f"seq 1 {LONG_OUTPUT_LINES}"), call("write", path="NOTES.md", content="# notes\nthe bug\n"),
             call("bash", command=f"cp {path} orig.py"), *ref[1:3],
             call("bash", command=f"diff -u orig.py {path}; rm orig.py"), *ref[3:]]
    long = Failure("long", [Setting("compaction", AgentConfig(compaction="elide_observations", keep_last=1))],
                   lambda e, t, s: Replayed(turns))
    plan = Failure("plan", [Setting("plan_execute", AgentConfig(mode="plan_execute"))],
                   lambda e, t, s: RepoScript(t, None, survey=False))
    [a] = run_setting(env, long, long.settings[0], [task], tok, LIMITS)
    [b] = run_setting(env, plan, plan.settings[0], [task], tok, Limits())
    mark_milestones([a, b], {"repo": hooks(env).milestones})
    return Episodes(env, task, a, b, tok)
