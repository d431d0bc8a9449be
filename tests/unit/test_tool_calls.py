"""Tool calls on vLLM (tasks/runtime/gateway/tool_calls.py): the engine inputs a request's tools and tool_choice
become, the hermes reading of an answer, fed whole or piece by piece, and what the gateway answers, whole and
streamed, read back through the openai SDK's own types (ChatCompletion, ChatCompletionChunk, and the SDK's stream
accumulator), with the refusals naming their field. Against the real Starlette app with FakeTriton
(tests/unit/test_gateway.py); the same on a real vLLM engine is tests/integration/test_serving.py
(vllm_keeps_the_openai_fields)."""

from __future__ import annotations

import json

import pytest

from tasks.base_model import CHATML_TEMPLATE, train_tokenizer
from tasks.runtime.gateway.protocol import ChatCompletionRequest
from tasks.runtime.gateway.tool_calls import CallReader, ToolCalling
from tests.unit.test_gateway import CHAT, QUESTION, FakeTriton, events, gateway

__all__ = ["gateway"]  # the fixture, used by name

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object's schema
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# A chat template that renders tools as Qwen2.5's does (a system turn listing them, asking for <tool_call> JSON)
TOOLS_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\nYou may call functions.\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{ \'\\n</tools>\\nAnswer a call as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}" + CHATML_TEMPLATE
)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Two tokenizers of one vocabulary: cpu-tiny's ChatML template (renders no tools) and one that renders them."""
    plain = tmp_path_factory.mktemp("chatml")
    tokenizer = train_tokenizer(["What is the opposite of hot? cold get_weather Paris city"] * 20, 300)
    tokenizer.save_pretrained(plain)
    rendering = tmp_path_factory.mktemp("tools")
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(rendering)
    return {"chatml": plain, "tools": rendering}


def reader(choice: str = "auto", parallel: bool = True, function: str = "") -> CallReader:
    return CallReader(choice, function, parallel)  # type: ignore[arg-type]


def read(text: str, pieces: int | None = None, **kwargs) -> list[dict]:
    """The deltas of `text` fed whole, or in pieces of `pieces` characters."""
    calls = reader(**kwargs)
    step = pieces or len(text) or 1
    fed = [delta for start in range(0, len(text), step) for delta in calls.feed(text[start : start + step])]
    return [*fed, *calls.close()]


def gathered(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of deltas, gathered as a client gathers a stream."""
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            name, arguments = calls.setdefault(call["index"], ["", ""])
            calls[call["index"]] = [name + call["function"].get("name", ""), arguments + call["function"]["arguments"]]
    return content, [(name, arguments) for name, arguments in calls.values()]


# --- reading an answer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("pieces", [None, 1, 3, 7])
def test_auto_reads_hermes_calls_after_the_content_however_the_text_is_split(pieces):
    text = f"Let me look.{CALL}\n{CALL.replace('Paris', '巴黎')}"
    content, calls = gathered(read(text, pieces))
    assert content == "Let me look."
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "巴黎"}')]


def test_auto_holds_back_what_could_begin_a_tag_and_sends_it_when_it_does_not():
    calls = reader()
    assert calls.feed("a <to") == [{"content": "a "}]  # "<to" may begin <tool_call>
    assert calls.feed("ol") == []
    assert calls.feed("s and more") == [{"content": "<tools and more"}]
    assert calls.feed("<tool") == [] and calls.close() == [{"content": "<tool"}]  # the answer ended: not a tag


def test_auto_keeps_a_region_that_is_no_call_as_text_and_reads_an_unclosed_last_one():
    assert gathered(read("<tool_call>not json</tool_call>")) == ("<tool_call>not json</tool_call>", [])
    assert gathered(read('<tool_call>{"name": 1, "arguments": {}}</tool_call>'))[1] == []
    unclosed = '<tool_call>{"name": "get_time", "arguments": {}}</tool_'  # max_tokens ended it in the tag
    assert gathered(read(unclosed, 4)) == ("", [("get_time", "{}")])
    assert gathered(read("<tool_call>{")) == ("<tool_call>{", [])
    assert gathered(read("x" * 5 + "[" * 5000, 64))[1] == []  # deep nesting is text, not a RecursionError


def test_parallel_false_keeps_the_first_call_only():
    assert gathered(read(CALL + CALL, parallel=False))[1] == [("get_weather", '{"city": "Paris"}')]
    required = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    assert gathered(read(required, choice="required", parallel=False))[1] == [("get_weather", '{"city": "Oslo"}')]


def test_required_reads_the_array_when_whole_and_keeps_a_cut_one_as_text():
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    calls = reader("required")
    assert calls.feed(text[:20]) == [] and calls.feed(text[20:]) == []  # nothing until the answer is whole
    assert gathered(calls.close())[1] == [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    assert gathered(read(text[:30], choice="required")) == (text[:30], [])


def test_named_streams_its_arguments_behind_a_first_delta_that_names_the_call():
    deltas = read('{"city": "Oslo"}', 5, choice="named", function="get_weather")
    first, *rest = deltas
    (call,) = first["tool_calls"]
    assert call["id"].startswith("call_") and {k: v for k, v in call.items() if k != "id"} == {
        "index": 0,
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert [d["tool_calls"][0]["function"]["arguments"] for d in rest] == ['{"cit', 'y": "', 'Oslo"', "}"]
    assert gathered(deltas) == ("", [("get_weather", '{"city": "Oslo"}')])


def test_none_is_all_content():
    assert gathered(read(CALL, 4, choice="none")) == (CALL, [])


def tool_calling(**body) -> ToolCalling | None:
    return ToolCalling.of(ChatCompletionRequest.model_validate({"messages": QUESTION, **body}), True)


def test_each_choice_becomes_the_engine_inputs_vllms_server_would_make():
    auto = tool_calling(tools=[WEATHER, CLOCK])
    assert auto is not None and auto.inputs() == {"tools": json.dumps([WEATHER, CLOCK])}
    named = tool_calling(tools=[WEATHER, CLOCK], tool_choice=NAMED)
    assert named is not None and json.loads(named.inputs()["structured_output"]) == {
        "json": WEATHER["function"]["parameters"]
    }
    clock = tool_calling(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert clock is not None and clock.schema() == {"type": "object", "properties": {}}
    required = tool_calling(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)
    assert required is not None and required.schema() == {
        "type": "array",
        "minItems": 1,
        "maxItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "parameters": parameters,
                    },
                    "required": ["name", "parameters"],
                }
                for name, parameters in (
                    ("get_weather", WEATHER["function"]["parameters"]),
                    ("get_time", {"type": "object", "properties": {}}),
                )
            ],
        },
    }
    none = tool_calling(tools=[WEATHER], tool_choice="none")
    assert none is not None and none.inputs() == {"tools": json.dumps([WEATHER])}  # rendered, not read
    assert tool_calling(tools=[], tool_choice="none") is None


# --- through the gateway --------------------------------------------------------------------------------


def completion(response) -> dict:
    """The body, after the openai SDK's ChatCompletion has read it."""
    from openai.types.chat import ChatCompletion

    assert response.status_code == 200, response.text
    body = response.json()
    ChatCompletion.model_validate(body)
    return body


def streamed(response, tools: list[dict]):
    """The stream's final completion as the openai SDK's accumulator builds it from its chunks (each read by the
    SDK's ChatCompletionChunk), with the chunks' deltas."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    assert response.status_code == 200, response.text
    state = ChatCompletionStreamState(input_tools=tools)
    chunks = [ChatCompletionChunk.model_validate(c) for c in events(response) if c != "[DONE]"]
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.get_final_completion(), [c.choices[0].delta for c in chunks if c.choices]


def test_a_named_choice_answers_one_call_whole_and_streamed(gateway):
    arguments = '{"city": "Paris"}'
    triton = FakeTriton(arguments, pieces=['{"city', '": "Par', 'is"}'])
    client = gateway(triton, backend="vllm")
    body = {"messages": QUESTION, "tools": [WEATHER, CLOCK], "tool_choice": NAMED, "max_tokens": 20}
    whole = completion(client.post(CHAT, json=body))
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "stop"  # as vLLM's server ends a named call
    assert choice["message"]["content"] is None and len(choice["message"]["tool_calls"]) == 1
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["function"] == {"name": "get_weather", "arguments": arguments}
    path, inputs = triton.requests[0]
    assert path.endswith("/generate") and json.loads(inputs["tools"]) == [WEATHER, CLOCK]
    assert json.loads(inputs["structured_output"]) == {"json": WEATHER["function"]["parameters"]}

    final, deltas = streamed(client.post(CHAT, json={**body, "stream": True}), [WEATHER, CLOCK])
    assert final.choices[0].finish_reason == "stop"
    (call,) = final.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", arguments)
    pieces = [d.tool_calls[0].function.arguments for d in deltas if d.tool_calls]
    assert pieces == ["", '{"city', '": "Par', 'is"}']  # the arguments as decoded, behind the naming delta


def test_required_answers_the_calls_with_finish_reason_tool_calls(gateway):
    answer = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    client = gateway(FakeTriton(answer, pieces=[answer[:25], answer[25:]]), backend="vllm")
    body = {"messages": QUESTION, "tools": [WEATHER, CLOCK], "tool_choice": "required"}
    choice = completion(client.post(CHAT, json=body))["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    expected = [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == expected
    final, _ = streamed(client.post(CHAT, json={**body, "stream": True}), [WEATHER, CLOCK])
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == expected
    assert len({c.id for c in final.choices[0].message.tool_calls}) == 2


def test_auto_reads_the_call_where_the_template_renders_tools_and_counts_them_in_the_prompt(gateway, tokenizers):
    from transformers import AutoTokenizer

    from tasks.quality.chat import encode_prompt

    answer = f"Checking.{CALL}"
    client = gateway(
        FakeTriton(answer, pieces=["Check", "ing.<tool", "_call>\n{", answer[22:]]),
        backend="vllm",
        tokenizer_dir=tokenizers["tools"],
    )
    body = {"messages": QUESTION, "tools": [WEATHER], "max_tokens": 200}  # tool_choice auto: the default
    whole = completion(client.post(CHAT, json=body))
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    tokenizer, question = AutoTokenizer.from_pretrained(tokenizers["tools"]), QUESTION[0]["content"]
    prompt_tokens = len(encode_prompt(tokenizer, question, [], True, [WEATHER]))
    assert whole["usage"]["prompt_tokens"] == prompt_tokens > len(encode_prompt(tokenizer, question, [], True))

    final, deltas = streamed(client.post(CHAT, json={**body, "stream": True}), [WEATHER])
    assert final.choices[0].finish_reason == "tool_calls" and final.choices[0].message.content == "Checking."
    assert [d.content for d in deltas if d.content] == ["Check", "ing."]  # "<tool" held back, never sent
    (call,) = final.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')

    plain = completion(client.post(CHAT, json={**body, "tool_choice": "none"}))["choices"][0]
    assert plain["finish_reason"] == "stop"
    assert plain["message"] == {"role": "assistant", "content": answer}  # rendered, not read


def test_auto_on_a_template_that_renders_no_tools_is_refused_naming_tools_and_a_forced_call_answers(
    gateway, tokenizers
):
    triton = FakeTriton('{"city": "Paris"}')
    client = gateway(triton, backend="vllm", tokenizer_dir=tokenizers["chatml"])
    for choice in ({}, {"tool_choice": "auto"}):
        response = client.post(CHAT, json={"messages": QUESTION, "tools": [WEATHER], **choice})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "tools" and "does not render tools" in error["message"]
        assert 'tool_choice "required"' in error["message"]
    assert triton.requests == []
    forced = client.post(CHAT, json={"messages": QUESTION, "tools": [WEATHER], "tool_choice": NAMED})
    assert completion(forced)["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"tool_choice": "required"}, "tool_choice", "tool_choice: needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
            "no tool is named 'f'",
        ),
        ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice", "tool_choice"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools", "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "tools[0].function.name"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "not with a forced tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": NAMED, "stop": ["}"]}, "stop", "not with a forced tool_choice"),
        ({"functions": [WEATHER["function"]]}, "functions", "deprecated by OpenAI for tools and tool_choice"),
        ({"function_call": "auto"}, "function_call", "deprecated by OpenAI"),
    ],
)
def test_what_does_not_fit_is_refused_naming_it(gateway, body, param, message):
    triton = FakeTriton()
    response = gateway(triton, backend="vllm").post(CHAT, json={"messages": QUESTION, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert triton.requests == []


@pytest.mark.parametrize("engine", ["python", "llmapi"])
def test_the_other_engines_refuse_tools_pointing_at_vllm(gateway, engine):
    response = gateway(FakeTriton(), backend=engine).post(CHAT, json={"messages": QUESTION, "tools": [WEATHER]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tools"
    assert response.json()["error"]["message"].endswith(f"serve with serve.backend vllm (serve.backend {engine})")


@pytest.mark.parametrize(
    "turn",
    [
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {}}]},
    ],
)
def test_a_tool_calls_second_turn_is_refused_in_one_line(gateway, turn):
    messages = [*QUESTION, turn, {"role": "user", "content": "And now?"}]
    response = gateway(FakeTriton(), backend="vllm").post(CHAT, json={"messages": messages, "tools": [WEATHER]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert response.json()["error"]["message"].startswith("messages[1]: a tool call's turn (role tool, or an assistant")


def test_an_exchange_with_tools_is_not_captured(gateway, tmp_path):
    """A harvest makes training conversations of text answers: a call's arguments without the tools they answer
    would teach the model nonsense."""
    from tests.unit.test_capture import settings, wait_written

    client = gateway(FakeTriton('{"city": "Paris"}'), backend="vllm", capture=settings(tmp_path))
    named = {"messages": QUESTION, "tools": [WEATHER], "tool_choice": NAMED}
    assert client.post(CHAT, json=named).status_code == 200
    assert client.post(CHAT, json={**named, "stream": True}).status_code == 200
    assert client.post(CHAT, json={**named, "tool_choice": "none"}).status_code == 200
    assert client.post(CHAT, json={"messages": QUESTION}).status_code == 200  # kept after the others, in order
    (kept,) = wait_written(tmp_path, "exchanges", 1)
    assert kept["messages"] == QUESTION and "tools" not in kept
