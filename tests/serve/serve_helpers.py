"""What the serve tests share: the calculator tool, its tasks and reference conversations, metric reads, and a
canary's clients (questions, the client's verdict, traffic with feedback)."""

import json
import re
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from assay.core.types import Message, Task, ToolCall, ToolSpec
from assay.rollout.engine import EngineConfig

CALC = ToolSpec("calc", "Add two numbers.",
                {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]})
MODEL = "tiny-calc"
SMALL_ENGINE = EngineConfig(kv_cache_bytes=16 * 2**20, max_batched_tokens=512)
TOOLS = [{"type": "function", "function": CALC.to_json()}]


def calc_task(a: int, b: int) -> Task:
    return Task(env="calc@1", task_id=f"{a}+{b}", difficulty=1, tools=[CALC],
                prompt=[Message("system", "Use the calc tool."), Message("user", f"What is {a}+{b}?")])


def reference(task: Task) -> list[Message]:
    answer = str(sum(int(x) for x in task.task_id.split("+")))
    return [Message("assistant", "Let me add.", [ToolCall("calc", {"expression": task.task_id})]),
            Message("tool", answer, name="calc"), Message("assistant", f"Answer: {answer}")]


def metric(server, name: str, **labels) -> float:
    """A sample's value from the server's Prometheus registry (0 when it has none yet)."""
    value = server.state.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def served_url(proc: subprocess.Popen, output: list[str], timeout_s: float) -> str:
    """The base URL a starting `assay serve` process logs, its lines kept in `output` (the failure message if it
    exits or takes longer than `timeout_s` first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        line = proc.stdout.readline()
        output.append(line)
        assert (line or proc.poll() is None) and time.monotonic() < deadline, "".join(output)
        if m := re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line):
            return m.group(1)


def question(k: int) -> list[dict]:
    a, b = k % 80, 7 * (k % 80) % 50  # the tasks the fixture's policy learnt
    return [{"role": "system", "content": "Use the calc tool."}, {"role": "user", "content": f"What is {a}+{b}?"}]


def verdict(body: dict) -> bool:
    """The client's own check: the answer is one well-formed calc call (the tiny policy learnt the call's form,
    not the arithmetic; the untrained one never makes it)."""
    calls = body["choices"][0]["message"].get("tool_calls") or []
    return (len(calls) == 1 and calls[0]["function"]["name"] == "calc"
            and isinstance(json.loads(calls[0]["function"]["arguments"]).get("expression"), str))


def drive(url: str, d, limit: int, first: int = 0, until: Callable[[], bool] | None = None) -> list[tuple[int, bool]]:
    """Requests from distinct sessions with the client's verdict fed back, until the deployment `d` decides (or
    `until()` holds, or `limit` requests); the (version, verdict) of each."""

    def one(k: int) -> tuple[int, bool]:
        messages = question(k)
        with httpx.Client(base_url=url, timeout=60) as c:
            r = c.post("/v1/chat/completions", headers={"X-Session-Id": f"user-{k}"}, json={
                "model": MODEL, "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 32})
            assert r.status_code == 200, r.text
            ok = verdict(r.json())
            f = c.post("/v1/feedback", json={"id": r.json()["id"], "success": ok})
            assert f.status_code == 200, f.text
            return int(r.headers["x-assay-version"]), ok

    out: list[tuple[int, bool]] = []
    with ThreadPoolExecutor(4) as pool:
        k = first
        while d.decision == "continue" and not (until and until()) and k < first + limit:
            out += pool.map(one, range(k, k + 8))
            k += 8
    return out


def versions(url: str, keys, model: str = MODEL) -> list[int]:
    """The version that answers each session `user-K`."""
    with httpx.Client(base_url=url, timeout=60) as c:
        return [int(c.post("/v1/chat/completions", headers={"X-Session-Id": f"user-{k}"}, json={
            "model": model, "messages": question(k), "max_tokens": 4, "temperature": 0}).headers["x-assay-version"])
            for k in keys]


def golden_records(out, stable, candidate, passes, tasks: int = 8, samples: int = 2, name: str = "golden"):
    """Evaluation records of the policy directories `stable` and `candidate` on a pinned suite of arith and toolcalc
    (`tasks` each), written by the evaluation's own writer with known results: `passes(policy, env, i)` -> the
    samples' verdicts of task i (policy "stable" or "candidate"; an empty list: every sample failed on
    infrastructure). Returns the directory holding both records, as `assay eval SUITE --policy A --policy B`."""
    import yaml

    from assay.core.types import Trajectory
    from assay.envs.registry import env_hash, get_env
    from assay.eval.evaluate import summarize_domains
    from assay.eval.record import policy_identity, write_record
    from assay.eval.suite import load_suite, resolve_entries, suite_tasks

    entries = [{"env": spec, "hash": env_hash(get_env(spec)), "tasks": tasks, **levels}
               for spec, levels in (("arith@4", {"levels": [2, 3]}), ("toolcalc@4", {"levels": [2, 3]}))]
    out.mkdir(parents=True, exist_ok=True)
    suite_file = out / f"{name}.yaml"
    suite_file.write_text(yaml.safe_dump({"name": name, "samples": samples, "entries": entries}, sort_keys=False))
    suite, sha = load_suite(suite_file)
    envs = resolve_entries(suite)
    task_list = suite_tasks(suite, envs)
    settings = {"backend": "engine", "seed": 0, "weights": "float32", "suite": suite.name, "suite_file": str(suite_file),
                "suite_sha256": sha, "suite_config": suite.model_dump(), "n": samples,
                "temperature": suite.limits.temperature}
    for i, (who, policy) in enumerate((("stable", stable), ("candidate", candidate))):
        trajs = []
        for task in task_list:
            index = [t.task_id for t in task_list if t.domain == task.domain].index(task.task_id)
            verdicts = passes(who, task.domain, index)
            for ok in verdicts or [False] * samples:
                trajs.append(Trajectory(task, [], [], [], [], 0, turns=1, passed=ok, reward=float(ok),
                                        status="ok" if verdicts else "rollout_error", group_id=f"{who}-{task.task_id}",
                                        timings={"generate": 0.01}))
        results = summarize_domains(task_list, trajs, [1, 2], overall=True)
        write_record(out / "eval" / f"{i}_{policy.name}", results, policy_identity(policy), envs, settings)
    return out / "eval"


def verified_suite(tmp_path, url: str, split: str = "eval", **keys):
    """A jsonl suite whose answers are what the policy served at `url` answers greedily: its verifier (exact match)
    passes the policy and fails anything else. `split`: the entry's (all: each of the 16 prompts a task); `keys`:
    more of the suite's keys (samples, limits)."""
    import yaml

    from assay.envs import env_hash, get_env

    prompts = [f"What is {a}+{7 * a % 50}?" for a in range(0, 80, 5)]
    with httpx.Client(base_url=url, timeout=60) as c:
        answers = [c.post("/v1/chat/completions", json={"model": MODEL, "temperature": 0, "max_tokens": 16,
                                                        "messages": [{"role": "user", "content": p}]}
                          ).json()["choices"][0]["message"]["content"].removeprefix("Answer: ") for p in prompts]
    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in zip(prompts, answers, strict=True)))
    suite = tmp_path / "verified.yaml"
    suite.write_text(yaml.safe_dump({"name": "verified", **keys, "entries": [
        {"env": "jsonl@4", "env_args": {"path": str(data)}, "tasks": len(prompts), "levels": [1],
         "split": split, "hash": env_hash(get_env("jsonl", path=str(data)))}]}))
    return suite
