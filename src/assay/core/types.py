"""The nouns every layer speaks: tasks, messages, tool calls, rewards, trajectories."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# Trajectory / Observation / Reward status. Anything but OK is an infrastructure failure:
# it is reported apart and never trained on as a (wrong) answer.
Status = Literal["ok", "sandbox_error", "verifier_error", "rollout_error"]
OK: Status = "ok"
SANDBOX_ERROR: Status = "sandbox_error"
VERIFIER_ERROR: Status = "verifier_error"
ROLLOUT_ERROR: Status = "rollout_error"
# Why an episode ended ("" while it runs): an answer, a turn cut at max_tokens, the turn limit, the
# context limit, or an error.
FinishReason = Literal["", "stop", "length", "max_turns", "time_limit", "context", "error"]
Role = Literal["system", "user", "assistant", "tool"]


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""


@dataclass
class ToolSpec:
    """A tool the model may call: its JSON schema validates every call's arguments."""

    name: str
    description: str
    parameters: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


@dataclass
class Message:
    role: Role
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    name: str | None = None  # the tool's name on a tool message
    is_error: bool = False  # a tool message whose observation was an error (the call failed or broke its schema)
    # an assistant turn's reasoning (the text inside <think>...</think>), kept apart from its content;
    # None: the turn has no reasoning block (as in every template without one)
    reasoning: str | None = None


@dataclass
class Observation:
    """What an episode returns for one tool call."""

    content: str
    is_error: bool = False  # the call broke the schema or the tool failed
    done: bool = False  # the episode ends after this observation
    status: Status = OK  # infrastructure failure (e.g. sandbox_error), never a reward


@dataclass
class Reward:
    score: float
    passed: bool
    status: Status = OK
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Task:
    env: str  # name@version
    task_id: str
    difficulty: int
    prompt: list[Message]
    tools: list[ToolSpec] = field(default_factory=list)
    payload: dict[str, Any] = field(default_factory=dict)  # hidden: answer, tests; never shown
    seed: int = 0
    env_hash: str = ""
    domain: str = ""  # the run's name for the domain it was drawn for; set by the drawer, not the environment


@dataclass
class Trajectory:
    task: Task
    messages: list[Message]
    token_ids: list[int]
    loss_mask: list[int]  # 1 only on tokens the policy sampled
    logprobs: list[float]  # behaviour logprobs, aligned with token_ids (0.0 where mask is 0)
    prompt_len: int  # tokens of the initial prompt (all masked)
    policy_version: int = 0
    turns: int = 0
    tool_errors: int = 0
    # tool-call reliability (agent loop): turns that tried to call a tool, those whose calls were malformed
    # (unparsable, unknown tool, schema violation), retry prompts the policy was shown, retries answered by a
    # well-formed turn, calls acted on only after a repair or a routing to a declared fallback tool (the degraded
    # path), and of those the routed ones
    call_turns: int = 0
    malformed_calls: int = 0
    retries: int = 0
    retry_successes: int = 0
    degraded_calls: int = 0
    fallback_calls: int = 0
    # staged verification: each milestone its environment declares (envs.milestones), in order, and whether
    # the episode reached it; {} where the environment declares none
    milestones: dict[str, bool] = field(default_factory=dict)
    # context handling (agent.* keys): where each context after the first starts in token_ids (a compaction or a
    # plan_execute turn re-renders the context: the policy then saw that segment, not the concatenation), the
    # largest context one turn saw (prompt + what it sampled), compactions, memory-tool calls and refused ones,
    # planning turns (plan_execute; counted in `turns`, not against max_turns)
    segment_starts: list[int] = field(default_factory=list)
    peak_context: int = 0
    compactions: int = 0
    compacted_turns: list[int] = field(default_factory=list)  # the turns (1-based) first prompted after a compaction
    memory_calls: int = 0
    memory_errors: int = 0
    plan_turns: int = 0
    # approvals (agent.approvals, evaluation only): critical calls a person approved; calls denied (by a person,
    # a timeout or a failed channel) and calls outside the deployment's allowlist, neither of which ran
    approved_calls: int = 0
    denied_calls: int = 0
    refused_calls: int = 0
    finish_reason: FinishReason = ""
    reward: float = 0.0
    passed: bool = False
    reward_info: dict[str, Any] = field(default_factory=dict)
    status: Status = OK
    env_hash: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    group_id: str = ""  # samples of one GRPO group share it
    usage: dict[str, int] = field(default_factory=dict)  # token counts a remote endpoint reported (it gives no ids)

    def segments(self) -> list[tuple[int, int]]:
        """(start, end) of each context in token_ids, in order: what the trainer scores as one sequence each.
        A segment starts with the context the policy was prompted with (mask 0)."""
        bounds = [0, *self.segment_starts, len(self.token_ids)]
        return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]

    @property
    def completion_tokens(self) -> int:
        """Tokens the policy sampled."""
        return sum(self.loss_mask) if self.token_ids else self.usage.get("completion_tokens", 0)

    @property
    def prompt_tokens(self) -> int:
        """Tokens the policy read but did not sample: prompt and observations (an endpoint's billed prompt
        tokens, which count the history again every turn; a re-rendered context counts again too)."""
        return len(self.token_ids) - sum(self.loss_mask) if self.token_ids else self.usage.get("prompt_tokens", 0)
