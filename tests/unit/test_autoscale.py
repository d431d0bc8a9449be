"""serve.autoscale's policy (tasks/runtime/autoscale.py) on sampled loads, the gateway's pool growing and draining
(tasks/runtime/gateway/replicas.py), and the settings a profile may not combine."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from tasks.platform.config import load_profile
from tasks.platform.config.autoscale import AutoscaleSection
from tasks.platform.errors import BadInput
from tasks.runtime.autoscale import Decision, ScalingPolicy
from tasks.runtime.gateway.replicas import Replicas

VERSION = SimpleNamespace(name="v1", model="m")  # what the pool reads of a version: its names
POLICY = AutoscaleSection(min_replicas=1, max_replicas=3, target=2, scale_up_window_s=10, scale_down_window_s=30)


def sampled(policy: ScalingPolicy, loads: list[float], start: float = 0.0, every: float = 1.0) -> float:
    now = start
    for load in loads:
        policy.observe(now, load)
        now += every
    return now - every


def test_a_load_above_the_target_over_the_up_window_adds_one_replica_and_says_why():
    policy = ScalingPolicy(POLICY)
    now = sampled(policy, [5.0] * 5)
    assert policy.decide(now, running=1, ready=1).replicas == 1  # 4 s seen: not a whole window yet
    now = sampled(policy, [5.0] * 7, start=now + 1)
    decision = policy.decide(now, running=1, ready=1)
    assert decision.replicas == 2
    assert decision.reason == "5.0 requests in flight per ready replica over 10 s, above the target 2"
    policy.reset()
    assert policy.decide(now, running=2, ready=2).replicas == 2  # after an action, a new window first


def test_it_never_goes_above_max_or_below_min():
    policy = ScalingPolicy(POLICY)
    now = sampled(policy, [50.0] * 40)
    assert policy.decide(now, running=3, ready=3).replicas == 3
    assert policy.decide(now, running=0, ready=0).replicas == 1  # replicas that died: back to the floor
    quiet = ScalingPolicy(POLICY)
    now = sampled(quiet, [0.0] * 40)
    assert quiet.decide(now, running=1, ready=1).replicas == 1


def test_one_fewer_only_when_the_peak_of_the_long_window_fits_and_a_burst_keeps_the_capacity():
    policy = ScalingPolicy(POLICY)
    now = sampled(policy, [1.0] * 20)
    assert policy.decide(now, running=2, ready=2).replicas == 2  # 19 s seen of the 30 s window
    now = sampled(policy, [1.0] * 12, start=now + 1)
    decision = policy.decide(now, running=2, ready=2)
    assert decision.replicas == 1 and decision.reason.startswith("at most 1 requests in flight over 30 s")
    burst = ScalingPolicy(POLICY)
    now = sampled(burst, [1.0] * 15 + [3.0] + [1.0] * 16)  # one sample of 3 in flight: one replica would be above 2
    assert burst.decide(now, running=2, ready=2).replicas == 2


class Upstream:
    """What the pool reads of a Triton: its URL (no request is sent here)."""

    def __init__(self, url: str):
        self.url, self.closed = url, False

    async def aclose(self) -> None:
        self.closed = True


def test_a_new_replica_joins_out_of_the_pool_and_a_draining_one_takes_no_request_then_leaves():
    async def scenario() -> None:
        pool = Replicas([Upstream("http://a")], CollectorRegistry(), strict=True, connect=Upstream)  # type: ignore[list-item,arg-type]
        added = await pool.add("http://b")
        assert not added.in_pool and pool.pick(set()).url == "http://a"  # the probes put it in the pool
        pool.join(added)
        added.outstanding = 1
        draining = asyncio.create_task(pool.drain("http://b", within_s=5))
        await asyncio.sleep(0.1)
        assert not added.in_pool and not draining.done()
        pool.join(added)  # a probe round that finds it answering does not bring it back
        assert not added.in_pool and pool.pick(set()).url == "http://a"
        added.outstanding = 0
        assert await draining == 0
        assert [r.url for r in pool.replicas] == ["http://a"] and added.triton.closed  # its connections closed

    asyncio.run(scenario())


def test_a_drain_closes_a_replicas_connections_only_after_its_probe_in_flight_answered():
    """The discovery test's CI failure: a probe round in flight when the drain ended had its connection closed
    under it ("Server disconnected", a model server fault in the log) and said the replica stopped answering."""
    from tasks.platform.config.serving import HealthSection
    from tasks.runtime.gateway.probes import Prober

    class SlowUpstream(Upstream):
        async def generate(self, version: object, inputs: object) -> str:
            await asyncio.sleep(0.3)
            if self.closed:
                raise ConnectionError("Server disconnected")
            return "pong"

    async def scenario() -> None:
        pool = Replicas([SlowUpstream("http://a")], CollectorRegistry(), strict=True, connect=SlowUpstream)  # type: ignore[list-item,arg-type]
        prober = Prober(pool, CollectorRegistry(), HealthSection(), lambda: [VERSION], lambda: [VERSION])  # type: ignore[list-item,return-value]
        probing = asyncio.create_task(prober.round())
        await asyncio.sleep(0.1)
        assert await pool.drain("http://a", within_s=5) == 0
        await probing  # it answered: the drain waited for it
        assert prober.state[("http://a", "v1")].answered
        await prober.round()  # a draining replica is probed no more
        assert prober.probes.labels("http://a", "v1", "ok")._value.get() == 1

    asyncio.run(scenario())


def test_settings_that_cannot_work_together_are_refused_naming_them():
    with pytest.raises(ValueError, match="max_replicas 1 is below min_replicas 2"):
        AutoscaleSection(min_replicas=2, max_replicas=1)
    with pytest.raises(ValueError, match="scale_down_window_s must be at least scale_up_window_s"):
        AutoscaleSection(scale_up_window_s=30, scale_down_window_s=10)
    with pytest.raises(BadInput, match="replicas and autoscale: set one"):
        load_profile("cpu-tiny", ["serve.replicas=2", "serve.autoscale={max_replicas: 2}"])
    assert load_profile("cpu-tiny", ["serve.autoscale={max_replicas: 2}"]).serve.autoscale.max_replicas == 2


def test_autoscale_is_refused_with_tritons_this_serve_does_not_own():
    from types import SimpleNamespace

    from flows.serve import start_fleet

    profile = load_profile("cpu-tiny", ["serve.autoscale={max_replicas: 2}"])
    with pytest.raises(
        BadInput, match="serve.autoscale: it starts and stops Tritons of its own; not with --triton-url"
    ):
        start_fleet(None, profile, None, None, attach=[object()])  # type: ignore[arg-type]
    # Tritons found by name are pods a KEDA ScaledObject scales by this policy: the serve only fronts them
    attached: list = []
    fleet = SimpleNamespace(attach=lambda tritons, champion: attached.extend(tritons))
    start_fleet(fleet, profile, None, None, attach=["pod"], discovered=True)  # type: ignore[arg-type]
    assert attached == ["pod"]


def test_an_in_flight_target_left_unset_is_what_the_tune_stage_measured_the_champion_to_hold():
    from types import SimpleNamespace

    from flows.serve import autoscale_policy

    said: list[str] = []
    profile = load_profile("cpu-tiny", ["serve.autoscale={max_replicas: 2}"])
    tuned = SimpleNamespace(version="7", settings={"capacity": {"in_flight": 6.0, "ttft_p99_ms": 410.0}})
    assert autoscale_policy(profile, tuned, said.append).target == 6.0  # type: ignore[arg-type]
    assert said == [
        "llmops serve: autoscale: target 6 requests in flight per replica, what the tune stage measured v7 to hold "
        "within gate.p99_time_to_first_token_ms"
    ]
    untuned = SimpleNamespace(version="1", settings={"max_batch_size": 8})
    assert autoscale_policy(profile, untuned, said.append).target == 4.0  # type: ignore[arg-type]
    own = load_profile("cpu-tiny", ["serve.autoscale={max_replicas: 2, target: 3}"])
    assert autoscale_policy(own, tuned, said.append).target == 3.0 and len(said) == 1  # type: ignore[arg-type]


class Pool:
    """What the Autoscaler reads of the gateway: its replicas' requests in flight, the route table's owner, the pool
    a replica joins (no Triton behind it: these tests are about the loop's accounting when starts fail)."""

    def __init__(self, in_flight: list[int]):
        from types import SimpleNamespace

        self.replicas = [
            SimpleNamespace(outstanding=n, in_pool=True, url=f"http://r{i}") for i, n in enumerate(in_flight)
        ]
        self.joined: list[str] = []
        self.waiting = 0
        self.gateway = SimpleNamespace(
            triton=self,
            metrics=SimpleNamespace(registry=CollectorRegistry(), recent_first_tokens=deque()),
            table=SimpleNamespace(owner=None),
            prober=SimpleNamespace(round=self.nothing),
        )

    async def add(self, url: str) -> None:
        self.joined.append(url)

    async def nothing(self) -> None:
        return None

    def call(self, work, timeout: float = 30):
        return asyncio.run(work)


class FailingFleet:
    """A fleet whose every new Triton dies as it starts (as the integration test's SIGKILLed one)."""

    def __init__(self, replicas: int):
        from types import SimpleNamespace

        self.replicas = [SimpleNamespace(index=i) for i in range(replicas)]
        self.tries = 0

    def grow(self):
        from tasks.platform.errors import CheckFailed

        self.tries += 1
        raise CheckFailed("tritonserver exited with -9: ")


def scaler(fleet, pool: Pool, said: list[str], **settings):
    from tasks.runtime.autoscale import Autoscaler

    cfg = AutoscaleSection(min_replicas=1, max_replicas=2, target=1, scale_up_window_s=2, scale_down_window_s=10)
    return Autoscaler(cfg.model_copy(update=settings), fleet, pool, lambda: None, said.append)  # type: ignore[arg-type]


def test_a_replica_that_fails_to_start_is_counted_said_never_joins_and_is_tried_again_a_whole_window_later():
    pool, fleet, said = Pool([5]), FailingFleet(1), []
    autoscale = scaler(fleet, pool, said)
    for now in (0.0, 1.0, 2.0):
        autoscale.step(now)
    assert fleet.tries == 1 and pool.joined == [] and len(fleet.replicas) == 1
    assert said[-1] == (
        "llmops serve: autoscale: the new replica did not start or load, and takes no request: tritonserver exited "
        "with -9: "
    )
    assert autoscale.decisions.labels("up", "failed")._value.get() == 1
    for now in (3.0, 4.0):
        autoscale.step(now)
    assert fleet.tries == 1  # a new window of samples first
    autoscale.step(5.0)
    assert fleet.tries == 2


def test_replicas_that_died_or_restart_count_against_max_replicas():
    """The fleet's replicas, dead or restarting ones included, are what max_replicas bounds: a load far above the
    target with one of two replicas down (out of the pool) starts no third."""
    pool, fleet, said = Pool([40, 0]), FailingFleet(2), []
    pool.replicas[1].in_pool = False
    autoscale = scaler(fleet, pool, said)
    for now in range(12):
        decision = autoscale.step(float(now))
    assert decision.replicas == 2 and fleet.tries == 0 and said == []


def test_with_min_0_a_quiet_window_scales_to_zero_and_a_waiting_request_or_an_owner_brings_one_back():
    policy = ScalingPolicy(POLICY.model_copy(update={"min_replicas": 0}))
    now = sampled(policy, [0.0] * 31)
    assert policy.decide(now, running=1, ready=1, needed="release r1 owns the service").replicas == 1
    decision = policy.decide(now, running=1, ready=1)
    assert decision == Decision(0, "no request over 30 s: scaled to zero until the next one")
    policy.reset()
    assert policy.decide(now + 1, running=0, ready=0).replicas == 0
    woken = policy.decide(now + 1, running=0, ready=0, needed="1 request waits for a replica")
    assert woken == Decision(1, "scaled to zero and 1 request waits for a replica")
    busy = ScalingPolicy(POLICY.model_copy(update={"min_replicas": 0}))
    now = sampled(busy, [0.0] * 30 + [1.0])  # one request in the window: the last replica stays
    assert busy.decide(now, running=1, ready=1).replicas == 1


def test_at_zero_a_request_wakes_the_pool_and_waits_for_a_replica_within_the_bound_else_a_503():
    from tasks.runtime.gateway.protocol import RequestError

    async def scenario() -> None:
        pool = Replicas([], CollectorRegistry(), strict=True, connect=Upstream)  # type: ignore[arg-type]
        woken: list[float] = []

        def wake() -> None:  # as the autoscaler: a replica starts, then its probes put it in the pool
            async def start() -> None:
                await asyncio.sleep(0.3)
                pool.join(await pool.add("http://a"))

            woken.append(asyncio.get_running_loop().time())
            asyncio.get_running_loop().create_task(start())

        pool.wake_with(wake, cold_start_s=5)
        assert pool.asleep()

        async def answer(triton) -> str:
            assert pool.waiting == 0
            return triton.url

        assert await pool.on_one(VERSION, answer) == "http://a" and len(woken) == 1
        assert await pool.on_one(VERSION, answer) == "http://a" and len(woken) == 1  # awake: nothing to wait for
        cold = Replicas([], CollectorRegistry(), strict=True, connect=Upstream)  # type: ignore[arg-type]
        cold.wake_with(lambda: None, cold_start_s=0.2)  # no replica comes
        with pytest.raises(RequestError, match="the model server is not available"):
            await cold.on_one(VERSION, answer)
        assert cold.waiting == 0

    asyncio.run(scenario())


TTFT = AutoscaleSection(signal="ttft_p90", target=250, scale_up_window_s=10, scale_down_window_s=30, max_replicas=3)


def test_ttft_p90_above_its_target_over_the_up_window_adds_a_replica_and_one_slow_request_does_not():
    policy = ScalingPolicy(TTFT)
    for second in range(11):
        policy.observe(float(second), 3, [120.0, 180.0, 400.0, 420.0] if second % 2 else [])
    decision = policy.decide(10.0, running=1, ready=1)
    assert decision == Decision(2, "TTFT p90 420 ms over 10 s (20 requests), above the target 250 ms")
    lone = ScalingPolicy(TTFT)
    for second in range(11):
        lone.observe(float(second), 1, [900.0] if second == 5 else [])
    assert lone.decide(10.0, running=1, ready=1).replicas == 1  # fewer than 5 first tokens: no load to speak of


def test_ttft_p90_under_half_its_target_over_the_whole_down_window_takes_one_away():
    policy = ScalingPolicy(TTFT)
    for second in range(31):
        policy.observe(float(second), 1, [60.0, 110.0])
    assert policy.decide(30.0, running=2, ready=2) == Decision(1, "TTFT p90 110 ms over 30 s, under 125 ms")
    slow = ScalingPolicy(TTFT)
    for second in range(31):
        slow.observe(float(second), 1, [60.0, 130.0])
    assert slow.decide(30.0, running=2, ready=2).replicas == 2


def test_a_ttft_target_comes_from_the_gates_latency_objective_else_it_is_asked_for():
    assert AutoscaleSection().with_target(None).target == 4.0
    assert TTFT.model_copy(update={"target": None}).with_target(300.0).target == 300.0
    with pytest.raises(BadInput, match="serve.autoscale.target: signal ttft_p90 needs a target in ms"):
        load_profile("cpu-tiny", ["serve.autoscale={signal: ttft_p90}", "gate.p99_time_to_first_token_ms=null"])
    profile = load_profile("cpu-tiny", ["serve.autoscale={signal: ttft_p90}", "gate.p99_time_to_first_token_ms=500"])
    assert profile.serve.autoscale.with_target(profile.gate.p99_time_to_first_token_ms).target == 500


TRITON_METRICS = """# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="svc-v3",version="1"} 120
nv_inference_request_success{model="svc-base",version="1"} 30
nv_inference_request_success{model="other-v1",version="1"} 999
nv_inference_request_success{model="svc-mini-v1",version="1"} 999
# HELP nv_inference_queue_duration_us Cumulative inference queuing duration in microseconds (includes cached requests)
# TYPE nv_inference_queue_duration_us counter
nv_inference_queue_duration_us{model="svc-v3",version="1"} 600000
nv_inference_queue_duration_us{model="svc-base",version="1"} 150000
nv_inference_queue_duration_us{model="other-v1",version="1"} 5
nv_inference_queue_duration_us{model="svc-mini-v1",version="1"} 5
"""


def test_triton_queue_time_is_summed_over_the_services_models_and_scales_on_the_mean_wait_a_request():
    from tasks.runtime.autoscale import queue_counters

    # another service's models are not ours, a service whose name begins with this one's (svc-mini) neither
    assert queue_counters(TRITON_METRICS, "svc") == (750000.0, 150.0)
    queue = AutoscaleSection(signal="queue_ms", target=20, scale_up_window_s=10, scale_down_window_s=30)
    policy = ScalingPolicy(queue)
    for second in range(11):
        policy.observe(float(second), 4, queued=(500_000.0, 10.0))  # 50 ms a request
    assert policy.decide(10.0, running=1, ready=1) == Decision(
        2, "Triton queue time a request 50 ms over 10 s (110 requests), above the target 20 ms"
    )
    quiet = ScalingPolicy(queue)
    for second in range(31):
        quiet.observe(float(second), 1, queued=(20_000.0, 10.0))  # 2 ms a request
    assert quiet.decide(30.0, running=2, ready=2) == Decision(
        1, "Triton queue time a request 2 ms over 30 s, under 10 ms"
    )
    with pytest.raises(BadInput, match="signal queue_ms needs a target in ms"):
        load_profile("cpu-tiny", ["serve.autoscale={signal: queue_ms}"])


def test_a_services_models_are_matched_by_whole_name_never_by_a_prefix_another_service_shares():
    """Issue 73's fencing holes: the reconciler, the autoscale signal and the KEDA queries selected `chat`'s models
    by the prefix `chat-`, so service `chat` unloaded `chat-mini`'s. One pattern, read by Python and by Prometheus
    (PromQL's =~ matches the whole value)."""
    import re

    from tasks.serving.versions import of_service, service_models_pattern

    assert [of_service(m, "chat") for m in ("chat-v1", "chat-v12", "chat-base")] == [True] * 3
    assert not any(of_service(m, "chat") for m in ("chat-mini-v1", "chat-mini-base", "chat-v1x", "chat", "xchat-v1"))
    assert of_service("qwen2.5-sft-v3", "qwen2.5-sft") and not of_service("qwen2x5-sft-v3", "qwen2.5-sft")
    assert "\\" not in service_models_pattern("qwen2.5-sft")  # nothing for a PromQL string to escape
    assert re.fullmatch(service_models_pattern("chat"), "chat-mini-v1") is None
