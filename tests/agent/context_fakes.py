"""A shelf of files to read (each a long tool result) and a scripted policy that decides each turn on the
text of its prompt: what the context-handling tests drive the agent loop with."""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from assay.agent.render import assistant_ids
from assay.core.types import Message, Observation, Reward, Task, ToolCall, ToolSpec
from assay.rollout.base import GenRequest, GenResult

READ = ToolSpec("read", "Read a file.", {"type": "object", "properties": {"path": {"type": "string"}},
                                         "required": ["path"], "additionalProperties": False})
FILES = {f"f{i}": f"{i}{i}{i} " + "1234567890 " * 12 for i in range(1, 9)}


def shelf_task(secret: str = "7+7") -> Task:
    return Task(env="shelf@1", task_id="shelf", domain="shelf", difficulty=1,
                prompt=[Message("system", "Use the tools."), Message("user", "Read the files, then answer.")],
                tools=[READ], payload={"answer": secret})


@dataclass
class ShelfEpisode:
    task: Task
    reads: list[str] = field(default_factory=list)

    def step(self, call: ToolCall) -> Observation:
        path = call.arguments["path"]
        self.reads.append(path)
        return Observation(FILES[path]) if path in FILES else Observation(f"no file {path}", is_error=True)

    def verify(self, final: list[Message]) -> Reward:
        ok = final[-1].role == "assistant" and final[-1].content == f"Answer: {self.task.payload['answer']}"
        return Reward(float(ok), ok)


Decide = Callable[[str, int], Message]  # (the prompt as text, the turn's index) -> the turn


@dataclass
class PromptPolicy:
    """A backend whose turns a function of the prompt's text decides; it records every request and result.
    With `model`, the logprobs are the model's own for the decided ids given the prompt (teacher forcing),
    as an engine sampling those ids from it would report them."""

    tok: object
    decide: Decide
    model: torch.nn.Module | None = None
    requests: list[GenRequest] = field(default_factory=list)
    results: list[GenResult] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)

    def generate(self, requests):
        out = []
        for r in requests:
            text = self.tok.decode(r.prompt_ids, skip_special_tokens=False)
            ids = assistant_ids(self.tok, self.decide(text, len(self.requests)))[: r.params.max_tokens]
            logprobs = self._score(r.prompt_ids, ids)
            res = GenResult(ids, logprobs, "stop", 0)
            self.requests.append(r)
            self.prompts.append(text)
            self.results.append(res)
            out.append([res])
        return out

    def _score(self, prompt: list[int], ids: list[int]) -> list[float]:
        if self.model is None:
            return [-0.01 * (i + 1) for i in range(len(ids))]
        with torch.no_grad():
            logits = self.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1).tolist()

    def update_weights(self, named_tensors, version):
        pass


def read(path: str) -> Message:
    return Message("assistant", "", [ToolCall("read", {"path": path})])


def call(name: str, **arguments) -> Message:
    return Message("assistant", "", [ToolCall(name, arguments)])
