"""The OpenAI API's request and response bodies, as pydantic models: FastAPI validates requests with them and
documents both in /openapi.json. Only what the engine serves is accepted: an unknown field is a 400 naming it,
rather than a setting silently ignored. Extensions beside OpenAI's fields: `top_k` and `ignore_eos` (as vLLM)."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from hybrid.engine.requests import MAX_STOP_CHARS

Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Stop = Union[StopText, Annotated[list[StopText], Field(max_length=4)]]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: Optional[bool] = Field(None, description="a last chunk with `usage` (and no choices)")


class _Sampling(_Strict):
    """Fields shared by chat and text completions."""
    model: str = Field(description="the served model's id (GET /v1/models)")
    max_tokens: Optional[int] = Field(None, ge=1, description="tokens to generate at most")
    temperature: Optional[Temperature] = Field(None, description="0 = greedy; default 1")
    top_p: Optional[TopP] = None
    top_k: Optional[int] = Field(None, ge=0, description="extension: sample from the k likeliest tokens; 0 = all")
    seed: Optional[Seed] = Field(None, description="reproducible sampling, whatever the request's batch mates")
    stop: Optional[Stop] = Field(None, description="up to 4 strings; the text ends before the first one")
    n: Optional[int] = Field(None, ge=1, description="choices per request; only 1 is served")
    stream: Optional[bool] = Field(False, description="server-sent events, one chunk per step, then `[DONE]`")
    stream_options: Optional[StreamOptions] = None
    ignore_eos: Optional[bool] = Field(False, description="extension: generate max_tokens whatever comes")
    user: Optional[str] = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="as max_tokens, and wins over it")


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int]] = Field(description="text, or token ids")


# -- responses --------------------------------------------------------------------------------------------------
FinishReason = Literal["stop", "length"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hybrid"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class Health(BaseModel):
    status: Literal["ok", "loading", "failed", "draining"]
    message: str = ""


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
