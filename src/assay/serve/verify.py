"""Verifier feedback for a canary: `assay serve STABLE --canary C --verify-suite SUITE.yaml`.

A chat request whose `metadata` names a task of the pinned suite (`{"assay_task": TASK_ID}`) and whose messages
are that task's prompt is graded by the task's own verifier once it completes, each choice a verdict, and the
verdicts feed the deployment's sequential test as a client's feedback would (the response id then takes no
client feedback: one request, one source of evidence). Only single-turn tasks (no tools) can be verified here:
a multi-turn task's tool results come from the client, which the server cannot check. Verification runs on a
pool of its own threads after the response has gone out, so a slow verifier never delays an answer."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from assay.core.errors import AssayError
from assay.core.types import OK, Message, Task
from assay.envs.base import Environment
from assay.envs.episode import close_episode, start_episode
from assay.eval.suite import load_suite, resolve_entries, suite_tasks
from assay.serve.canary import Deployment
from assay.serve.prompt import chat_messages
from assay.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from assay.serve.sessions import Served

log = logging.getLogger("assay.serve.verify")

TASK_KEY = "assay_task"  # the request's metadata key naming a suite task


@dataclass
class SuiteVerifier:
    """The suite's single-turn tasks by id, and where their verdicts go (`record(response_id, verdicts)`, set by
    `attach_verifier`)."""

    suite: str
    tasks: dict[str, tuple[Task, Environment]]
    record: Callable[[str, list[bool]], None] | None = None
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="verify"))
    verified: int = 0  # requests graded
    failures: int = 0  # requests whose verification failed (an infrastructure status): no verdict

    def task_of(self, req: ChatCompletionRequest | CompletionRequest) -> tuple[Task, Environment] | None:
        """The task a request names, after checking that it can be verified; None when it names none."""
        named = (req.metadata or {}).get(TASK_KEY)
        if named is None:
            return None
        if not isinstance(req, ChatCompletionRequest):
            raise ApiError(400, f"metadata.{TASK_KEY}: only a chat completion can name a suite task",
                           param=f"metadata.{TASK_KEY}")
        if not isinstance(named, str) or named not in self.tasks:
            raise ApiError(400, f"metadata.{TASK_KEY}: {named!r} is no single-turn task of the suite {self.suite} this "
                                "server verifies; name one of its task ids, or leave the key out",
                           param=f"metadata.{TASK_KEY}")
        task, env = self.tasks[named]
        sent = [(m.role, m.content) for m in chat_messages(req.messages)]
        if sent != [(m.role, m.content) for m in task.prompt]:
            raise ApiError(400, f"metadata.{TASK_KEY}: the messages are not task {named}'s prompt; send its prompt "
                                "as the suite gives it, or leave the key out", param="messages")
        return task, env

    def check(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        self.task_of(req)

    def observe(self, d: Served) -> None:
        named = (d.req.metadata or {}).get(TASK_KEY)  # `check` validated the request before it was queued
        if named is not None:
            self.pool.submit(self._verify, d, *self.tasks[named])

    def _verify(self, d: Served, task: Task, env: Environment) -> None:
        verdicts = []
        for view in d.views[0]:
            episode = start_episode(env, task)
            try:
                reward = episode.verify([*task.prompt, Message("assistant", view.content)])
            except Exception as e:  # a verifier's bug is no verdict on the policy
                log.warning("verify: task %s raised %s: %s", task.task_id, type(e).__name__, e)
                reward = None
            finally:
                close_episode(episode)
            if reward is None or reward.status != OK:
                self.failures += 1
                return
            verdicts.append(reward.passed)
        self.verified += 1
        assert self.record is not None
        self.record(d.request_id, verdicts)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def suite_verifier(path: Path) -> SuiteVerifier:
    """The suite's single-turn tasks, its environments checked against the pinned hashes."""
    suite, _ = load_suite(path)
    envs = resolve_entries(suite)
    tasks = {t.task_id: (t, envs[t.domain]) for t in suite_tasks(suite, envs) if not t.tools}
    if not tasks:
        raise AssayError(f"--verify-suite {path}: the suite has no single-turn task (every task has tools, whose "
                         "results come from the client); pass a suite of single-turn tasks")
    return SuiteVerifier(suite.name, tasks)


def attach_verifier(verifier: SuiteVerifier, deployment: Deployment) -> None:
    """Check every request the deployment's stable state receives, and grade what any version answers; the
    verdicts go to the deployment's test (after its own observer has registered the response)."""
    verifier.record = deployment.verdicts
    stable = deployment.states[deployment.current]
    stable.checks.append(verifier.check)
    for state in deployment.states.values():
        state.observers.append(verifier.observe)
