"""A tiny policy that has learnt to call a calculator tool (SFT on reference conversations), served on the
loopback by servers the tests start on ephemeral ports."""

import pytest
import torch
from serve_helpers import MODEL, SMALL_ENGINE, calc_task, reference

from assay.agent.render import sft_example
from assay.core.config import ModelConfig
from assay.core.modeling import build_model
from assay.core.tokenizer import render_messages, train_tokenizer
from assay.rollout.engine import EngineConfig
from assay.serve.canary import CanaryConfig, canary
from assay.serve.profile import STANDARD
from assay.serve.server import ServeOptions, build_state, start_server
from assay.serve.session_log import SessionLog
from assay.serve.sessions import attach_log
from assay.train.sft import sft_train

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tok():
    tasks = [calc_task(a, 7 * a % 50) for a in range(80)]
    return train_tokenizer([render_messages(t.prompt + reference(t), t.tools) for t in tasks], 360)


@pytest.fixture(scope="session")
def policy(tok):
    torch.manual_seed(0)
    model = build_model(ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                                    max_position=1024), tok)
    tasks = [calc_task(a, 7 * a % 50) for a in range(80)]
    sft_train(model, [sft_example(tok, t, reference(t)) for t in tasks], steps=60, batch_size=8, lr=5e-3,
              warmup=5, seed=0)
    return model.eval()


def _servers(model, tok):
    """start(engine=..., **options) -> a running server of `model` on 127.0.0.1:<ephemeral>; yields `start` and
    closes every server it started."""
    started = []

    def start(engine: EngineConfig = SMALL_ENGINE, **options):
        state = build_state(model, tok, MODEL, STANDARD, ServeOptions(**options), engine)
        started.append(start_server(state))
        return started[-1]

    yield start
    for s in started:
        s.close()


@pytest.fixture
def serve(policy, tok):
    """serve(**options) -> a running server on 127.0.0.1:<ephemeral>, closed after the test."""
    yield from _servers(policy, tok)


@pytest.fixture(scope="session")
def babbler(tok):
    """An untrained policy: greedy, it repeats itself and never ends a turn (a long request to abort)."""
    torch.manual_seed(0)
    return build_model(ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                                   max_position=1024), tok).eval()


@pytest.fixture
def serve_babbler(babbler, tok):
    yield from _servers(babbler, tok)


@pytest.fixture
def logged(policy, tok):
    """logged(url, **log options) -> (server, log): the policy served with a session log; both closed after."""
    opened = []

    def start(url: str, **kw):
        state = build_state(policy, tok, MODEL, STANDARD, ServeOptions(), SMALL_ENGINE)
        log = SessionLog(url, **kw)
        attach_log(state, log)
        opened.append((start_server(state), log))
        return opened[-1]

    yield start
    for server, log in opened:
        server.close()
        log.close()


@pytest.fixture
def deploy(policy, tok):
    """deploy(candidate_model, record=None, gate=None, **config) -> (server, deployment, candidate_state): the
    fixture's policy as version 1, the candidate as version 2 in canary; closed after the test."""
    opened = []

    def start(candidate, record=None, gate=None, **cfg):
        stable = build_state(policy, tok, MODEL, STANDARD, ServeOptions(), SMALL_ENGINE, policy_name="stable")
        cand = build_state(candidate, tok, MODEL, STANDARD, ServeOptions(), SMALL_ENGINE, version=2,
                           policy_name="candidate")
        d = canary(stable, cand, CanaryConfig(**cfg), record, gate)
        opened.append((start_server(stable), cand))
        return opened[-1][0], d, cand

    yield start
    for server, cand in opened:
        server.close()
        cand.batcher.stop()
