"""A tiny fake calculator environment (the builtin envs are someone else's) and a scripted backend."""

from dataclasses import dataclass, field

from assay.agent.render import assistant_ids
from assay.core.types import Message, Observation, Reward, Task, ToolCall, ToolSpec
from assay.rollout.base import GenRequest, GenResult

CALC = ToolSpec(
    "calc",
    "Add two numbers.",
    {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"],
     "additionalProperties": False},
)


def calc_task(a: int, b: int) -> Task:
    return Task(env="fakecalc@1", task_id=f"{a}+{b}", domain="math", difficulty=1,
                prompt=[Message("system", "Use the calc tool."), Message("user", f"What is {a}+{b}?")],
                tools=[CALC], payload={"answer": str(a + b)}, env_hash="hash-fakecalc-1")


def reference(task: Task) -> list[Message]:
    return [
        Message("assistant", "Let me add.", [ToolCall("calc", {"expression": task.task_id})]),
        Message("tool", task.payload["answer"], name="calc"),
        Message("assistant", f"Answer: {task.payload['answer']}"),
    ]


@dataclass
class FakeEpisode:
    task: Task
    step_obs: Observation | None = None  # returned instead of computing, if set
    reward: Reward | None = None  # returned by verify instead of checking, if set
    calls: list[ToolCall] = field(default_factory=list)
    verified: list[Message] | None = None
    closed: int = 0

    def close(self) -> None:
        self.closed += 1

    def step(self, call: ToolCall) -> Observation:
        self.calls.append(call)
        if self.step_obs is not None:
            return self.step_obs
        try:
            a, b = call.arguments["expression"].split("+")
            return Observation(str(int(a) + int(b)))
        except ValueError:
            return Observation("error: expected a+b", is_error=True)

    def verify(self, final: list[Message]) -> Reward:
        self.verified = list(final)
        if self.reward is not None:
            return self.reward
        last = final[-1]
        want = f"Answer: {self.task.payload['answer']}"
        ok = last.role == "assistant" and not last.tool_calls and last.content == want
        return Reward(float(ok), ok, details={"answer": last.content})


class ScriptedBackend:
    """Replays fixed assistant turns per episode. An episode is recognised by its prompt ids (the prefix of
    every request it makes); each turn is (ids, finish_reason) and logprobs are -0.01 * position."""

    def __init__(self, scripts: dict[tuple[int, ...], list[tuple[list[int], str]]], version: int = 0):
        self.scripts = scripts
        self.pos = dict.fromkeys(scripts, 0)
        self.batches: list[int] = []
        self.requests: list[GenRequest] = []
        self.version = version

    def generate(self, requests):
        self.batches.append(len(requests))
        out = []
        for r in requests:
            assert r.n == 1
            self.requests.append(r)
            key = next(k for k in self.scripts if tuple(r.prompt_ids[: len(k)]) == k)
            ids, reason = self.scripts[key][self.pos[key]]
            self.pos[key] += 1
            if len(ids) > r.params.max_tokens:
                ids, reason = ids[: r.params.max_tokens], "length"
            out.append([GenResult(list(ids), [-0.01 * (i + 1) for i in range(len(ids))], reason, self.version)])
        return out

    def update_weights(self, named_tensors, version):
        self.version = version


class OnlineScripted(ScriptedBackend):
    """The online API over the scripted backend: every step finishes what was added since the last."""

    def __init__(self, scripts):
        super().__init__(scripts)
        self.pending: list = []
        self.next_id = 0

    def add_requests(self, requests, on_done=None):
        ids = list(range(self.next_id, self.next_id + len(requests)))
        self.next_id += len(requests)
        self.pending += list(zip(ids, requests, strict=True))
        return ids

    def add_request(self, request, on_done=None):
        return self.add_requests([request])[0]

    def step(self):
        batch, self.pending = self.pending, []
        return [(rid, res) for (rid, _), res in zip(batch, self.generate([r for _, r in batch]), strict=True)]

    def abort(self, request_id):
        pass


def turn(tok, message: Message) -> tuple[list[int], str]:
    return assistant_ids(tok, message), "stop"
