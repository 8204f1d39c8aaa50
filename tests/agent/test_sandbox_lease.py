"""An environment that declares `sandbox_limits` gets a warm pooled sandbox per episode through
`start(task, sandbox)`, given back restored when the episode closes; one that does not gets None."""

import random
from dataclasses import dataclass

import pytest

from assay.core.config import DomainConfig, ModelConfig
from assay.core.modeling import build_model
from assay.core.types import Message, Reward, Task, ToolCall
from assay.envs import task_id
from assay.envs.episode import start_episode
from assay.sandbox import Limits
from assay.sandbox.pool import LeasedSandbox, shared_pool


@dataclass
class _Episode:
    task: Task
    sandbox: object

    def step(self, call: ToolCall):
        raise AssertionError("no tools")

    def verify(self, final: list[Message]) -> Reward:
        # leave a file behind: the next episode on this sandbox must not see it
        res = self.sandbox.run_python("import os; print(sorted(os.listdir('.'))); open('left.txt', 'w').write('x')")
        seen = res.stdout.strip()
        return Reward(1.0, True, details={"seen": seen, "sandbox": id(self.sandbox._sbx)})


class _Needs:
    name, version, category, difficulties, tools = "needs-sandbox", "1", "code", (1,), ()
    sandbox_limits = Limits(timeout_s=5, memory_mb=128)

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        word = rng.choice("abcdef")
        return Task(env="", task_id=task_id("needs-sandbox@1", difficulty, word), difficulty=difficulty,
                    prompt=[Message("user", word)], domain="d")

    def reference_solution(self, task):
        return [Message("assistant", "ok")]

    def start(self, task, sandbox):
        return _Episode(task, sandbox)


class _Opens(_Needs):
    sandbox_limits = None


def test_a_declared_sandbox_is_leased_from_the_pool_and_given_back_restored(isolated, tok):
    from assay.agent.groups import collect
    from assay.rollout.hf import HFBackend

    env = _Needs()
    pool = shared_pool(env.sandbox_limits)
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                    intermediate_size=64), tok)
    tasks = [env.generate(random.Random(i), 1) for i in range(3)]
    domains = {"d": DomainConfig(name="d", env="needs-sandbox", group_size=2, max_new_tokens=2)}
    used = set()
    for _ in range(2):  # the second batch runs on the sandboxes the first gave back
        trajs = collect(HFBackend(model, tok), tok, {"d": env}, domains, tasks, samples=2, temperature=1.0)
        assert all(t.passed and t.reward_info["seen"] == "['main.py']" for t in trajs)  # nothing left behind
        used |= {t.reward_info["sandbox"] for t in trajs}
    assert len(used) <= pool.size < 2 * len(trajs)  # 12 episodes on the pool's 8 sandboxes, none opened apart
    assert len(pool._free) == pool.size  # every lease given back


def test_an_undeclared_sandbox_is_none_and_a_closed_lease_refuses_use(isolated):
    env = _Opens()
    task = env.generate(random.Random(0), 1)
    assert start_episode(env, task).sandbox is None
    lease = LeasedSandbox(shared_pool(_Needs.sandbox_limits))
    assert lease.exec(["/bin/true"]).ok
    lease.close()
    with pytest.raises(Exception, match="given back"):
        lease.exec(["/bin/true"])
