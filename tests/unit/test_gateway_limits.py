"""Who may call the gateway of `llmops serve` and how much: API keys as read from the environment and key
files, the limits per client (requests per second, tokens per minute) and overall (requests in flight), the
access log and the per-client metrics; and what `llmops serve` refuses before it starts (no keys or no TLS
off loopback, a Triton open to clients). The app runs as it is (TestClient); Triton is a MockTransport."""

from __future__ import annotations

import json
import logging

import anyio
import httpx
import pytest

from tasks.platform.errors import BadInput
from tasks.serving.gateway import Gateway, GatewayConfig, read_api_keys
from tests.unit.test_gateway import AUTH, CHAT, KEY, QUESTION, SERVICE, TABLE, FakeTriton, gateway

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
    assert "1 requests per second" in error["message"]
    on_v2 = client.post(GENERATE, json={"text_input": "hot"})
    assert on_v2.status_code == 429 and "requests per second" in on_v2.json()["error"]  # Triton's shape
    other = {"Authorization": f"Bearer {OTHER_KEY}"}
    assert client.post(CHAT, json={"messages": QUESTION}, headers=other).status_code == 200


@pytest.mark.parametrize(("burst_s", "admitted_at_once"), [(1.0, 10), (0.5, 5), (0.1, 2), (0.0, 2)])
def test_a_key_may_send_burst_s_seconds_of_its_rate_at_once(burst_s, admitted_at_once):
    from tasks.serving.gateway.limits import ClientLimits

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
    # No tokenizer here: an answer counts its budget, max_tokens 40, 10 over the minute's 30.
    assert client.post(CHAT, json={"messages": QUESTION, "max_tokens": 40}).status_code == 200
    refused = client.post(GENERATE, json={"text_input": "hot"})
    assert refused.status_code == 429 and refused.headers["retry-after"] == "22"  # (10 + 1) tokens at 0.5/s
    assert "30 tokens per minute" in refused.json()["error"]
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
    assert busy.json()["error"]["message"] == "the service is at its limit of requests in flight; retry shortly"


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

    metrics = client.get("/metrics", headers={"Authorization": ""})  # no key needed
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
    from flows.serve import check_listen
    from tasks.platform.config import load_profile

    args = build_parser().parse_args(
        ["serve", "--host=0.0.0.0", "--triton-host=0.0.0.0", "--behind-tls-proxy", "--triton-ports-firewalled"]
    )
    profile = load_profile("cpu-tiny", listen_overrides(args))
    assert profile.serve.listen.behind_tls_proxy and profile.serve.listen.triton_ports_firewalled
    check_listen(profile.serve.listen, {"cccccccccccccccccccc": "client-1"})  # refuses nothing


def test_a_key_removed_from_the_key_file_stops_working_without_a_restart(gateway, tmp_path, monkeypatch, caplog):
    from tasks.serving.gateway import KeyRing, auth

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
    from tasks.serving.gateway.limits import ClientLimits

    now = [100.0]
    limits = ClientLimits(requests_per_second=10, tokens_per_minute=0, burst_s=0.0, clock=lambda: now[0])
    for step in range(100):  # every 100 ms, alternately 5 ms early and 5 ms late
        now[0] = 100.0 + step * 0.1 + (-0.005 if step % 2 else 0.005)
        limits.admit("team-a")
