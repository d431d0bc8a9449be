"""serve.autoscale in `llmops serve`: the policy (samples of the gateway's load in, the replicas it wants out, with the
reason) and the loop that acts on it, one replica at a time.

- Up: a new tritonserver on free ports loads every version the route table serves (Fleet.grow) before the gateway
  hears of it; the gateway keeps it out of the pool until the probes find every routed version answering there, so
  its first request is served as the table's weights say. One that does not start or load is killed, counted, never
  takes a request; the policy waits a whole up-window before it tries again.
- Down: the newest replica (never the first) takes no new request, its outstanding ones end (Replicas.drain), then
  it leaves the fleet and its Triton stops. Not while a release owns the service: a replica it is loading its
  candidate onto never goes away under it (scale-ups go on).
- Each decision is one line with its reason, counted on the gateway's /metrics, beside the replicas wanted and ready
  and the signal.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tasks.platform.config.autoscale import AutoscaleSection
from tasks.platform.errors import CheckFailed, TransientError
from tasks.runtime.fleet import Fleet
from tasks.runtime.gateway.running import RunningGateway

DRAIN_S = 120.0  # the longest a leaving replica's outstanding requests are waited for (then they are cut)


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str


class ScalingPolicy:
    """Samples of the requests in flight at the replicas; a decision from those taken since the last action."""

    def __init__(self, cfg: AutoscaleSection):
        self.cfg = cfg
        self.samples: deque[tuple[float, float]] = deque()  # (monotonic time, requests in flight, all replicas)
        self.since: float | None = None  # the first sample after the last action

    def observe(self, now: float, in_flight: float) -> None:
        self.samples.append((now, in_flight))
        self.since = now if self.since is None else self.since
        while self.samples and self.samples[0][0] < now - self.cfg.scale_down_window_s:
            self.samples.popleft()

    def reset(self) -> None:
        """After an action (or a failed one): the next decision sees only the pool as it is now."""
        self.samples.clear()
        self.since = None

    def decide(self, now: float, running: int, ready: int, needed: str = "") -> Decision:
        """`running`: the replicas the fleet has (ready or not); `ready`: those in the gateway's pool; `needed`: why
        one replica is needed whatever the samples say (a request waits for one, a release owns the service)."""
        cfg = self.cfg
        if running < cfg.min_replicas:
            return Decision(cfg.min_replicas, f"{running} running, below min_replicas {cfg.min_replicas}")
        if running == 0:
            return Decision(1, f"scaled to zero and {needed}") if needed else Decision(0, "")
        observed = now - self.since if self.since is not None else 0.0
        if observed >= cfg.scale_up_window_s and running < cfg.max_replicas:
            recent = [value for at, value in self.samples if at >= now - cfg.scale_up_window_s]
            per_replica = sum(recent) / len(recent) / max(ready, 1)
            if per_replica > cfg.target:
                return Decision(
                    running + 1,
                    f"{per_replica:.1f} requests in flight per ready replica over {cfg.scale_up_window_s:g} s, above "
                    f"the target {cfg.target:g}",
                )
        if observed >= cfg.scale_down_window_s and running > cfg.min_replicas:
            peak = max(value for _, value in self.samples)
            window = f"over {cfg.scale_down_window_s:g} s"
            if running == 1 and peak == 0 and not needed:
                return Decision(0, f"no request {window}: scaled to zero until the next one")
            if running > 1 and peak / (running - 1) <= cfg.target:
                return Decision(
                    running - 1,
                    f"at most {peak:g} requests in flight {window}: {running - 1} "
                    f"{'replica holds' if running == 2 else 'replicas hold'} them under the target {cfg.target:g}",
                )
        return Decision(running, "")


class Autoscaler:
    def __init__(
        self,
        cfg: AutoscaleSection,
        fleet: Fleet,
        gateway: RunningGateway,
        republish: Callable[[], object],
        say: Callable[[str], None],
    ):
        from prometheus_client import Counter, Gauge

        self.cfg, self.fleet, self.gateway, self.republish, self.say = cfg, fleet, gateway, republish, say
        self.policy = ScalingPolicy(cfg)
        self.woken = threading.Event()
        if cfg.min_replicas == 0:  # at zero, a request (or a release) that finds no replica wakes the loop and waits
            gateway.gateway.triton.wake_with(self.woken.set, cfg.cold_start_timeout_s)
        registry = gateway.gateway.metrics.registry
        self.desired = Gauge("llmops_serve_replicas_desired", "Replicas serve.autoscale wants.", registry=registry)
        self.ready = Gauge("llmops_serve_replicas_ready", "Replicas in the gateway's pool.", registry=registry)
        self.signal = Gauge(
            "llmops_serve_autoscale_in_flight", "Requests in flight at the replicas, all together.", registry=registry
        )
        self.decisions = Counter(
            "llmops_serve_scaling_decisions", "serve.autoscale's actions, by direction and outcome.",
            ["direction", "outcome"], registry=registry,
        )  # fmt: skip

    def run(self, stopped: threading.Event) -> None:
        while not stopped.is_set():
            self.woken.wait(self.cfg.sample_every_s)  # a request that found no replica wakes it at once
            self.woken.clear()
            try:
                self.step(time.monotonic())
            except Exception as exc:  # a round that failed is said; the next one samples again
                self.say(f"llmops serve: autoscale: {type(exc).__name__}: {exc}")

    def step(self, now: float) -> Decision:
        pool = self.gateway.gateway.triton
        in_flight = sum(r.outstanding for r in pool.replicas)
        ready = sum(1 for r in pool.replicas if r.in_pool)
        running = len(self.fleet.replicas)
        self.policy.observe(now, in_flight + pool.waiting)
        self.signal.set(in_flight)
        self.ready.set(ready)
        decision = self.policy.decide(now, running, ready, self.needed(pool.waiting))
        self.desired.set(decision.replicas)
        if decision.replicas > running:
            self.grow(running, decision.reason)
        elif decision.replicas < running:
            self.shrink(running, decision.reason)
        return decision

    def needed(self, waiting: int) -> str:
        """Why one replica must run whatever the load says: requests wait for one, or a release owns the service."""
        owner = self.gateway.gateway.table.owner
        if owner is not None and not owner.expired(time.time()):
            return f"release {owner.release} owns the service"
        if waiting:
            return f"{waiting} {'request waits' if waiting == 1 else 'requests wait'} for a replica"
        return ""

    def grow(self, running: int, reason: str) -> None:
        self.say(
            f"llmops serve: autoscale: starting replica {running + 1} of at most {self.cfg.max_replicas} ({reason})"
        )
        self.policy.reset()
        started = time.monotonic()
        try:
            replica = self.fleet.grow()
        except (TransientError, CheckFailed, OSError) as exc:
            self.decisions.labels("up", "failed").inc()
            self.say(f"llmops serve: autoscale: the new replica did not start or load, and takes no request: {exc}")
            return
        self.gateway.call(self.gateway.gateway.triton.add(replica.client.url))
        self.republish()
        self.decisions.labels("up", "done").inc()
        self.say(
            f"llmops serve: autoscale: replica {replica.client.url} joins, every routed version loaded "
            f"({time.monotonic() - started:.1f} s)"
        )
        self.gateway.call(self.gateway.gateway.prober.round(), timeout=60)  # in the pool once its versions answer

    def shrink(self, running: int, reason: str) -> None:
        table = self.gateway.gateway.table
        if table.owner is not None and not table.owner.expired(time.time()):
            return  # a release owns the service: none of the replicas it may be loading onto goes away under it
        replica = self.fleet.newest()
        if replica is None:
            return
        self.say(f"llmops serve: autoscale: stopping replica {replica.client.url}, {running - 1} left ({reason})")
        self.policy.reset()
        cut = self.gateway.call(self.gateway.gateway.triton.drain(replica.client.url, DRAIN_S), timeout=DRAIN_S + 30)
        self.fleet.retire(replica)
        self.republish()
        self.decisions.labels("down", "done" if not cut else "cut").inc()
        if cut:
            self.say(f"llmops serve: autoscale: {cut} requests were still outstanding after {DRAIN_S:g} s and were cut")
