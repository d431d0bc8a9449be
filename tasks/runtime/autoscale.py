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
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tasks.platform.config.autoscale import AutoscaleSection
from tasks.platform.errors import CheckFailed, TransientError
from tasks.runtime.fleet import Fleet
from tasks.runtime.gateway.running import RunningGateway
from tasks.serving.client import metric_by_model
from tasks.serving.versions import of_service

DRAIN_S = 120.0  # the longest a leaving replica's outstanding requests are waited for (then they are cut)
MIN_FIRST_TOKENS = 5  # a latency signal scales up on no fewer requests in its window: one slow request is no load


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str


class ScalingPolicy:
    """Samples of the requests in flight at the replicas and the times to first token the gateway measured; a decision
    from those taken since the last action. `cfg`'s target resolved (AutoscaleSection.with_target)."""

    def __init__(self, cfg: AutoscaleSection):
        if cfg.target is None:
            raise ValueError("serve.autoscale.target: resolve it first (AutoscaleSection.with_target)")
        self.cfg, self.target = cfg, cfg.target
        self.samples: deque[tuple[float, float]] = deque()  # (monotonic time, requests in flight, all replicas)
        self.first_tokens: deque[tuple[float, float]] = deque()  # (monotonic time, ms to the first token)
        self.queued: deque[tuple[float, float, float]] = deque()  # (monotonic time, µs in Triton's queues, requests)
        self.since: float | None = None  # the first sample after the last action

    def observe(
        self,
        now: float,
        in_flight: float,
        first_tokens_ms: Iterable[float] = (),
        queued: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        """One sample: the requests in flight now, the first tokens measured since the last sample, and the µs the
        requests answered since then waited in Triton's queues with their count."""
        self.samples.append((now, in_flight))
        self.first_tokens.extend((now, ms) for ms in first_tokens_ms)
        self.queued.append((now, *queued))
        self.since = now if self.since is None else self.since
        for kept in (self.samples, self.first_tokens, self.queued):
            while kept and kept[0][0] < now - self.cfg.scale_down_window_s:
                kept.popleft()

    def reset(self) -> None:
        """After an action (or a failed one): the next decision sees only the pool as it is now."""
        self.samples.clear()
        self.first_tokens.clear()
        self.queued.clear()
        self.since = None

    def ttft_p90(self, now: float, window_s: float) -> tuple[float, int]:
        """The p90 of the first tokens measured over the last `window_s` (ms; 0 with none), and how many there were."""
        times = sorted(ms for at, ms in self.first_tokens if at >= now - window_s)
        return (times[int(0.9 * (len(times) - 1))] if times else 0.0), len(times)

    def queue_ms(self, now: float, window_s: float) -> tuple[float, int]:
        """The mean wait in Triton's queues of the requests answered over the last `window_s` (ms), and their count."""
        waited = sum(us for at, us, _ in self.queued if at >= now - window_s)
        answered = sum(n for at, _, n in self.queued if at >= now - window_s)
        return (waited / answered / 1000 if answered else 0.0), int(answered)

    def latency(self, now: float, window_s: float) -> tuple[float, int, str]:
        """A latency signal over the window: its value (ms), the requests it is of, and what it is called."""
        if self.cfg.signal == "queue_ms":
            return (*self.queue_ms(now, window_s), "Triton queue time a request")
        return (*self.ttft_p90(now, window_s), "TTFT p90")

    def decide(self, now: float, running: int, ready: int, needed: str = "") -> Decision:
        """`running`: the replicas the fleet has (ready or not); `ready`: those in the gateway's pool; `needed`: why
        one replica is needed whatever the samples say (a request waits for one, a release owns the service)."""
        cfg = self.cfg
        if running < cfg.min_replicas:
            return Decision(cfg.min_replicas, f"{running} running, below min_replicas {cfg.min_replicas}")
        if running == 0:
            return Decision(1, f"scaled to zero and {needed}") if needed else Decision(0, "")
        observed = now - self.since if self.since is not None else 0.0
        if observed >= cfg.scale_up_window_s and running < cfg.max_replicas and (why := self.pressed(now, ready)):
            return Decision(running + 1, why)
        if observed >= cfg.scale_down_window_s and running > cfg.min_replicas:
            peak = max(value for _, value in self.samples)
            if running == 1 and peak == 0 and not needed:
                return Decision(0, f"no request over {cfg.scale_down_window_s:g} s: scaled to zero until the next one")
            if running > 1 and (why := self.fits_on_fewer(now, running, peak)):
                return Decision(running - 1, why)
        return Decision(running, "")

    def pressed(self, now: float, ready: int) -> str:
        """Why one more replica, where the signal over the up window is above the target; "" where it is not."""
        window = self.cfg.scale_up_window_s
        if self.cfg.signal != "in_flight":
            value, count, name = self.latency(now, window)
            if count < MIN_FIRST_TOKENS or value <= self.target:
                return ""
            return f"{name} {value:.0f} ms over {window:g} s ({count} requests), above the target {self.target:g} ms"
        recent = [value for at, value in self.samples if at >= now - window]
        per_replica = sum(recent) / len(recent) / max(ready, 1)
        if per_replica <= self.target:
            return ""
        return f"{per_replica:.1f} requests in flight per ready replica over {window:g} s, above the target {self.target:g}"

    def fits_on_fewer(self, now: float, running: int, peak: float) -> str:
        """Why one replica fewer, where the whole down window says the others hold the load; "" where it does not."""
        window, fewer = self.cfg.scale_down_window_s, running - 1
        if self.cfg.signal != "in_flight":
            value, _, name = self.latency(now, window)
            under = self.target * self.cfg.scale_down_below
            return f"{name} {value:.0f} ms over {window:g} s, under {under:g} ms" if value < under else ""
        if peak / fewer > self.target:
            return ""
        holds = "replica holds" if fewer == 1 else "replicas hold"
        return f"at most {peak:g} requests in flight over {window:g} s: {fewer} {holds} them under the target {self.target:g}"


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
        self.ttft = Gauge(
            "llmops_serve_autoscale_ttft_p90_ms", "The p90 of the first tokens over the up window.", registry=registry
        )
        self.queue = Gauge(
            "llmops_serve_autoscale_queue_ms", "The mean wait in Triton's queues over the up window.", registry=registry
        )
        self.seen_until = 0.0  # the newest first token taken from the gateway's metrics
        self.queue_counters: dict[str, tuple[float, float]] = {}  # by replica URL: Triton's queue µs and requests
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
        signal, window = self.cfg.signal, self.cfg.scale_up_window_s
        first_tokens = self.new_first_tokens_ms() if signal == "ttft_p90" else []  # read for their signal alone
        queued = self.new_queue_time() if signal == "queue_ms" else (0.0, 0.0)
        self.policy.observe(now, in_flight + pool.waiting, first_tokens, queued)
        self.signal.set(in_flight)
        if signal != "in_flight":
            (self.ttft if signal == "ttft_p90" else self.queue).set(self.policy.latency(now, window)[0])
        self.ready.set(ready)
        decision = self.policy.decide(now, running, ready, self.needed(pool.waiting))
        self.desired.set(decision.replicas)
        if decision.replicas > running:
            self.grow(running, decision.reason)
        elif decision.replicas < running:
            self.shrink(running, decision.reason)
        return decision

    def new_first_tokens_ms(self) -> list[float]:
        """The first tokens the gateway measured since the last sample (its loop appends them; copied whole, one C
        call under the GIL)."""
        recent = list(self.gateway.gateway.metrics.recent_first_tokens)
        fresh = [seconds * 1000 for at, seconds in recent if at > self.seen_until]
        self.seen_until = recent[-1][0] if recent else self.seen_until
        return fresh

    def new_queue_time(self) -> tuple[float, float]:
        """The µs the requests each replica answered since the last sample waited in its Triton's queues, and how many
        they were, all replicas together (read from each Triton's metrics; a replica that cannot be read adds none)."""
        import requests

        service, waited, answered = self.gateway.gateway.config.service, 0.0, 0.0
        counters: dict[str, tuple[float, float]] = {}
        for replica in self.fleet.replicas:
            url = replica.client.metrics_url
            if url is None:  # a Triton without a metrics port: none to read
                continue
            try:
                now = queue_counters(requests.get(url, timeout=2).text, service)
            except requests.RequestException:
                continue
            before = self.queue_counters.get(url, (0.0, 0.0))
            fresh = now if now[1] < before[1] else (now[0] - before[0], now[1] - before[1])  # restarted: from 0
            waited, answered, counters[url] = waited + fresh[0], answered + fresh[1], now
        self.queue_counters = counters
        return waited, answered

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


def queue_counters(metrics: str, service: str) -> tuple[float, float]:
    """Triton's cumulative queue time (µs) and answered requests over the service's models (of_service)."""

    def ours(metric: str) -> float:
        return sum(value for model, value in metric_by_model(metrics, metric).items() if of_service(model, service))

    return ours("nv_inference_queue_duration_us"), ours("nv_inference_request_success")
