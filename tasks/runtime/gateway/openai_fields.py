"""Which OpenAI request fields each serving engine honours, the 400 a request gets for one it would not, and the
generate inputs the honoured ones become (`sampling`, and `scored_tokens` for the logprobs that come back).

Every field of the `openai` SDK's own request types (openai 2.8.0: `openai/types/chat/completion_create_params.py`
and `openai/types/completion_create_params.py`, CompletionCreateParamsBase, plus `stream`), and the vLLM
extensions that load tools and harnesses send (min_tokens, ignore_eos, top_k, ...), is listed here once, with the
engines (serve.backend: python, vllm, llmapi) that do not honour it and why. A request is refused, naming the field
and the reason, where it sets such a field to anything but its neutral value (the value that asks for nothing:
clients such as LangChain send `"top_p": 1, "n": 1, "presence_penalty": 0` with every request); a field this table
does not know is refused as OpenAI refuses it. Nothing is ignored silently.

The documentation's table (docs/reference/openai-fields.md) is printed from this one:
    python -m tasks.runtime.gateway.openai_fields > docs/reference/openai-fields.md
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tasks.runtime.gateway.protocol import GenerateInputs, OpenAIRequest, RequestError

Engine = Literal["python", "vllm", "llmapi"]
ENGINES: tuple[Engine, ...] = ("python", "vllm", "llmapi")
Api = Literal["chat", "completions"]
API_NAMES: dict[Api, str] = {"chat": "chat completions", "completions": "completions"}
BOTH: frozenset[Api] = frozenset(("chat", "completions"))
CHAT: frozenset[Api] = frozenset(("chat",))
TEXT: frozenset[Api] = frozenset(("completions",))

# Why an engine does not honour a field. The gateway hands every engine the same Triton generate inputs
# (infra/triton/llm/config.pbtxt: text_input, chat_history, max_tokens, min_length, temperature, top_k, random_seed);
# a field with no input there reaches no engine, whatever the engine itself could do.
NOT_AN_INPUT = "the gateway's generate inputs carry no {what} to any engine (vLLM's own server has it)"


def not_an_input(what: str) -> dict[Engine, str]:
    return dict.fromkeys(ENGINES, NOT_AN_INPUT.format(what=what))


def everywhere(reason: str) -> dict[Engine, str]:
    return dict.fromkeys(ENGINES, reason)


@dataclass(frozen=True)
class Neutral:
    """The values of a field that ask nothing of the engine: null, or one of `values` (compared with their type:
    false is not 0), or an empty list, object or string where `empty`; every value where `anything`."""

    values: tuple[Any, ...] = ()
    empty: bool = False
    anything: bool = False

    def __call__(self, value: Any) -> bool:
        if value is None or self.anything or (self.empty and value in ([], {}, "")):
            return True
        return any(type(value) is type(v) and value == v for v in self.values)

    def __str__(self) -> str:
        if self.anything:
            return "any"
        shown = ["null", *(json.dumps(v) for v in self.values), *(["empty"] if self.empty else [])]
        return ", ".join(f"`{v}`" if v != "empty" else v for v in shown)


def absent_or(*values: Any) -> Neutral:
    return Neutral(values)


any_value = Neutral(anything=True)
empty = Neutral(empty=True)


@dataclass(frozen=True)
class OpenAIField:
    apis: frozenset[Api]
    source: Literal["openai", "vllm"]
    neutral: Neutral = any_value  # a value that asks for nothing of the engine
    refused: Mapping[Engine, str] = field(default_factory=dict)  # engine -> why it does not honour the field
    how: str = ""  # how it is honoured, for the docs
    vllm_on: frozenset[Api] = frozenset()  # an OpenAI field that only vLLM's server takes on these APIs
    refused_on: Mapping[Api, str] = field(default_factory=dict)  # API -> why no engine honours it there

    def origin(self, api: Api) -> str:
        return "vllm" if api in self.vllm_on else self.source


def honoured(apis: frozenset[Api], how: str, source: Literal["openai", "vllm"] = "openai") -> OpenAIField:
    return OpenAIField(apis, source, how=how)


def refused(
    apis: frozenset[Api],
    neutral: Neutral,
    reasons: Mapping[Engine, str],
    source: Literal["openai", "vllm"] = "openai",
    how: str = "",
    vllm_on: frozenset[Api] = frozenset(),
) -> OpenAIField:
    return OpenAIField(apis, source, neutral, reasons, how, vllm_on)


INFORMATIONAL = "accepted; it asks nothing of the answer (an identifier or a hint)"
TOOLS: dict[Engine, str] = {
    "python": "the python backend has no tool parser; serve with serve.backend vllm",
    "llmapi": "the gateway does not pass tools to TensorRT-LLM's LLM API; serve with serve.backend vllm",
}
FUNCTIONS: dict[Engine, str] = {**TOOLS, "vllm": "deprecated by OpenAI for tools and tool_choice; send those"}
RESPONSE_FORMAT: dict[Engine, str] = {
    "python": "the python backend has no guided decoding; serve with serve.backend vllm",
    "llmapi": "the gateway does not pass guided decoding to TensorRT-LLM's LLM API",
}
GUIDED: dict[Engine, str] = {
    **RESPONSE_FORMAT,
    "vllm": "vLLM's own guided_* fields are not passed; use response_format (json_object, json_schema)",
}
LOGPROBS: dict[Engine, str] = {"llmapi": "the gateway does not pass logprobs to TensorRT-LLM's LLM API yet"}
PROMPT_LOGPROBS: dict[Engine, str] = {
    **LOGPROBS,
    "python": "the prompt's log probabilities come with echo and logprobs on completions",
    "vllm": "the prompt's log probabilities come with echo and logprobs on completions",
}
PENALTIES: dict[Engine, str] = {
    "python": "the python backend applies no penalties or logit biases",
    "vllm": NOT_AN_INPUT.format(what="penalties or logit biases"),
    "llmapi": NOT_AN_INPUT.format(what="penalties or logit biases"),
}
ONE_CHOICE = everywhere("one choice per request (the served model answers once); send n requests")

FIELDS: dict[str, OpenAIField] = {
    # the request itself
    "model": honoured(
        BOTH,
        "the service's name, or a live version with serve.version_pinning (GET /v1/models lists them); another is 404",
    ),
    "messages": honoured(CHAT, "system, user and assistant turns of text, ending with the user's"),
    "prompt": honoured(TEXT, "one string, encoded as it is (no chat template), as OpenAI's and vLLM's completions"),
    "stream": honoured(BOTH, "server-sent events, one per decoded piece, usage on the last"),
    "stream_options": honoured(BOTH, "include_usage: usage rides on the last event (always)"),
    # length
    "max_tokens": honoured(BOTH, "bounded by the model's context"),
    "max_completion_tokens": honoured(CHAT, "as max_tokens; wins where both are sent"),
    "min_tokens": honoured(BOTH, "end-of-sequence suppressed until that many tokens", "vllm"),
    "ignore_eos": honoured(BOTH, "runs to max_tokens (as min_tokens = max_tokens)", "vllm"),
    "stop": honoured(BOTH, "up to 4 sequences, cut by the gateway"),
    # sampling
    "temperature": honoured(BOTH, "0 is greedy"),
    "seed": honoured(BOTH, "per request; TensorRT-LLM 1.2 refuses it for a sampled request (its sampler has none)"),
    "top_k": honoured(BOTH, "0 or -1: every token", "vllm"),
    "n": refused(BOTH, absent_or(1), ONE_CHOICE),
    "best_of": refused(TEXT, absent_or(1), ONE_CHOICE),
    "top_p": honoured(BOTH, "nucleus sampling, with temperature > 0; 1: every token"),
    "frequency_penalty": refused(BOTH, absent_or(0, 0.0), PENALTIES),
    "presence_penalty": refused(BOTH, absent_or(0, 0.0), PENALTIES),
    "logit_bias": refused(BOTH, empty, PENALTIES),
    # what comes back
    "logprobs": refused(
        BOTH,
        absent_or(False),
        LOGPROBS,
        how="python: from its logits; vllm: SamplingParams.logprobs; per token, per streamed chunk; not with stop",
    ),
    "top_logprobs": refused(CHAT, absent_or(0), LOGPROBS, how="0 to 20, with logprobs: true"),
    "echo": OpenAIField(
        BOTH,
        "openai",
        absent_or(False),
        refused_on={"chat": "a chat answer does not echo the conversation (vLLM's extension); use completions"},
        how="completions: the prompt before the answer; with logprobs, the prompt's tokens scored first (the first "
        "null), as lm-evaluation-harness's loglikelihood reads them",
        vllm_on=CHAT,
    ),
    "suffix": refused(TEXT, empty, everywhere("no engine here inserts text (suffix)")),
    "response_format": refused(
        BOTH,
        absent_or({"type": "text"}),
        RESPONSE_FORMAT,
        vllm_on=TEXT,
        how="vllm: json_object, json_schema (its schema) through vLLM's structured outputs",
    ),
    "tools": refused(
        CHAT,
        empty,
        TOOLS,
        how="vllm: rendered by the model's chat template; function tools; tool_calls.py",
    ),
    "tool_choice": refused(
        CHAT,
        absent_or("none"),
        TOOLS,
        how="vllm: auto (hermes `<tool_call>` parsing; refused where the template renders no tools), required and "
        "a named function (guided decoding), none",
    ),
    "parallel_tool_calls": OpenAIField(CHAT, "openai", how="false: at most one tool call; refused where tools are"),
    "functions": refused(CHAT, empty, FUNCTIONS),
    "function_call": refused(CHAT, absent_or("none"), FUNCTIONS),
    "audio": refused(CHAT, empty, everywhere("the served models answer in text only")),
    "modalities": refused(CHAT, absent_or(["text"]), everywhere("the served models answer in text only")),
    "prediction": refused(CHAT, empty, everywhere("no engine here takes a predicted output")),
    "reasoning_effort": refused(CHAT, absent_or(), everywhere("the served models are not reasoning models")),
    "verbosity": refused(CHAT, absent_or(), everywhere("the served models have no verbosity control")),
    "web_search_options": refused(CHAT, absent_or(), everywhere("no web search here")),
    "store": refused(
        CHAT,
        absent_or(False),
        everywhere("completions are not stored for retrieval (serve.capture keeps exchanges for training)"),
    ),
    "service_tier": refused(CHAT, absent_or("auto", "default"), everywhere("one service tier here: auto (or default)")),
    # identifiers and hints
    "user": OpenAIField(BOTH, "openai", how=INFORMATIONAL),
    "metadata": OpenAIField(CHAT, "openai", how=INFORMATIONAL),
    "safety_identifier": OpenAIField(CHAT, "openai", how=INFORMATIONAL),
    "prompt_cache_key": OpenAIField(CHAT, "openai", how=INFORMATIONAL),
    "prompt_cache_retention": OpenAIField(CHAT, "openai", how=INFORMATIONAL),
    # vLLM's extensions (vllm/entrypoints/openai/protocol.py) that clients and load tools send
    "min_p": refused(BOTH, absent_or(0, 0.0), not_an_input("min_p"), "vllm"),
    "repetition_penalty": refused(BOTH, absent_or(1, 1.0), PENALTIES, "vllm"),
    "length_penalty": refused(BOTH, absent_or(1, 1.0), everywhere("no beam search here"), "vllm"),
    "use_beam_search": refused(BOTH, absent_or(False), everywhere("no beam search here"), "vllm"),
    "stop_token_ids": refused(BOTH, empty, not_an_input("stop token ids; use stop"), "vllm"),
    "bad_words": refused(BOTH, empty, PENALTIES, "vllm"),
    "allowed_token_ids": refused(BOTH, empty, PENALTIES, "vllm"),
    "include_stop_str_in_output": refused(BOTH, absent_or(False), everywhere("the stop sequence is cut"), "vllm"),
    "skip_special_tokens": refused(BOTH, absent_or(True), everywhere("special tokens are always skipped"), "vllm"),
    "spaces_between_special_tokens": refused(BOTH, absent_or(True), not_an_input("detokenizer options"), "vllm"),
    "truncate_prompt_tokens": refused(BOTH, absent_or(), everywhere("prompts are never truncated here"), "vllm"),
    "prompt_logprobs": refused(BOTH, absent_or(), PROMPT_LOGPROBS, "vllm"),
    "return_tokens_as_token_ids": refused(
        BOTH, absent_or(False), everywhere("logprobs name their tokens by text and bytes, not by id"), "vllm"
    ),
    "guided_json": refused(BOTH, empty, GUIDED, "vllm"),
    "guided_regex": refused(BOTH, empty, GUIDED, "vllm"),
    "guided_choice": refused(BOTH, empty, GUIDED, "vllm"),
    "guided_grammar": refused(BOTH, empty, GUIDED, "vllm"),
    "structured_outputs": refused(BOTH, empty, GUIDED, "vllm"),
    "add_special_tokens": refused(
        BOTH,
        absent_or(),
        everywhere("the prompt is encoded as training encoded it (serve.apply_chat_template)"),
        "vllm",
    ),
    "add_generation_prompt": refused(
        CHAT, absent_or(True), everywhere("the chat template always adds the generation prompt"), "vllm"
    ),
    "continue_final_message": refused(
        CHAT, absent_or(False), everywhere("the last message must be the user's"), "vllm"
    ),
    "chat_template": refused(
        CHAT, empty, everywhere("the model's own chat template is the train/serve contract"), "vllm"
    ),
    "chat_template_kwargs": refused(
        CHAT, empty, everywhere("the model's own chat template is the train/serve contract"), "vllm"
    ),
    "documents": refused(CHAT, empty, everywhere("the chat template takes no documents here"), "vllm"),
    "priority": refused(BOTH, absent_or(0), everywhere("requests are served first come, first served"), "vllm"),
    "request_id": refused(BOTH, absent_or(), everywhere("the gateway names each request (X-Request-Id)"), "vllm"),
}


def check_fields(api: Api, sent: Mapping[str, Any], engine: Engine) -> None:
    """Refuse (400, OpenAI's shape) a request to `api` on `engine` that sets a field it would not honour, or one
    no one knows; `sent` is every field the body carried, with its value."""
    unknown = sorted(name for name in sent if name not in FIELDS or api not in FIELDS[name].apis)
    if unknown:
        names = ", ".join(unknown)
        raise RequestError(
            400,
            f"{names}: not a parameter of OpenAI's {API_NAMES[api]} API, nor a vLLM extension this service knows",
            param=unknown[0],
            code="unknown_parameter",
        )
    for name, value in sent.items():
        spec = FIELDS[name]
        why = spec.refused_on.get(api) or spec.refused.get(engine)
        if why is not None and not spec.neutral(value):
            raise RequestError(400, f"{name}: {why} (serve.backend {engine})", param=name, code="unsupported_parameter")


def sampling(request: OpenAIRequest, max_tokens: int) -> dict[str, Any]:
    """The generate inputs of a request's length and sampling fields (those check_fields lets through)."""
    min_length = request.min_tokens or None
    if request.ignore_eos:  # vLLM's ignore_eos, as min_tokens = max_tokens: the answer runs to its budget
        min_length = max_tokens
    elif min_length is not None and min_length > max_tokens:
        raise RequestError(400, f"min_tokens {min_length} is more than max_tokens {max_tokens}", param="min_tokens")
    alternatives = request.alternatives()
    if alternatives is not None and request.stop:
        # the gateway cuts stop sequences from the text, after the engine made (and scored) the tokens
        raise RequestError(
            400,
            "logprobs: not with stop (the gateway cuts stop sequences from the text, after the "
            "engine scored its tokens); send one or the other",
            param="logprobs",
        )
    return {
        "max_tokens": max_tokens,
        "min_length": min_length,
        "temperature": request.temperature,
        "top_k": request.top_k if request.top_k and request.top_k > 0 else None,
        "top_p": request.top_p if request.top_p is not None and request.top_p < 1 else None,
        "random_seed": request.seed,
        "logprobs": alternatives,
        "structured_output": request.response_format.structured_output() if request.response_format else None,
    }


def scored_tokens(outputs: dict[str, Any], inputs: GenerateInputs) -> list[dict[str, Any]] | None:
    """The answer tokens with their log probabilities that an engine's response carries, where they were asked for."""
    if inputs.logprobs is None:
        return None
    return list(json.loads(outputs.get("logprobs") or "[]"))


def scored_prompt(outputs: dict[str, Any], inputs: GenerateInputs) -> list[dict[str, Any]] | None:
    """The prompt's tokens with their log probabilities (the first with none), where echo asked for them."""
    if inputs.prompt_logprobs is None:
        return None
    return list(json.loads(outputs.get("prompt_logprobs") or "[]"))


def status(spec: OpenAIField, engine: Engine) -> str:
    why = spec.refused.get(engine)
    if why is not None:
        return f"refused: {why}"
    return "honoured" + "".join(f"; refused on {api}: {reason}" for api, reason in spec.refused_on.items())


def table(apis: Iterable[Api] = ("chat", "completions")) -> str:
    """The docs' table: each field, where it is sent, what each engine does with a value that asks for something,
    and the values accepted everywhere (neutral)."""
    lines = [
        "| field | API | from | " + " | ".join(ENGINES) + " | neutral values (accepted everywhere) | notes |",
        "|---|---|---|" + "---|" * len(ENGINES) + "---|---|",
    ]
    for name, spec in FIELDS.items():
        where = " + ".join(api for api in apis if api in spec.apis)
        origin = " + ".join(sorted({spec.origin(api) for api in apis if api in spec.apis}))
        cells = [status(spec, engine) for engine in ENGINES]
        neutral = str(spec.neutral) if spec.refused or spec.refused_on else "-"
        lines.append(f"| `{name}` | {where} | {origin} | " + " | ".join(cells) + f" | {neutral} | {spec.how} |")
    return "\n".join(lines)


PAGE = """# OpenAI request fields, by engine

<!-- Generated from tasks/runtime/gateway/openai_fields.py:
`python -m tasks.runtime.gateway.openai_fields > docs/reference/openai-fields.md`; do not edit. -->

Every field of OpenAI's chat completions and completions requests (the `openai` SDK's own request types,
openai 2.8.0) and the vLLM extensions that clients and load tools send, with what each engine of
`serve.backend` does with it behind `llmops serve`'s `/v1`. A field is either honoured or refused with a 400 in
OpenAI's error shape that names it and says why (`"param"`: the field; `"code"`: `unsupported_parameter`, or
`unknown_parameter` for a field that is in neither list). A refused field is still accepted at its neutral value,
the one that asks for nothing (`"n": 1`, `"top_p": 1`, `"logprobs": false`, `"tools": []`, null), as many
clients send those with every request. Nothing is ignored silently.

"""


def page() -> str:
    return PAGE + table() + "\n"


if __name__ == "__main__":
    print(page(), end="")
