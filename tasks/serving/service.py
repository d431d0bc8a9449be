"""A running service as a release reaches it: the Triton it loads versions on, and the control API of the gateway in
front of it (tasks/serving/gateway/control.py), which routes the service's requests.

The gateway is the one `llmops serve` runs for this LLMOPS_HOME, or a temporary one that the release starts beside
its own Triton (tasks/serving/champion.py:open_service): the canary's steps, the shadow copy, the probes and the
served scoring go through a gateway either way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import requests

from tasks.platform.errors import CheckFailed, TransientError
from tasks.serving.client import CONTROL_HEADER, Triton, generate_body
from tasks.serving.routes import Owner, RouteTable


@dataclass
class ServiceControl:
    """The control API of a gateway: its URL (its control listener) and the serve's control key (never printed)."""

    url: str
    key: str = field(repr=False)

    def call(self, method: str, path: str, body: Mapping[str, Any] | None = None, timeout: float = 30) -> dict:
        try:
            response = requests.request(
                method, f"{self.url}{path}", json=body, headers={CONTROL_HEADER: self.key}, timeout=timeout
            )
        except requests.RequestException as exc:
            raise TransientError(f"the control API of the service at {self.url}: {type(exc).__name__}") from None
        if response.status_code != 200:
            raise CheckFailed(f"the control API at {self.url}: {method} {path}: {error_text(response)}")
        return response.json()

    def table(self) -> RouteTable:
        return RouteTable.of(self.call("GET", "/control/v1/deployment"))

    def put_table(self, table: RouteTable, lease_s: float | None = None) -> RouteTable:
        body = {**table.as_json(), "lease_s": lease_s if table.release else None}
        return RouteTable.of(self.call("PUT", "/control/v1/deployment", body))

    def set_weights(self, weights: Mapping[str, float], release: str | None, lease_s: float | None) -> RouteTable:
        body = {"weights": dict(weights), "release": release, "lease_s": lease_s if release else None}
        return RouteTable.of(self.call("PUT", "/control/v1/routes", body))

    def start_shadow(self, version: str, fraction: float, release: str, lease_s: float) -> RouteTable:
        body = {"version": version, "fraction": fraction, "release": release, "lease_s": lease_s}
        return RouteTable.of(self.call("PUT", "/control/v1/shadow", body))

    def renew(self, release: str, lease_s: float) -> RouteTable:
        return RouteTable.of(self.call("PUT", "/control/v1/lease", {"release": release, "lease_s": lease_s}))

    def own(self, release: str, lease_s: float, waiting: str | None = None) -> Owner | None:
        """Take (or renew, or take over from a lapsed owner) the service's ownership for `release`: None once it is
        the owner, else the release that owns it."""
        body = {"release": release, "lease_s": lease_s, "waiting": waiting}
        try:
            response = requests.put(
                f"{self.url}/control/v1/owner", json=body, headers={CONTROL_HEADER: self.key}, timeout=30
            )
        except requests.RequestException as exc:
            raise TransientError(f"the control API of the service at {self.url}: {type(exc).__name__}") from None
        if response.status_code == 409 and isinstance(response.json().get("owner"), dict):
            return Owner.of(response.json()["owner"])
        if response.status_code != 200:
            raise CheckFailed(f"the control API at {self.url}: PUT /control/v1/owner: {error_text(response)}")
        return None

    def disown(self, release: str) -> RouteTable:
        """`release` gives the service up (nothing changes where it is not the owner)."""
        return RouteTable.of(self.call("DELETE", "/control/v1/owner", {"release": release}))

    def restart_replica(self, triton: Triton, timeout_s: float) -> None:
        """`llmops serve` starts its Triton at triton.url again (a load hung there) and answers once it serves the
        table's versions again; CheckFailed where the serve does not own that Triton."""
        self.call("POST", "/control/v1/replicas/restart", {"url": triton.url, "timeout_s": timeout_s}, timeout_s + 30)

    def stop_shadow(self) -> RouteTable:
        return RouteTable.of(self.call("DELETE", "/control/v1/shadow"))

    def generate(
        self,
        name: str,
        text: str,
        max_tokens: int = 16,
        timeout: float = 60,
        history: Sequence[Mapping[str, object]] | None = None,
    ) -> str:
        """Greedy answer of `name` (the service: a version drawn by weight; or one version by its name) through the
        gateway, after `history` (earlier messages)."""
        body = generate_body(text, max_tokens, history)
        response = requests.post(
            f"{self.url}/v2/models/{name}/generate", json=body, headers={CONTROL_HEADER: self.key}, timeout=timeout
        )
        if response.status_code != 200:
            raise CheckFailed(f"the service: {name} generate failed: {error_text(response)}")
        return response.json()["text_output"]

    def metrics(self) -> str:
        try:
            return requests.get(f"{self.url}/metrics", timeout=10).text
        except requests.RequestException as exc:
            raise TransientError(f"the gateway's /metrics at {self.url}: {type(exc).__name__}") from None


def error_text(response: requests.Response) -> str:
    try:
        return str(response.json().get("error", response.text))[:300]
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:300]}"


@dataclass
class VersionCounters:
    """How one version's requests ended, as the gateway counts them (llmops_gateway_version_*)."""

    ok: float
    refused: float
    failed: float
    seconds: float  # of the answered ones


def version_counters(metrics: str, version: str) -> VersionCounters:
    """The gateway's counters of `version` in its /metrics text (Prometheus' exposition format)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = {"ok": 0.0, "refused": 0.0, "failed": 0.0, "seconds": 0.0}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.labels.get("version") != version or not sample.name.endswith("_total"):
                continue
            if sample.name == "llmops_gateway_version_requests_total":
                counts[sample.labels["outcome"]] += sample.value
            elif sample.name == "llmops_gateway_version_seconds_total":
                counts["seconds"] += sample.value
    return VersionCounters(counts["ok"], counts["refused"], counts["failed"], counts["seconds"])


@dataclass
class Service:
    """The service a release rolls out on: its name, its Triton replicas (every version is loaded on each), its
    gateway's control API; `stop` ends what the release started for itself (its temporary Triton and gateway),
    nothing where it attached to `llmops serve`."""

    name: str
    tritons: list[Triton]
    control: ServiceControl
    stop: Callable[[], None] = lambda: None
    # (replica, timeout_s): a replica where a load hung, killed with its model processes and started again on its
    # ports, by the release where it started that Triton, by `llmops serve` where it serves; None where neither owns it
    restart: Callable[[Triton, float], None] | None = None

    @property
    def triton(self) -> Triton:
        """The first replica: where the benchmark measures and the gate reads what was loaded."""
        return self.tritons[0]
