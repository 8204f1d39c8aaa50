"""The wire format of the OpenAI-compatible API: requests as pydantic models (validated before anything
reaches the engine), responses and stream chunks, and the error body every refusal carries.

Fields that would change what is sampled and that the engine cannot honour (penalties, logit bias, top
alternatives' logprobs, forced tool choice, best_of, echo) are declared, so that a request setting them is
refused with the field named instead of being served as if they were not there. Unknown fields are refused
for the same reason; a few fields that change nothing about sampling (`user`, `metadata`, ...) are accepted
and ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# ---- errors ------------------------------------------------------------------------------------------


class ApiError(Exception):
    """A refusal with its HTTP status, answered as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(e: ValidationError) -> ApiError:
    """The first problem pydantic found, as a 400 naming the field."""
    first = e.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    message = first["msg"] if param is None else f"{param}: {first['msg']}"
    if len(e.errors()) > 1:
        message += f" (and {len(e.errors()) - 1} more problem{'s' if len(e.errors()) > 2 else ''})"
    return ApiError(400, message, param=param)


# ---- requests ----------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = Field(False, description="Send a last chunk with the token counts")


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="The served model's id (GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to sample per choice; default: the room "
                                                              "left in the model's context")
    temperature: float = Field(1.0, ge=0, le=2, description="Sampling temperature; 0 is greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: the smallest set of tokens holding this "
                                                      "much probability")
    n: int = Field(1, ge=1, description="Choices sampled from the one prompt")
    stop: str | list[str] | None = Field(None, description="Up to 4 strings; a choice ends where one appears, "
                                                           "which is left out of its text")
    seed: int | None = Field(None, description="Seed of the sampling streams: the same request and seed sample the "
                                               "same tokens")
    stream: bool = Field(False, description="Send tokens as they are sampled, as server-sent events")
    stream_options: StreamOptions | None = Field(None, description="Streaming only: include_usage adds a last "
                                                                   "chunk with the token counts")
    user: str | None = Field(None, description="Accepted and ignored")
    metadata: dict[str, Any] | None = Field(None, description="Accepted; `assay_task` names a suite task whose "
                                                              "verifier grades the answer (assay serve --verify-suite)")
    store: bool | None = Field(None, description="Accepted and ignored")
    # declared only to be refused unless they keep their neutral value (see _unsupported)
    frequency_penalty: float | None = Field(None, description="Not supported unless 0")
    presence_penalty: float | None = Field(None, description="Not supported unless 0")
    logit_bias: dict[str, float] | None = Field(None, description="Not supported unless empty")

    @model_validator(mode="after")
    def _common(self) -> _Request:
        stops = self.stop_list()
        if len(stops) > 4:
            raise ValueError(f"stop: at most 4 strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop: an empty string would end every choice at once; remove it")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by Assay's engine; leave it out or 0")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by Assay's engine; leave it out")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only for stream: true")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="The tool's name, as the model calls it")
    description: str = Field("", description="What the tool does, shown to the model")
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}},
                                       description="JSON schema of the tool's arguments")
    strict: bool | None = Field(None, description="Accepted and ignored: calls are parsed, not constrained")


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = Field(description="Always function")
    function: FunctionDef = Field(description="The tool")


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="The called tool")
    arguments: str = Field(description="The arguments, a JSON object as text")


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field("", description="The call's id, which a tool message answers")
    type: Literal["function"] = Field("function", description="Always function")
    function: FunctionCall = Field(description="The call")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"] = Field(description="Only text parts are served")
    text: str = Field(description="The text")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(description="Who speaks")
    content: str | list[TextPart] | None = Field(None, description="The text (or text parts)")
    name: str | None = Field(None, description="Accepted and ignored")
    tool_calls: list[ToolCallIn] | None = Field(None, description="An assistant turn's tool calls")
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers")
    reasoning_content: str | None = Field(None, description="An assistant turn's reasoning, where the chat template "
                                                            "renders reasoning")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far")
    max_completion_tokens: int | None = Field(None, ge=1, description="max_tokens under its newer name")
    logprobs: bool = Field(False, description="Return each sampled token's logprob")
    top_logprobs: int | None = Field(None, description="Not supported unless 0: the engine records the sampled "
                                                       "token's logprob only")
    tools: list[ToolDef] | None = Field(None, description="Tools the model may call, in its own chat format")
    tool_choice: Literal["auto", "none"] | None = Field(None, description="auto (default with tools) or none; "
                                                                          "forcing a call is not supported")
    parallel_tool_calls: bool | None = Field(None, description="Accepted and ignored")

    @model_validator(mode="after")
    def _chat(self) -> ChatCompletionRequest:
        if self.top_logprobs:
            raise ValueError("top_logprobs is not supported: Assay's engine records only the sampled token's "
                             "logprob; pass logprobs: true without top_logprobs")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(description="Text, texts, token ids, or lists of "
                                                                              "token ids")
    logprobs: int | None = Field(None, description="0: return each sampled token's logprob; more (top "
                                                   "alternatives) is not supported")
    echo: bool = Field(False, description="Not supported unless false")
    best_of: int | None = Field(None, description="Not supported unless 1")
    suffix: str | None = Field(None, description="Not supported")

    @model_validator(mode="after")
    def _completion(self) -> CompletionRequest:
        if self.logprobs:
            raise ValueError(f"logprobs: {self.logprobs} asks for the top alternatives, which Assay's engine does not "
                             "record; pass logprobs: 0 for the sampled tokens' logprobs")
        if self.echo:
            raise ValueError("echo is not supported; leave it out")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported; sample n choices instead")
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported; leave it out")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: an empty list; give at least one prompt")
        return self

    def token_limit(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """One prompt per entry: a text or its token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


# ---- responses ---------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[Any] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
