"""The Tritons behind one gateway (`serve.replicas`, or `llmops serve --triton-url` repeated): every version is loaded
on each, and each request goes to the replica in the pool with the fewest requests outstanding.

A replica that cannot be reached leaves the pool at once: the request that found it so (nothing had reached the
client) goes to another replica, and so does one that found the version not loaded there; a request whose answer
had begun gets its 503 (or a stream's error event). The probes (probes.py) put a replica back in the pool once every
routed version answers there again, and take one out whose versions stop answering.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Gauge

from tasks.control.contract import Version
from tasks.runtime.gateway.upstream import Answer, TritonUpstream, Unanswered, server_fault, text_pieces

LOG = logging.getLogger("llmops.gateway")
# A request that found one of a version's model instances dead tries the same replica this many times in all: the
# dead instance fails at once, and Triton hands the next request to whichever instance is free (mostly the dead one,
# which is free the soonest), so a second and a third try mostly reach a live one.
DEAD_INSTANCE_TRIES = 3


@dataclass
class PooledReplica:
    triton: TritonUpstream
    outstanding: int = 0
    in_pool: bool = True
    draining: bool = False  # leaving for good (serve.autoscale): no new request, never back in the pool
    probing: int = 0  # probes in flight (probes.py): its connections stay open until they end

    @property
    def url(self) -> str:
        return self.triton.url


class Replicas:
    """`strict`: a request goes only to a replica in the pool, else it is a 503 at once (the probes put replicas back);
    not strict (no probes), a request tries a replica out of the pool where none is in it."""

    def __init__(
        self,
        tritons: list[TritonUpstream],
        registry: CollectorRegistry,
        strict: bool = False,
        connect: Callable[[str], TritonUpstream] = TritonUpstream,
        service: str = "",
    ):
        self.replicas, self.strict, self.connect = [PooledReplica(triton) for triton in tritons], strict, connect
        self.next = 0  # where the search for the least busy starts: ties go round the pool
        self.wake: Callable[[], None] | None = None  # serve.autoscale at zero: asks for a replica (wake_with)
        self.cold_start_s = 0.0
        self.waiting = 0  # requests waiting for a replica to start
        # a request found one of a version's instances dead on a replica (probes.py loads that model again)
        self.instance_died: Callable[[str, Version], None] = lambda url, version: None
        self.up = Gauge(
            "llmops_gateway_replica_up", "1 while the replica is in the pool, else 0.", ["replica"], registry=registry
        )
        for replica in self.replicas:
            self.up.labels(replica.url).set(1)
        Gauge(
            "llmops_gateway_requests_in_flight",
            "Requests sent to the replicas and not answered yet, and those waiting for a replica (at zero): "
            "serve.autoscale's in_flight signal, which a KEDA ScaledObject reads on Kubernetes.",
            ["llmops_service"],  # not `service`: Prometheus's scrape configs label targets so (infra/monitoring)
            registry=registry,
        ).labels(service).set_function(lambda: sum(r.outstanding for r in self.replicas) + self.waiting)

    def wake_with(self, wake: Callable[[], None], cold_start_s: float) -> None:
        """serve.autoscale with min_replicas 0: a request that finds no replica in the pool calls `wake` and waits up
        to `cold_start_s` for one to join, instead of a 503 at once."""
        self.wake, self.cold_start_s = wake, cold_start_s

    def asleep(self) -> bool:
        """Scaled to zero: no replica, and the next request starts one."""
        return self.wake is not None and not self.replicas

    async def woken(self) -> None:
        """Where none is in the pool and the pool can be woken: a replica asked for and waited for (bounded)."""
        if self.wake is None or any(r.in_pool for r in self.replicas):
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cold_start_s
        self.waiting += 1
        try:
            self.wake()
            while not any(r.in_pool for r in self.replicas) and loop.time() < deadline:
                await asyncio.sleep(0.05)
        finally:
            self.waiting -= 1

    def pick(self, tried: set[str]) -> PooledReplica:
        """The replica in the pool with the fewest requests outstanding, not among those `tried`; not strict, where
        none is in the pool, one out of it."""
        count = len(self.replicas)
        rotated = [self.replicas[(self.next + i) % count] for i in range(count)]
        order = [r for r in rotated if r.url not in tried]
        candidates = [r for r in order if r.in_pool] or ([] if self.strict else order)
        if not candidates:
            raise server_fault(503, f"no replica answers (tried: {', '.join(sorted(tried)) or 'none in the pool'})")
        self.next = (self.next + 1) % count
        return min(candidates, key=lambda r: r.outstanding)

    def leave(self, replica: PooledReplica, why: str) -> None:
        if replica.in_pool:
            LOG.warning("replicas: %s leaves the pool (%s)", replica.url, why)
            replica.in_pool = False
            self.up.labels(replica.url).set(0)

    def join(self, replica: PooledReplica) -> None:
        if not replica.in_pool and not replica.draining:
            LOG.warning("replicas: %s is back in the pool", replica.url)
            replica.in_pool = True
            self.up.labels(replica.url).set(1)

    async def add(self, url: str) -> PooledReplica:
        """The Triton at `url` joined the fleet, every routed version loaded on it. Strict, it is out of the pool until
        the probes' next round finds every routed version answering there; else in it at once."""
        replica = PooledReplica(self.connect(url), in_pool=not self.strict)
        self.replicas = [*self.replicas, replica]  # a new list: a pick or a probe round iterating the old one goes on
        self.up.labels(replica.url).set(int(replica.in_pool))
        LOG.warning("replicas: %s joins%s", replica.url, " (in the pool once its probes answer)" if self.strict else "")
        return replica

    async def drain(self, url: str, within_s: float) -> int:
        """The replica at `url` takes no new request; once the requests it has outstanding ended (or `within_s`
        passed) it leaves the list. The requests still outstanding then (0 unless the deadline passed)."""
        replica = next(r for r in self.replicas if r.url == url)
        replica.draining = True
        self.leave(replica, "draining: leaving the fleet")
        deadline = asyncio.get_running_loop().time() + within_s
        while replica.outstanding and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        self.replicas = [r for r in self.replicas if r is not replica]
        self.up.remove(replica.url)
        cut = replica.outstanding
        while replica.probing and asyncio.get_running_loop().time() < deadline:  # a probe cut off is no fault of it
            await asyncio.sleep(0.05)
        await replica.triton.aclose()  # its connections (else asyncio says "Unclosed client session" at GC)
        return cut

    async def on_one(self, version: Version, work: Callable[[TritonUpstream], Any]) -> Any:
        """`work(triton)` on the least busy replica; where it was not answered there, on another (or, where one of the
        version's instances was found dead there, on the same one again: DEAD_INSTANCE_TRIES)."""
        tried: set[str] = set()
        dead_instance_tries = 0
        await self.woken()
        while True:
            replica = self.pick(tried)
            replica.outstanding += 1
            try:
                return await work(replica.triton)
            except Unanswered as unanswered:
                if unanswered.dead_instance:
                    self.instance_died(replica.url, version)
                    dead_instance_tries += 1
                    if dead_instance_tries < DEAD_INSTANCE_TRIES:
                        continue
                tried.add(replica.url)
                if unanswered.down:
                    self.leave(replica, "not reachable")
                if len(tried) >= len(self.replicas):
                    raise
            finally:
                replica.outstanding -= 1

    async def generate(self, version: Version, inputs: dict[str, Any]) -> str:
        return await self.on_one(version, lambda triton: triton.generate(version, inputs))

    async def generate_outputs(self, version: Version, inputs: dict[str, Any]) -> dict[str, Any]:
        return await self.on_one(version, lambda triton: triton.generate_outputs(version, inputs))

    async def forward(self, version: Version, body: dict[str, Any]) -> Answer:
        return await self.on_one(version, lambda triton: triton.forward(version, body))

    async def forward_stream(
        self, version: Version, body: dict[str, Any], ended: Callable[[bool], None] = lambda ok: None
    ) -> tuple[httpx.Response, AsyncIterator[bytes]]:
        """Triton.forward_stream on a replica that answered; it counts as outstanding until the relay ends."""
        holder: list[PooledReplica] = []

        async def started(triton: TritonUpstream) -> tuple[httpx.Response, AsyncIterator[bytes]]:
            replica = next(r for r in self.replicas if r.triton is triton)
            response, chunks = await triton.forward_stream(version, body, ended)
            replica.outstanding += 1  # held by the relay from here on
            holder.append(replica)
            return response, chunks

        response, chunks = await self.on_one(version, started)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                holder[0].outstanding -= 1

        return response, relay()

    def generate_stream(self, version: Version, inputs: dict[str, Any]) -> AsyncGenerator[str, None]:
        """The text pieces of generate_stream_outputs' events."""
        return text_pieces(self.generate_stream_outputs(version, inputs))

    async def generate_stream_outputs(
        self, version: Version, inputs: dict[str, Any]
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Triton.generate_stream_outputs on a replica whose first event came (before it, another replica may
        answer)."""
        holder: list[tuple[PooledReplica, AsyncGenerator[dict[str, Any], None]]] = []

        async def first(triton: TritonUpstream) -> dict[str, Any] | None:
            events = triton.generate_stream_outputs(version, inputs)
            try:
                event = await anext(events, None)
            except BaseException:
                await events.aclose()
                raise
            replica = next(r for r in self.replicas if r.triton is triton)
            replica.outstanding += 1
            holder.append((replica, events))
            return event

        event = await self.on_one(version, first)
        replica, events = holder[0]
        try:
            while event is not None:
                yield event
                event = await anext(events, None)
        finally:
            replica.outstanding -= 1
            await events.aclose()

    async def version_ready(self, version: Version) -> bool:
        """The version's model ready on a replica in the pool."""
        for replica in self.replicas:
            if replica.in_pool and await replica.triton.version_ready(version):
                return True
        return False

    async def not_ready_on(self, version: Version) -> list[str]:
        """The URLs of the replicas in the pool whose model of `version` is not ready (a rollout's candidate needs
        every one: each serves its share)."""
        pool = [replica for replica in self.replicas if replica.in_pool]
        ready = await asyncio.gather(*(replica.triton.version_ready(version) for replica in pool))
        return [replica.triton.url for replica, ok in zip(pool, ready, strict=True) if not ok]

    async def aclose(self) -> None:
        for replica in self.replicas:
            await replica.triton.aclose()
