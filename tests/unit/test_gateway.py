"""The gateway of `llmops serve` against the real Starlette app (TestClient), with httpx.MockTransport standing
in for Triton's HTTP generate API: the OpenAI translation (inputs, stop sequences, finish_reason, usage,
streaming), the checks every request passes (keys, JSON only, the body cap, parameter bounds) and how Triton's
failures reach clients, in each API's own error shape. The pure parts (API keys from the environment, stop
sequences) too. The same gateway in front of a real Triton is in tests/integration/test_serving.py."""

from __future__ import annotations

import json
from collections.abc import Callable

import anyio
import httpx
import pytest
from starlette.testclient import TestClient

from tasks.control.contract import RouteTable, Version
from tasks.runtime.gateway import Gateway, GatewayConfig
from tasks.runtime.gateway.stops import cut_at_stop, held_back

SERVICE = "demo"
CHAMPION = Version(f"{SERVICE}-v1", f"{SERVICE}-v1")
TABLE = RouteTable(SERVICE, CHAMPION, weights={CHAMPION.name: 100.0})  # the champion answers every request
KEY = "team-a-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUESTION = [{"role": "user", "content": "What is the opposite of hot?"}]
CHAT = "/v1/chat/completions"


class FakeTriton:
    """Triton's generate API as httpx sees it: answers `answer` (streamed in `pieces`), records each request."""

    def __init__(self, answer: str = "cold", pieces: list[str] | None = None):
        self.answer, self.pieces = answer, pieces or [answer]
        self.requests: list[tuple[str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append((request.url.path, json.loads(request.content or b"{}")))
        if request.url.path.endswith("/ready"):
            return httpx.Response(200)
        if request.url.path.endswith("/generate_stream"):
            events = "".join(f"data: {json.dumps({'text_output': p})}\n\n" for p in self.pieces)
            return httpx.Response(200, text=events, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"model_name": SERVICE, "text_output": self.answer})

    @property
    def inputs(self) -> dict:
        """The inputs of the one generate request Triton got."""
        assert len(self.requests) == 1, self.requests
        return self.requests[0][1]


@pytest.fixture
def gateway():
    """A gateway in front of `triton` (a MockTransport handler): its TestClient, closed after the test."""
    clients: list[TestClient] = []

    def start(triton: Callable[[httpx.Request], httpx.Response], **config) -> TestClient:
        config = {"api_keys": {KEY: "team-a"}, "table": TABLE, **config}
        settings = GatewayConfig(triton_url="http://triton.test:8000", service=SERVICE, context_tokens=512, **config)
        running = Gateway(settings, transport=httpx.MockTransport(triton))
        app = running.app()
        app.state.gateway = running  # for scrape(): /metrics is on a listener of its own
        client = TestClient(app, headers=AUTH, raise_server_exceptions=False)
        clients.append(client.__enter__())
        return client

    yield start
    for client in clients:
        client.__exit__(None, None, None)


def scrape(client: TestClient) -> httpx.Response:
    """GET /metrics of the gateway behind `client`, from its metrics listener (the clients' one has no /metrics)."""
    return TestClient(client.app.state.gateway.metrics_app()).get("/metrics")  # type: ignore[attr-defined]


def events(response: httpx.Response) -> list:
    """The data of each server-sent event: JSON, or the text [DONE]."""
    data = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    return [item if item == "[DONE]" else json.loads(item) for item in data]


def streamed_text(chunks: list) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content", "") for c in chunks if isinstance(c, dict) and "choices" in c
    )


# --- the OpenAI translation -----------------------------------------------------------------------------


def test_a_chat_request_becomes_tritons_generate_inputs_and_its_answer_a_completion(gateway):
    triton = FakeTriton("cold")
    messages = [{"role": "system", "content": "One word."}, *QUESTION]
    body = {"model": SERVICE, "messages": messages, "temperature": 0, "seed": 7, "max_completion_tokens": 5}
    response = gateway(triton).post(CHAT, json={**body, "max_tokens": 9, "top_p": 1})  # top_p 1: asks nothing
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "chat.completion" and answer["model"] == SERVICE and answer["id"].startswith("chatcmpl-")
    assert answer["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "cold"}, "finish_reason": "stop", "logprobs": None}
    ]
    assert answer["usage"] == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}  # no tokenizer
    assert triton.requests[0][0] == f"/v2/models/{CHAMPION.model}/generate"  # the version the table routes to
    assert triton.inputs == {
        "text_input": "What is the opposite of hot?",
        "chat_history": json.dumps([{"role": "system", "content": "One word."}]),
        "max_tokens": 5,  # max_completion_tokens wins over max_tokens
        "temperature": 0.0,
        "random_seed": 7,
        "exclude_input_in_output": True,
    }


def test_max_tokens_defaults_to_the_profiles_and_a_text_completion_gets_the_prompt_raw(gateway):
    """A text completion's prompt is raw text, as OpenAI's and vLLM's: not put through the chat template."""
    triton = FakeTriton("cold")
    response = gateway(triton, default_max_tokens=16).post("/v1/completions", json={"prompt": "hot:"})
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "text_completion" and response.json()["choices"][0]["text"] == "cold"
    expected = {"text_input": "hot:", "max_tokens": 16, "apply_chat_template": False, "exclude_input_in_output": True}
    assert triton.inputs == expected


@pytest.mark.parametrize("temperature", [0, 2, 0.7])
def test_temperature_from_0_to_2_is_accepted(gateway, temperature):
    triton = FakeTriton()
    assert gateway(triton).post(CHAT, json={"messages": QUESTION, "temperature": temperature}).status_code == 200
    assert triton.inputs["temperature"] == temperature


@pytest.mark.parametrize(
    "change, param, message",
    [
        ({"temperature": 2.5}, "temperature", "temperature: Input should be less than or equal to 2"),
        ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
        ({"temperature": "1"}, "temperature", "temperature: Input should be a valid number"),
        ({"temperature": True}, "temperature", "a valid number"),
        ({"n": 2}, "n", "n: one choice per request"),
        ({"seed": "7"}, "seed", "seed: Input should be a valid integer"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens: Input should be greater than or equal to 1"),
        ({"max_tokens": 8.0}, "max_tokens", "a valid integer"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 items"),
        ({"stop": ""}, "stop", "stop[0]: String should have at least 1 character"),
        ({"stream": "yes"}, "stream", "a valid boolean"),
        ({"messages": []}, "messages", "at least 1 item"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages", "the last message must be the user's"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "messages[0]: a tool call's turn (role tool"),
        ({"messages": [{"role": "critic", "content": "x"}]}, "messages", "messages[0].role: Input should be"),
        ({"messages": [{"role": "user"}]}, "messages", "messages[0].content: Field required"),
    ],
)
def test_a_bad_parameter_is_refused_in_openais_shape_naming_it(gateway, change, param, message):
    triton = FakeTriton()
    response = gateway(triton).post(CHAT, json={"messages": QUESTION, **change})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}
    assert triton.requests == []


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_over_the_models_context_is_refused(gateway, name):
    response = gateway(FakeTriton()).post(CHAT, json={"messages": QUESTION, name: 513})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": f"{name} 513 is more than the model's context of 512 tokens",
        "type": "invalid_request_error",
        "param": name,
        "code": "context_length_exceeded",
    }


def test_a_model_not_served_here_is_404(gateway):
    response = gateway(FakeTriton()).post(CHAT, json={"model": "gpt-4o", "messages": QUESTION})
    assert response.status_code == 404
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("not_found_error", "model") and "'gpt-4o'" in error["message"]
    models = gateway(FakeTriton()).get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [SERVICE, CHAMPION.name]


@pytest.mark.parametrize("pinning", [False, True])
def test_models_lists_the_live_versions_and_a_request_pins_one_where_the_profile_allows_it(gateway, pinning):
    """GET /v1/models: the service, then each version of the gateway's route table; a request naming a version is
    answered by that version alone with serve.version_pinning (an adapter version by its base engine, asked for the
    table's adapter), else a 400 naming the setting. A client names a version only, never a model or an adapter."""
    triton = FakeTriton("cold")
    candidate = Version(f"{SERVICE}-v2", f"{SERVICE}-base", f"{SERVICE}-v2")  # an adapter on the base engine
    table = RouteTable(SERVICE, CHAMPION, candidate, weights={CHAMPION.name: 90.0, candidate.name: 10.0})
    client = gateway(triton, table=table, version_pinning=pinning)
    models = client.get("/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [
        (SERVICE, None),
        (CHAMPION.name, SERVICE),
        (candidate.name, SERVICE),
    ]
    for model in (f"{SERVICE}-base", f"{SERVICE}-v3"):  # a Triton model that is no version, a version not served
        refused = client.post(CHAT, json={"model": model, "messages": QUESTION})
        assert refused.status_code == 404 and refused.json()["error"]["param"] == "model", refused.text
    adapter = client.post(CHAT, json={"messages": QUESTION, "lora_name": "other"})
    assert adapter.status_code == 400 and adapter.json()["error"]["param"] == "lora_name", adapter.text
    pinned = client.post(CHAT, json={"model": candidate.name, "messages": QUESTION, "stream": True})
    if not pinning:
        assert pinned.status_code == 400 and "serve.version_pinning" in pinned.json()["error"]["message"]
        assert pinned.json()["error"]["param"] == "model" and triton.requests == []
        return
    assert pinned.status_code == 200 and events(pinned)[0]["model"] == candidate.name
    answered = client.post("/v1/completions", json={"model": CHAMPION.name, "prompt": "hot:"})
    assert answered.json()["model"] == CHAMPION.name
    assert [(path, body.get("lora_name")) for path, body in triton.requests] == [
        (f"/v2/models/{candidate.model}/generate_stream", candidate.name),
        (f"/v2/models/{CHAMPION.model}/generate", None),
    ]


@pytest.mark.parametrize("stop", ["\nUser:", ["\n\n", "\nUser:"]])
def test_a_stop_sequence_cuts_the_answer_and_finishes_it(gateway, stop):
    triton = FakeTriton("cold\nUser: and warm?", pieces=["co", "ld\nUs", "er: and", " warm?"])
    client = gateway(triton)
    whole = client.post(CHAT, json={"messages": QUESTION, "stop": stop}).json()["choices"][0]
    assert whole["message"]["content"] == "cold" and whole["finish_reason"] == "stop"
    chunks = events(client.post(CHAT, json={"messages": QUESTION, "stop": stop, "stream": True}))
    assert streamed_text(chunks) == "cold"  # "\nUs" was held back, then dropped with the stop sequence
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1] == "[DONE]"


def test_a_held_back_beginning_that_no_stop_follows_is_sent_at_the_end(gateway):
    triton = FakeTriton(pieces=["cold\nU", "s"])
    chunks = events(gateway(triton).post(CHAT, json={"messages": QUESTION, "stop": "\nUser:", "stream": True}))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"] for c in chunks[1:-2]] == [{"content": "cold"}, {"content": "\nUs"}]
    assert streamed_text(chunks) == "cold\nUs"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tasks.base_model import train_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(["What is the opposite of hot? cold warm cold hot"] * 20, 300).save_pretrained(folder)
    return folder


def test_finish_reason_is_length_when_the_answer_used_its_whole_budget_and_usage_counts_tokens(gateway, tokenizer_dir):
    from transformers import AutoTokenizer

    from tasks.quality.chat import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    answer = "cold warm cold"
    used = len(tokenizer.encode(answer, add_special_tokens=False))
    prompt = len(encode_prompt(tokenizer, QUESTION[0]["content"], [], True))
    client = gateway(FakeTriton(answer, pieces=["cold", " warm", " cold"]), tokenizer_dir=tokenizer_dir)

    for budget, finish in ((used, "length"), (used + 1, "stop")):
        whole = client.post(CHAT, json={"messages": QUESTION, "max_tokens": budget}).json()
        assert whole["choices"][0]["finish_reason"] == finish
        assert whole["usage"] == {"prompt_tokens": prompt, "completion_tokens": used, "total_tokens": prompt + used}
        chunks = events(client.post(CHAT, json={"messages": QUESTION, "max_tokens": budget, "stream": True}))
        assert chunks[-2]["choices"][0]["finish_reason"] == finish and chunks[-2]["usage"] == whole["usage"]
        assert streamed_text(chunks) == answer


def test_a_streamed_text_completion_sends_text_chunks(gateway):
    chunks = events(
        gateway(FakeTriton(pieces=["co", "ld"])).post("/v1/completions", json={"prompt": "hot:", "stream": True})
    )
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["co", "ld", ""]
    assert {c["object"] for c in chunks[:-1]} == {"text_completion"} and chunks[-1] == "[DONE]"


def test_each_answered_request_has_its_time_to_first_token_on_metrics_streamed_or_whole(gateway):
    """A stream's first token is its first piece; a whole answer's, the answer; both in the histogram and in the
    window serve.autoscale's ttft_p90 reads."""
    client = gateway(FakeTriton(pieces=["co", "ld"]))
    assert client.post("/v1/completions", json={"prompt": "hot:", "stream": True}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "hot:"}).status_code == 200
    count = f'llmops_gateway_time_to_first_token_seconds_count{{version="{SERVICE}-v1"}} 2.0'
    assert count in scrape(client).text
    assert len(client.app.state.gateway.metrics.recent_first_tokens) == 2  # type: ignore[attr-defined]


# --- the checks every request passes --------------------------------------------------------------------


def test_a_missing_or_wrong_key_is_401_in_each_apis_shape(gateway):
    client = gateway(FakeTriton())
    missing = client.post(CHAT, json={"messages": QUESTION}, headers={"Authorization": ""})
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"]["type"] == "authentication_error"
    assert "missing API key" in missing.json()["error"]["message"]
    wrong = client.post(CHAT, json={"messages": QUESTION}, headers={"Authorization": "Bearer not-the-key"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models", headers={"Authorization": ""}).status_code == 401
    v2 = client.post(f"/v2/models/{SERVICE}/generate", json={"text_input": "hot"}, headers={"Authorization": ""})
    assert v2.status_code == 401 and v2.json() == {"error": "missing API key: send `Authorization: Bearer <key>`"}
    probes = [client.get(path, headers={"Authorization": ""}).status_code for path in ("/health/live", "/health/ready")]
    assert probes == [200, 200]  # probes need no key


def test_only_a_json_object_is_read(gateway):
    triton = FakeTriton()
    client = gateway(triton)
    form = client.post(CHAT, content=b"messages=hi", headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415 and form.json()["error"]["message"] == "Content-Type must be application/json"
    broken = client.post(CHAT, content=b'{"messages": ', headers={"Content-Type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["message"].startswith("request body is not JSON: ")
    array = client.post(CHAT, json=[QUESTION])
    assert array.status_code == 400 and array.json()["error"]["message"] == "request body must be a JSON object"
    assert triton.requests == []


def test_a_body_over_the_cap_is_413_whether_its_length_is_declared_or_it_comes_in_chunks(gateway):
    triton = FakeTriton()
    client = gateway(triton, max_body_bytes=1000)
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 2000}]}).encode()
    declared = client.post(CHAT, content=big, headers={"Content-Type": "application/json"})
    assert declared.status_code == 413
    assert declared.json()["error"]["message"] == f"request body of {len(big)} bytes is over the limit of 1000"

    def chunks():
        yield from (big[i : i + 100] for i in range(0, len(big), 100))

    chunked = client.post(CHAT, content=chunks(), headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413, chunked.text
    assert chunked.json()["error"]["message"] == "request body is over the limit of 1000 bytes"
    assert triton.requests == []


def test_a_chunked_body_is_refused_before_it_is_read_whole():
    """The ASGI app itself, fed 100-byte chunks of an endless body: it stops reading just past the cap."""
    gateway = Gateway(GatewayConfig("http://triton.test", SERVICE, 512, max_body_bytes=1000))
    pulled, sent = 0, []

    async def receive() -> dict:
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": b"x" * 100, "more_body": True}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": CHAT,
        "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
        "query_string": b"",
    }
    anyio.run(gateway.app(), scope, receive, send)
    anyio.run(gateway.triton.aclose)
    assert sent[0]["status"] == 413 and pulled == 11


# --- Triton's own API on /v2 ----------------------------------------------------------------------------


def test_v2_generate_is_forwarded_with_its_inputs_and_max_tokens_bounded(gateway):
    triton = FakeTriton("cold", pieces=["co", "ld"])
    client = gateway(triton, default_max_tokens=16)
    body = {"text_input": "hot", "exclude_input_in_output": True, "temperature": 0}
    response = client.post(f"/v2/models/{SERVICE}/generate", json=body)
    assert response.status_code == 200 and response.json()["text_output"] == "cold"
    assert triton.inputs == {**body, "max_tokens": 16}
    streamed = client.post(f"/v2/models/{SERVICE}/generate_stream", json={**body, "max_tokens": 4, "stream": True})
    assert [e["text_output"] for e in events(streamed)] == ["co", "ld"]


def test_every_answer_names_the_version_that_produced_it_in_each_api_whole_or_streamed(gateway):
    """x-llmops-version (issue 73): which version answered, without asking the route table (a canary check, a soak)."""
    client = gateway(FakeTriton("cold", pieces=["co", "ld"]))
    answered = [
        client.post(CHAT, json={"model": SERVICE, "messages": QUESTION}),
        client.post(CHAT, json={"model": SERVICE, "messages": QUESTION, "stream": True}),
        client.post(f"/v2/models/{SERVICE}/generate", json={"text_input": "hot"}),
        client.post(f"/v2/models/{SERVICE}/generate_stream", json={"text_input": "hot", "stream": True}),
    ]
    assert [(r.status_code, r.headers.get("x-llmops-version")) for r in answered] == [(200, CHAMPION.name)] * 4


@pytest.mark.parametrize(
    "path, body, status, message",
    [
        (f"/v2/models/{SERVICE}/generate", {"max_tokens": 4}, 400, "text_input: Field required"),
        (f"/v2/models/{SERVICE}/generate", {"text_input": 1}, 400, "text_input: Input should be a valid string"),
        (
            f"/v2/models/{SERVICE}/generate",
            {"text_input": "hot", "max_tokens": 100000},
            400,
            "max_tokens 100000 is more than the model's context of 512 tokens",
        ),
        (
            "/v2/models/other/generate",
            {"text_input": "hot"},
            404,
            "model 'other' is not served here; the service is 'demo'",
        ),
    ],
)
def test_v2_errors_are_in_tritons_shape(gateway, path, body, status, message):
    triton = FakeTriton()
    response = gateway(triton).post(path, json=body)
    assert (response.status_code, response.json()) == (status, {"error": message})
    assert triton.requests == []


# --- the pure parts -------------------------------------------------------------------------------------


def test_stop_sequences_cut_the_text_and_hold_back_a_partial_match():
    assert cut_at_stop("cold\nUser:", ["\nUser:"]) == ("cold", True)
    assert cut_at_stop("cold", ["ol", "d"]) == ("c", True)
    assert cut_at_stop("cold", []) == ("cold", False)
    assert held_back("cold\nUs", ["\nUser:"]) == 3  # "\nUs" may begin the stop sequence
    assert held_back("cold", ["\nUser:"]) == 0


# --- shadow copies ------------------------------------------------------------------------------------------


class ShadowedTriton(FakeTriton):
    """The champion's model, and the candidate's own answers (`candidate`: text by prompt)."""

    def __init__(self, candidate: dict[str, str], failing: bool = False):
        super().__init__("cold")
        self.candidate, self.failing = candidate, failing

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == f"/v2/models/{SERVICE}-v2/generate":
            body = json.loads(request.content)
            self.requests.append((path, body))
            if self.failing:
                return httpx.Response(500, json={"error": "engine died"})
            return httpx.Response(200, json={"text_output": self.candidate[body["text_input"]]})
        return super().__call__(request)


def shadowed(fraction: float = 1.0) -> RouteTable:
    """The champion serving alone, with `fraction` of its answered requests copied to the candidate demo-v2."""
    candidate = Version(f"{SERVICE}-v2", f"{SERVICE}-v2")
    return RouteTable(
        SERVICE, CHAMPION, candidate, {CHAMPION.name: 100.0}, shadow=candidate.name, shadow_fraction=fraction
    )


def shadow_counters(client: TestClient) -> dict[str, float]:
    lines = scrape(client).text.splitlines()
    return {
        line.split("{")[0].removeprefix("llmops_shadow_").removesuffix("_total"): float(line.split()[-1])
        for line in lines
        if line.startswith("llmops_shadow_") and '_total{model="demo-v2"}' in line
    }


def wait_for_copies(client: TestClient, requests: float) -> dict[str, float]:
    for _ in range(200):
        counters = shadow_counters(client)
        if counters.get("requests", 0) >= requests:
            return counters
        anyio.run(anyio.sleep, 0.02)
    raise AssertionError(f"copies never finished: {shadow_counters(client)}")


def test_answered_requests_are_copied_to_the_tables_shadow_version_and_recorded(gateway, tmp_path):
    """Clients get the champion's answers; each answered request goes again to the shadow version, and its record
    has the inputs, both answers (the copy's cut at the client's stop sequences) and both latencies."""
    triton = ShadowedTriton({"hot": "cold", "big": "large. and more", "up": "warm"})
    client = gateway(triton, table=shadowed(), shadow_records=tmp_path)
    triton.answer = "large"
    chat = client.post(CHAT, json={"messages": [{"role": "user", "content": "big"}], "stop": ["."]})
    assert chat.json()["choices"][0]["message"]["content"] == "large"  # the client's answer: the champion's
    streamed = client.post(CHAT, json={"messages": [{"role": "user", "content": "hot"}], "stream": True})
    triton.answer = "cold"
    assert streamed_text(events(streamed)) == "cold"
    v2 = client.post(f"/v2/models/{SERVICE}/generate", json={"text_input": "up"})
    assert v2.json()["text_output"] == "cold"
    sampled = client.post(CHAT, json={"messages": [{"role": "user", "content": "up"}], "temperature": 0.7})
    assert sampled.status_code == 200 and "shadow" not in sampled.text
    counters = wait_for_copies(client, 4)
    assert (counters["requests"], counters["errors"], counters["dropped"]) == (4, 0, 0)
    assert counters["primary_seconds"] > 0 and counters["shadow_seconds"] > 0
    records = [json.loads(line) for line in (tmp_path / "demo-v2.jsonl").read_text().splitlines()]
    assert sorted((r["inputs"]["text_input"], r["champion"], r["candidate"]) for r in records) == [
        ("big", "large", "large"),
        ("hot", "cold", "cold"),
        ("up", "cold", "warm"),
        ("up", "cold", "warm"),
    ]  # in the order their copies ended
    by_prompt = {r["inputs"]["text_input"]: r for r in records if "temperature" not in r["inputs"]}
    assert [r["inputs"]["temperature"] for r in records if "temperature" in r["inputs"]] == [0.7]
    assert by_prompt["big"]["inputs"]["max_tokens"] == 64
    assert all(r["error"] is None and r["champion_s"] > 0 and r["candidate_s"] > 0 for r in records)
    assert (tmp_path / "demo-v2.jsonl").stat().st_mode & 0o777 == 0o600  # live prompts and answers
    copies = [body for path, body in triton.requests if path.endswith("-v2/generate")]
    assert [c["text_input"] for c in copies] == ["big", "hot", "up", "up"] and not any(c["stream"] for c in copies)


def test_shadow_records_are_redacted_and_an_opted_out_request_is_not_copied(gateway, tmp_path):
    """A copy's record holds live text: its prompt and both answers go through the capture's redaction rules before
    they reach the disk; a client that opted out of capture (X-LLMOps-Capture: off) is not copied at all."""
    key = "sk-proj-Ab3dEf6hIj9kLm2nOp5qT3BlbkFJZy8xWv5uTs2rQp9oNm4l"  # an OpenAI key's shape (detect-secrets')
    triton = ShadowedTriton({f"my key is {key}": f"noted {key}"})
    client = gateway(triton, table=shadowed(), shadow_records=tmp_path)
    client.post(CHAT, json={"messages": [{"role": "user", "content": "hot"}]}, headers={"X-LLMOps-Capture": "off"})
    answer = client.post(CHAT, json={"messages": [{"role": "user", "content": f"my key is {key}"}]})
    assert answer.json()["choices"][0]["message"]["content"] == "cold"  # the client's answer: the champion's
    assert wait_for_copies(client, 1)["requests"] == 1  # only the second request was copied
    written = (tmp_path / "demo-v2.jsonl").read_text()
    assert key not in written and "[SECRET]" in written
    (record,) = [json.loads(line) for line in written.splitlines()]
    assert record["inputs"]["text_input"] == "my key is [SECRET]" and record["candidate"] == "noted [SECRET]"


def test_a_failing_shadow_version_is_recorded_and_never_reaches_the_client(gateway, tmp_path):
    triton = ShadowedTriton({}, failing=True)
    client = gateway(triton, table=shadowed(), shadow_records=tmp_path)
    response = client.post(CHAT, json={"messages": QUESTION})
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "cold"
    assert wait_for_copies(client, 1)["errors"] == 1
    (record,) = [json.loads(line) for line in (tmp_path / "demo-v2.jsonl").read_text().splitlines()]
    assert record["candidate"] is None and record["error"].startswith("HTTP 503")  # the copy's fault, in the log
