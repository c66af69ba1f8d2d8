"""The OpenAI API's request and response bodies, as pydantic models: FastAPI validates requests with them and
documents both in /openapi.json. Every field of OpenAI's chat and text completion requests is accepted; those the
server does not act on (`IGNORED`) change nothing and are named in the response's `X-Hybrid-Ignored-Fields` header.
A field outside OpenAI's is a 400 naming it, rather than a setting silently dropped — but for the extensions (as
vLLM's): `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`, and on text completions
`return_token_ids`; and those the SGLang and vLLM gateways send with every request (hybrid/serve/gateway.py):
`skip_special_tokens`, `no_stop_trim`, `return_hidden_states`, and on chat `continue_final_message`,
`separate_reasoning`, `stream_reasoning`, `include_reasoning`. docs/design/serving-api.md lists what each endpoint
serves."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from hybrid.engine.requests import MAX_STOP_CHARS, MAX_TOP_LOGPROBS

Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Stop = Union[StopText, Annotated[list[StopText], Field(max_length=4)]]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
MAX_CHOICES = 16

# accepted and without effect: named in X-Hybrid-Ignored-Fields when a request sets them (not to null)
IGNORED_CHAT = frozenset({"store", "metadata", "service_tier", "user", "safety_identifier", "prompt_cache_key",
                          "prompt_cache_retention", "modalities", "audio", "prediction", "verbosity",
                          "web_search_options", "reasoning_effort", "stream_options", "functions",
                          "function_call"})
IGNORED_COMPLETION = frozenset({"user", "suffix", "best_of", "stream_options"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    """Objects whose inside the server does not read (tools, metadata, ...): any keys."""
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Strict):
    include_usage: Optional[bool] = Field(None, description="a last chunk with `usage` (and no choices)")
    include_obfuscation: Optional[bool] = Field(None, description="ignored")


class _Sampling(_Strict):
    """Fields shared by chat and text completions."""
    model: str = Field(description="the served model's id (GET /v1/models)")
    max_tokens: Optional[int] = Field(None, ge=1, description="tokens to generate at most")
    temperature: Optional[Temperature] = Field(None, description="0 = greedy; default 1")
    top_p: Optional[TopP] = None
    seed: Optional[Seed] = Field(None, description="reproducible sampling, whatever the request's batch mates "
                                                   "(choice i of n draws with seed + i)")
    stop: Optional[Stop] = Field(None, description="up to 4 strings; the text ends before the first one")
    n: Optional[int] = Field(None, ge=1, le=MAX_CHOICES, description="choices of the one prompt")
    stream: Optional[bool] = Field(False, description="server-sent events, one chunk per step, then `[DONE]`")
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[Penalty] = Field(None, description="subtracted once from each token already in "
                                                                  "the output")
    frequency_penalty: Optional[Penalty] = Field(None, description="subtracted per occurrence in the output")
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100, le=100)]]] = Field(
        None, description="token id (as a string) -> bias added to its logit")
    user: Optional[str] = None
    # extensions
    top_k: Optional[int] = Field(None, ge=0, description="extension: sample from the k likeliest tokens; 0 = all")
    min_p: Optional[Annotated[float, Field(ge=0, le=1)]] = Field(
        None, description="extension: drop tokens less likely than min_p x the likeliest one")
    repetition_penalty: Optional[Annotated[float, Field(ge=0.01, le=100)]] = Field(
        None, description="extension: > 1 lowers the logits of every token in the prompt and the output")
    stop_token_ids: Optional[list[Annotated[int, Field(ge=0)]]] = Field(
        None, description="extension: token ids that end the text (not shown)")
    ignore_eos: Optional[bool] = Field(False, description="extension: generate max_tokens whatever comes")
    skip_special_tokens: Optional[bool] = Field(True, description="extension: false shows special tokens in the text")
    no_stop_trim: Optional[bool] = Field(False, description="extension: the stop string or stop token that ended "
                                                            "the text stays in it")
    return_hidden_states: Optional[bool] = Field(False, description="extension: false only (no hidden states here)")


class TextPart(_Open):
    type: Literal["text"]
    text: str


class ContentPart(_Open):
    """A non-text part (image_url, input_audio, file, refusal): refused with a 400 naming its type."""
    type: str


class ToolCallFunction(_Open):
    name: str
    arguments: str


class ToolCall(_Open):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


Content = Union[str, list[Union[TextPart, ContentPart]]]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Content] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = Field(None, description="an assistant's reasoning, for templates that keep it")
    refusal: Optional[str] = None
    audio: Optional[_Open] = None
    function_call: Optional[_Open] = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(p.text for p in self.content if isinstance(p, TextPart))

    def other_parts(self) -> list[str]:
        """The types of the parts that are not text."""
        return [p.type for p in self.content or () if not isinstance(p, (TextPart, str))]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="as max_tokens, and wins over it")
    logprobs: Optional[bool] = Field(None, description="each output token's log-probability")
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                        description="the likeliest tokens at each position (needs logprobs)")
    tools: Optional[list[_Open]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], _Open]] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[_Open]] = None
    function_call: Optional[Union[Literal["none", "auto"], _Open]] = None
    response_format: Optional[_Open] = None
    chat_template_kwargs: Optional[dict[str, Any]] = Field(
        None, description="extension: the chat template's own switches, e.g. {\"thinking\": true}")
    continue_final_message: Optional[bool] = Field(False, description="extension: the model goes on with the last "
                                                                      "message, an assistant's")
    separate_reasoning: Optional[bool] = Field(True, description="extension: false keeps the reasoning in content")
    stream_reasoning: Optional[bool] = Field(True, description="extension: false streams the reasoning as one delta "
                                                               "once it ends")
    include_reasoning: Optional[bool] = Field(True, description="extension: false leaves reasoning_content out")
    reasoning_effort: Optional[str] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    modalities: Optional[list[str]] = None
    audio: Optional[_Open] = None
    prediction: Optional[_Open] = None
    verbosity: Optional[str] = None
    web_search_options: Optional[_Open] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, Annotated[list[str], Field(min_length=1)], TokenIds, Annotated[list[TokenIds], Field(
        min_length=1)]] = Field(description="text, token ids, or a batch of either (a choice per prompt and n)")
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                    description="the sampled token's log-probability and this many likeliest")
    echo: Optional[bool] = Field(False, description="the prompt's text before the completion's")
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(None, ge=1, le=MAX_CHOICES)
    return_token_ids: Optional[bool] = Field(
        None, description="extension: each choice with the prompt's token ids (`prompt_token_ids`; in a stream on "
                          "the choice's first chunk) and the generated ones (`token_ids`; in a stream, the chunk's)")

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)


class TokenizeRequest(_Strict):
    model: Optional[str] = None
    prompt: Optional[str] = Field(None, description="text to tokenize as it is")
    messages: Optional[list[ChatMessage]] = Field(None, description="or messages, through the chat template")
    add_special_tokens: Optional[bool] = Field(True, description="with prompt: the BOS where the model adds one")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


# -- responses --------------------------------------------------------------------------------------------------
FinishReason = Literal["stop", "length"]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None
    refusal: Optional[list[ChatTokenLogprob]] = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


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
    logprobs: Optional[ChatLogprobs] = None


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
    logprobs: Optional[CompletionLogprobs] = None
    prompt_token_ids: Optional[list[int]] = Field(None, description="with return_token_ids: the prompt's token ids")
    token_ids: Optional[list[int]] = Field(None, description="with return_token_ids: every generated token id (a "
                                                             "stop token that ended the text too)")


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
