"""What the serve tests share: the calculator tool, its tasks and reference conversations, and metric reads."""

import re
import subprocess
import time

from assay.core.types import Message, Task, ToolCall, ToolSpec
from assay.rollout.engine import EngineConfig

CALC = ToolSpec("calc", "Add two numbers.",
                {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]})
MODEL = "tiny-calc"
SMALL_ENGINE = EngineConfig(kv_cache_bytes=16 * 2**20, max_batched_tokens=512)


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
