"""How the gateway of `llmops serve` answers what goes wrong, in each API's own shape (OpenAI's on /v1,
Triton's on /v2): unknown paths and wrong methods, bodies that are not JSON (broken, nested 100,000 deep, a
lone surrogate, invalid UTF-8), /v2 inputs the model does not have, a Triton that is down, restarting or
failing (503 with Retry-After, never its own words), and any unexpected exception (500 with a request id only).
The real app (TestClient); Triton is a MockTransport handler, the one stub, standing in for its failures."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from tasks.runtime.gateway.upstream import BETWEEN_CHUNKS_S, chunk_timeouts
from tests.unit.test_gateway import CHAMPION, CHAT, QUESTION, SERVICE, FakeTriton, events, gateway, streamed_text

__all__ = ["gateway"]  # the fixture, used by name
GENERATE = f"/v2/models/{SERVICE}/generate"
INTERNAL = "Traceback: /opt/tritonserver/backends/python/model.py line 3: CUDA error: out of memory"


def openai_shaped(body: dict) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# --- not routed ------------------------------------------------------------------------------------------


def test_an_unknown_path_and_a_wrong_method_are_answered_in_the_apis_shape(gateway):
    client = gateway(FakeTriton())
    response = client.get("/v1/nowhere")
    assert response.status_code == 404 and openai_shaped(response.json())["type"] == "not_found_error"
    response = client.get(CHAT)
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert openai_shaped(response.json())["message"] == "method GET is not allowed"
    response = client.get(GENERATE)
    assert (response.status_code, response.json()) == (405, {"error": "method GET is not allowed"})
    response = client.post(f"/v2/models/{SERVICE}/infer", json={})
    assert (response.status_code, response.json()) == (404, {"error": f"no route /v2/models/{SERVICE}/infer here"})


# --- bodies that are not JSON ----------------------------------------------------------------------------

NOT_JSON = {
    "broken": b'{"messages": [',
    "nested 100,000 deep": b'{"messages": [{"role": "user", "content": "x"}], "x": '
    + b"[" * 100_000
    + b"]" * 100_000
    + b"}",
    "a lone surrogate": b'{"messages": [{"role": "user", "content": "\\ud800"}], "text_input": "\\ud800"}',
    "invalid UTF-8": b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}], "text_input": "\xff"}',
}


@pytest.mark.parametrize("body", NOT_JSON.values(), ids=NOT_JSON.keys())
def test_a_body_that_is_not_json_is_400_in_each_apis_shape(gateway, body):
    triton = FakeTriton()
    client = gateway(triton)
    response = client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert openai_shaped(response.json())["type"] == "invalid_request_error"
    response = client.post(GENERATE, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and isinstance(response.json()["error"], str), response.text
    assert triton.requests == []


# --- /v2 forwards the model's inputs only, bounded -------------------------------------------------------


@pytest.mark.parametrize(
    "body, message",
    [
        ({"text_input": "hot", "parameters": {"x": 1}}, "parameters: Extra inputs are not permitted"),
        ({"text_input": "hot", "top_k": -1}, "top_k: Input should be greater than or equal to 0"),
        ({"text_input": "hot", "temperature": 1e9}, "temperature: Input should be less than or equal to 2"),
        ({"text_input": "hot", "random_seed": 1 << 64}, "random_seed: Input should be less than 18446744073709551616"),
        ({"text_input": "hot", "min_length": 4096}, "min_length 4096 is more than the model's context of 16 tokens"),
    ],
)
def test_v2_refuses_inputs_the_model_does_not_have_or_out_of_bounds(gateway, body, message):
    triton = FakeTriton()
    response = gateway(triton, default_max_tokens=16).post(GENERATE, json=body)
    assert (response.status_code, response.json()) == (400, {"error": message})
    assert triton.requests == []


@pytest.mark.parametrize("seed", [-1, 1 << 64])
def test_a_seed_the_engines_cannot_take_is_400_naming_it_not_a_model_server_fault(gateway, seed):
    triton = FakeTriton()
    response = gateway(triton).post(CHAT, json={"messages": QUESTION, "seed": seed})
    assert response.status_code == 400 and openai_shaped(response.json())["param"] == "seed", response.text
    assert triton.requests == []


# --- Triton down, restarting or failing ------------------------------------------------------------------


def unreachable(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("[Errno 111] Connection refused to /var/run/triton", request=request)


def not_loaded(request: httpx.Request) -> httpx.Response:
    return httpx.Response(404, json={"error": f"Request for unknown model: '{SERVICE}' is not found"})


def failing(request: httpx.Request) -> httpx.Response:
    return httpx.Response(500, json={"error": INTERNAL})


@pytest.mark.parametrize("triton", [unreachable, not_loaded, failing])
def test_triton_down_restarting_or_failing_is_503_with_retry_after_and_none_of_its_words(gateway, triton, caplog):
    client = gateway(triton)
    caplog.set_level(logging.WARNING, "llmops.gateway")
    answers = [client.post(CHAT, json={"messages": QUESTION, "stream": stream}) for stream in (False, True)]
    answers += [client.post(path, json={"text_input": "hot"}) for path in (GENERATE, GENERATE + "_stream")]
    for response in answers:
        assert response.status_code == 503 and response.headers["retry-after"] == "2", response.text
        assert "request id" in response.text and "/var/run" not in response.text and "/opt" not in response.text
    assert openai_shaped(answers[0].json())["code"] == "service_unavailable"
    assert isinstance(answers[2].json()["error"], str)
    assert "/var/run/triton" in caplog.text or INTERNAL in caplog.text or "unknown model" in caplog.text
    ready = client.get("/health/ready")
    assert ready.status_code == 503


def test_every_request_to_triton_carries_the_gateways_timeouts(gateway):
    """A Triton that hangs is a 504 only while each request carries the timeouts: the /v2 routes hand their
    requests to the transport themselves, not through httpx's client, which would add them."""
    triton, sent = FakeTriton(), []

    def timed(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.path, request.extensions.get("timeout"), request.headers.get("content-type")))
        return triton(request)

    client = gateway(timed)
    for stream in (False, True):
        assert client.post(CHAT, json={"messages": QUESTION, "stream": stream}).status_code == 200
    for path in (GENERATE, GENERATE + "_stream"):
        assert client.post(path, json={"text_input": "hot"}).status_code == 200
    routed = f"/v2/models/{CHAMPION.model}/generate"  # the version the table routes the service's name to
    assert [path for path, _, _ in sent] == [routed, routed + "_stream"] * 2
    expected = chunk_timeouts(BETWEEN_CHUNKS_S).as_dict()
    assert all(timeout == expected and kind == "application/json" for _, timeout, kind in sent), sent


@pytest.mark.parametrize(
    "status, message",
    [
        (503, "Exceeds maximum queue size"),  # the python model's batcher (serve.max_queue_size)
        (400, "Exceeds maximum queue size"),  # a decoupled model's refusal, whose error code Triton 2.51 drops
    ],
)
def test_a_full_queue_in_triton_is_503_with_retry_after_in_each_apis_shape(gateway, status, message):
    client = gateway(lambda request: httpx.Response(status, json={"error": message}))
    answers = [client.post(CHAT, json={"messages": QUESTION, "stream": stream}) for stream in (False, True)]
    answers += [client.post(path, json={"text_input": "hot"}) for path in (GENERATE, GENERATE + "_stream")]
    for response in answers:
        assert response.status_code == 503 and response.headers["retry-after"] == "1", response.text
        assert "at its limit of requests" in response.text
    assert openai_shaped(answers[0].json())["message"] == "the service is at its limit of requests; retry shortly"
    assert answers[2].json() == {"error": "the service is at its limit of requests; retry shortly"}


def test_tritons_refusal_of_a_request_keeps_its_400_and_its_message(gateway):
    message = "input token count 600 exceeds the model's context of 512 tokens"
    client = gateway(lambda request: httpx.Response(400, json={"error": message}))
    for stream in (False, True):
        response = client.post(CHAT, json={"messages": QUESTION, "stream": stream})
        assert response.status_code == 400 and response.json()["error"]["message"] == message
    response = client.post(GENERATE, json={"text_input": "hot"})
    assert (response.status_code, response.json()) == (400, {"error": message})


class BrokenStream(httpx.AsyncByteStream):
    """A generate_stream answer whose connection breaks off after its first event."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'data: {"text_output": "co"}\n\n'
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


@pytest.mark.parametrize(
    "upstream",
    [
        lambda request: httpx.Response(
            200, text=f'data: {{"text_output": "co"}}\n\ndata: {json.dumps({"error": INTERNAL})}\n\n'
        ),
        lambda request: httpx.Response(200, stream=BrokenStream()),
    ],
)
def test_an_upstream_error_mid_stream_ends_the_stream_with_an_error_event(gateway, upstream):
    response = gateway(upstream).post(CHAT, json={"messages": QUESTION, "stream": True})
    assert response.status_code == 200  # the first piece was on its way
    chunks = events(response)
    assert streamed_text(chunks) == "co"
    error = chunks[-1]["error"]
    assert error["type"] == "server_error" and "(request id " in error["message"]  # a 503's or a 502's words
    assert INTERNAL not in response.text and "[DONE]" not in chunks


# --- anything else ---------------------------------------------------------------------------------------


def test_an_unexpected_exception_is_500_in_the_shape_with_a_request_id_only(gateway, caplog):
    def broken(request: httpx.Request) -> httpx.Response:
        raise RuntimeError(INTERNAL)

    client = gateway(broken)
    for path, body in ((CHAT, {"messages": QUESTION}), (GENERATE, {"text_input": "hot"})):
        response = client.post(path, json=body)
        assert response.status_code == 500, response.text
        message = response.json()["error"] if path == GENERATE else openai_shaped(response.json())["message"]
        assert message.startswith("internal error; request id ") and INTERNAL not in response.text
        assert message.removeprefix("internal error; request id ") in caplog.text and INTERNAL in caplog.text
