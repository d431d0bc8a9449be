"""The gateway's wire formats: the OpenAI requests and responses it speaks, Triton's generate request, and
the error every refusal becomes.

Requests are parsed from the raw body in pydantic's strict JSON mode, so a string is no number, a bool no
integer and 1.0 no token count, as a hand-written check would have it. On /v1 the fields this gateway does not
translate are kept (`extra="allow"`) for openai_fields.py to judge: honoured, neutral, or a 400 naming the field and
why, never ignored; on /v2 any other field is refused, as Triton would pass it to the model. The first problem
becomes a 400 naming its field. Bodies nested deeper than pydantic's JSON parser
allows, and broken escapes such as a lone surrogate ("\\ud800"), are a 400 there too: parsed with `json.loads`
they had been a RecursionError, or a string that later failed to encode (UnicodeEncodeError), each a 500.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

Count = Annotated[int, Field(ge=1)]
StopSequence = Annotated[str, Field(min_length=1)]


class RequestError(Exception):
    """A refused request: HTTP status, message, and (OpenAI) the parameter it is about."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,  # seconds, sent as Retry-After (429, 503)
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after
        self.detail = ""  # what the model server said, for the log only (upstream.server_fault)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")  # name, ...: nothing a served model reads, so refused

    role: Literal["system", "user", "assistant"]
    content: str

    @model_validator(mode="before")
    @classmethod
    def no_tool_turn(cls, data: Any) -> Any:
        """A tool's result (role tool) or an assistant's tool_calls in the history: the second turn of a tool call,
        which the served models' inputs (the user's question and the turns before it, as text) do not carry."""
        if isinstance(data, dict) and (data.get("role") == "tool" or "tool_calls" in data):
            raise PydanticCustomError(
                "tool_turn",
                "a tool call's turn (role tool, or an assistant's tool_calls) is not taken here: send the tool's "
                "result as text in the user's message",
            )
        return data


class FunctionDefinition(BaseModel):
    """A tool's function, as OpenAI defines it: its `parameters` are the JSON schema of its arguments."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(BaseModel):
    """tool_choice {"type": "function", "function": {"name": N}}: the answer is a call of N."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1, max_length=64)]
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object, or json_schema with its schema (vLLM's structured outputs)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    def structured_output(self) -> str | None:
        """The engine's structured_output input: vLLM's StructuredOutputsParams fields as JSON; None for text."""
        if self.type == "json_object":
            return json.dumps({"json_object": True})
        if self.type == "json_schema":
            if self.json_schema is None:
                raise RequestError(
                    400, "response_format.json_schema is required with type json_schema", "response_format"
                )
            return json.dumps({"json": self.json_schema.schema_ or {}})
        return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = None  # usage rides on the last event either way
    include_obfuscation: Literal[False] | None = None  # no padding of events here


class OpenAIRequest(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="allow")  # judged by openai_fields.check_fields, with the engine's table

    model: str | None = None
    max_tokens: Count | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None  # vLLM's extension: no end of sequence before that many
    ignore_eos: bool | None = None  # vLLM's extension: the answer runs to max_tokens
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=1 << 20)] | None = None  # vLLM's extension; 0 or -1: every token
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=0, lt=1 << 64)] | None = None  # the engines' random_seed is a UINT64
    stop: Annotated[list[StopSequence], Field(max_length=4)] = []
    stream: bool | None = False  # null too: some clients send every field
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None

    def alternatives(self) -> int | None:
        """How many most likely tokens to return with each answer token's log probability; None: no logprobs."""
        return None

    def sent(self) -> dict[str, Any]:
        """Every field the body carried, with its value: those parsed here, and those kept for openai_fields."""
        parsed = {name: getattr(self, name) for name in self.model_fields_set}
        plain = {k: dumped(v) for k, v in parsed.items()}
        return plain | (self.model_extra or {})

    @field_validator("stop", mode="before")
    @classmethod
    def one_stop_is_a_list_of_one(cls, value: Any) -> Any:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value


def dumped(value: Any) -> Any:
    """A parsed field's value as the body sent it."""
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_none=True, by_alias=True)
    if isinstance(value, list):
        return [dumped(item) for item in value]
    return value


class ChatCompletionRequest(OpenAIRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Count | None = None  # OpenAI's newer name for max_tokens; it wins where both are sent
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[ToolDefinition] | None = None  # tool_calls.py: on vLLM
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def alternatives(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("messages")
    @classmethod
    def ends_with_the_users_question(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if messages[-1].role != "user":
            raise PydanticCustomError("last_message", "the last message must be the user's")
        return messages


class CompletionRequest(OpenAIRequest):
    prompt: str
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None  # the chosen token's, and that many alternatives
    echo: bool | None = None  # the prompt before the answer, and with logprobs its tokens' scores

    def alternatives(self) -> int | None:
        return self.logprobs


class GenerateRequest(BaseModel):
    """Triton's generate request on /v2: the `llm` model's inputs only (infra/triton/llm/config.pbtxt), each
    bounded; any other field is refused, as Triton would forward it to the model unchecked."""

    model_config = ConfigDict(extra="forbid")

    text_input: str
    chat_history: str | None = None
    max_tokens: Count | None = None
    min_length: Annotated[int, Field(ge=0)] | None = None
    stream: bool | None = None
    exclude_input_in_output: bool | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_k: Annotated[int, Field(ge=0, le=1 << 20)] | None = None
    random_seed: Annotated[int, Field(ge=0, lt=1 << 64)] | None = None  # TYPE_UINT64


class FeedbackRequest(BaseModel):
    """`POST /v1/feedback`: a client's judgement of an answer it got, by the answer's id (the completion's `id`,
    or the `X-Request-Id` of a /v2 answer); a correction is the answer it should have been."""

    model_config = ConfigDict(extra="forbid")

    id: Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_-]+$")]
    rating: Literal["good", "bad"]
    correction: Annotated[str, Field(min_length=1, max_length=32_768)] | None = None
    comment: Annotated[str, Field(max_length=4096)] | None = None


class FeedbackResponse(BaseModel):
    id: str
    object: Literal["feedback"] = "feedback"
    recorded: bool = True


class GenerateInputs(BaseModel):
    """The Triton generate inputs an OpenAI request becomes."""

    text_input: str
    max_tokens: int
    chat_history: str | None = None  # the earlier messages as JSON, as the served model reads them
    min_length: int | None = None  # no end of sequence before that many tokens (min_tokens; ignore_eos: max_tokens)
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    random_seed: int | None = None
    logprobs: int | None = None  # alternatives per token with each token's log probability
    structured_output: str | None = None  # vLLM's StructuredOutputsParams as JSON (response_format)
    apply_chat_template: bool | None = None  # False: the text as it is (completions); None: the model's setting
    prompt_logprobs: int | None = None  # the prompt's tokens scored too (echo with logprobs)
    exclude_input_in_output: bool = True
    tools: str | None = None  # the tool definitions as JSON, which vLLM's engine renders with the chat template

    def payload(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


RequestModel = TypeVar("RequestModel", bound=BaseModel)


def parse(model: type[RequestModel], body: bytes) -> RequestModel:
    """The request in `body`, or a 400 RequestError naming the first field that is wrong."""
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as exc:
        raise invalid(exc) from None


def invalid(exc: ValidationError) -> RequestError:
    first = exc.errors(include_url=False)[0]
    location = first["loc"]
    if first["type"] == "json_invalid":
        return RequestError(400, f"request body is not JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    if not location:
        return RequestError(400, "request body must be a JSON object")
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in location).lstrip(".")
    return RequestError(400, f"{path}: {first['msg']}", param=str(location[0]))


# --- responses --------------------------------------------------------------------------------------


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null where the answer is tool calls (tool_calls.py adds them)


class ChatCompletionChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: dict[str, Any] | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str
    logprobs: dict[str, Any] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, Any]  # {"role", "content"} first, {"content"} or {"tool_calls"} then, {} with the finish_reason
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class CompletionChunkChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class StreamChunk(BaseModel):
    """One server-sent event of a streamed completion; usage rides on the last."""

    id: str
    object: Literal["chat.completion.chunk", "text_completion"]
    created: int
    model: str
    choices: list[ChatChunkChoice] | list[CompletionChunkChoice]
    usage: UsageInfo | None = None

    def event(self) -> bytes:
        return f"data: {self.model_dump_json(exclude={'usage'} if self.usage is None else None)}\n\n".encode()


def chat_logprobs(tokens: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's chat `logprobs` of answer tokens as the engine sends them ({token, logprob, bytes, top_logprobs})."""
    return {"content": tokens, "refusal": None}


def completion_logprobs(tokens: list[dict[str, Any]], offset: int) -> dict[str, Any]:
    """OpenAI's completions `logprobs` of the same tokens; `offset`: where the first one starts in the answer. An
    echoed prompt's first token has neither log probability nor alternatives (null, as OpenAI and vLLM send it)."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token["token"])
    return {
        "tokens": [t["token"] for t in tokens],
        "token_logprobs": [t["logprob"] for t in tokens],
        "top_logprobs": [
            None if t["top_logprobs"] is None else {a["token"]: a["logprob"] for a in t["top_logprobs"]} for t in tokens
        ],
        "text_offset": offsets,
    }


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo

    @classmethod
    def of(cls, error: RequestError) -> ErrorResponse:
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
            error.status, "invalid_request_error" if error.status < 500 else "server_error"
        )
        return cls(error=ErrorInfo(message=error.message, type=kind, param=error.param, code=error.code))
