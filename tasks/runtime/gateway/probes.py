"""Synthetic requests to every version in the route table, readiness from them, and the recovery of a model that
stopped answering (serve.health).

Every `probe_interval_s` each version (the champion, and a candidate at any weight) gets a one-token generate
request on every replica, within `probe_timeout_s`. A replica is in the pool (replicas.py) while every routed version
answers there; /health/ready is 200 while a replica is: a model that stopped answering turns readiness false within
one interval and one timeout (where it was on the last replica), whatever Triton's own readiness says (a
Python-backend model whose stub died stays READY in Triton 2.51 and fails every request sent to that instance).
After `recover_after` failed probes in a row the version's Triton model on that replica is recovered by `recover`
(loading it again; `llmops serve` restarts the replica's Triton where that fails), at most once per
`recover_cooldown_s`. Everything is counted on /metrics: each probe's outcome, each version's state per replica,
each recovery's outcome.

One dead instance of a model with several (serve.instance_count) is its own fault: Triton 2.51 starts none again,
and probes pass whenever they reach a live one. A request or a probe that meets one (upstream.DEAD_INSTANCE) has the
model loaded again on that replica at once (a load replaces the instances without a gap, the replica's other versions
untouched); a probe that met it keeps the replica in the pool, whose other instances answer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from tasks.control.contract import Version
from tasks.platform.config.serving import HealthSection
from tasks.runtime.gateway.access import CURRENT, PROBE_CLIENT, RequestRecord
from tasks.runtime.gateway.protocol import RequestError
from tasks.runtime.gateway.replicas import PooledReplica, Replicas
from tasks.runtime.gateway.upstream import Unanswered
from tasks.runtime.gateway.work import Pools

LOG = logging.getLogger("llmops.gateway")
PROBE = {"text_input": "ping", "max_tokens": 1, "exclude_input_in_output": True}


@dataclass
class VersionHealth:
    answered: bool = False  # the last probe's outcome
    refused: bool = False  # the last probe failed with an answer (unreachable, not loaded, a dead stub), not a timeout
    failures: int = 0  # failed probes in a row
    probed_at: float = 0.0
    why: str = ""  # what the last failed probe met (the model server's words, or the timeout)


Recover = Callable[[str, str], str]  # (replica URL, Triton model) -> what was done: "reloaded", "restarted"
DEAD_AGAIN_S = 10.0  # after a reload, an instance found dead this much later is a new death: no cooldown for it


class Prober:
    """The probes of one gateway: `versions()` says what to probe, `routed()` what must answer for a replica to be
    in the pool, `recover(replica, model)` loads a model again (blocking)."""

    def __init__(
        self,
        replicas: Replicas,
        registry: CollectorRegistry,
        health: HealthSection,
        versions: Callable[[], list[Version]],
        routed: Callable[[], list[Version]],
        recover: Recover | None = None,
        pools: Pools | None = None,
    ):
        self.replicas, self.health, self.recover = replicas, health, recover
        self.pools = pools or Pools()
        self.versions, self.routed = versions, routed
        self.state: dict[tuple[str, str], VersionHealth] = {}  # (replica URL, version name)
        self.recovered_at: dict[tuple[str, str], float] = {}
        self.recovering: set[tuple[str, str]] = set()
        self.reloaded: set[tuple[str, str]] = set()  # whose last recovery loaded it again
        replicas.instance_died = self.instance_died
        self.probes = Counter(
            "llmops_gateway_probes",
            "Synthetic requests to each version on each replica, by outcome (ok, failed).",
            ["replica", "version", "outcome"],
            registry=registry,
        )
        self.up = Gauge(
            "llmops_gateway_version_up",
            "1 while the version's last probe on the replica answered, else 0.",
            ["replica", "version"],
            registry=registry,
        )
        self.recoveries = Counter(
            "llmops_gateway_recoveries",
            "Recoveries of a Triton model whose probes kept failing, by outcome (reloaded, restarted, failed).",
            ["replica", "model", "outcome"],
            registry=registry,
        )

    @property
    def enabled(self) -> bool:
        return self.health.probe_interval_s > 0

    async def run(self) -> None:
        """Probe until cancelled."""
        while True:
            await self.round()
            await asyncio.sleep(self.health.probe_interval_s)

    async def round(self) -> None:
        """Every version on every replica once; then each replica in the pool or out of it."""
        versions, replicas = self.versions(), [r for r in self.replicas.replicas if not r.draining]
        await asyncio.gather(*(self.probe(r, v) for r in replicas for v in versions))
        names = {v.name for v in versions}
        for gone in [key for key in self.state if key[1] not in names]:
            del self.state[gone]
        for replica in self.replicas.replicas:
            self.place(replica)

    def answering(self, replica: PooledReplica) -> bool:
        """Every routed version's last probe on `replica` answered; with nothing routed yet (a first release's
        candidate at 0%), every probed version's; with nothing to probe, nothing speaks against it."""
        judged = self.routed() or self.versions()
        return all(self.state.get((replica.url, v.name), VersionHealth()).answered for v in judged)

    def failing(self, replica: PooledReplica) -> bool:
        """A judged version's last probe on `replica` failed with an answer. One that only timed out keeps the replica
        in the pool: a replica too busy to answer a probe in probe_timeout_s (a load test on its Triton, a full CPU)
        is slow, not gone, and out of the pool it would cost every client a 503; readiness and recovery still count
        the timeout."""
        judged = self.routed() or self.versions()
        return any(self.state.get((replica.url, v.name), VersionHealth()).refused for v in judged)

    def place(self, replica: PooledReplica) -> None:
        if self.answering(replica):
            self.replicas.join(replica)
        elif self.failing(replica):
            self.replicas.leave(replica, "its probes do not answer")

    async def probe(self, replica: PooledReplica, version: Version) -> bool:
        """One probe of `version` on `replica`; its state, counters and (where it keeps failing) its recovery."""
        token = CURRENT.set(RequestRecord(client=PROBE_CLIENT))
        refused, why = False, ""
        replica.probing += 1  # a drain closes the replica's connections only after this ends
        try:
            async with asyncio.timeout(self.health.probe_timeout_s):
                await replica.triton.generate(version, PROBE)
            answered = True
        except Unanswered as unanswered:
            answered, refused = False, not unanswered.dead_instance  # another instance may answer the next
            why = unanswered.detail or unanswered.message
            if unanswered.dead_instance:
                self.instance_died(replica.url, version)
        except RequestError as error:
            answered, refused = False, error.status != 504  # a 504: Triton's own deadline, a timeout as well
            why = error.detail or error.message
        except TimeoutError:
            answered, why = False, f"no answer within serve.health.probe_timeout_s {self.health.probe_timeout_s:g}"
        finally:
            replica.probing -= 1
            CURRENT.reset(token)
        state = self.state.setdefault((replica.url, version.name), VersionHealth())
        state.refused = refused
        if answered != state.answered and state.probed_at:
            change = "answers again" if answered else f"stopped answering: {why}"
            LOG.warning("probes: %s on %s %s", version.name, replica.url, change)
        state.answered, state.probed_at, state.why = answered, time.monotonic(), why
        state.failures = 0 if answered else state.failures + 1
        self.probes.labels(replica.url, version.name, "ok" if answered else "failed").inc()
        self.up.labels(replica.url, version.name).set(1 if answered else 0)
        if state.failures >= self.health.recover_after and self.recoverable(version):
            self.start_recovery(replica.url, version.model, f"keeps failing ({why})")
        return answered

    def recoverable(self, version: Version) -> bool:
        """A version clients are routed to. One at 0% (a candidate, shadowed or not) is its release's: the release
        loads it, loads it again with other settings (tune_serving), measures and unloads it, and a recovery here
        would load it again under the release's feet (a reload unloads the version before the new one is ready)."""
        return any(routed.name == version.name for routed in self.routed())

    def instance_died(self, replica: str, version: Version) -> None:
        """A request or a probe found one of `version`'s instances dead on `replica`."""
        if self.recoverable(version):
            self.start_recovery(replica, version.model, "one of its instances died", dead_instance=True)

    def start_recovery(self, replica: str, model: str, why: str = "keeps failing", dead_instance: bool = False) -> None:
        key = (replica, model)
        since = time.monotonic() - self.recovered_at.get(key, -math.inf)
        cooldown_s = DEAD_AGAIN_S if dead_instance and key in self.reloaded else self.health.recover_cooldown_s
        if self.recover is None or key in self.recovering or since < cooldown_s:
            return
        self.recovering.add(key)
        self.recovered_at[key] = time.monotonic()
        task = asyncio.create_task(self.recovery(replica, model, why))
        task.add_done_callback(lambda _: self.recovering.discard(key))

    async def recovery(self, replica: str, model: str, why: str) -> None:
        assert self.recover is not None
        LOG.warning("probes: %s on %s %s; recovering it", model, replica, why)
        started = time.monotonic()
        try:
            outcome = await self.pools.job(self.recover, replica, model)  # minutes: never in an answer's way
        except Exception as exc:  # a recovery that failed is counted and logged; the probes go on
            LOG.warning("probes: recovering %s on %s failed: %s", model, replica, exc)
            outcome = "failed"
        else:
            LOG.warning("probes: %s on %s %s (%.1f s)", model, replica, outcome, time.monotonic() - started)
        self.recoveries.labels(replica, model, outcome).inc()
        self.recovered_at[(replica, model)] = time.monotonic()
        (self.reloaded.add if outcome == "reloaded" else self.reloaded.discard)((replica, model))

    async def ready(self) -> bool:
        """A replica answers for every routed version: by its last probes, else by probing it now (a replica that
        just came back is ready at once, not at the next round); or the service scaled to zero."""
        if not self.routed():
            return False
        if self.replicas.asleep():  # scaled to zero: the next request starts a replica and is answered
            return True
        if any(self.answering(replica) for replica in self.replicas.replicas):
            return True
        for replica in self.replicas.replicas:
            await asyncio.gather(*(self.probe(replica, v) for v in self.routed()))
            self.place(replica)
        return any(self.answering(replica) for replica in self.replicas.replicas)
