"""serve.autoscale's policy (tasks/runtime/autoscale.py) on sampled loads, the gateway's pool growing and draining
(tasks/runtime/gateway/replicas.py), and the settings a profile may not combine."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from tasks.platform.config import load_profile
from tasks.platform.config.autoscale import AutoscaleSection
from tasks.platform.errors import BadInput
from tasks.runtime.autoscale import ScalingPolicy
from tasks.runtime.gateway.replicas import Replicas

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
        self.url = url


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
        assert [r.url for r in pool.replicas] == ["http://a"]

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
    from flows.serve import start_fleet

    profile = load_profile("cpu-tiny", ["serve.autoscale={max_replicas: 2}"])
    with pytest.raises(
        BadInput, match="serve.autoscale: it starts and stops Tritons of its own; not with --triton-url"
    ):
        start_fleet(None, profile, None, None, attach=[object()])  # type: ignore[arg-type]
