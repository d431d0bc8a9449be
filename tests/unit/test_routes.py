"""The traffic plane without a server: the route table and its deployment record, the control API of `llmops serve`
(the real Starlette apps, TestClient; Triton is a MockTransport handler), and the base engine's adapter map. The same
against a real Triton: tests/integration/test_serving.py."""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from tasks.control.contract import RoutesError, RouteTable, Version, read_record, write_record
from tasks.runtime.gateway import Gateway, GatewayConfig
from tasks.runtime.gateway.control import ControlApi
from tasks.runtime.loads import ReleaseLoads
from tasks.serving import adapter_registry
from tasks.serving.service import ServiceControl
from tests.unit.test_gateway import AUTH, CHAMPION, CHAT, KEY, QUESTION, SERVICE, TABLE, FakeTriton, scrape

CONTROL_KEY = "serve-control-key-0123456789"
CANDIDATE = Version(f"{SERVICE}-v2", f"{SERVICE}-base", f"{SERVICE}-v2", {"version": "2"})  # an adapter on the base


def with_candidate(weight: float, **fields) -> RouteTable:
    return replace(TABLE, candidate=CANDIDATE, weights={CHAMPION.name: 100 - weight, CANDIDATE.name: weight}, **fields)


# --- the route table and its record -----------------------------------------------------------------------


def test_a_lapsed_hold_gives_the_champion_alone_and_a_renewed_one_keeps_the_routes():
    """What the gateway's lease watch decides under the table's lock (issue 73: it decided on a table read before,
    so a renewal that landed in between was undone)."""
    held = with_candidate(10, release="run-1", expires_at=100.0)
    assert held.lapsed(99.9) is None
    alone = held.lapsed(100.0)
    assert alone is not None and alone.candidate is None and alone.weights == {CHAMPION.name: 100.0}
    renewed = replace(held, expires_at=115.0)  # what the record holds once the renewal landed
    assert renewed.lapsed(100.0) is None and TABLE.lapsed(10**9) is None  # nothing held: nothing to drop


def test_a_request_draws_its_version_by_weight():
    table = with_candidate(10)
    draws = [table.draw(random.Random(seed)).name for seed in range(4000)]
    assert 0.08 < draws.count(CANDIDATE.name) / len(draws) < 0.12
    assert {with_candidate(100).draw(random.Random(seed)).name for seed in range(50)} == {CANDIDATE.name}
    assert RouteTable(SERVICE).draw(random.Random()) is None  # nothing served yet
    assert with_candidate(10).describe() == "demo-v1=90,demo-v2=10"
    assert CANDIDATE.inputs({"text_input": "hot"}) == {"text_input": "hot", "lora_name": "demo-v2"}
    assert CHAMPION.inputs({"text_input": "hot"}) == {"text_input": "hot"}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"weights": {"demo-v9": 10}}, "weights: demo-v9 is neither the champion nor the candidate"),
        ({"weights": {"demo-v1": 0}}, "weights: at least one version needs a positive weight"),
        ({"weights": {"demo-v1": 101}}, "weights.demo-v1: a number from 0 to 100"),
        ({"weights": {"demo-v1": True}}, "weights.demo-v1: a number from 0 to 100"),
        ({"shadow": "demo-v9", "shadow_fraction": 0.5}, "shadow: demo-v9 is neither the champion nor the candidate"),
        ({"shadow": "demo-v1", "shadow_fraction": 2}, "shadow_fraction: must be in (0, 1]"),
        ({"candidate": {"name": "demo-v1"}}, "candidate: demo-v1 is the champion already"),
        ({"champion": {"model": "x"}}, "champion: a version needs a name"),
        # names become file names and URL paths (issue 61, low): Triton's model-name rule
        (
            {"candidate": {"name": "../../etc/x"}},
            "candidate.name: '../../etc/x' is not a model name (letters, digits, '-', '_', '.')",
        ),
        (
            {"candidate": {"name": "demo-v2", "model": "a/b"}},
            "candidate.model: 'a/b' is not a model name (letters, digits, '-', '_', '.')",
        ),
        (
            {"candidate": {"name": "demo-v2", "adapter": "x?y=1"}},
            "candidate.adapter: 'x?y=1' is not a model name (letters, digits, '-', '_', '.')",
        ),
    ],
)
def test_a_table_that_cannot_serve_is_refused_naming_its_field(change, message):
    with pytest.raises(RoutesError, match=f"^{re.escape(message)}$"):
        RouteTable.of({**TABLE.as_json(), **change})


def test_the_record_is_written_whole_and_read_back(tmp_path: Path):
    path = tmp_path / "serving" / "demo.json"
    table = with_candidate(50, release="run-1", expires_at=123.0)
    write_record(path, table)
    assert read_record(path) == table and [p.name for p in path.parent.iterdir()] == ["demo.json"]  # no staging left
    assert read_record(path).candidate.source == {"version": "2"}  # what loads it again, kept
    path.write_text('{"service": "demo", "weights": {"x": 1}')
    with pytest.raises(RoutesError, match=f"^deployment record {path}: "):
        read_record(path)
    assert read_record(tmp_path / "none.json") is None


# --- the control API -----------------------------------------------------------------------------------------


@pytest.fixture
def service(tmp_path: Path):
    """A gateway with its deployment record, and TestClients of its clients' listener and its control listener."""
    clients: list[TestClient] = []

    def start(triton=None, record: RouteTable | None = TABLE) -> tuple[Gateway, TestClient, TestClient]:
        path = tmp_path / "serving" / f"{SERVICE}.json"
        if record is not None:
            write_record(path, record)
        config = GatewayConfig(
            "http://triton.test:8000", SERVICE, 512, api_keys={KEY: "team-a"}, record=path, control_key=CONTROL_KEY
        )
        gateway = Gateway(config, transport=httpx.MockTransport(triton or FakeTriton()))
        public = TestClient(gateway.app(), headers=AUTH, raise_server_exceptions=False).__enter__()
        control = TestClient(ControlApi(gateway, CONTROL_KEY).app(), headers={"llmops-control-key": CONTROL_KEY})
        clients.extend([public, control.__enter__()])
        return gateway, public, control

    yield start
    for client in clients:
        client.__exit__(None, None, None)


def test_the_control_api_needs_the_serves_control_key_not_a_client_key(service):
    gateway, public, control = service()
    with TestClient(ControlApi(gateway, CONTROL_KEY).app()) as keyless:
        for headers in ({}, {"llmops-control-key": KEY}, AUTH):
            refused = keyless.get("/control/v1/deployment", headers=headers)
            assert refused.status_code == 401 and "control key" in refused.json()["error"]
            assert keyless.post(f"/v2/models/{SERVICE}/generate", json={}, headers=headers).status_code == 401
        assert keyless.get("/health/ready").status_code == 200  # probes and /metrics: no key
    assert control.get("/control/v1/deployment").json()["champion"]["name"] == CHAMPION.name
    assert public.get("/control/v1/deployment").status_code == 404  # not on the clients' listener


def test_the_gateways_listeners_share_one_uvloop_in_a_thread_as_uvicorn_run_would_give_them(tmp_path: Path):
    """`llmops serve`'s listeners run on uvicorn's own choice of loop (uvloop), not the standard library's."""
    from tasks.platform.ports import free_port
    from tasks.runtime.gateway.running import Listener, RunningGateway

    write_record(tmp_path / f"{SERVICE}.json", TABLE)
    config = GatewayConfig("http://triton.test:8000", SERVICE, 512, record=tmp_path / f"{SERVICE}.json")
    gateway = Gateway(config, transport=httpx.MockTransport(FakeTriton()))
    public, control = free_port(), free_port()
    listeners = [
        Listener(gateway.app(), "127.0.0.1", public),
        Listener(ControlApi(gateway, CONTROL_KEY).app(), "127.0.0.1", control),
    ]
    running = RunningGateway(listeners, gateway).start()
    try:
        assert type(running.loop).__module__.startswith("uvloop")
        answer = httpx.post(f"http://127.0.0.1:{public}/v2/models/{SERVICE}/generate", json={"text_input": "hot"})
        assert answer.status_code == 200, answer.text
        table = httpx.get(
            f"http://127.0.0.1:{control}/control/v1/deployment", headers={"llmops-control-key": CONTROL_KEY}
        )
        assert table.json()["champion"]["name"] == CHAMPION.name
    finally:
        running.stop()
    assert not running.thread.is_alive()


def test_a_canary_step_takes_effect_for_the_next_request_and_lands_in_the_record(service, tmp_path):
    triton = FakeTriton()
    gateway, public, control = service(triton)
    table = with_candidate(0, release="run-7")
    answer = control.put("/control/v1/deployment", json={**table.as_json(), "lease_s": 600})
    assert answer.status_code == 200, answer.text
    assert answer.json()["release"] == "run-7" and answer.json()["expires_at"] > time.time() + 590
    public.post(CHAT, json={"messages": QUESTION})
    started = time.perf_counter()
    step = control.put("/control/v1/routes", json={"weights": {CANDIDATE.name: 100}, "release": "run-7"})
    step_ms = (time.perf_counter() - started) * 1000
    assert step.status_code == 200 and step.json()["expires_at"] == answer.json()["expires_at"]  # the hold kept
    assert step_ms < 50, step_ms  # no model loaded again: a table swapped (and its record written)
    public.post(CHAT, json={"messages": QUESTION})
    public.post(f"/v2/models/{SERVICE}/generate_stream", json={"text_input": "hot"})
    assert [(path, body.get("lora_name")) for path, body in triton.requests] == [
        (f"/v2/models/{CHAMPION.model}/generate", None),
        (f"/v2/models/{CANDIDATE.model}/generate", CANDIDATE.name),  # the base engine, asked for the adapter
        (f"/v2/models/{CANDIDATE.model}/generate_stream", CANDIDATE.name),
    ]
    recorded = read_record(tmp_path / "serving" / f"{SERVICE}.json")
    assert recorded is not None and recorded.weights == {CANDIDATE.name: 100.0} and recorded.release == "run-7"
    metrics = scrape(public).text
    assert 'llmops_gateway_version_requests_total{outcome="ok",version="demo-v2"} 2.0' in metrics
    assert gateway.table.describe() == "demo-v2=100"


def test_a_client_cannot_name_a_version_or_an_adapter_and_the_release_can_name_a_version(service):
    triton = FakeTriton()
    _, public, control = service(triton, with_candidate(0, release="run-7"))
    control.put("/control/v1/deployment", json=with_candidate(0, release="run-7").as_json())
    pinned = public.post(f"/v2/models/{CANDIDATE.name}/generate", json={"text_input": "hot"})
    assert pinned.status_code == 404 and "is not served here" in pinned.json()["error"]
    named = public.post(f"/v2/models/{SERVICE}/generate", json={"text_input": "hot", "lora_name": "other"})
    assert named.status_code == 400  # an input the API does not have
    answered = control.post(f"/v2/models/{CANDIDATE.name}/generate", json={"text_input": "hot"})
    assert answered.status_code == 200
    assert triton.requests[-1] == (
        f"/v2/models/{CANDIDATE.model}/generate",
        {"text_input": "hot", "max_tokens": 64, "lora_name": CANDIDATE.name},
    )


def test_shadow_copies_start_and_stop_through_the_control_api(service):
    _, _, control = service()
    control.put("/control/v1/deployment", json=with_candidate(0, release="run-7").as_json())
    started = control.put("/control/v1/shadow", json={"version": CANDIDATE.name, "fraction": 0.5, "release": "run-7"})
    assert (started.json()["shadow"], started.json()["shadow_fraction"]) == (CANDIDATE.name, 0.5)
    stopped = control.delete("/control/v1/shadow")
    assert stopped.json()["shadow"] is None
    bad = control.put("/control/v1/shadow", json={"version": CANDIDATE.name, "fraction": "half"})
    assert bad.status_code == 400 and bad.json() == {"error": "fraction: a number in (0, 1]"}
    bad = control.put("/control/v1/routes", json={"weights": {"demo-v9": 5}})
    assert bad.status_code == 400 and "weights: demo-v9" in bad.json()["error"]


def test_a_release_that_lets_its_hold_lapse_leaves_the_champion_serving_alone(service):
    gateway, public, control = service()
    control.put("/control/v1/deployment", json={**with_candidate(50, release="run-7").as_json(), "lease_s": 0.2})
    deadline = time.monotonic() + 5
    while gateway.table.candidate is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gateway.table == replace(TABLE, updated_at=gateway.table.updated_at)  # the champion alone
    assert "llmops_gateway_leases_expired_total 1.0" in scrape(public).text


def test_a_gateway_starts_from_its_record_with_the_champion_alone(service, tmp_path):
    gateway, public, _ = service(record=with_candidate(50, release="run-7", shadow=CANDIDATE.name, shadow_fraction=1))
    assert gateway.table.describe() == "demo-v1=100" and gateway.table.candidate is None
    assert public.get("/health/ready").status_code == 200
    assert read_record(tmp_path / "serving" / f"{SERVICE}.json").candidate is None


# --- the base engine's adapter map ------------------------------------------------------------------------------


def adapter(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def test_a_pid_given_again_to_a_later_triton_gets_a_map_of_its_own_and_a_stopped_tritons_map_goes(
    tmp_path: Path, monkeypatch
):
    """Maps were keyed by the PID alone: a Triton given the PID of an earlier one found that one's bindings and
    refused to load its own v1 ("bound to other weights"), seen in test_serving after a day of Tritons here."""
    monkeypatch.setattr(adapter_registry.tempfile, "gettempdir", lambda: str(tmp_path))
    pid = os.getpid()
    assert adapter_registry.process_start(pid) not in ("", "0")  # /proc/PID/stat's start time, on Linux
    earlier = adapter_registry.registry_root(pid)
    adapter_registry.register(earlier, "svc-base", "svc-v1", str(adapter(tmp_path / "a", b"one")))
    monkeypatch.setattr(adapter_registry, "process_start", lambda _pid: "999999999")  # the same PID, started later
    later = adapter_registry.registry_root(pid)
    assert later != earlier
    adapter_registry.register(later, "svc-base", "svc-v1", str(adapter(tmp_path / "b", b"two")))  # not refused
    adapter_registry.forget_map(pid)
    assert not os.path.exists(earlier) and not os.path.exists(later)


def test_a_name_is_bound_to_one_adapter_and_never_bound_again(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(adapter_registry.tempfile, "gettempdir", lambda: str(tmp_path))
    root = adapter_registry.registry_root(12345)
    assert os.stat(root).st_mode & 0o777 == 0o700
    first = adapter_registry.register(root, "svc-base", "svc-v2", str(adapter(tmp_path / "a", b"one")))
    assert adapter_registry.active(root, "svc-base", "svc-v2")["path"] == first["path"] != str(tmp_path / "a")
    with pytest.raises(adapter_registry.RegistryError, match="'svc-v2' is bound to other weights on svc-base"):
        adapter_registry.register(root, "svc-base", "svc-v2", str(adapter(tmp_path / "b", b"two")))
    adapter_registry.retire(root, "svc-base", "svc-v2")
    assert adapter_registry.active(root, "svc-base", "svc-v2") is None  # the engine frees it
    with pytest.raises(adapter_registry.RegistryError, match="bound to other weights"):  # a tombstone holds the name
        adapter_registry.register(root, "svc-base", "svc-v2", str(tmp_path / "b"))
    adapter_registry.register(root, "svc-base", "svc-v2", str(tmp_path / "a"))  # the same weights again
    assert adapter_registry.active(root, "svc-base", "svc-v2") is not None
    with pytest.raises(adapter_registry.RegistryError, match="no adapter_config.json"):
        adapter_registry.register(root, "svc-base", "svc-v3", str(tmp_path))
    with pytest.raises(adapter_registry.RegistryError, match="not a model name"):
        adapter_registry.register(root, "svc-base", "../x", str(tmp_path / "a"))


def test_only_the_release_that_holds_the_routes_renews_its_hold(service):
    gateway, _, control = service()
    held = control.put("/control/v1/deployment", json={**with_candidate(0, release="run-7").as_json(), "lease_s": 5})
    renewed = control.put("/control/v1/lease", json={"release": "run-7", "lease_s": 600})
    assert renewed.status_code == 200 and renewed.json()["expires_at"] > held.json()["expires_at"] + 500
    assert gateway.table.describe() == "demo-v1=100"  # the routes themselves untouched
    other = control.put("/control/v1/lease", json={"release": "run-8", "lease_s": 600})
    assert other.status_code == 409 and other.json() == {"error": "release: the routes are held by run-7, not run-8"}


class Loads:
    """What loads a release's versions, as the control API calls it (the serve's fleet, a release's own Triton)."""

    def __init__(self) -> None:
        self.loaded: list[tuple[str, float, bool]] = []
        self.unloaded: list[str] = []

    def load_everywhere(self, version: Version, load_timeout_s: float, fresh: bool = False) -> list[dict]:
        from tasks.platform.errors import CheckFailed, TransientError

        if version.name == "demo-v8":
            raise CheckFailed("demo-v8's load hung on Triton http://h:1, the last replica serving the champion")
        if version.name == "demo-v9":
            raise TransientError("Triton http://h:1 did not serve again within 60s")
        if version.source.get("settings") == {"instance_count": 0}:
            raise ValueError("serve.instance_count: Input should be greater than 0")
        self.loaded.append((version.name, load_timeout_s, fresh))
        return [{"url": "http://h:1", "load_s": 1.5}]

    def unload_everywhere(self, version: Version) -> list[str]:
        self.unloaded.append(version.name)
        return ["http://h:1"]


def test_a_release_asks_the_service_to_load_its_version_and_hears_how_each_replica_took_it_or_why_not(service):
    """POST /control/v1/versions: the service loads a release's version itself (the release holds no Triton key);
    each refusal in Triton's error shape, the load's own failures by kind. The loads themselves, with a hung one, are
    test_attach's two-replica test and the serving tests' releases."""
    gateway, _, control = service()
    version = {"name": "demo-v2", "model": "demo-v2", "source": {"version": "2", "artifacts": {"merge": "ab"}}}
    body = {"version": version, "load_timeout_s": 60}
    assert control.post("/control/v1/versions", json=body).json() == {"error": "this gateway loads no versions"}
    loads = Loads()
    with TestClient(ControlApi(gateway, CONTROL_KEY, loads).app(), headers={"llmops-control-key": CONTROL_KEY}) as c:
        done = c.post("/control/v1/versions", json={**body, "fresh": True})
        assert done.status_code == 200, done.text
        assert done.json() == {"name": "demo-v2", "replicas": [{"url": "http://h:1", "load_s": 1.5}]}
        assert loads.loaded == [("demo-v2", 60.0, True)]
        gone = c.request("DELETE", "/control/v1/versions", json={"version": version})
        assert gone.json() == {"name": "demo-v2", "unloaded": ["http://h:1"]} and loads.unloaded == ["demo-v2"]
        refused_settings = {**version, "source": {"settings": {"instance_count": 0}}}
        for sent, status, error in [
            ({**body, "version": {**version, "name": "demo-v8"}}, 409, "the last replica serving the champion"),
            ({**body, "version": {**version, "name": "demo-v9"}}, 504, "did not serve again within 60s"),
            ({**body, "version": refused_settings}, 400, "version.source: serve.instance_count"),
            ({"load_timeout_s": 60}, 400, "version: a version needs a name"),
            ({**body, "version": {**version, "name": "../x"}}, 400, "version.name: '../x' is not a model name"),
            ({**body, "load_timeout_s": 0}, 400, "load_timeout_s: seconds in (0, 3600]"),
            ({**body, "load_timeout_s": True}, 400, "load_timeout_s"),
            ({**body, "fresh": "yes"}, 400, "fresh: true or false"),
        ]:
            refused = c.post("/control/v1/versions", json=sent)
            assert refused.status_code == status and error in refused.json()["error"], (sent, refused.text)
        assert c.post("/control/v1/versions", json=body, headers={"llmops-control-key": "x"}).status_code == 401
    assert len(loads.loaded) == 1


# --- the service's ownership (the serving lock) -----------------------------------------------------------------


def test_one_release_owns_the_service_until_it_gives_it_up_or_lets_it_lapse(service, tmp_path):
    gateway, _, control = service()
    taken = control.put("/control/v1/owner", json={"release": "run-7", "lease_s": 600})
    assert taken.status_code == 200 and taken.json()["owner"]["release"] == "run-7"
    since, epoch = taken.json()["owner"]["since"], taken.json()["owner"]["epoch"]
    assert epoch == 1 == taken.json()["last_epoch"]
    other = control.put("/control/v1/owner", json={"release": "run-8", "lease_s": 600})
    assert other.status_code == 409 and other.json()["owner"]["release"] == "run-7"
    assert other.json()["error"].startswith("demo is owned by release run-7 (epoch 1, owner since ")
    # the owner's changes of the routes (with its epoch) keep its ownership, and so does the record a restarted
    # gateway reads
    held = control.put(
        "/control/v1/deployment", json={**with_candidate(0, release="run-7").as_json(), "lease_s": 60, "epoch": 1}
    )
    assert held.status_code == 200, held.text
    step = {"weights": {CHAMPION.name: 90, CANDIDATE.name: 10}, "release": "run-7", "epoch": epoch}
    assert control.put("/control/v1/routes", json=step).status_code == 200
    assert gateway.table.owner.release == "run-7"
    assert read_record(tmp_path / "serving" / f"{SERVICE}.json").owner.release == "run-7"
    restarted, _, _ = service(record=None)
    assert restarted.table.owner.release == "run-7" and restarted.table.candidate is None
    renewed = control.put("/control/v1/owner", json={"release": "run-7", "lease_s": 900, "waiting": "approval"})
    assert renewed.json()["owner"]["since"] == since and renewed.json()["owner"]["waiting"] == "approval"
    waiting = control.put("/control/v1/owner", json={"release": "run-8", "lease_s": 600})
    assert "waiting for approval" in waiting.json()["error"]
    assert control.request("DELETE", "/control/v1/owner", json={"release": "run-8"}).json()["owner"] is not None
    assert control.request("DELETE", "/control/v1/owner", json={"release": "run-7", "epoch": 2}).json()["owner"]
    assert control.request("DELETE", "/control/v1/owner", json={"release": "run-7"}).json()["owner"] is None
    assert control.put("/control/v1/owner", json={"release": "run-8", "lease_s": 0.01}).status_code == 200
    time.sleep(0.05)  # run-8 died: its ownership lapsed and the next release takes the service over
    over = control.put("/control/v1/owner", json={"release": "run-9", "lease_s": 600})
    assert over.status_code == 200 and over.json()["owner"]["release"] == "run-9"
    for body, error in [
        ({"lease_s": 5}, "release: a run id"),
        ({"release": "run-9"}, "lease_s: required"),
        ({"release": "run-9", "lease_s": 5, "waiting": "lunch"}, "waiting: null or approval"),
    ]:
        bad = control.put("/control/v1/owner", json=body)
        assert bad.status_code == 400 and bad.json() == {"error": error}


class OwnerControl(ServiceControl):
    """A release's view of the control API (ServiceControl, its fence included) over a TestClient."""

    def __init__(self, control: TestClient):
        super().__init__("http://control.test", CONTROL_KEY)
        self.client = control

    def send(self, method: str, path: str, body, timeout: float):  # type: ignore[override]
        return self.client.request(method, path, json=body)


def test_a_second_release_queues_behind_a_working_owner_and_fails_fast_behind_one_waiting_for_a_person(service):
    from tasks.platform.errors import CheckFailed
    from tasks.serving.ownership import Ownership

    gateway, _, control = service()
    first = Ownership(OwnerControl(control), SERVICE, "run-1", lease_s=600)
    assert first.take(timeout_s=1) < 1
    second = Ownership(OwnerControl(control), SERVICE, "run-2", lease_s=600)
    started = time.monotonic()
    with pytest.raises(
        CheckFailed, match=r"^demo is still owned by release run-1 \(epoch 1, owner since .*\) after \d+s"
    ):
        second.take(timeout_s=1, poll_s=0.2)
    assert time.monotonic() - started >= 1  # it queued
    first.wait_for_approval(86_400)
    assert gateway.table.owner.expires_at > time.time() + 86_000
    started = time.monotonic()
    with pytest.raises(
        CheckFailed, match=r"owned by release run-1 \(epoch 1, owner since .*, waiting for approval\); a rel"
    ):
        second.take(timeout_s=60)
    assert time.monotonic() - started < 1  # it did not queue behind a person
    first.decided()
    assert gateway.table.owner.waiting is None
    threading.Timer(0.5, first.give_up).start()  # the first one ends while the second queues
    assert 0.4 < second.take(timeout_s=10, poll_s=0.1) < 5
    assert gateway.table.owner.release == "run-2"


def test_a_release_renews_its_ownership_while_it_runs_and_frees_the_service_at_its_end(service):
    from tasks.serving.ownership import Ownership

    gateway, _, control = service()
    owning = Ownership(OwnerControl(control), SERVICE, "run-1", lease_s=0.6)
    owning.take(timeout_s=1)
    owning.keep()
    time.sleep(1.5)  # over two leases: renewed every third of one
    assert gateway.table.owner.release == "run-1" and not gateway.table.owner.expired(time.time())
    owning.give_up()
    assert gateway.table.owner is None


class Tags:
    """The MLflow run's tags and metrics as the serving lock writes them."""

    def __init__(self):
        self.tags: dict[str, str] = {}
        self.metrics: dict[str, float] = {}

    def set_tags(self, tags: dict) -> None:
        self.tags.update(tags)

    def log_metrics(self, prefix: str, metrics: dict) -> None:
        self.metrics.update({f"{prefix}/{k}": v for k, v in metrics.items()})


def test_a_release_suspended_for_approval_stays_the_owner_and_its_resumed_run_owns_the_service_again(service):
    from prefect.exceptions import Pause

    from tasks.platform.config import load_profile
    from tasks.serving.ownership import serving_lock
    from tasks.serving.service import Service

    gateway, _, control = service()
    config = load_profile("cpu-tiny", ["canary.lease_s=0.3"])  # renewed every 0.1 s for 0.3 s while it runs
    served = Service(SERVICE, [], OwnerControl(control))
    first = Tags()
    with pytest.raises(Pause), serving_lock(config, first, served, "flow-run-1") as lock:  # type: ignore[arg-type]
        lock.wait_for_approval(86_400)
        time.sleep(0.5)  # the renewals of a working release go on until it suspends
        raise Pause()  # what suspend_flow_run raises: the process exits
    time.sleep(0.5)  # no renewal of a short lease lands after the suspension
    owner = gateway.table.owner
    assert (owner.release, owner.waiting) == ("flow-run-1", "approval") and owner.expires_at > time.time() + 86_000
    assert "serving_lock.released_at" not in first.tags and not lock.renewing.is_alive()
    resumed = Tags()
    with serving_lock(config, resumed, served, "flow-run-1", resumed=True) as lock:  # the decision started it again
        assert gateway.table.owner.since == owner.since and gateway.table.owner.waiting is None
    assert gateway.table.owner is None and "serving_lock/wait_s" not in resumed.metrics  # its first wait stands
    assert "serving_lock.released_at" in resumed.tags


def test_a_lost_record_gives_epoch_1_again_and_the_release_it_was_first_given_to_is_still_refused(service, tmp_path):
    """Issue 73's fencing hole: epochs start over where the record is lost (on Kubernetes it lives in an emptyDir).
    Every fenced write names the release its epoch was given to (the client's `epoch_of`), so run-a, stopped with
    epoch 1 of the lost record, cannot write over run-b, which the new record gave epoch 1 too."""
    from tasks.platform.errors import LostService
    from tasks.serving.service import Fence

    _, _, control = service()
    assert control.put("/control/v1/owner", json={"release": "run-a", "lease_s": 600}).json()["owner"]["epoch"] == 1
    (tmp_path / "serving" / f"{SERVICE}.json").unlink()  # the volume went with its pod
    gateway, _, control = service()
    assert control.put("/control/v1/owner", json={"release": "run-b", "lease_s": 600}).json()["owner"]["epoch"] == 1
    stale = ServiceControl(str(control.base_url), CONTROL_KEY, fence=Fence("run-a", 1))
    stale.send = lambda method, path, body, timeout: control.request(method, path, json=body)  # type: ignore[method-assign]
    with pytest.raises(LostService, match="owned by release run-b"):
        stale.stop_shadow()  # a write whose body names no release: epoch_of does
    no_release = control.put("/control/v1/routes", json={"weights": {CHAMPION.name: 100}, "epoch": 1})
    assert no_release.status_code == 400 and no_release.json()["error"].startswith("epoch_of: ")
    assert gateway.table.owner.release == "run-b"


def test_the_gateways_of_one_home_share_the_services_owner_through_its_record(service):
    """`llmops serve`'s gateway and a release's temporary one read and write the same record: a release that gave
    the service up at one gateway frees it for a release queued at the other."""
    _, _, first = service()
    _, _, second = service(record=None)
    assert first.put("/control/v1/owner", json={"release": "run-1", "lease_s": 600}).status_code == 200
    refused = second.put("/control/v1/owner", json={"release": "run-2", "lease_s": 600})
    assert refused.status_code == 409 and refused.json()["owner"]["release"] == "run-1"
    first.put("/control/v1/routes", json={"weights": {CHAMPION.name: 100}, "release": "run-1"})  # keeps the owner
    assert second.put("/control/v1/owner", json={"release": "run-2", "lease_s": 600}).status_code == 409
    first.request("DELETE", "/control/v1/owner", json={"release": "run-1"})
    assert second.put("/control/v1/owner", json={"release": "run-2", "lease_s": 600}).status_code == 200


def test_the_gateways_of_one_home_never_give_one_epoch_twice(service):
    """An epoch given at one gateway (a release's temporary one) is known to the other (`llmops serve`'s) when it writes
    the record next, so the next owner there gets a newer one: a fence two owners shared would fence nothing."""
    first_gateway, _, first = service()
    _, _, second = service(record=None)
    assert second.put("/control/v1/owner", json={"release": "run-1", "lease_s": 600}).json()["owner"]["epoch"] == 1
    second.request("DELETE", "/control/v1/owner", json={"release": "run-1"})
    assert first_gateway.table.last_epoch == 0  # its memory has not seen the other gateway's epoch
    assert first.put("/control/v1/routes", json={"weights": {CHAMPION.name: 100}}).status_code == 200
    assert first.put("/control/v1/owner", json={"release": "run-2", "lease_s": 600}).json()["owner"]["epoch"] == 2


# --- fencing: a release that lost the service writes nothing more ------------------------------------------------


@pytest.fixture
def control_url(tmp_path: Path):
    """The control listener of a real gateway (uvicorn on a free port), as releases reach it over HTTP."""
    from tasks.platform.ports import free_port
    from tasks.runtime.gateway.running import Listener, RunningGateway

    record = tmp_path / "serving" / f"{SERVICE}.json"
    write_record(record, TABLE)
    config = GatewayConfig("http://triton.test:8000", SERVICE, 512, record=record, control_key=CONTROL_KEY)
    gateway = Gateway(config, transport=httpx.MockTransport(FakeTriton()))
    port = free_port()
    running = RunningGateway([Listener(ControlApi(gateway, CONTROL_KEY).app(), "127.0.0.1", port)], gateway).start()
    yield f"http://127.0.0.1:{port}", gateway
    running.stop()


def test_a_release_whose_lease_lapsed_is_fenced_off_once_another_owns_the_service(control_url):
    """Issue 60, finding 1: release A stops renewing (SIGSTOPped, a long benchmark) past its lease; B takes the service
    over with the next epoch and canaries. A's next write is refused by the gateway (409 naming B), A's writes after
    it are refused unsent, and B's routes and ownership are untouched."""
    from tasks.platform.errors import LOST_SERVICE_EXIT_CODE, LostService
    from tasks.serving.ownership import Ownership
    from tasks.serving.service import Fence

    url, gateway = control_url
    first = Ownership(ServiceControl(url, CONTROL_KEY), SERVICE, "flow-run-a", lease_s=0.5)
    first.take(timeout_s=1)
    assert (first.epoch, first.control.fence) == (1, Fence("flow-run-a", 1))
    first.control.put_table(with_candidate(0, release="flow-run-a"), 60)
    time.sleep(0.6)  # A renews nothing: its lease lapses
    second = Ownership(ServiceControl(url, CONTROL_KEY), SERVICE, "flow-run-b", lease_s=600)
    assert second.take(timeout_s=1) < 1 and second.epoch == 2
    second.control.put_table(with_candidate(10, release="flow-run-b"), 60)
    with pytest.raises(LostService, match=r"^demo is owned by release flow-run-b \(epoch 2, .*a write with epoch 1"):
        first.control.set_weights({CHAMPION.name: 50, CANDIDATE.name: 50}, "flow-run-a", 60)
    assert (
        gateway.table.weights == {CHAMPION.name: 90.0, CANDIDATE.name: 10.0} and gateway.table.release == "flow-run-b"
    )
    first.control.url = "http://127.0.0.1:9"  # nothing listens: a write sent would be a TransientError
    for write in (lambda: first.control.put_table(TABLE), first.control.stop_shadow, lambda: first.renew()):
        with pytest.raises(LostService, match="this release wrote nothing more"):
            write()
    first.give_up()  # frees nothing of B's
    assert gateway.table.owner.release == "flow-run-b" and gateway.table.owner.epoch == 2
    assert LostService.exit_code == LOST_SERVICE_EXIT_CODE == 6
    # B's renewal keeps its epoch; a writer without one (an operator) waits until no release owns the service
    second.renew()
    assert gateway.table.owner.epoch == 2
    operator = {"weights": {CHAMPION.name: 100}}
    assert ServiceControl(url, CONTROL_KEY).send("PUT", "/control/v1/routes", operator, 10).status_code == 409
    second.give_up()
    assert gateway.table.owner is None and gateway.table.last_epoch == 2
    third = Ownership(ServiceControl(url, CONTROL_KEY), SERVICE, "flow-run-c", lease_s=600)
    third.take(timeout_s=1)
    assert third.epoch == 3  # an epoch is never given twice


def test_only_the_live_owner_declares_what_it_loads_and_the_next_owner_starts_with_nothing(control_url):
    """PUT /control/v1/loads: the owner's epoch only (400 without one, 409 with another's); kept through renewals;
    a new owner declares its own. A release on a gateway of its own (no fence) declares nothing."""
    from tasks.platform.errors import LostService
    from tasks.serving.ownership import Ownership

    url, gateway = control_url
    ServiceControl(url, CONTROL_KEY).declare(["ignored"])  # no fence: nothing sent
    first = Ownership(ServiceControl(url, CONTROL_KEY), SERVICE, "flow-run-a", lease_s=0.5)
    first.take(timeout_s=1)
    first.control.declare([CANDIDATE.name, CHAMPION.name, CANDIDATE.name])
    assert gateway.table.owner.loads == (CHAMPION.name, CANDIDATE.name)
    first.renew()
    assert gateway.table.owner.loads == (CHAMPION.name, CANDIDATE.name)
    assert gateway.table.wanted(time.time()) >= {CANDIDATE.name, CHAMPION.name}
    no_epoch = ServiceControl(url, CONTROL_KEY).send("PUT", "/control/v1/loads", {"models": ["x"]}, 10)
    assert no_epoch.status_code == 400 and "epoch" in no_epoch.json()["error"]
    bad = ServiceControl(url, CONTROL_KEY).send("PUT", "/control/v1/loads", {"models": ["a/b"], "epoch": 1}, 10)
    assert bad.status_code == 400 and bad.json()["error"].startswith("models: 'a/b' is not a model name")
    time.sleep(0.6)  # A's lease lapses: what it declared is nobody's
    assert CANDIDATE.name not in gateway.table.wanted(time.time())
    second = Ownership(ServiceControl(url, CONTROL_KEY), SERVICE, "flow-run-b", lease_s=600)
    second.take(timeout_s=1)
    assert gateway.table.owner.loads == ()
    with pytest.raises(LostService, match="owned by release flow-run-b"):
        first.control.declare([CANDIDATE.name])
    second.give_up()


def test_a_release_whose_renewals_stop_landing_for_a_whole_lease_stops_itself(control_url):
    """The service unreachable from the release for longer than its lease (a partition): the release cannot know
    whether another took the service over, so it writes nothing more and says why."""
    from tasks.platform.errors import LostService
    from tasks.serving.ownership import Ownership

    url, gateway = control_url
    owning = Ownership(ServiceControl(url, CONTROL_KEY), SERVICE, "flow-run-a", lease_s=0.4)
    owning.take(timeout_s=1)
    owning.control.url = "http://127.0.0.1:9"
    owning.renew()  # within its lease: a warning, and on
    time.sleep(0.45)
    with pytest.raises(LostService, match=r"^demo: no renewal of this release's ownership landed for 0.4s"):
        owning.renew()
    with pytest.raises(LostService):
        owning.control.set_weights({CHAMPION.name: 100}, "flow-run-a", 60)


def test_a_release_that_owns_the_service_again_after_another_did_gives_that_ownership_up_and_stops(control_url):
    """A's lease lapsed, B owned the service and gave it up (its promotion done); A's renewal is answered with a new
    epoch: B may have changed everything since, so A frees the service at once and stops."""
    from tasks.platform.errors import LostService
    from tasks.serving.ownership import Ownership

    url, gateway = control_url
    first = Ownership(ServiceControl(url, CONTROL_KEY), SERVICE, "flow-run-a", lease_s=0.3)
    first.take(timeout_s=1)
    time.sleep(0.35)
    second = Ownership(ServiceControl(url, CONTROL_KEY), SERVICE, "flow-run-b", lease_s=600)
    second.take(timeout_s=1)
    second.give_up()
    with pytest.raises(LostService, match="this release's ownership lapsed before it was renewed"):
        first.renew()
    assert gateway.table.owner is None and gateway.table.last_epoch == 3


def test_an_owner_whose_lease_lapsed_cannot_renew_under_its_old_epoch(control_url):
    """Issue 73's fencing holes: A's lease lapsed and no release took the service since. A's renewal is not a renewal:
    the gateway gives a new epoch (it served the champion alone meanwhile), A frees the service at once and stops,
    and a write under A's old epoch is refused."""
    from tasks.platform.errors import LostService
    from tasks.serving.ownership import Ownership

    url, gateway = control_url
    first = Ownership(ServiceControl(url, CONTROL_KEY), SERVICE, "flow-run-a", lease_s=0.3)
    first.take(timeout_s=1)
    assert first.epoch == 1
    time.sleep(0.35)
    with pytest.raises(LostService, match=r"^demo: this release's ownership lapsed before it was renewed \(epoch 1\)"):
        first.renew()
    assert gateway.table.owner is None and gateway.table.last_epoch == 2
    late = ServiceControl(url, CONTROL_KEY).send(
        "PUT", "/control/v1/routes", {"weights": {CHAMPION.name: 100}, "release": "flow-run-a", "epoch": 1}, 10
    )
    assert late.status_code == 409, late.text


# --- a candidate cannot cost the champion its clients ---------------------------------------------------------------


class StubServer:
    """A replica's tritonserver as the fleet sees it: killed, it is started again by the serve's watch."""

    def __init__(self, replica_started: list):
        self.kills, self.replica_started = 0, replica_started

    def running(self) -> bool:
        return True

    def kill(self) -> None:
        self.kills += 1
        self.replica_started[0].started += 1  # the watch started it again

    def end_model_processes(self, models: list[str]) -> list[int]:
        self.ended = [*getattr(self, "ended", []), *models]
        return [4242]


def fleet_of(count: int, table: RouteTable | None):
    from types import SimpleNamespace

    from tasks.runtime.fleet import Fleet, Replica

    fleet = Fleet(None, None, say=lambda line: None)  # type: ignore[arg-type]
    for index in range(count):
        holder: list = []
        triton = SimpleNamespace(url=f"http://127.0.0.1:{8000 + index}", is_ready=lambda name: name == "demo-base")
        replica = Replica(index, triton, StubServer(holder))  # type: ignore[arg-type]
        holder.append(replica)
        fleet.replicas.append(replica)
    fleet.table = lambda: table
    return fleet


def test_the_serve_never_restarts_its_last_replica_serving_the_champion_for_a_releases_hung_load():
    """Issue 60, finding 2: a candidate's hung load on a one-replica serve restarted the Triton serving the champion
    (every client a 503 for minutes). Now the candidate's model processes are ended and its load abandoned there; a
    restart only where another replica serves (or nothing is served yet)."""
    alone = fleet_of(1, TABLE)
    # an adapter candidate's models: its own and the base engine, which serves (never ended), and the champion's
    assert (
        ReleaseLoads(alone).hung_load("http://127.0.0.1:8000", ["demo-base", "demo-v2", CHAMPION.name], 5)
        == "abandoned"
    )
    assert alone.replicas[0].server.kills == 0 and alone.replicas[0].server.ended == ["demo-v2"]  # type: ignore[union-attr]
    two = fleet_of(2, TABLE)
    assert ReleaseLoads(two).hung_load("http://127.0.0.1:8001", ["demo-v2"], 5) == "restarted"
    assert [r.server.kills for r in two.replicas] == [0, 1]  # type: ignore[union-attr]
    first_release = fleet_of(1, RouteTable(SERVICE))  # nothing served yet: no client to lose
    assert ReleaseLoads(first_release).hung_load("http://127.0.0.1:8000", ["demo-v1"], 5) == "restarted"
    assert first_release.replicas[0].server.kills == 1  # type: ignore[union-attr]


def test_a_version_whose_load_hangs_is_the_serves_to_end_and_one_that_does_not_load_is_unloaded(monkeypatch):
    """The serve loads a release's version (Fleet.load_everywhere). A load that hangs where another replica serves the
    champion restarts that Triton and is tried once more; a second hang is a failed check with one line (a transient
    fault would be loaded up to three times more by Prefect's retries); on the last replica serving the champion the
    load is abandoned, never retried; a version that does not load is unloaded again from every replica."""
    from types import SimpleNamespace

    from tasks.platform.config import load_profile
    from tasks.platform.errors import CheckFailed, TransientError
    from tasks.runtime import loads as module

    candidate = SimpleNamespace(name="demo-v2", models=["demo-v2"])
    monkeypatch.setattr(module, "served_of", lambda ctx, service, version: candidate)
    monkeypatch.setattr(module, "released_profile", lambda profile, served: profile)
    loads: list[str] = []
    retired: list[str] = []

    def hangs(triton, profile, served):
        loads.append(triton.url)
        raise TransientError("demo-v2 did not load within 40s (serve.load_timeout_s)")

    monkeypatch.setattr(module, "install_model", hangs)
    monkeypatch.setattr(module, "retire", lambda triton, service, served: retired.append(triton.url))
    version = Version("demo-v2", "demo-v2")

    two = fleet_of(2, TABLE)
    two.ctx = SimpleNamespace(profile=load_profile("cpu-tiny"))  # type: ignore[assignment]
    monkeypatch.setattr(module, "loaded_on", lambda triton, served, seconds, said: {"url": triton.url})
    with pytest.raises(CheckFailed, match=r"^demo-v2's load hung again after Triton http://127.0.0.1:8000 restarted"):
        ReleaseLoads(two).load_everywhere(version, 60)
    assert loads == ["http://127.0.0.1:8000"] * 2 and [r.server.kills for r in two.replicas] == [1, 0]  # type: ignore[union-attr]

    alone = fleet_of(1, TABLE)
    alone.ctx = two.ctx
    with pytest.raises(CheckFailed, match=r"^demo-v2's load hung on Triton .* the load abandoned; the champion"):
        ReleaseLoads(alone).load_everywhere(version, 60)
    assert len(loads) == 3 and alone.replicas[0].server.kills == 0  # type: ignore[union-attr]

    def fails(triton, profile, served):
        raise CheckFailed("demo-v2: the serving config names no model_dir")

    monkeypatch.setattr(module, "install_model", fails)
    with pytest.raises(CheckFailed, match="names no model_dir"):
        ReleaseLoads(two).load_everywhere(version, 60)
    assert retired == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"] and not retired.clear()
    with pytest.raises(CheckFailed, match="names no model_dir"):
        ReleaseLoads(two).load_everywhere(
            Version(CHAMPION.name, CHAMPION.model), 60
        )  # the champion: routed, never unloaded
    assert retired == []


# --- bounded pools: an answer never waits behind a job ---------------------------------------------------------------


def test_answers_and_control_writes_go_on_while_every_job_thread_is_held_by_restarts(tmp_path: Path):
    """Issue 60, finding 5: one default executor (six threads here) carried every /v1 answer's token count and the
    minute-long restarts: eight releases' restarts at once left an answer waiting for them. The gateway's pools are
    bounded by kind (tasks/runtime/gateway/work.py): the restarts queue behind the job threads, and an answer's token
    count and a control write's record go on."""
    from concurrent.futures import ThreadPoolExecutor

    from tasks.base_model import train_tokenizer
    from tasks.platform.ports import free_port
    from tasks.runtime.gateway.running import Listener, RunningGateway
    from tasks.runtime.gateway.work import JOB_THREADS

    tokenizer = tmp_path / "tokenizer"
    train_tokenizer(["What is the opposite of hot? cold", "big small"] * 8, 300).save_pretrained(tokenizer)
    record = tmp_path / "serving" / f"{SERVICE}.json"
    write_record(record, TABLE)
    config = GatewayConfig(
        "http://triton.test:8000", SERVICE, 512, api_keys={KEY: "team-a"}, tokenizer_dir=tokenizer, record=record
    )
    gateway = Gateway(config, transport=httpx.MockTransport(FakeTriton()))
    release = threading.Event()
    held: list[str] = []

    class Restarts(Loads):
        def load_everywhere(self, version: Version, load_timeout_s: float, fresh: bool = False) -> list[dict]:
            held.append(version.name)  # a load, a replica started again: minutes here
            release.wait(60)
            return []

    public, control = free_port(), free_port()
    listeners = [
        Listener(gateway.app(), "127.0.0.1", public),
        Listener(ControlApi(gateway, CONTROL_KEY, Restarts()).app(), "127.0.0.1", control),
    ]
    running = RunningGateway(listeners, gateway).start()
    headers = {"llmops-control-key": CONTROL_KEY}
    try:
        with ThreadPoolExecutor(8) as callers:
            restarts = [
                callers.submit(
                    httpx.post,
                    f"http://127.0.0.1:{control}/control/v1/versions",
                    json={"version": {"name": f"demo-v{n + 2}"}, "load_timeout_s": 60},
                    headers=headers,
                    timeout=90,
                )
                for n in range(8)
            ]
            deadline = time.monotonic() + 10
            while len(held) < JOB_THREADS and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(held) == JOB_THREADS  # every job thread held; six more restarts queued behind them
            started = time.monotonic()
            answer = httpx.post(
                f"http://127.0.0.1:{public}{CHAT}", json={"messages": QUESTION}, headers=AUTH, timeout=10
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["prompt_tokens"] > 0  # counted in the answers' pool
            step = httpx.put(
                f"http://127.0.0.1:{control}/control/v1/routes",
                json={"weights": {CHAMPION.name: 100}},
                headers=headers,
                timeout=10,
            )
            assert step.status_code == 200, step.text  # the record written in the answers' pool too
            assert time.monotonic() - started < 5
            release.set()
            assert all(r.result().status_code == 200 for r in restarts)
        assert len(held) == 8  # every restart ran, two at a time
    finally:
        release.set()
        running.stop()


# --- the reconciler: what the replicas hold follows the table ------------------------------------------------------


class HeldModels:
    """A replica's Triton as the reconciler reads it: its ready models, and the unloads it is asked for."""

    def __init__(self, url: str, models: list[str]):
        self.url, self.models, self.unloaded = url, list(models), []

    def loaded_models(self) -> list[str]:
        return sorted(self.models)

    def unload(self, name: str) -> None:
        self.unloaded.append(name)
        self.models.remove(name)


def test_the_serve_unloads_what_no_route_needs_and_no_live_owner_declared():
    """Issue 60, finding 3: a release that died mid-canary left its candidate loaded on every replica (an adapter
    holding a max_loras slot, a merged engine its memory). The reconciler keeps what the table routes and what a live
    owner declared it loads (PUT /control/v1/loads, before its loads), and unloads every other model of the service
    on each replica, counting it: the dead release's candidate once its ownership lapsed, at once where another
    release owns the service now (it declared its own)."""
    from types import SimpleNamespace

    from tasks.control.contract import Owner
    from tasks.platform.config import load_profile
    from tasks.runtime.fleet import Fleet, Replica

    service = "tiny-qwen2-antonyms"
    champion = Version(f"{service}-v1", f"{service}-base", f"{service}-v1")  # an adapter on the base engine
    left = Version(f"{service}-v2", f"{service}-base", f"{service}-v2")
    said, counted = [], []
    fleet = Fleet(SimpleNamespace(profile=load_profile("cpu-tiny")), None, say=said.append)  # type: ignore[arg-type]
    fleet.count = lambda action, model: counted.append((action, model))
    held = [f"{service}-base", f"{service}-v1", f"{service}-v2", "another-service-v7"]
    tritons = [HeldModels(f"http://127.0.0.1:{8000 + n}", held) for n in range(2)]
    fleet.replicas = [Replica(n, triton, StubServer([])) for n, triton in enumerate(tritons)]  # type: ignore[arg-type]
    now = time.time()
    declared = (f"{service}-base", f"{service}-v2")
    at_work = RouteTable(service, champion, left, {champion.name: 90.0, left.name: 10.0})
    fleet.table = lambda: replace(at_work, owner=Owner("run-2", now, now + 60, loads=declared))
    assert fleet.reconcile() == [] and not any(t.unloaded for t in tritons)
    lapsed_owner = replace(at_work.champion_alone(), owner=Owner("run-2", now - 120, now - 60, loads=declared))
    fleet.table = lambda: replace(lapsed_owner, owner=Owner("run-2", now, now + 60, loads=declared))
    assert fleet.reconcile() == []  # the owner lives and declared v2, before it is in the routes: its own
    fleet.table = lambda: lapsed_owner
    assert fleet.reconcile() == [f"unload {service}-v2 {t.url}" for t in tritons]
    assert all(t.models == [f"{service}-base", f"{service}-v1", "another-service-v7"] for t in tritons)
    assert counted == [("unload", f"{service}-v2")] * 2
    assert (
        said[0]
        == f"llmops serve: reconcile: unloaded {service}-v2 from http://127.0.0.1:8000 (no version in the table needs "
        "it and no live owner declared it)"
    )
    assert fleet.reconcile() == []  # converged
    merged = Version(f"{service}-v3", f"{service}-v3")  # the champion promoted as a merged model: no adapter engine
    tritons[0].models.append(f"{service}-v3")
    fleet.table = lambda: RouteTable(service, merged, weights={merged.name: 100.0})
    assert fleet.reconcile()[:2] == [f"unload {service}-v1 {tritons[0].url}", f"unload {service}-base {tritons[0].url}"]
    tritons[1].models.append(f"{service}-v4")  # what a stopped release loaded; another owns the service now
    fleet.table = lambda: RouteTable(
        service, merged, weights={merged.name: 100.0}, owner=Owner("run-5", now, now + 60, loads=(f"{service}-v5",))
    )
    assert f"unload {service}-v4 {tritons[1].url}" in fleet.reconcile()


def test_a_replica_started_again_loads_the_versions_with_a_source_and_not_an_operators_second_name(monkeypatch):
    """An operator's PUT may route a second name of the champion's model (no source: nothing to load of its own); a
    replica started again loads the champion, and the second name is answered by it (a soak's ramp crashed the
    serve's restart on it once)."""
    from types import SimpleNamespace

    from tasks.runtime import fleet as fleet_module

    champion = Version(f"{SERVICE}-v1", f"{SERVICE}-v1", None, {"version": "1", "artifacts": {"merge": "abc"}})
    alias = Version(f"{SERVICE}-v900", f"{SERVICE}-v1")
    table = RouteTable(SERVICE, champion, alias, {champion.name: 50.0, alias.name: 50.0})
    fleet = fleet_of(1, table)
    fleet.ctx = SimpleNamespace(profile=SimpleNamespace(registry=SimpleNamespace(model_name=SERVICE)))  # type: ignore[assignment]
    monkeypatch.setattr(fleet_module, "served_of", lambda ctx, service, version: version.name)
    assert fleet.table_versions() == [champion.name]  # type: ignore[comparison-overlap]


def test_a_release_follows_a_serve_started_again_to_its_new_key_and_address(control_url):
    """Issue 61, a Low finding: `llmops serve` started again has a new control key (and, on free ports, a new
    address); a running release held the old ones, so even its rollback failed. On a 401 or a refused connection
    it reads what the serve publishes now and sends the call once more."""
    from tasks.platform.errors import CheckFailed

    url, gateway = control_url
    published = [(url, CONTROL_KEY)]
    stale_key = ServiceControl(url, "the-key-of-the-last-start", reread=lambda: published[0])
    assert stale_key.table().service == SERVICE and stale_key.key == CONTROL_KEY
    moved = ServiceControl("http://127.0.0.1:9", "the-key-of-the-last-start", reread=lambda: published[0])
    assert moved.table().service == SERVICE and moved.url == url
    nowhere = ServiceControl(url, "the-key-of-the-last-start", reread=lambda: (url, "the-key-of-the-last-start"))
    with pytest.raises(CheckFailed, match="401|control key"):
        nowhere.table()


def test_an_adapter_map_is_never_a_planted_link_and_an_ended_tritons_map_is_swept(tmp_path: Path, monkeypatch):
    """Issue 61, a Low finding: the map's check followed a symbolic link planted at its (predictable) name, and the
    maps of a SIGKILLed serve's Tritons stayed in /tmp. Maps go where the starter says (LLMOPS_ADAPTER_MAPS)."""
    maps = tmp_path / "adapter-maps"
    maps.mkdir(mode=0o700)
    monkeypatch.setenv(adapter_registry.MAPS_ENV, str(maps))
    pid = os.getpid()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (maps / f"llmops-lora-{pid}-{adapter_registry.process_start(pid)}").symlink_to(elsewhere)
    with pytest.raises(adapter_registry.RegistryError, match="not a folder private to this user"):
        adapter_registry.registry_root(pid)
    (maps / f"llmops-lora-{pid}-{adapter_registry.process_start(pid)}").unlink()
    assert adapter_registry.registry_root(pid).startswith(str(maps))
    ended = maps / "llmops-lora-999999999-12345"
    ended.mkdir()
    adapter_registry.forget_ended_maps(str(maps))
    assert not ended.exists() and len(list(maps.iterdir())) == 1  # this process's map stays
