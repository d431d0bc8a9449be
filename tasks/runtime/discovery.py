"""Tritons found by name (`llmops serve --triton-discover NAME`): on Kubernetes, the headless Service in front of a
Deployment of `llmops triton` pods that a KEDA ScaledObject scales (infra/kubernetes/serving-autoscale.yaml). The
name resolves, through the system's resolver, to one address per ready pod; every pod listens on the same ports
(serve.listen.triton_*). Every few seconds the name is resolved again:

- an address that appeared is a new replica: every version of the route table is loaded on it (the files sent with
  the load requests: the pod shares no disk) before the gateway hears of it, and it takes requests once its probes
  answer, so a canary reaches a pod that joins during a ramp at its weight from the pod's first request;
- an address that went away (its pod is stopping: Kubernetes takes it out of the Service first) is drained and
  leaves the fleet; the pod's own Triton finishes what it has (`preStop` and --exit-timeout-secs);
- a replica whose load failed is not one: it is tried again on the next round that still finds it;
- at zero (serve.autoscale.min_replicas 0: KEDA stopped the last pod), a request waits for a pod up to
  serve.autoscale.cold_start_timeout_s, counted in llmops_gateway_requests_in_flight, which wakes the pods, and the
  name is looked up again at once and then every few seconds.

The pods are started and stopped by Kubernetes, never by this serve: it restarts none, and a dead pod's probes take
it out of the pool until the name stops naming it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tasks.platform.config import ListenSection
from tasks.platform.errors import BadInput, CheckFailed, TransientError
from tasks.runtime.fleet import Fleet
from tasks.runtime.gateway.running import RunningGateway
from tasks.serving.client import Triton

DISCOVER_EVERY_S = 5.0  # CoreDNS's kubernetes plugin answers with a 5 s TTL: a pod's change is seen within 10 s
DRAIN_S = 120.0  # the longest a leaving pod's outstanding requests are waited for (its preStop outlasts this)


def resolve(name: str) -> list[str]:
    """The addresses `name` resolves to now, sorted; none where it names nothing (a headless Service with no ready
    pod answers NXDOMAIN)."""
    try:
        found = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return sorted({str(info[4][0]) for info in found})


@dataclass(frozen=True)
class Discovery:
    """The Tritons behind `name`, on serve.listen's Triton ports, with the control key `key`."""

    name: str
    listen: ListenSection
    key: str | None

    def url(self, address: str) -> str:
        return f"http://{self.host(address)}:{self.listen.triton_http_port}"

    @staticmethod
    def host(address: str) -> str:
        return f"[{address}]" if ":" in address else address

    def triton(self, address: str, timeout: float = 30) -> Triton:
        host, listen = self.host(address), self.listen
        return Triton.attach(
            self.url(address),
            None,  # a pod's own disk: every model goes with its load request
            f"http://{host}:{listen.triton_metrics_port}/metrics",
            f"{host}:{listen.triton_grpc_port}",
            self.key,
            timeout=timeout,
        )

    def first(self, wait_s: float, say: Callable[[str], None]) -> list[Triton]:
        """The Tritons the name finds at start, waiting up to `wait_s` for one (the pods may start with this serve)."""
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            addresses = resolve(self.name)
            if addresses:
                return [self.triton(address, max(deadline - time.monotonic(), 30)) for address in addresses]
            if time.monotonic() > deadline:
                raise BadInput(f"--triton-discover {self.name}: the name resolves to no address after {wait_s:.0f}s")
            if not said:
                say(f"llmops serve: waiting for {self.name} to name a Triton (up to {wait_s:.0f}s)")
                said = True
            time.sleep(1)


class Membership:
    """What the name finds made the fleet's replicas (and the gateway's pool), round after round."""

    def __init__(
        self,
        discovery: Discovery,
        fleet: Fleet,
        gateway: RunningGateway,
        say: Callable[[str], None],
        republish: Callable[[], object] = lambda: None,
    ):
        self.discovery, self.fleet, self.gateway, self.say = discovery, fleet, gateway, say
        self.republish = republish  # server.json lists the replicas for the releases of this home
        self.woken = threading.Event()  # a request waits for a pod (the pods at zero): look the name up at once

    def run(self, stopped: threading.Event, every_s: float = DISCOVER_EVERY_S) -> None:
        while not stopped.is_set():
            self.woken.wait(every_s)
            self.woken.clear()
            try:
                self.step()
            except Exception as exc:  # a round that failed is said; the next one resolves again
                self.say(f"llmops serve: discovery: {type(exc).__name__}: {exc}")

    def step(self) -> tuple[list[str], list[str]]:
        """One round: the URLs that joined and those that left."""
        found = {self.discovery.url(address): address for address in resolve(self.discovery.name)}
        known = {replica.client.url for replica in self.fleet.replicas}
        joined = [url for url, address in found.items() if url not in known and self.join(address)]
        left = [url for url in known if url not in found]
        for url in left:
            self.leave(url)
        if joined or left:
            self.republish()
        return joined, left

    def join(self, address: str) -> bool:
        started = time.monotonic()
        try:
            replica = self.fleet.join(self.discovery.triton(address, timeout=10))
        except (TransientError, CheckFailed, OSError) as exc:
            self.say(
                f"llmops serve: discovery: {self.discovery.url(address)} did not take every routed version, and takes "
                f"no request (tried again next round): {exc}"
            )
            return False
        pool = self.gateway.gateway
        self.gateway.call(pool.triton.add(replica.client.url))
        self.say(
            f"llmops serve: discovery: {replica.client.url} joins, every routed version loaded "
            f"({time.monotonic() - started:.1f} s)"
        )
        self.gateway.call(pool.prober.round(), timeout=60)  # in the pool once its versions answer
        return True

    def leave(self, url: str) -> None:
        replica = next(r for r in self.fleet.replicas if r.client.url == url)
        self.say(f"llmops serve: discovery: {self.discovery.name} no longer names {url}; draining it")
        cut = self.gateway.call(self.gateway.gateway.triton.drain(url, DRAIN_S), timeout=DRAIN_S + 30)
        self.fleet.retire(replica)
        if cut:
            self.say(f"llmops serve: discovery: {cut} requests to {url} were still outstanding after {DRAIN_S:g} s")
