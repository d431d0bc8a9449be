"""No OpenAI field is ignored: every field of the `openai` SDK's own request types (and the vLLM extensions the
gateway knows) sent to the gateway of each engine (serve.backend) is honoured, reaching Triton's generate inputs,
or refused with a 400 in OpenAI's shape naming it; a field in neither list is refused; the docs' table is the one
the code holds. Against the real Starlette app with httpx.MockTransport for Triton (tests/unit/test_gateway.py's
fixtures); the same through the real stack is in tests/integration/test_service.py."""

from __future__ import annotations

import json

import httpx
import pytest

from tasks.runtime.gateway.openai_fields import ENGINES, FIELDS, page
from tests.unit.test_gateway import CHAT, QUESTION, FakeTriton, events, gateway

__all__ = ["gateway"]  # the fixture, used by name

TEXT = "/v1/completions"
BASE = {CHAT: {"messages": QUESTION}, TEXT: {"prompt": "hot:"}}
API = {CHAT: "chat", TEXT: "completions"}

# A value of each field that asks something of the engine (not its neutral value)
ASKING = {
    "model": "demo",
    "messages": [{"role": "system", "content": "One word."}, *QUESTION],
    "prompt": "cold:",
    "stream": False,
    "stream_options": {"include_usage": True},
    "max_tokens": 7,
    "max_completion_tokens": 6,
    "min_tokens": 3,
    "ignore_eos": True,
    "stop": ["\n"],
    "temperature": 0.7,
    "seed": 11,
    "top_k": 5,
    "n": 2,
    "best_of": 2,
    "top_p": 0.5,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "logit_bias": {"50256": -100},
    "logprobs": True,
    "top_logprobs": 2,
    "echo": True,
    "suffix": "end",
    "response_format": {"type": "json_object"},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "cold"},
    "reasoning_effort": "low",
    "verbosity": "low",
    "web_search_options": {},
    "store": True,
    "service_tier": "priority",
    "user": "user-1",
    "metadata": {"k": "v"},
    "safety_identifier": "hash-1",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "min_p": 0.1,
    "repetition_penalty": 1.2,
    "length_penalty": 0.5,
    "use_beam_search": True,
    "stop_token_ids": [2],
    "bad_words": ["hot"],
    "allowed_token_ids": [1, 2],
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 10,
    "prompt_logprobs": 1,
    "return_tokens_as_token_ids": True,
    "guided_json": {"type": "object"},
    "guided_regex": "[a-z]+",
    "guided_choice": ["hot", "cold"],
    "guided_grammar": "root ::= 'cold'",
    "structured_outputs": {"json": {"type": "object"}},
    "add_special_tokens": True,
    "add_generation_prompt": False,
    "continue_final_message": True,
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False},
    "documents": [{"title": "t", "text": "x"}],
    "priority": 1,
    "request_id": "r-1",
}
ASKING_TEXT = {"logprobs": 2}  # completions' logprobs is a count
WITH = {"top_logprobs": {"logprobs": True}, "tool_choice": {"tools": ASKING["tools"]}}  # what a field needs beside it
# What an honoured field's asking value makes of Triton's generate inputs (each alone, on BASE)
HONOURED_INPUTS = {
    "messages": {"chat_history": '[{"role": "system", "content": "One word."}]'},
    "prompt": {"text_input": "cold:"},
    "max_tokens": {"max_tokens": 7},
    "max_completion_tokens": {"max_tokens": 6},
    "min_tokens": {"min_length": 3},
    "ignore_eos": {"min_length": 16},  # as min_tokens = max_tokens (the default here: 16)
    "temperature": {"temperature": 0.7},
    "seed": {"random_seed": 11},
    "top_k": {"top_k": 5},
    "top_p": {"top_p": 0.5},
    "logprobs": {"logprobs": 0},  # chat: logprobs true, no alternatives
    "top_logprobs": {"logprobs": 2},
    "response_format": {"structured_output": '{"json_object": true}'},  # vllm's StructuredOutputsParams
    "tools": {"tools": json.dumps(ASKING["tools"])},  # for the chat template; tool_choice auto: read from the answer
    "tool_choice": {  # required: a non-empty array of calls, as vLLM's get_json_schema_from_tools makes it
        "structured_output": json.dumps(
            {
                "json": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "anyOf": [
                            {
                                "properties": {
                                    "name": {"type": "string", "enum": ["f"]},
                                    "parameters": {"type": "object"},
                                },
                                "required": ["name", "parameters"],
                            }
                        ],
                    },
                }
            }
        )
    },
}
HONOURED_TEXT_INPUTS = {
    "logprobs": {"logprobs": 2},
    "prompt": {"text_input": "cold:", "apply_chat_template": False},  # raw, as OpenAI's completions
    "echo": {"apply_chat_template": False},  # the gateway echoes; the engine scores the prompt only with logprobs
}


def sdk_fields(module) -> set[str]:
    """The fields of an openai SDK request type: CompletionCreateParamsBase, plus `stream` of its two variants."""
    return set(module.CompletionCreateParamsBase.__annotations__) | {"stream"}


def test_the_table_holds_every_field_of_the_openai_sdks_request_types():
    from openai.types import completion_create_params as text
    from openai.types.chat import completion_create_params as chat

    known = {api: {n for n, f in FIELDS.items() if api in f.apis and f.origin(api) == "openai"} for api in API.values()}
    assert known["chat"] == sdk_fields(chat)
    assert known["completions"] == sdk_fields(text)
    assert ASKING.keys() == FIELDS.keys()


def asking_value(path: str, name: str):
    if path == TEXT and name in ASKING_TEXT:
        return ASKING_TEXT[name]
    return ASKING[name] if not (name == "stream" and path == TEXT) else False


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_each_field_is_honoured_or_refused_naming_it_on_each_engine(gateway, engine, path):
    """Each field alone, at a value that asks something: 200 with its effect on Triton's inputs, or 400 naming it."""
    api = API[path]
    outcomes = {}
    for name, spec in FIELDS.items():
        triton = FakeTriton("cold")
        why = spec.refused_on.get(api) or spec.refused.get(engine)
        beside = WITH.get(name, {}) if why is None and api in spec.apis else {}  # else alone: it is the one named
        body = {**BASE[path], **beside, name: asking_value(path, name)}
        response = gateway(triton, backend=engine, default_max_tokens=16).post(path, json=body)
        if api not in spec.apis:
            assert response.status_code == 400, (name, response.text)
            error = response.json()["error"]
            assert error["param"] == name and error["code"] == "unknown_parameter", error
            outcomes[name] = "unknown"
            continue
        if why is None:
            assert response.status_code == 200, (name, response.text)
            expected = (HONOURED_TEXT_INPUTS if path == TEXT else {}).get(name) or HONOURED_INPUTS.get(name, {})
            assert {k: triton.inputs.get(k) for k in expected} == expected, name
            outcomes[name] = "honoured"
        else:
            assert response.status_code == 400, (name, response.text)
            error = response.json()["error"]
            assert error == {
                "message": f"{name}: {why} (serve.backend {engine})",
                "type": "invalid_request_error",
                "param": name,
                "code": "unsupported_parameter",
            }
            assert triton.requests == []
            outcomes[name] = "refused"
    print(engine, api, outcomes)
    assert {n for n, o in outcomes.items() if o != "unknown"} == {n for n, f in FIELDS.items() if api in f.apis}


@pytest.mark.parametrize("engine", ENGINES)
def test_a_neutral_value_of_a_refused_field_is_accepted(gateway, engine):
    """What LangChain and others send with every request asks nothing, and is answered."""
    neutral = {
        "n": 1,
        "top_p": 1,
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "logit_bias": {},
        "logprobs": False,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "store": False,
        "service_tier": "auto",
        "skip_special_tokens": True,
        "user": "u",
        "stream_options": None,
        "parallel_tool_calls": True,
    }
    triton = FakeTriton()
    response = gateway(triton, backend=engine).post(CHAT, json={"messages": QUESTION, **neutral})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", [CHAT, TEXT])
def test_a_field_no_one_knows_is_refused_by_name(gateway, path):
    triton = FakeTriton()
    response = gateway(triton).post(path, json={**BASE[path], "temprature": 0.5, "beam_width": 2})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "beam_width" and error["code"] == "unknown_parameter"
    assert error["message"].startswith("beam_width, temprature: not a parameter of OpenAI's")
    assert triton.requests == []


def test_a_message_field_the_model_does_not_read_is_refused(gateway):
    message = {"role": "user", "content": "hi", "name": "bob"}
    response = gateway(FakeTriton()).post(CHAT, json={"messages": [message]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert "messages[0].name: Extra inputs are not permitted" in response.json()["error"]["message"]


def test_forced_lengths_reach_every_engine_as_min_length(gateway):
    triton = FakeTriton()
    body = {"messages": QUESTION, "max_tokens": 12, "min_tokens": 4, "ignore_eos": True, "top_k": -1}
    assert gateway(triton, backend="vllm").post(CHAT, json=body).status_code == 200
    assert triton.inputs["min_length"] == 12 and "top_k" not in triton.inputs  # ignore_eos wins; -1: every token
    response = gateway(FakeTriton()).post(TEXT, json={"prompt": "x", "max_tokens": 3, "min_tokens": 4})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "min_tokens 4 is more than max_tokens 3"


def test_the_docs_table_is_the_codes():
    from pathlib import Path

    docs = Path(__file__).parents[2] / "docs" / "reference" / "openai-fields.md"
    assert docs.read_text() == page(), (
        "docs/reference/openai-fields.md is stale: "
        "python -m tasks.runtime.gateway.openai_fields > docs/reference/openai-fields.md"
    )


class ScoringTriton(FakeTriton):
    """The python backend's answer with logprobs: each piece carries its tokens, as infra/triton/llm sends them."""

    TOKENS = [("co", -0.5), ("ld", -0.25), ("", -1.0)]  # the last decodes to nothing (a special token)

    def __init__(self):
        super().__init__("cold", pieces=["co", "ld", ""])

    @staticmethod
    def scored(token: str, logprob: float) -> dict:
        alternative = {"token": "hot", "logprob": -2.0, "bytes": [104, 111, 116]}
        return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": [alternative]}

    def __call__(self, request):
        import httpx

        self.requests.append((request.url.path, json.loads(request.content)))
        tokens = [self.scored(*t) for t in self.TOKENS]
        if request.url.path.endswith("/generate_stream"):
            events = "".join(
                f"data: {json.dumps({'text_output': p, 'logprobs': json.dumps([t])})}\n\n"
                for p, t in zip(self.pieces, tokens, strict=True)
            )
            return httpx.Response(200, text=events, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"text_output": self.answer, "logprobs": json.dumps(tokens)})


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_come_back_in_each_apis_shape_per_streamed_chunk(gateway, stream):
    from tests.unit.test_gateway import events

    triton = ScoringTriton()
    client = gateway(triton)
    chat = client.post(CHAT, json={"messages": QUESTION, "logprobs": True, "top_logprobs": 1, "stream": stream})
    text = client.post(TEXT, json={"prompt": "hot:", "logprobs": 1, "stream": stream})
    assert chat.status_code == text.status_code == 200, chat.text + text.text
    assert [inputs["logprobs"] for _, inputs in triton.requests] == [1, 1]
    scored = [ScoringTriton.scored(*t) for t in ScoringTriton.TOKENS]
    if not stream:
        assert chat.json()["choices"][0]["logprobs"] == {"content": scored, "refusal": None}
        assert chat.json()["usage"]["completion_tokens"] == 3  # the tokens the engine scored, whatever the text
        assert text.json()["choices"][0]["logprobs"] == {
            "tokens": ["co", "ld", ""],
            "token_logprobs": [-0.5, -0.25, -1.0],
            "top_logprobs": [{"hot": -2.0}] * 3,
            "text_offset": [0, 2, 4],
        }
        return
    assert events(chat)[-2]["usage"]["completion_tokens"] == events(text)[-2]["usage"]["completion_tokens"] == 3
    chunks = [c["choices"][0] for c in events(chat)[1:-1]]  # after the role's chunk, before [DONE]
    assert [c["logprobs"] for c in chunks] == [{"content": [t], "refusal": None} for t in scored] + [None]
    assert [c["delta"].get("content") for c in chunks] == ["co", "ld", "", None]
    pieces = [c["choices"][0] for c in events(text)[:-1]]
    assert [p["logprobs"] and (p["logprobs"]["tokens"], p["logprobs"]["text_offset"]) for p in pieces] == [
        (["co"], [0]),
        (["ld"], [2]),
        ([""], [4]),
        None,
    ]


def test_logprobs_with_stop_or_top_logprobs_alone_are_refused_naming_them(gateway):
    client = gateway(FakeTriton())
    response = client.post(CHAT, json={"messages": QUESTION, "logprobs": True, "stop": ["."]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"
    response = client.post(CHAT, json={"messages": QUESTION, "top_logprobs": 2})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "top_logprobs needs logprobs: true"


def test_a_json_schema_reaches_vllm_as_its_structured_output_and_a_bad_format_is_named(gateway):
    schema = {"type": "object", "properties": {"answer": {"enum": ["cold", "hot"]}}, "required": ["answer"]}
    triton = FakeTriton('{"answer": "cold"}')
    client = gateway(triton, backend="vllm")
    asked = {"type": "json_schema", "json_schema": {"name": "antonym", "schema": schema}}
    assert client.post(CHAT, json={"messages": QUESTION, "response_format": asked}).status_code == 200
    assert json.loads(triton.inputs["structured_output"]) == {"json": schema}
    for bad in ({"type": "json_schema"}, {"type": "yaml"}, {"type": "json_object", "schema": {}}):
        response = client.post(CHAT, json={"messages": QUESTION, "response_format": bad})
        assert response.status_code == 400 and response.json()["error"]["param"] == "response_format", bad


def scored(token: str, logprob: float | None, alternatives: int = 1) -> dict:
    top = None if logprob is None else [{"token": token, "logprob": logprob, "bytes": []}][:alternatives]
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": top}


class EchoingTriton(FakeTriton):
    """An engine that scores: the answer's tokens in `logprobs`, the prompt's in `prompt_logprobs` (on the first
    response), as infra/triton/llm and infra/triton/vllm send them."""

    PROMPT = [scored("hot", None), scored(":", -1.5)]
    ANSWER = [scored("co", -0.25), scored("ld", -0.5)]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append((request.url.path, json.loads(request.content or b"{}")))
        prompt = json.dumps(self.PROMPT)
        if request.url.path.endswith("/generate_stream"):
            first = {"text_output": "co", "logprobs": json.dumps(self.ANSWER[:1]), "prompt_logprobs": prompt}
            then = {"text_output": "ld", "logprobs": json.dumps(self.ANSWER[1:])}
            events = "".join(f"data: {json.dumps(e)}\n\n" for e in (first, then))
            return httpx.Response(200, text=events, headers={"content-type": "text/event-stream"})
        answer = {"text_output": "cold", "logprobs": json.dumps(self.ANSWER), "prompt_logprobs": prompt}
        return httpx.Response(200, json=answer)


def test_echo_puts_the_prompt_and_its_scored_tokens_before_the_answer_as_loglikelihood_harnesses_read_them(gateway):
    """lm-evaluation-harness's local-completions scores a continuation from `token_logprobs[ctxlen:-1]` of an echoed
    prompt (lm_eval/models/openai_completions.py): the prompt's tokens first, the first one null, then the answer's."""
    triton = EchoingTriton()
    body = {"prompt": "hot:", "max_tokens": 2, "logprobs": 1, "echo": True, "temperature": 0}
    choice = gateway(triton, backend="python").post(TEXT, json=body).json()["choices"][0]
    assert triton.inputs["prompt_logprobs"] == 1 and triton.inputs["apply_chat_template"] is False
    assert choice["text"] == "hot:cold"
    assert choice["logprobs"] == {
        "tokens": ["hot", ":", "co", "ld"],
        "token_logprobs": [None, -1.5, -0.25, -0.5],
        "top_logprobs": [None, {":": -1.5}, {"co": -0.25}, {"ld": -0.5}],
        "text_offset": [0, 3, 4, 6],
    }

    triton = EchoingTriton()
    streamed = gateway(triton, backend="vllm").post(TEXT, json={**body, "stream": True})
    chunks = [c for c in events(streamed) if isinstance(c, dict)]
    assert [c["choices"][0]["text"] for c in chunks] == ["hot:", "co", "ld", ""]
    assert [c["choices"][0]["logprobs"]["tokens"] for c in chunks[:3]] == [["hot", ":"], ["co"], ["ld"]]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks[:3]] == [[0, 3], [4], [6]]

    triton = FakeTriton("cold")  # echo alone: the prompt's text, and no scoring asked of the engine
    plain = gateway(triton).post(TEXT, json={"prompt": "hot:", "echo": True}).json()["choices"][0]
    assert plain["text"] == "hot:cold" and plain["logprobs"] is None and "prompt_logprobs" not in triton.inputs


class CountingTriton(FakeTriton):
    """An engine that says how many tokens each response came from and why it stopped, as every engine here does:
    16 tokens made for text that re-encodes to 24 (a forced answer of odd tokens), ended by max_tokens."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append((request.url.path, json.loads(request.content or b"{}")))
        if request.url.path.endswith("/generate_stream"):
            pieces = [{"text_output": "co", "token_count": 9}, {"text_output": "ld", "token_count": 7}]
            pieces[-1]["finish_reason"] = "length"
            events = "".join(f"data: {json.dumps(p)}\n\n" for p in pieces)
            return httpx.Response(200, text=events, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"text_output": "cold", "token_count": 16, "finish_reason": "length"})


@pytest.mark.parametrize("stream", [False, True])
def test_usage_counts_the_tokens_the_engine_made_and_the_finish_reason_is_the_engines(gateway, stream):
    """usage.completion_tokens is the engine's count (AIPerf and genai-perf read it, and limits charge it), not a
    re-encoding of the text, and finish_reason is the engine's where no stop sequence cut the answer."""
    body = {"messages": QUESTION, "max_tokens": 16, "stream": stream}
    response = gateway(CountingTriton()).post(CHAT, json=body)
    last = events(response)[-2] if stream else response.json()
    assert last["usage"]["completion_tokens"] == 16 and last["choices"][0]["finish_reason"] == "length"
