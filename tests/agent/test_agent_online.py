"""Episodes that advance on their own (the engine's online API) give the lockstep loop's trajectories."""

import random

import pytest
import torch

from assay.agent.groups import collect
from assay.agent.render import sft_example
from assay.core.config import DomainConfig, ModelConfig
from assay.core.errors import AssayError
from assay.core.modeling import build_model
from assay.core.tokenizer import train_tokenizer
from assay.envs import get_env
from assay.envs.split import draw_task
from assay.pipeline.policy import reference_corpus
from assay.rollout.engine import Engine
from assay.rollout.hf import HFBackend
from assay.train.sft import sft_train


@pytest.fixture(scope="module")
def setup():
    """A tiny policy SFT'd briefly on arith and toolcalc: it calls the lookup tool, often wrongly, so
    episodes take one turn or several and end for different reasons."""
    envs = {"arith": get_env("arith"), "toolcalc": get_env("toolcalc")}
    tok = train_tokenizer(reference_corpus(envs, 200, seed=0), 400)
    torch.manual_seed(0)
    model = build_model(ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                                    max_position=512), tok)
    rng = random.Random(0)
    tasks = [draw_task(env, rng, 1 + i % 2, "train") for env in envs.values() for i in range(150)]
    examples = [sft_example(tok, t, envs[t.env.split("@")[0]].reference_solution(t)) for t in tasks]
    sft_train(model, examples, steps=150, batch_size=16, lr=3e-3, warmup=10, seed=0)
    domains = {"arith": DomainConfig(name="arith", env="arith", max_new_tokens=24),
               "toolcalc": DomainConfig(name="toolcalc", env="toolcalc", max_new_tokens=32, max_turns=4)}
    eval_tasks = []
    for name, env in envs.items():
        for i in range(6):
            task = draw_task(env, random.Random(f"online/{name}/{i}"), 1 + i % 3, "eval")
            task.domain = name
            eval_tasks.append(task)
    return tok, model.eval(), envs, domains, eval_tasks


def test_online_episodes_equal_the_lockstep_loop(setup):
    tok, model, envs, domains, tasks = setup
    kw = dict(samples=4, temperature=1.0, seed=11)
    lockstep = collect(Engine(model, tok), tok, envs, domains, tasks, **kw)
    online = collect(Engine(model, tok), tok, envs, domains, tasks, **kw, online=True)
    assert len(online) == len(lockstep) == 48
    for a, b in zip(lockstep, online, strict=True):
        assert (a.group_id, a.token_ids, a.loss_mask) == (b.group_id, b.token_ids, b.loss_mask)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert (a.reward, a.turns, a.tool_errors, a.finish_reason, a.status) == \
               (b.reward, b.turns, b.tool_errors, b.finish_reason, b.status)
    toolcalc = [t for t in lockstep if t.task.domain == "toolcalc"]
    assert any(t.turns >= 2 for t in toolcalc)  # the comparison covered multi-turn episodes
    assert len({t.turns for t in toolcalc}) >= 2  # which finished at different turns


def test_online_needs_a_backend_that_admits_requests(setup):
    tok, model, envs, domains, tasks = setup
    with pytest.raises(AssayError, match="admits requests while it runs"):
        collect(HFBackend(model, tok), tok, envs, domains, tasks[:1], samples=1, temperature=1.0, online=True)
