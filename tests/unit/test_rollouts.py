"""The service walks a release's rollout itself (issue 73): the controller of the gateway (tasks/runtime/rollouts.py)
routes each step, watches its window on the gateway's own counters of client traffic, promotes or rolls back, and
writes each step to the deployment record before it acts; the release only submits the plan, reads the status and
decides. The real Starlette apps (TestClient), Triton a MockTransport handler, as in test_routes.py; the same through
a real release on a real Triton: tests/integration/test_serving.py."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx
import pytest

from tasks.control.contract import RouteTable, read_record
from tests.unit import test_routes
from tests.unit.test_gateway import SERVICE, FakeTriton
from tests.unit.test_routes import CANDIDATE, CHAMPION, with_candidate

service = test_routes.service  # the fixture: a gateway with its record, its clients' and its control listener

PLAN = {"steps": [10, 50, 100], "window_s": 0.4, "max_error_rate": 0.0, "max_mean_latency_ms": 2000}


def candidate_fails(request: httpx.Request) -> httpx.Response:
    """Triton answering the champion, and a 500 for every request of the candidate's adapter."""
    body = json.loads(request.content or b"{}")
    if body.get("lora_name") == CANDIDATE.adapter:
        return httpx.Response(500, json={"error": "candidate broke"})
    return FakeTriton()(request)


def rolled_out(control, public, until: Callable[[RouteTable], bool], seconds: float = 15) -> RouteTable:
    """Client requests for the service's name until the record's table meets `until`; the table then."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        public.post(f"/v2/models/{SERVICE}/generate", json={"text_input": "hot"})
        table = RouteTable.of(control.get("/control/v1/deployment").json())
        if until(table):
            return table
    raise AssertionError(f"the rollout did not get there in {seconds}s: {table.rollout}")


def submit(gateway, control, plan=PLAN, lease_s: float = 30):
    control.put("/control/v1/deployment", json={**with_candidate(0, release="run-2").as_json(), "lease_s": lease_s})
    submitted = control.put("/control/v1/rollout", json={**plan, "release": "run-2", "lease_s": lease_s})
    assert submitted.status_code == 200, submitted.text
    return submitted


def test_the_service_walks_each_step_on_client_traffic_and_promotes_with_each_step_in_the_record(service, tmp_path):
    gateway, public, control = service()
    submit(gateway, control)
    steps_seen = set()

    def done(table: RouteTable) -> bool:
        steps_seen.add(table.describe())
        return table.rollout is not None and not table.rollout.active

    table = rolled_out(control, public, done)
    assert table.rollout.phase == "promoted" and table.rollout.reason is None
    assert table.champion.name == CANDIDATE.name and table.candidate is None and table.describe() == "demo-v2=100"
    assert table.release is None and table.expires_at is None  # no release holds the routes any more
    assert [w.weight for w in table.rollout.windows] == [10, 50, 100]
    assert all(w.requests > 0 and w.failures == 0 and w.breach is None for w in table.rollout.windows)
    assert {"demo-v2=10,demo-v1=90", "demo-v2=50,demo-v1=50"} <= steps_seen  # each step served clients
    assert read_record(tmp_path / "serving" / f"{SERVICE}.json").rollout == table.rollout  # the record says so


def test_a_candidate_that_fails_its_clients_is_rolled_back_at_its_first_step_naming_the_breach(service):
    gateway, public, control = service(triton=candidate_fails)
    submit(gateway, control)
    table = rolled_out(control, public, lambda t: t.rollout is not None and not t.rollout.active)
    assert table.rollout.phase == "rolled_back" and table.rollout.reason.startswith("canary breach: candidate failed")
    assert [w.weight for w in table.rollout.windows] == [10] and table.rollout.windows[0].failures > 0
    assert table.candidate is None and table.describe() == "demo-v1=100"  # the champion alone


def test_a_release_that_stops_renewing_is_rolled_back_within_its_lease(service):
    gateway, public, control = service()
    submit(gateway, control, plan={**PLAN, "window_s": 60}, lease_s=1.0)  # nobody renews: the release died
    submitted = time.monotonic()
    table = rolled_out(control, public, lambda t: t.rollout is not None and not t.rollout.active)
    assert time.monotonic() - submitted < 1.0 + 1.0  # the lease, and the controller's round
    assert table.rollout.phase == "rolled_back" and "run-2 stopped renewing" in table.rollout.reason
    assert table.candidate is None and table.describe() == "demo-v1=100"


def test_a_rollout_paused_for_the_release_waits_for_its_next_and_promote(service):
    gateway, public, control = service()
    submit(gateway, control, plan={**PLAN, "steps": [50, 100], "await_decision": True})

    def decide(decision: str) -> httpx.Response:
        return control.post("/control/v1/rollout/decision", json={"decision": decision, "release": "run-2"})

    paused = rolled_out(control, public, lambda t: t.rollout.phase == "paused")
    assert paused.describe() == "demo-v2=50,demo-v1=50" and len(paused.rollout.windows) == 1
    refused = decide("promote")
    assert refused.status_code == 409 and "promote: after the last step" in refused.json()["error"]
    assert decide("next").status_code == 200
    rolled_out(control, public, lambda t: t.rollout.phase == "paused" and t.describe() == "demo-v2=100")
    promoted = RouteTable.of(decide("promote").json())
    assert promoted.rollout.phase == "promoted" and promoted.champion.name == CANDIDATE.name


def test_an_abort_rolls_back_at_once_and_no_one_steps_the_routes_beside_the_controller(service):
    gateway, public, control = service()
    submit(gateway, control, plan={**PLAN, "window_s": 60})
    rolled_out(control, public, lambda t: t.describe() == "demo-v2=10,demo-v1=90")
    stepped = control.put(
        "/control/v1/routes", json={"weights": {CANDIDATE.name: 50, CHAMPION.name: 50}, "release": "run-2"}
    )
    assert stepped.status_code == 409 and "walked by the service's controller" in stepped.json()["error"]
    aborted = control.post(
        "/control/v1/rollout/decision", json={"decision": "abort", "reason": "p99", "release": "run-2"}
    )
    table = RouteTable.of(aborted.json())
    assert table.rollout.phase == "rolled_back" and table.rollout.reason == "aborted by release run-2: p99"
    assert table.describe() == "demo-v1=100" and gateway.table.candidate is None
    again = control.post("/control/v1/rollout/decision", json={"decision": "abort", "release": "run-2"})
    assert again.status_code == 200 and RouteTable.of(again.json()).rollout == table.rollout  # ended: said so


@pytest.mark.parametrize(
    "plan, message",
    [
        ({**PLAN, "steps": [50, 10]}, "rollout.steps: rising percentages in (0, 100] ending at 100"),
        ({**PLAN, "window_s": 0}, "rollout.window_s and rollout.max_mean_latency_ms: above 0"),
        ({**PLAN, "candidate": "demo-v9"}, "candidate: the table's candidate is demo-v2, not demo-v9"),
    ],
)
def test_a_plan_that_cannot_run_is_refused_naming_its_field(service, plan, message):
    gateway, public, control = service()
    control.put("/control/v1/deployment", json={**with_candidate(0, release="run-2").as_json(), "lease_s": 30})
    refused = control.put("/control/v1/rollout", json={**plan, "release": "run-2", "lease_s": 30})
    assert refused.status_code == 400 and refused.json()["error"] == message


def test_a_serve_started_again_mid_ramp_rolls_the_rollout_back_and_says_why(service, tmp_path):
    gateway, public, control = service()
    submit(gateway, control, plan={**PLAN, "window_s": 60})
    rolled_out(control, public, lambda t: t.describe() == "demo-v2=10,demo-v1=90")
    again, public, control = service(record=None)  # the same record, a new gateway: the serve started again
    table = again.table
    assert table.describe() == "demo-v1=100" and table.candidate is None
    assert table.rollout.phase == "rolled_back" and "started again during the rollout" in table.rollout.reason
