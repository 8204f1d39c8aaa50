"""What the serve tests share: the calculator tool, its tasks and reference conversations, and metric reads."""

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
