"""A running service as a release reaches it: the Triton it loads versions on, and the control API of the gateway in
front of it (tasks/runtime/gateway/control.py), which routes the service's requests. The one client of the runtime
(tasks/runtime/) on the release's side: its types are the control API's contract (tasks/control/contract.py), and no
stage reaches the runtime any other way.

The gateway is the one `llmops serve` runs for this LLMOPS_HOME, or a temporary one that the release starts beside
its own Triton (tasks/runtime/standalone.py:open_service): the canary's steps, the shadow copy, the probes and the
served scoring go through a gateway either way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn

import requests

from tasks.control.contract import Owner, RouteTable, Version
from tasks.platform.errors import CheckFailed, LostService, TransientError
from tasks.serving.client import CONTROL_HEADER, Triton, generate_body


@dataclass(frozen=True)
class Fence:
    """What every write of a release carries: the epoch its ownership of the service was given (PUT /owner)."""

    release: str
    epoch: int


@dataclass
class ServiceControl:
    """The control API of a gateway: its URL (its control listener) and the serve's control key (never printed).

    A release's writes carry its `fence` once it owns the service. Once it `lost` the service (a write refused by
    the fence, a takeover seen at renewal, a lease that lapsed before a renewal landed), every write is refused here,
    unsent, with the line that says who owns the service now."""

    url: str
    key: str = field(repr=False)
    fence: Fence | None = None
    lost: str | None = None
    # where `llmops serve` publishes its control API's URL and key now (a restarted serve has a new key): read again
    # on a 401 or a refused connection, and the call sent once more to what it says
    reread: Callable[[], tuple[str, str] | None] | None = field(default=None, repr=False)

    def call(self, method: str, path: str, body: Mapping[str, Any] | None = None, timeout: float = 30) -> dict:
        response = self.send(method, path, body, timeout)
        if response.status_code != 200:
            raise CheckFailed(f"the control API at {self.url}: {method} {path}: {error_text(response)}")
        return response.json()

    def send(self, method: str, path: str, body: Mapping[str, Any] | None, timeout: float) -> requests.Response:
        try:
            response = self.request(method, path, body, timeout)
        except requests.ConnectionError:
            if not self.published_again():
                raise TransientError(f"the control API of the service at {self.url}: ConnectionError") from None
            response = None
        except requests.RequestException as exc:
            raise TransientError(f"the control API of the service at {self.url}: {type(exc).__name__}") from None
        if response is not None and (response.status_code != 401 or not self.published_again()):
            return response
        try:  # the serve started again: its new key (and URL), once
            return self.request(method, path, body, timeout)
        except requests.RequestException as exc:
            raise TransientError(f"the control API of the service at {self.url}: {type(exc).__name__}") from None

    def request(self, method: str, path: str, body: Mapping[str, Any] | None, timeout: float) -> requests.Response:
        return requests.request(
            method, f"{self.url}{path}", json=body, headers={CONTROL_HEADER: self.key}, timeout=timeout
        )

    def published_again(self) -> bool:
        """The serve's URL and key as published now, where they changed (it started again); False otherwise."""
        now = self.reread() if self.reread is not None else None
        if now is None or now == (self.url, self.key):
            return False
        self.url, self.key = now
        return True

    def write(
        self, method: str, path: str, body: Mapping[str, Any], timeout: float = 30, transient: tuple[int, ...] = ()
    ) -> dict:
        """A change of the service, fenced: with the release's epoch, never once the release lost the service.
        A status in `transient` is a TransientError (Prefect's retry), any other refusal a CheckFailed."""
        self.refuse_if_lost()
        fence = self.fence
        fenced = {**body, "epoch": fence.epoch, "epoch_of": fence.release} if fence else dict(body)
        response = self.send(method, path, fenced, timeout)
        if response.status_code == 409 and "owner" in json_object(response) and self.fence is not None:
            self.lose(f"{error_text(response)}; this release wrote nothing more")
        if response.status_code in transient:
            raise TransientError(f"the control API at {self.url}: {method} {path}: {error_text(response)}")
        if response.status_code != 200:
            raise CheckFailed(f"the control API at {self.url}: {method} {path}: {error_text(response)}")
        return response.json()

    def lose(self, why: str) -> NoReturn:
        """The release lost the service: no write after this one is sent."""
        self.lost = why
        raise LostService(why)

    def refuse_if_lost(self) -> None:
        if self.lost:
            raise LostService(self.lost)

    def confirm_owner(self) -> None:
        """LostService where the service's record no longer names this release's ownership (asked after a stage
        failed: its failure may be that another release took the service); nothing where it cannot be asked."""
        self.refuse_if_lost()
        if self.fence is None:
            return
        try:
            table = self.table()
        except (CheckFailed, TransientError):
            return
        owner, now = table.owner, time.time()
        if owner is None or owner.epoch != self.fence.epoch or owner.expired(now):
            by = f"owned by {owner.describe()}" if owner and not owner.expired(now) else "owned by no release"
            self.lose(
                f"{table.service} is {by} now, not by this release (epoch {self.fence.epoch}); it wrote nothing more"
            )

    def table(self) -> RouteTable:
        return RouteTable.of(self.call("GET", "/control/v1/deployment"))

    def put_table(self, table: RouteTable, lease_s: float | None = None) -> RouteTable:
        body = {**table.as_json(), "lease_s": lease_s if table.release else None}
        return RouteTable.of(self.write("PUT", "/control/v1/deployment", body))

    def set_weights(self, weights: Mapping[str, float], release: str | None, lease_s: float | None) -> RouteTable:
        body = {"weights": dict(weights), "release": release, "lease_s": lease_s if release else None}
        return RouteTable.of(self.write("PUT", "/control/v1/routes", body))

    def start_shadow(self, version: str, fraction: float, release: str, lease_s: float) -> RouteTable:
        body = {"version": version, "fraction": fraction, "release": release, "lease_s": lease_s}
        return RouteTable.of(self.write("PUT", "/control/v1/shadow", body))

    def renew(self, release: str, lease_s: float) -> RouteTable:
        return RouteTable.of(self.write("PUT", "/control/v1/lease", {"release": release, "lease_s": lease_s}))

    def own(self, release: str, lease_s: float, waiting: str | None = None) -> Owner:
        """Take (or renew, or take over from a lapsed owner) the service's ownership for `release`: the owner after
        the call, `release` with its epoch where it owns the service, else the release that does."""
        body = {"release": release, "lease_s": lease_s, "waiting": waiting}
        # a service scaled to zero answers once a replica serves (serve.autoscale.cold_start_timeout_s, 300 s default)
        response = self.send("PUT", "/control/v1/owner", body, 360)
        owner = json_object(response).get("owner") if response.status_code in (200, 409) else None
        if not isinstance(owner, dict):
            raise CheckFailed(f"the control API at {self.url}: PUT /control/v1/owner: {error_text(response)}")
        return Owner.of(owner)

    def declare(self, models: Sequence[str]) -> None:
        """The Triton models this release (the owner) loads, declared before it loads them: `llmops serve`'s
        reconciler leaves them loaded while the release owns the service, and unloads them once its ownership lapsed.
        Nothing where the release owns no service here (a gateway of its own, which reconciles nothing)."""
        if self.fence is not None:
            self.write("PUT", "/control/v1/loads", {"models": sorted(set(models))})

    def disown(self, release: str, epoch: int | None = None) -> RouteTable:
        """`release` gives up the service's ownership of `epoch` (its fence's by default): nothing changes where it is
        not the owner, or another epoch of it."""
        body = {"release": release, "epoch": epoch if epoch is not None else self.fence.epoch if self.fence else None}
        return RouteTable.of(self.call("DELETE", "/control/v1/owner", body))

    def load(self, version: Version, load_timeout_s: float, replicas: int, fresh: bool = False) -> list[dict[str, Any]]:
        """`version` loaded by the service on every replica, from the artifact store with the settings its source
        carries (POST /control/v1/versions; `fresh`: unloaded first), a load past `load_timeout_s` taken for hung:
        per replica, what it took. A hung load is the service's to end (it restarts a replica where another serves the
        champion, else abandons the load). CheckFailed with the service's reason where the version does not load,
        TransientError where a replica did not serve; the call waits for each of the `replicas`."""
        body = {"version": asdict(version), "load_timeout_s": load_timeout_s, "fresh": fresh}
        waited = max(1, replicas) * (4 * load_timeout_s + 120)  # a load, a restart (2 loads and 60 s) and a load again
        self.refuse_if_lost()
        try:
            answer = self.write("POST", "/control/v1/versions", body, waited, transient=(502, 503, 504))
        except CheckFailed as refused:
            raise CheckFailed(str(refused).split(": POST /control/v1/versions: ", 1)[-1]) from None
        return list(answer["replicas"])

    def held(self) -> list[dict[str, Any]]:
        """What each replica holds, as the service reads it (GET /control/v1/replicas): url, models (None: no answer)."""
        return list(self.call("GET", "/control/v1/replicas")["replicas"])

    def unload(self, version: Version) -> None:
        """`version` unloaded from every replica by the service (DELETE /control/v1/versions); never a routed one."""
        self.write("DELETE", "/control/v1/versions", {"version": asdict(version)}, 120)

    def start_rollout(self, plan: Mapping[str, Any], release: str, lease_s: float) -> RouteTable:
        """The table's candidate rolled out by the service's controller, as `plan` says, held for lease_s."""
        body = {**plan, "release": release, "lease_s": lease_s}
        return RouteTable.of(self.write("PUT", "/control/v1/rollout", body))

    def decide(self, release: str, decision: str, reason: str = "") -> RouteTable:
        """abort, next or promote: the release's decision on its rollout (the table after it)."""
        body = {"decision": decision, "reason": reason, "release": release}
        return RouteTable.of(self.write("POST", "/control/v1/rollout/decision", body))

    def stop_shadow(self) -> RouteTable:
        return RouteTable.of(self.write("DELETE", "/control/v1/shadow", {}))

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


def json_object(response: requests.Response) -> dict:
    """An answer's JSON object; {} where it is none."""
    try:
        data = response.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


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

    @property
    def triton(self) -> Triton:
        """The first replica: where the benchmark measures and the gate reads what was loaded."""
        return self.tritons[0]
