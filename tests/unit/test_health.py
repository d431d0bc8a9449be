"""Nothing hangs: the gateway's deadlines against a real HTTP upstream that stops answering (a small Starlette app under
uvicorn standing in for Triton: before its first byte, and between two chunks of a stream), and its probes,
readiness and recovery against one whose model stops answering. The same faults injected into a real Triton:
tests/integration/test_serving.py."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import select
import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from tasks.control.contract import RouteTable, Version
from tasks.platform.config.serving import HealthSection
from tasks.platform.ports import free_port
from tasks.runtime.gateway import Gateway, GatewayConfig
from tests.unit.test_gateway import AUTH, CHAT, KEY, QUESTION, SERVICE, TABLE, scrape

DEADLINES = HealthSection(first_byte_s=0.5, between_chunks_s=0.5, probe_interval_s=0)


class Upstream:
    """A Triton stand-in on a real socket: answers, or stalls (`stall`: "first byte" or "between chunks")."""

    def __init__(self) -> None:
        self.stall: str | None = None
        self.failing = False
        self.failing_models: set[str] = set()
        self.fault = ("Stub process 'demo-v1_0_0' is not healthy.", 400)  # every instance dead: what Triton says
        self.dead_instance = False  # one of two instances dead: every other request reaches it
        self.generated = 0

    async def generate(self, request: Request):
        self.generated += 1
        if self.failing or request.path_params["model"] in self.failing_models:
            return JSONResponse({"error": self.fault[0]}, status_code=self.fault[1])
        if self.dead_instance and self.generated % 2:
            return JSONResponse({"error": "Stub process 'demo-v1_0_1' is not healthy."}, status_code=400)
        if (await request.json())["text_input"] == "refuse me":
            return JSONResponse({"error": "the prompt is over the model's context"}, status_code=400)
        if self.stall == "first byte":
            await asyncio.sleep(1.5)
        if request.url.path.endswith("_stream"):

            async def events():
                yield f"data: {json.dumps({'text_output': 'co'})}\n\n".encode()
                if self.stall == "between chunks":
                    await asyncio.sleep(1.5)
                yield f"data: {json.dumps({'text_output': 'ld'})}\n\n".encode()

            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"text_output": "cold"})

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v2/models/{model}/generate", self.generate, methods=["POST"]),
                Route("/v2/models/{model}/generate_stream", self.generate, methods=["POST"]),
                Route("/v2/models/{model}/ready", lambda request: JSONResponse({})),
            ]
        )


@pytest.fixture
def upstream() -> Iterator[tuple[Upstream, str]]:
    fake, port = Upstream(), free_port()
    server = uvicorn.Server(uvicorn.Config(fake.app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield fake, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def gateway(url: str, **config) -> TestClient:
    settings = GatewayConfig(url, SERVICE, 512, api_keys={KEY: "team-a"}, **{"table": TABLE, **config})
    return TestClient(Gateway(settings).app(), headers=AUTH, raise_server_exceptions=False)


def test_no_answer_before_the_first_byte_deadline_is_504_in_each_apis_shape(upstream):
    fake, url = upstream
    fake.stall = "first byte"
    with gateway(url, health=DEADLINES) as client:
        started = time.monotonic()
        answers = [client.post(CHAT, json={"messages": QUESTION, "stream": stream}) for stream in (False, True)]
        answers += [
            client.post(f"/v2/models/{SERVICE}/{path}", json={"text_input": "hot"})
            for path in ("generate", "generate_stream")
        ]
        assert time.monotonic() - started < 4 * 2  # four requests, each cut at its 0.5 s deadline
        for response in answers:
            assert response.status_code == 504, response.text
        assert answers[0].json()["error"]["code"] == "timeout" and answers[2].json() == {
            "error": "the model server did not answer in time"
        }
        metrics = scrape(client).text
        assert 'llmops_gateway_version_requests_total{outcome="failed",version="demo-v1"} 4.0' in metrics


def test_a_whole_answer_has_the_first_byte_deadline_not_the_one_between_chunks(upstream, caplog):
    """A non-streaming answer is its first byte (serve.health.first_byte_s): Triton answering after 1.5 s is a 200
    within a first-byte deadline of 3 s, even with 0.5 s between chunks (aiohttp's read deadline cut it at 0.5 s, and
    the fault line named the first byte's); past the first byte's own deadline it is a 504 that says so."""
    fake, url = upstream
    fake.stall = "first byte"
    generate = f"/v2/models/{SERVICE}/generate"
    patient = HealthSection(first_byte_s=3, between_chunks_s=0.5, probe_interval_s=0)
    with gateway(url, health=patient) as client:
        answers = [client.post(generate, json={"text_input": "hot"}), client.post(CHAT, json={"messages": QUESTION})]
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    impatient = HealthSection(first_byte_s=0.8, between_chunks_s=30, probe_interval_s=0)
    with caplog.at_level("WARNING", logger="llmops.gateway"), gateway(url, health=impatient) as client:
        started = time.monotonic()
        late = client.post(generate, json={"text_input": "hot"})
    assert late.status_code == 504 and 0.8 <= time.monotonic() - started < 1.5
    assert "no answer within 0.8s" in caplog.text


def test_a_v2_answer_a_refusal_and_a_fault_reach_the_client_as_triton_and_the_gateway_say(upstream):
    """The /v2 generate forward on aiohttp's session (upstream.py post_on_aiohttp, what `llmops serve` runs) against a
    real socket: the answer as Triton sent it, its refusal a 400 with its words, a dead model process and a Triton
    that is not there 503s with Retry-After and none of Triton's words."""
    fake, url = upstream
    generate = f"/v2/models/{SERVICE}/generate"
    with gateway(url) as client:
        answer = client.post(generate, json={"text_input": "hot", "max_tokens": 4})
        refused = client.post(generate, json={"text_input": "refuse me"})
        fake.failing = True
        dead = client.post(generate, json={"text_input": "hot"})
    with gateway(f"http://127.0.0.1:{free_port()}") as client:
        away = client.post(generate, json={"text_input": "hot"})
    assert answer.status_code == 200 and answer.json() == {"text_output": "cold"}
    assert answer.headers["content-type"] == "application/json" and answer.headers["x-request-id"]
    assert refused.status_code == 400 and refused.json() == {"error": "the prompt is over the model's context"}
    for fault in (dead, away):
        assert fault.status_code == 503 and fault.headers["retry-after"] == "2", fault.text
        assert "not available" in fault.json()["error"] and "Stub" not in fault.text


def test_a_stream_that_stops_between_chunks_ends_with_an_error_event(upstream):
    fake, url = upstream
    fake.stall = "between chunks"
    with gateway(url, health=DEADLINES) as client:
        started = time.monotonic()
        chat = client.post(CHAT, json={"messages": QUESTION, "stream": True})
        v2 = client.post(f"/v2/models/{SERVICE}/generate_stream", json={"text_input": "hot"})
        assert time.monotonic() - started < 4
    assert chat.status_code == 200 and '"content":"co"' in chat.text.replace(" ", "")
    assert '"type":"server_error"' in chat.text.replace(" ", "") and "[DONE]" not in chat.text
    assert v2.status_code == 200 and '{"error": "the model server did not answer in time"}' in v2.text


def test_a_candidate_at_0_percent_that_stops_answering_is_left_to_its_release(upstream):
    """The release loads its candidate again with other settings (tune_serving) while the probes run: a recovery
    would load it once more under the release's feet. Only what clients are routed to is recovered."""
    fake, url = upstream
    recovered: list[str] = []
    candidate = Version(f"{SERVICE}-v2", f"{SERVICE}-v2")
    table = RouteTable(SERVICE, TABLE.champion, candidate, {f"{SERVICE}-v1": 100.0, candidate.name: 0.0})
    health = HealthSection(probe_interval_s=0.05, probe_timeout_s=1, recover_after=2, recover_cooldown_s=60)
    with gateway(
        url, table=table, health=health, recover=lambda _, model: recovered.append(model) or "reloaded"
    ) as client:
        fake.failing_models = {candidate.name}
        time.sleep(1)  # 20 probe rounds: the candidate failed every one
        assert recovered == []
        fake.failing_models = {f"{SERVICE}-v1"}
        deadline = time.monotonic() + 5
        while not recovered and time.monotonic() < deadline:
            time.sleep(0.02)
        assert recovered == [f"{SERVICE}-v1"]
        metrics = scrape(client).text
    assert f'llmops_gateway_probes_total{{outcome="failed",replica="{url}",version="{candidate.name}"}}' in metrics


def test_a_model_that_stops_answering_turns_readiness_false_is_recovered_and_ready_again(upstream):
    """Probes every 0.1 s: readiness follows them; after 2 failed probes in a row the model is recovered (here: the
    stand-in answers again), once per cool-down, and counted."""
    fake, url = upstream
    recovered: list[str] = []

    def recover(replica: str, model: str) -> str:
        recovered.append(model)
        fake.failing = False
        return "reloaded"

    health = HealthSection(probe_interval_s=0.1, probe_timeout_s=1, recover_after=2, recover_cooldown_s=60)
    with gateway(url, health=health, recover=recover) as client:
        assert client.get("/health/ready").status_code == 200
        fake.fault, fake.failing = ("CUDA error: an illegal memory access was encountered", 500), True
        # Triton's 500 in its words, a 503 for the client
        refused = client.post(f"/v2/models/{SERVICE}/generate", json={"text_input": "hot"})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
        deadline = time.monotonic() + 5
        while not recovered and time.monotonic() < deadline:
            time.sleep(0.02)
        assert recovered == ["demo-v1"]
        deadline = time.monotonic() + 5
        while client.get("/health/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.get("/health/ready").status_code == 200
        metrics = scrape(client).text
    replica = f'replica="{url}"'
    assert f'llmops_gateway_recoveries_total{{model="demo-v1",outcome="reloaded",{replica}}} 1.0' in metrics
    assert f'llmops_gateway_probes_total{{outcome="failed",{replica},version="demo-v1"}}' in metrics
    assert f'llmops_gateway_version_up{{{replica},version="demo-v1"}} 1.0' in metrics


def test_a_version_that_fails_its_probes_is_said_once_with_the_servers_words_and_a_clients_fault_each_time(
    upstream, caplog
):
    """Issue 73: a version not loaded on a Triton yet (a release's own service, before its canary stage loads the
    champion) failed every probe with a `model server fault` warning, 8 in 12 s. A probe's fault is now said where the
    version's state changes (stopped answering, with what Triton said) and in its recovery line; a client's request
    that meets it is still a warning of its own."""
    import logging

    fake, url = upstream
    health = HealthSection(probe_interval_s=0.05, probe_timeout_s=1, recover_after=1000, recover_cooldown_s=600)
    caplog.set_level(logging.WARNING)
    with gateway(url, health=health) as client:
        time.sleep(0.3)  # answering
        fake.fault = ("Request for unknown model: 'demo-v1' has no available versions", 404)
        fake.failing = True
        time.sleep(0.6)  # about 12 failed probes
        assert client.post(f"/v2/models/{SERVICE}/generate", json={"text_input": "hot"}).status_code == 503
    faults = [r.message for r in caplog.records if "model server fault" in r.message]
    stopped = [r.message for r in caplog.records if "stopped answering" in r.message]
    assert len(faults) == 1, faults  # the client's request alone (the replica had left the pool for its probes)
    assert stopped == [f"probes: demo-v1 on {url} stopped answering: HTTP 404: Request for unknown model: 'demo-v1' "
                       "has no available versions"], stopped  # fmt: skip


def test_a_version_its_release_has_not_loaded_yet_is_not_probed_recovered_or_a_reason_to_leave_the_pool(
    upstream, caplog
):
    """Issue 73: a release's own service (tasks/runtime/standalone.py) routes the record's champion on a Triton that
    has yet to load it; its probes failed, the replica left the pool, and a recovery loaded the champion beside the
    canary stage's own load (a second release without a serve: 5 warnings, the candidate's load 8.3 s instead of
    4.5). GatewayConfig.probed judges only what the release loaded: nothing is said or recovered until it has."""
    import logging

    fake, url = upstream
    loaded: set[str] = set()
    recovered: list[str] = []
    health = HealthSection(probe_interval_s=0.05, probe_timeout_s=1, recover_after=2, recover_cooldown_s=600)
    caplog.set_level(logging.WARNING)
    fake.fault, fake.failing = ("Request for unknown model: 'demo-v1' has no available versions", 404), True
    with gateway(
        url, health=health, probed=lambda v: v.name in loaded, recover=lambda r, m: recovered.append(m) or "reloaded"
    ):
        time.sleep(0.5)  # ten probe rounds with the champion not loaded
        assert not caplog.records and not recovered
        fake.failing = False
        loaded.add("demo-v1")  # the release loaded it: judged from now on
        time.sleep(0.3)
        fake.failing = True
        deadline = time.monotonic() + 5
        while not recovered and time.monotonic() < deadline:
            time.sleep(0.02)
    assert recovered == ["demo-v1"] and any("stopped answering" in r.message for r in caplog.records)


def test_one_dead_instance_is_loaded_again_at_once_while_its_replica_stays_in_the_pool_and_requests_are_answered(
    upstream, caplog
):
    """One of two model instances dead (its stub SIGKILLed: Triton 2.51 starts none again, every other request it
    hands that instance fails while the model stays READY): a request that meets it tries the replica again and is
    answered, the model is loaded again at once (not after recover_after failed probes, which the live instance keeps
    from failing in a row), and a probe that meets it leaves the only replica in the pool."""
    fake, url = upstream
    recovered: list[str] = []
    health = HealthSection(probe_interval_s=0.05, probe_timeout_s=1, recover_after=1000, recover_cooldown_s=600)

    def recover(replica: str, model: str) -> str:
        recovered.append(model)
        time.sleep(0.5)  # the load: the probes and the requests go on meanwhile
        fake.dead_instance = False
        return "reloaded"

    with gateway(url, health=health, recover=recover) as client:
        fake.dead_instance = True
        statuses = [client.post(f"/v2/models/{SERVICE}/generate", json={"text_input": "hot"}).status_code]
        time.sleep(0.3)  # probes meet the dead instance as well
        statuses += [client.post(f"/v2/models/{SERVICE}/generate", json={"text_input": "hot"}).status_code]
        deadline = time.monotonic() + 5
        while fake.dead_instance and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not fake.dead_instance and recovered == ["demo-v1"]  # once, for one request's and many probes' meetings
        metrics = scrape(client).text
        fake.dead_instance = True  # dead again 10 s after it was loaded again: a new death, no cool-down for it
        assert client.post(f"/v2/models/{SERVICE}/generate", json={"text_input": "hot"}).status_code == 200
        time.sleep(0.3)
        assert recovered == ["demo-v1"]  # within 10 s of the last reload: the cool-down holds
    assert statuses == [200, 200]
    assert f'llmops_gateway_replica_up{{replica="{url}"}} 1.0' in metrics
    assert not [r.message for r in caplog.records if "leaves the pool" in r.message]
    assert "demo-v1 on " + url + " one of its instances died; recovering it" in caplog.text
    assert f'llmops_gateway_recoveries_total{{model="demo-v1",outcome="reloaded",replica="{url}"}} 1.0' in metrics


def test_readiness_is_false_while_the_probes_fail(upstream):
    fake, url = upstream
    health = HealthSection(probe_interval_s=0.1, probe_timeout_s=0.3, recover_after=100)
    with gateway(url, health=health) as client:
        assert client.get("/health/ready").status_code == 200
        fake.stall = "first byte"
        deadline = time.monotonic() + 3
        while client.get("/health/ready").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.get("/health/ready").status_code == 503
        assert f'llmops_gateway_version_up{{replica="{url}",version="demo-v1"}} 0.0' in scrape(client).text


def test_the_transport_gets_the_deadline_between_chunks():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.extensions["timeout"])
        return httpx.Response(200, json={"text_output": "cold"})

    health = HealthSection(between_chunks_s=7, probe_interval_s=0)
    config = GatewayConfig("http://t", SERVICE, 512, table=TABLE, health=health)
    with TestClient(Gateway(config, transport=httpx.MockTransport(handler)).app()) as client:
        assert client.post(f"/v2/models/{SERVICE}/generate", json={"text_input": "hot"}).status_code == 200
        assert client.post(CHAT, json={"messages": QUESTION}).status_code == 200
    assert [t["read"] for t in seen] == [7, 7] and seen[0]["connect"] == 5


def test_a_log_stream_nobody_reads_stops_no_request_and_the_dropped_lines_are_said(upstream):
    """The gateway's access log as `llmops serve` writes it (flows/serve.py show_access_log: a LogWriter), to a pipe
    nobody reads: with a handler on the event loop's thread, `llmops serve` stopped answering after 385 requests once
    the pipe was full. Here every request is answered; once the pipe is read, the writer says how many lines it
    dropped meanwhile."""
    from tasks.runtime.gateway.logs import LogWriter
    from tasks.runtime.gateway.running import Listener, RunningGateway

    _, url = upstream
    read_end, write_end = os.pipe()
    stream = open(write_end, "w", buffering=1)  # noqa: SIM115 -- closed below, after the writer
    writer = LogWriter(stream, lines=50).start(["llmops.gateway.access"])
    inner = Gateway(GatewayConfig(url, SERVICE, 512, api_keys={KEY: "team-a"}, table=TABLE))
    port = free_port()
    running = RunningGateway([Listener(inner.app(), "127.0.0.1", port)], inner).start()
    generate = f"http://127.0.0.1:{port}/v2/models/{SERVICE}/generate"
    try:
        with httpx.Client(headers=AUTH, timeout=10) as client:
            statuses = Counter(client.post(generate, json={"text_input": "hot"}).status_code for _ in range(1500))
            assert statuses == {200: 1500}  # about 170 bytes a line: the pipe's 64 KiB hold about 390
            written = drain(read_end)  # the pipe's lines, then the 50 the writer held
            assert client.post(generate, json={"text_input": "hot"}).status_code == 200
            writer.close()  # its line is written, after the count of the lines dropped
            written += drain(read_end)
    finally:
        running.stop()
        writer.close(timeout_s=0)
        stream.close()
        os.close(read_end)
    lines = written.decode().splitlines()
    notices = [line for line in lines if " llmops.gateway log: " in line and "lines dropped" in line]
    dropped = sum(int(line.split("log: ")[1].split()[0]) for line in notices)
    assert notices and dropped > 0, lines[-3:]
    assert dropped + len(lines) - len(notices) == 1501  # each request's line written, or counted where dropped
    assert json.loads(lines[-1].split(" llmops.gateway.access ")[1])["status"] == 200


def drain(fd: int) -> bytes:
    """What comes out of the pipe `fd` until nothing more comes for half a second."""
    data = b""
    while select.select([fd], [], [], 0.5)[0]:
        data += os.read(fd, 1 << 20)
    return data


# --- several Tritons behind one gateway ---------------------------------------------------------------------


class Fleet:
    """Two Triton stand-ins behind one MockTransport, told apart by port: each can refuse connections (`down`),
    not have the version (`unloaded`), or hold its answers until `release` is set."""

    def __init__(self) -> None:
        self.down: set[int] = set()
        self.unloaded: set[int] = set()
        self.held: set[int] = set()
        self.answered: list[int] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        port = request.url.port
        if port in self.down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if request.url.path.endswith("/ready"):
            return httpx.Response(200)
        if port in self.unloaded:
            return httpx.Response(400, json={"error": "Request for unknown model: 'demo-v1' has no available versions"})
        while port in self.held:
            await asyncio.sleep(0.01)
        self.answered.append(port)
        return httpx.Response(200, json={"text_output": "cold"})


def two_replicas(fleet: Fleet, **config) -> TestClient:
    settings = GatewayConfig(
        "http://triton.test:1",
        SERVICE,
        512,
        api_keys={KEY: "team-a"},
        table=TABLE,
        more_replicas=["http://triton.test:2"],
        **config,
    )
    return TestClient(Gateway(settings, transport=httpx.MockTransport(fleet)).app(), headers=AUTH)


def test_a_replica_that_cannot_be_reached_leaves_the_pool_and_its_requests_go_to_the_other(gateway=None):
    fleet = Fleet()
    fleet.down.add(1)
    with two_replicas(fleet) as client:
        answers = [client.post(f"/v2/models/{SERVICE}/generate", json={"text_input": "hot"}) for _ in range(4)]
        answers += [client.post(CHAT, json={"messages": QUESTION, "stream": stream}) for stream in (False, True)]
        assert [a.status_code for a in answers] == [200] * 6
        assert set(fleet.answered) == {2}
        metrics = scrape(client).text
        assert 'llmops_gateway_replica_up{replica="http://triton.test:1"} 0.0' in metrics
        fleet.down.add(2)  # both gone: a 503 in the API's shape, at once
        refused = client.post(CHAT, json={"messages": QUESTION})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "service_unavailable"


def test_a_version_not_loaded_on_one_replica_is_answered_by_the_other():
    fleet = Fleet()
    fleet.unloaded.add(2)
    with two_replicas(fleet) as client:
        statuses = [
            client.post(f"/v2/models/{SERVICE}/generate", json={"text_input": "hot"}).status_code for _ in range(4)
        ]
        assert statuses == [200] * 4 and set(fleet.answered) == {1}


def test_each_request_goes_to_the_replica_with_the_fewest_outstanding():
    import anyio

    fleet = Fleet()
    fleet.held.add(1)

    async def main() -> list[int]:
        settings = GatewayConfig(
            "http://triton.test:1", SERVICE, 512, table=TABLE, more_replicas=["http://triton.test:2"]
        )
        gateway = Gateway(settings, transport=httpx.MockTransport(fleet))
        transport = httpx.ASGITransport(gateway.app())
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://gw") as client,
            anyio.create_task_group() as tasks,
        ):
            first = functools.partial(client.post, f"/v2/models/{SERVICE}/generate", json={"text_input": "a"})
            tasks.start_soon(first)
            await anyio.sleep(0.2)  # the first is held on replica 1 (or 2)
            for _ in range(3):
                await client.post(f"/v2/models/{SERVICE}/generate", json={"text_input": "b"})
            fleet.held.clear()
        return fleet.answered

    answered = anyio.run(main)
    # the held request's replica has one outstanding: the next three go to the other, then the held one ends
    assert answered[:3] in ([2, 2, 2], [1, 1, 1]) and len(answered) == 4


def test_the_probes_put_a_replica_back_in_the_pool_once_it_answers():
    fleet = Fleet()
    fleet.down.add(1)
    health = HealthSection(probe_interval_s=0.05, probe_timeout_s=1, recover_after=1000)
    with two_replicas(fleet, health=health) as client:
        replica = 'llmops_gateway_replica_up{replica="http://triton.test:1"}'
        deadline = time.monotonic() + 5
        while f"{replica} 0.0" not in scrape(client).text and time.monotonic() < deadline:
            time.sleep(0.02)
        assert f"{replica} 0.0" in scrape(client).text
        assert client.get("/health/ready").status_code == 200  # the other replica answers
        fleet.down.clear()
        while f"{replica} 1.0" not in scrape(client).text and time.monotonic() < deadline:
            time.sleep(0.02)
        assert f"{replica} 1.0" in scrape(client).text
