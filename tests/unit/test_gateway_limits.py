"""Who may call the gateway of `llmops serve` and how much: API keys as read from the environment and key
files, the limits per client (requests per second, tokens per minute) and overall (requests in flight), the
access log and the per-client metrics; and what `llmops serve` refuses before it starts (no keys or no TLS
off loopback, a Triton open to clients). The app runs as it is (TestClient); Triton is a MockTransport."""

from __future__ import annotations

import json
import logging
import re

import anyio
import httpx
import pytest

from tasks.platform.errors import BadInput
from tasks.runtime.gateway import Gateway, GatewayConfig, read_api_keys
from tasks.runtime.gateway.protocol import RequestError
from tests.unit.test_gateway import AUTH, CHAT, KEY, QUESTION, SERVICE, TABLE, FakeTriton, gateway, scrape

__all__ = ["gateway"]  # the fixture, used by name
OTHER_KEY = "team-b-key-0123456789"
KEYS = {KEY: "team-a", OTHER_KEY: "team-b"}
GENERATE = f"/v2/models/{SERVICE}/generate"

# --- limits per client and overall ----------------------------------------------------------------------


def test_a_key_over_its_requests_per_second_gets_429_with_retry_after_and_other_keys_do_not(gateway):
    client = gateway(FakeTriton(), api_keys=KEYS, requests_per_second=1)
    for _ in range(2):  # the bucket's smallest size: two requests at once
        assert client.post(CHAT, json={"messages": QUESTION}).status_code == 200
    refused = client.post(CHAT, json={"messages": QUESTION})
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert re.fullmatch(
        r"rate limit: serve.limits.requests_per_second = 1 per key; retry after [01]\.\d s", error["message"]
    )
    on_v2 = client.post(GENERATE, json={"text_input": "hot"})
    assert on_v2.status_code == 429 and "serve.limits.requests_per_second" in on_v2.json()["error"]  # Triton's
    other = {"Authorization": f"Bearer {OTHER_KEY}"}
    assert client.post(CHAT, json={"messages": QUESTION}, headers=other).status_code == 200


@pytest.mark.parametrize(("burst_s", "admitted_at_once"), [(1.0, 10), (0.5, 5), (0.1, 2), (0.0, 2)])
def test_a_key_may_send_burst_s_seconds_of_its_rate_at_once(burst_s, admitted_at_once):
    from tasks.runtime.gateway.limits import ClientLimits

    now = [100.0]
    limits = ClientLimits(requests_per_second=10, tokens_per_minute=0, burst_s=burst_s, clock=lambda: now[0])
    admitted = 0
    for _ in range(20):  # all at the same instant
        try:
            limits.admit("team-a")
            admitted += 1
        except Exception as refused:
            assert getattr(refused, "status", None) == 429
    assert admitted == admitted_at_once
    now[0] += 0.15  # over one request's worth of the rate later (0.1 s is a hair under it in floating point)
    limits.admit("team-a")


def test_a_key_that_used_its_tokens_per_minute_waits_until_they_refill(gateway):
    client = gateway(FakeTriton(), api_keys=KEYS, tokens_per_minute=30)
    # No tokenizer here: an answer counts its budget, max_tokens 40: the whole minute's 30 reserved, 10 more
    # charged after (a debt).
    assert client.post(CHAT, json={"messages": QUESTION, "max_tokens": 40}).status_code == 200
    refused = client.post(GENERATE, json={"text_input": "hot"})
    assert refused.status_code == 429 and refused.headers["retry-after"] == "20"  # 10 tokens of debt at 0.5/s
    assert refused.json()["error"].startswith("rate limit: serve.limits.tokens_per_minute = 30 per key; retry after")
    other = {"Authorization": f"Bearer {OTHER_KEY}"}
    assert client.post(GENERATE, json={"text_input": "hot"}, headers=other).status_code == 200


def test_requests_over_the_cap_in_flight_get_503_with_retry_after():
    async def main() -> tuple[httpx.Response, httpx.Response]:
        release, called = anyio.Event(), anyio.Event()

        async def slow_triton(request: httpx.Request) -> httpx.Response:
            called.set()
            await release.wait()
            return httpx.Response(200, json={"text_output": "cold"})

        config = GatewayConfig("http://triton.test:8000", SERVICE, 512, api_keys=KEYS, max_in_flight=1, table=TABLE)
        gateway = Gateway(config, transport=httpx.MockTransport(slow_triton))
        transport = httpx.ASGITransport(gateway.app())
        answers: list[httpx.Response] = []
        client = httpx.AsyncClient(transport=transport, base_url="http://gw", headers=AUTH)

        async def first() -> None:
            answers.append(await client.post(GENERATE, json={"text_input": "hot"}))

        async with client, anyio.create_task_group() as tasks:
            tasks.start_soon(first)
            await called.wait()
            answers.append(await client.post(CHAT, json={"messages": QUESTION}))
            release.set()
        return answers[1], answers[0]

    first, busy = anyio.run(main)
    assert first.status_code == 200 and first.json()["text_output"] == "cold"
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["message"] == (
        "the service is at its limit of requests in flight: serve.limits.max_in_flight = 1 for all keys together; "
        "retry after 1 s"
    )


def test_max_tokens_are_reserved_at_admission_and_what_the_answer_did_not_use_comes_back():
    from tasks.runtime.gateway.limits import ClientLimits

    now = [100.0]
    limits = ClientLimits(requests_per_second=0, tokens_per_minute=60, clock=lambda: now[0])  # 1 token a second
    first, second = limits.admit("team-a"), limits.admit("team-a")
    first.reserve(40)  # before the model starts: 20 of the minute's 60 are left
    with pytest.raises(RequestError) as refused:
        second.reserve(40)  # the reservation counts, not what the first answer has used so far
    assert refused.value.status == 429 and refused.value.retry_after == 20
    assert refused.value.message == "rate limit: serve.limits.tokens_per_minute = 60 per key; retry after 20.0 s"
    first.release(10)  # the answer used 10: 30 come back
    second.reserve(40)  # 50 were there
    second.release(45)  # 5 more than reserved (a prompt the reservation did not cover): charged, a debt
    assert limits.tokens["team-a"].level == 5
    first.release(10)  # a request ends once: a second release changes nothing
    assert limits.tokens["team-a"].level == 5 and limits.in_flight == {}
    huge = limits.admit("team-a")
    now[0] += 55  # the bucket is full again
    huge.reserve(500)  # more than a minute's budget: waits for a full bucket and takes all of it
    assert huge.reserved == 60 and limits.tokens["team-a"].level == 0


def test_a_failed_answer_gives_its_reservation_back_and_a_stream_cut_short_pays_what_it_sent(gateway):
    answers = [
        lambda request: httpx.Response(500, json={"error": "CUDA error: out of memory"}),
        lambda request: httpx.Response(200, text='data: {"text_output": "co"}\n\ndata: {"error": "x"}\n\n'),
    ]
    client = gateway(lambda request: answers.pop(0)(request), api_keys=KEYS, tokens_per_minute=30)
    assert client.post(CHAT, json={"messages": QUESTION, "max_tokens": 30}).status_code >= 500
    streamed = client.post(CHAT, json={"messages": QUESTION, "max_tokens": 30, "stream": True})  # all 30 came back
    assert streamed.status_code == 200 and '"server_error"' in streamed.text  # one piece sent, then it failed
    refused = client.post(CHAT, json={"messages": QUESTION, "max_tokens": 30})
    assert refused.status_code == 429 and refused.headers["retry-after"] == "2"  # 1 token charged, at 0.5/s


def test_on_v2_a_failed_answer_gives_its_reservation_back_and_an_answer_pays_its_max_tokens(gateway):
    answers = [lambda request: httpx.Response(500, json={"error": "engine died"}), FakeTriton(), FakeTriton()]
    client = gateway(lambda request: answers.pop(0)(request), api_keys=KEYS, tokens_per_minute=30)
    assert client.post(GENERATE, json={"text_input": "hot", "max_tokens": 30}).status_code >= 500
    assert client.post(GENERATE, json={"text_input": "hot", "max_tokens": 30}).status_code == 200  # all 30 came back
    refused = client.post(GENERATE, json={"text_input": "hot", "max_tokens": 30})  # Triton counts none: 30 were paid
    assert refused.status_code == 429 and "serve.limits.tokens_per_minute = 30" in refused.json()["error"]


def test_a_client_that_hangs_up_mid_stream_pays_only_what_was_sent():
    """The ASGI conversation itself: the client disconnects after the first piece while Triton still generates."""

    class EndlessStream(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"text_output": "co"}\n\n'
            await anyio.sleep_forever()
            yield b""

    config = GatewayConfig("http://triton.test:8000", SERVICE, 512, api_keys=KEYS, tokens_per_minute=60, table=TABLE)
    gateway = Gateway(
        config, transport=httpx.MockTransport(lambda request: httpx.Response(200, stream=EndlessStream()))
    )
    requests = [{"type": "http.request", "body": json.dumps(STREAMED).encode(), "more_body": False}]
    first_piece = anyio.Event()

    async def receive() -> dict:
        if requests:
            return requests.pop(0)
        await first_piece.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and b'"co"' in message.get("body", b""):
            first_piece.set()

    async def main() -> None:
        with anyio.fail_after(10):
            await gateway.app()(http_scope(CHAT), receive, send)

    anyio.run(main)
    assert first_piece.is_set() and gateway.limits.in_flight == {}
    assert 58.5 < gateway.limits.tokens["team-a"].level <= 59.5  # 30 reserved, 29 back: one piece sent


STREAMED = {"messages": QUESTION, "max_tokens": 30, "stream": True}


def http_scope(path: str) -> dict:
    headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json")]
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [*headers, (b"host", b"gw")],
        "client": ("127.0.0.1", 50000),
        "server": ("gw", 80),
    }


def test_a_key_over_its_cap_in_flight_gets_429_naming_it_and_other_keys_do_not():
    async def main() -> list[httpx.Response]:
        release, called = anyio.Event(), anyio.Event()

        async def slow_triton(request: httpx.Request) -> httpx.Response:
            called.set()
            await release.wait()
            return httpx.Response(200, json={"text_output": "cold"})

        config = GatewayConfig(
            "http://triton.test:8000", SERVICE, 512, api_keys=KEYS, max_in_flight_per_key=1, table=TABLE
        )
        gateway = Gateway(config, transport=httpx.MockTransport(slow_triton))
        client = httpx.AsyncClient(transport=httpx.ASGITransport(gateway.app()), base_url="http://gw", headers=AUTH)
        answers: list[httpx.Response] = []

        async def post(headers: dict | None = None) -> None:
            answers.append(await client.post(GENERATE, json={"text_input": "hot"}, headers=headers))

        async with client:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(post)
                await called.wait()  # team-a's long answer holds its one place
                answers.append(await client.post(CHAT, json={"messages": QUESTION}))
                other = await client.get("/v1/models", headers={"Authorization": f"Bearer {OTHER_KEY}"})  # team-b: in
                release.set()
            assert gateway.limits.in_flight == {}  # the place came back with the answer
            answers += [other, await client.post(CHAT, json={"messages": QUESTION})]
        return answers

    busy, holding, other, again = anyio.run(main)
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
    assert (
        busy.json()["error"]["message"]
        == "rate limit: serve.limits.max_in_flight_per_key = 1 per key; retry after 1.0 s"
    )
    assert holding.status_code == 200 and other.status_code == 200 and again.status_code == 200


def test_the_limits_in_force_are_said_in_one_line():
    from tasks.runtime.gateway.limits import ClientLimits

    assert ClientLimits(400, 1_000_000, 1.0, 64).summary(128, keyed=True) == (
        "limits per API key: 400 requests/s (bursts of 400), 1,000,000 tokens/min (max_tokens reserved at "
        "admission), 64 requests in flight; all together: 128 requests in flight (serve.limits.*; 0 turns one off: "
        "--set serve.limits.requests_per_second=0)"
    )
    assert (
        ClientLimits(0, 0, 1.0, 0)
        .summary(0, keyed=False)
        .startswith(
            "limits per client (no keys: all clients are one): no requests/s limit, no tokens/min limit, no requests in "
            "flight limit; all together: no requests in flight limit"
        )
    )


# --- the access log and the metrics ---------------------------------------------------------------------


def test_each_request_is_one_access_log_line_and_counted_per_client_on_metrics(gateway, caplog):
    caplog.set_level(logging.INFO, "llmops.gateway.access")
    client = gateway(FakeTriton(), api_keys=KEYS)
    assert client.post(CHAT, json={"messages": QUESTION, "max_tokens": 8}).status_code == 200
    assert client.get("/health/live").status_code == 200  # probes leave no line
    assert (
        client.post(GENERATE, json={"text_input": "hot"}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    )
    lines = [json.loads(record.message) for record in caplog.records if record.name == "llmops.gateway.access"]
    assert [{k: v for k, v in line.items() if k not in ("request_id", "latency_ms")} for line in lines] == [
        {"client": "team-a", "method": "POST", "route": CHAT, "status": 200, "tokens": 8},
        {"client": "-", "method": "POST", "route": "/v2/models/{model}/generate", "status": 401, "tokens": 0},
    ]
    assert all(line["latency_ms"] >= 0 for line in lines)
    assert QUESTION[0]["content"] not in caplog.text and KEY not in caplog.text and "wrong" not in caplog.text

    # not on the clients' listener, with a key or without: it names clients
    assert (
        client.get("/metrics").status_code == 404
        and client.get("/metrics", headers={"Authorization": ""}).status_code == 404
    )
    metrics = scrape(client)  # on the metrics listener (loopback by default), no key needed
    assert metrics.status_code == 200
    assert (
        'llmops_gateway_requests_total{client="team-a",route="/v1/chat/completions",status="200"} 1.0' in metrics.text
    )
    assert (
        'llmops_gateway_requests_total{client="-",route="/v2/models/{model}/generate",status="401"} 1.0' in metrics.text
    )
    assert 'llmops_gateway_tokens_total{client="team-a"} 8.0' in metrics.text
    assert KEY not in metrics.text and OTHER_KEY not in metrics.text


# --- API keys -------------------------------------------------------------------------------------------


def test_api_keys_come_from_a_file_with_names_or_from_the_environment(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# clients\nteam-a: aaaaaaaaaaaaaaaaaaaa\n\nbbbbbbbbbbbbbbbbbbbb  # unnamed\n")
    found = read_api_keys({"LLMOPS_API_KEYS_FILE": str(keys), "LLMOPS_API_KEYS": "cccccccccccccccccccc, "})
    assert found == {
        "aaaaaaaaaaaaaaaaaaaa": "team-a",
        "bbbbbbbbbbbbbbbbbbbb": "keys:4",
        "cccccccccccccccccccc": "client-1",
    }
    assert read_api_keys({}) == {}


def test_a_short_key_or_a_missing_file_is_refused_with_its_line(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("team-a: aaaaaaaaaaaaaaaaaaaa\nteam-b: short\n")
    with pytest.raises(BadInput, match=r"keys line 2: an API key must be at least 16 characters"):
        read_api_keys({"LLMOPS_API_KEYS_FILE": str(keys)})
    with pytest.raises(BadInput, match="LLMOPS_API_KEYS_FILE .*missing: cannot read"):
        read_api_keys({"LLMOPS_API_KEYS_FILE": str(tmp_path / "missing")})


def test_serve_refuses_a_public_address_without_api_keys(tmp_path, monkeypatch):
    """Before anything starts: clients from other machines would reach an endpoint open to anyone."""
    from flows.serve import serve
    from tasks.platform.config import load_profile

    monkeypatch.delenv("LLMOPS_API_KEYS", raising=False)
    monkeypatch.delenv("LLMOPS_API_KEYS_FILE", raising=False)
    with pytest.raises(BadInput, match=r"serve.listen.host 0.0.0.0: clients from other machines need API keys"):
        serve(load_profile("cpu-tiny", ["serve.listen.host=0.0.0.0"]), tmp_path, None, None)
    assert not (tmp_path / "triton").exists()  # nothing was started


def test_a_hash_in_a_key_is_kept_and_a_name_ends_at_the_first_colon(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("team-a: aaaa#aaaa:aaaaaaaaaaaa # team a's\n#bbbbbbbbbbbbbbbbbbbb\n")
    assert read_api_keys({"LLMOPS_API_KEYS_FILE": str(keys)}) == {"aaaa#aaaa:aaaaaaaaaaaa": "team-a"}


def test_a_short_key_from_the_environment_is_refused_naming_its_entry():
    with pytest.raises(BadInput, match=r"LLMOPS_API_KEYS entry 2: an API key must be at least 16 characters"):
        read_api_keys({"LLMOPS_API_KEYS": "cccccccccccccccccccc,short"})


def test_a_key_written_twice_is_refused_naming_both_places(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("team-a: aaaaaaaaaaaaaaaaaaaa\nteam-b: aaaaaaaaaaaaaaaaaaaa\n")
    with pytest.raises(BadInput, match=r"keys line 2: the same API key as LLMOPS_API_KEYS_FILE .*keys line 1"):
        read_api_keys({"LLMOPS_API_KEYS_FILE": str(keys)})
    keys.write_text("team-a: cccccccccccccccccccc\n")
    with pytest.raises(BadInput, match=r"keys line 1: the same API key as LLMOPS_API_KEYS entry 1"):
        read_api_keys({"LLMOPS_API_KEYS_FILE": str(keys), "LLMOPS_API_KEYS": "cccccccccccccccccccc"})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([], "serve.listen.host 0.0.0.0: keys from other machines would cross in cleartext; give --tls-cert"),
        (
            ["serve.listen.host=127.0.0.1", "serve.listen.triton_host=0.0.0.0"],
            "serve.listen.triton_host 0.0.0.0: Triton answers inference there without API keys; .*"
            "--triton-ports-firewalled",
        ),
    ],
)
def test_serve_refuses_cleartext_off_loopback_and_a_triton_clients_could_reach(
    tmp_path, monkeypatch, overrides, message
):
    from flows.serve import serve
    from tasks.platform.config import load_profile

    monkeypatch.setenv("LLMOPS_API_KEYS", "cccccccccccccccccccc")
    monkeypatch.delenv("LLMOPS_API_KEYS_FILE", raising=False)
    with pytest.raises(BadInput, match=message):
        serve(load_profile("cpu-tiny", ["serve.listen.host=0.0.0.0", *overrides]), tmp_path, None, None)
    assert not (tmp_path / "triton").exists()


def test_a_tls_proxy_or_firewalled_triton_ports_are_said_with_a_flag():
    from flows.cli.app import build_parser
    from flows.cli.serve import listen_overrides
    from flows.serve_listen import check_listen
    from tasks.platform.config import load_profile

    args = build_parser().parse_args(
        ["serve", "--host=0.0.0.0", "--triton-host=0.0.0.0", "--behind-tls-proxy", "--triton-ports-firewalled"]
    )
    profile = load_profile("cpu-tiny", listen_overrides(args))
    assert profile.serve.listen.behind_tls_proxy and profile.serve.listen.triton_ports_firewalled
    check_listen(profile.serve.listen, {"cccccccccccccccccccc": "client-1"})  # refuses nothing


def test_a_key_removed_from_the_key_file_stops_working_without_a_restart(gateway, tmp_path, monkeypatch, caplog):
    from tasks.runtime.gateway import KeyRing, auth

    monkeypatch.setattr(auth, "RELOAD_CHECK_S", 0.0)  # look at the file on every request
    key_file = tmp_path / "keys"
    key_file.write_text(f"team-a: {KEY}\nteam-b: {OTHER_KEY}\n")
    client = gateway(FakeTriton(), api_keys=KeyRing({"LLMOPS_API_KEYS_FILE": str(key_file)}))
    other, no_key = {"Authorization": f"Bearer {OTHER_KEY}"}, {"Authorization": ""}
    assert client.post(CHAT, json={"messages": QUESTION}, headers=other).status_code == 200
    key_file.write_text(f"team-a: {KEY}\n")  # team-b's key revoked
    assert client.post(CHAT, json={"messages": QUESTION}, headers=other).status_code == 401
    assert client.post(CHAT, json={"messages": QUESTION}).status_code == 200  # team-a's still works
    with caplog.at_level(logging.WARNING, logger="llmops.gateway"):
        key_file.write_text("")  # a half-saved edit: no key at all would open the service; team-a's stays
        assert client.post(CHAT, json={"messages": QUESTION}, headers=no_key).status_code == 401
        key_file.write_text("team-c: short\n")  # a bad edit: refused, the key in force stays
        assert client.post(CHAT, json={"messages": QUESTION}).status_code == 200
    assert "now holds none" in caplog.text and "at least 16 characters" in caplog.text
    key_file.write_text(f"team-a: {KEY}\nteam-b: {OTHER_KEY}\n")  # the next good edit is taken
    assert client.post(CHAT, json={"messages": QUESTION}, headers=other).status_code == 200


def test_a_client_pacing_itself_at_its_rate_is_not_refused_for_running_a_little_early():
    from tasks.runtime.gateway.limits import ClientLimits

    now = [100.0]
    limits = ClientLimits(requests_per_second=10, tokens_per_minute=0, burst_s=0.0, clock=lambda: now[0])
    for step in range(100):  # every 100 ms, alternately 5 ms early and 5 ms late
        now[0] = 100.0 + step * 0.1 + (-0.005 if step % 2 else 0.005)
        limits.admit("team-a")
