"""Verifier processes (`rollout.verifier_processes`): real codegen verifications in sandboxes give what the
rollout's own verification gives; a verifier that hangs is killed at its timeout and its pool goes on; one
that dies mid-request is replaced and the request issued again; only episodes whose verdict reads nothing
but the task and the messages are sent there."""

import os
import random
import time

import pytest

from assay.core.errors import AssayError
from assay.core.types import Message, Reward, Task
from assay.envs.episode import close_episode
from assay.envs.registry import generate_task, get_env
from assay.envs.verifiers import (
    VerifiedElsewhere,
    VerifierProcesses,
    acting_episode,
    shared_verifiers,
    verifies_anywhere,
    verify_fresh,
)


class _ScriptedEnv:
    """A tool-less environment whose verification does what the task's payload asks (picklable, so a
    spawned verifier process can hold it)."""

    name, version, category, difficulties, tools = "scripted", "1", "test", (1,), ()

    def start(self, task, sandbox):
        return self

    def verify(self, final):
        action = final[-1].content
        if action == "hang":
            time.sleep(600)
        if action == "die-once":
            marker = final[0].content  # a path: the first process to see it dies, the next one answers
            if not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)
        if action == "die":
            os._exit(1)
        if action == "raise":
            raise ValueError("a verifier bug")
        return Reward(1.0, True, details={"pid": os.getpid()})


def _task() -> Task:
    return Task(env="scripted@1", task_id="t", domain="s", difficulty=1, prompt=[], tools=[], payload={})


@pytest.fixture
def scripted():
    pool = VerifierProcesses({"s": _ScriptedEnv()}, 1)
    yield pool
    pool.close()


def test_codegen_verdicts_in_verifier_processes_are_the_rollouts_own(isolated):
    """A reference solution, a wrong one and an empty answer, on tasks of every level: the processes'
    rewards equal a local verification's, field for field."""
    env = get_env("codegen")
    envs = {"code": env}
    rng = random.Random(3)
    cases = []
    for level in env.difficulties:
        task = generate_task(env, rng, level)
        task.domain = "code"
        ref = env.reference_solution(task)
        cases += [(task, task.prompt + ref), (task, task.prompt + [Message("assistant", "```python\nprint(0)\n```")]),
                  (task, task.prompt + [Message("assistant", "")])]
    pool = VerifierProcesses(envs, 2)
    try:
        remote = [pool.verify(task, messages, timeout_s=60) for task, messages in cases]
    finally:
        pool.close()
    local = [verify_fresh(envs, task, messages) for task, messages in cases]
    assert [(r.score, r.passed, r.status, r.details) for r in remote] == \
           [(r.score, r.passed, r.status, r.details) for r in local]
    assert any(r.passed for r in remote) and not all(r.passed for r in remote)


def test_a_hung_verifier_is_killed_at_its_timeout_and_replaced(scripted):
    first = scripted.all[0].process
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="killed"):
        scripted.verify(_task(), [Message("user", "hang")], timeout_s=1.0)
    assert time.perf_counter() - t0 < 60  # not the 600 s it would sleep
    assert not first.is_alive() and scripted.replaced == 1
    assert scripted.verify(_task(), [Message("user", "ok")], timeout_s=30).passed  # the replacement serves


def test_a_verifier_that_dies_is_replaced_and_its_request_issued_again(scripted, tmp_path):
    first = scripted.all[0].process.pid
    reward = scripted.verify(_task(), [Message("user", str(tmp_path / "died")), Message("user", "die-once")],
                             timeout_s=60)
    assert reward.passed and reward.details["pid"] != first and scripted.replaced == 1


def test_a_verifier_that_raises_is_named_and_the_process_kept(scripted):
    pid = scripted.all[0].process.pid
    with pytest.raises(AssayError, match="in a verifier process: ValueError: a verifier bug"):
        scripted.verify(_task(), [Message("user", "raise")], timeout_s=30)
    assert scripted.verify(_task(), [Message("user", "ok")], timeout_s=30).details["pid"] == pid


def test_only_episodes_whose_verdict_reads_the_task_and_messages_go_to_the_processes():
    assert verifies_anywhere(get_env("codegen")) and verifies_anywhere(get_env("arith"))
    assert not verifies_anywhere(get_env("toolcalc")) and not verifies_anywhere(get_env("terminal"))
    env = get_env("toolcalc")
    env.stateless_verify = True  # an environment may declare it
    assert verifies_anywhere(env)
    assert shared_verifiers({"agent": get_env("toolcalc")}, 2) is None  # nothing to send: no processes
    task = generate_task(get_env("toolcalc"), random.Random(0), 1)
    acting = acting_episode(get_env("toolcalc"), task, pool=object())  # a tool's state stays where it acts
    assert type(acting).__name__ == "ToolcalcEpisode"
    close_episode(acting)
    code = get_env("codegen")
    assert isinstance(acting_episode(code, generate_task(code, random.Random(0), 1), pool=object()), VerifiedElsewhere)
    assert shared_verifiers({"math": get_env("arith")}, 0) is None


def test_a_pool_of_no_processes_is_refused():
    with pytest.raises(AssayError, match="at least one process, got 0"):
        VerifierProcesses({"s": _ScriptedEnv()}, 0)


def test_a_request_that_kills_every_verifier_is_its_own_error_and_the_pool_stays_whole(scripted, tmp_path):
    with pytest.raises(AssayError, match="two verifier processes died verifying t"):
        scripted.verify(_task(), [Message("user", "die")], timeout_s=60)
    assert scripted.replaced == 2 and len(scripted.all) == 1
    assert scripted.verify(_task(), [Message("user", "ok")], timeout_s=30).passed
