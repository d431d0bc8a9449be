"""The service's route table and the deployment record it is kept in.

The gateway of `llmops serve` draws each request's version from this table: the champion and, during a release, a
candidate, each with a weight; a request for the service's name goes to one of them, drawn by weight. A version is
answered by a Triton model: its own (`<service>-vN`, a merged model) or the service's base engine
(`<service>-base`), which the gateway asks for the version's adapter by name (serve.lora adapter). A shadow copy
names a version and the share of answered requests copied to it.

The table is the deployment record: written to disk whole and atomically (a temporary file renamed into place) on
every change, and read back when `llmops serve` starts, so that it serves what it served without asking MLflow. A
release that changes the routes holds them for a lease: past `expires_at` (the release died or hung), the
gateway serves the champion alone again. Each version carries what is needed to load it again (`source`: the store
artifacts and the serving settings it was released with), which the gateway itself never reads.

The record also names the release that owns the service (`owner`): one release of a service deploys, waits for
approval and promotes at a time. Ownership is data with an expiry, not a process: the owner renews it while it
runs, gives it up at its end, and one that lapsed (the release died, or its wait for a person timed out) is taken
over by the next release. A release waiting for approval without a process (suspended) owns the service until its
approval timeout.

Plain data and the standard library: the gateway, `llmops serve`, and the release runs that call the control API
read and write the same JSON.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from itertools import accumulate
from pathlib import Path
from typing import Any

from tasks.control.rollout import Rollout, RolloutError
from tasks.platform.config.base import TRITON_NAME

RECORD_VERSION = 1


class RoutesError(ValueError):
    """A route table that cannot serve: the message names the field."""


@dataclass(frozen=True)
class Version:
    """A served version as the gateway routes to it."""

    name: str  # `<service>-vN`: what metrics, capture, shadow records and pinned requests call it
    model: str  # the Triton model that answers it
    adapter: str | None = None  # the adapter the model is asked for (`lora_name`), or None
    source: dict[str, Any] = field(default_factory=dict, compare=False)  # what loads it again (llmops serve)

    def inputs(self, body: dict[str, Any]) -> dict[str, Any]:
        """A request's generate inputs as this version's model takes them: with its adapter named."""
        return {**body, "lora_name": self.adapter} if self.adapter else body

    @classmethod
    def of(cls, data: Any, where: str) -> Version:
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
            raise RoutesError(f"{where}: a version needs a name")
        model, adapter, source = data.get("model", data["name"]), data.get("adapter"), data.get("source", {})
        if not isinstance(model, str) or not model or (adapter is not None and not isinstance(adapter, str)):
            raise RoutesError(f"{where}: model must be a name and adapter a name or null")
        # names become file names (shadow records) and URL paths (Triton's /v2/models/NAME): Triton's rule, no '/'
        for key, value in (("name", data["name"]), ("model", model), ("adapter", adapter)):
            if value is not None and not TRITON_NAME.match(value):
                raise RoutesError(f"{where}.{key}: {value!r} is not a model name (letters, digits, '-', '_', '.')")
        if not isinstance(source, dict):
            raise RoutesError(f"{where}.source: must be an object")
        return cls(data["name"], model, adapter or None, source)


@dataclass(frozen=True)
class Owner:
    """The release that owns the service: since when, until when without renewal, and what it waits for."""

    release: str
    since: float  # unix time it took the service
    expires_at: float  # past this, the next release takes the service over
    waiting: str | None = None  # "approval": it waits for a person (others do not queue behind it)
    epoch: int = 0  # its fencing token: every write of the release carries it, and one of an older owner is refused
    loads: tuple[str, ...] = ()  # the Triton models it declared it loads (its candidate, the champion it serves)

    def expired(self, now: float) -> bool:
        return now >= self.expires_at

    def describe(self) -> str:
        from datetime import UTC, datetime

        since = datetime.fromtimestamp(self.since, UTC).isoformat(timespec="seconds")
        waits = ", waiting for approval" if self.waiting == "approval" else ""
        return f"release {self.release} (epoch {self.epoch}, owner since {since}{waits})"

    @classmethod
    def of(cls, data: Any) -> Owner:
        if not isinstance(data, dict) or not isinstance(data.get("release"), str) or not data["release"]:
            raise RoutesError("owner.release: a run id")
        try:
            since, expires_at = float(data["since"]), float(data["expires_at"])
        except (KeyError, TypeError, ValueError):
            raise RoutesError("owner: since and expires_at are unix times") from None
        waiting = data.get("waiting") or None
        if waiting not in (None, "approval"):
            raise RoutesError("owner.waiting: null or approval")
        epoch = parse_epoch(data.get("epoch", 0), "owner.epoch")
        return cls(
            data["release"], since, expires_at, waiting, epoch, parse_models(data.get("loads", []), "owner.loads")
        )

    def declared(self, now: float) -> set[str]:
        """The models a live owner declared (a lapsed one's are nobody's)."""
        return set() if self.expired(now) else set(self.loads)


def parse_models(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(name, str) for name in value):
        raise RoutesError(f"{where}: a list of model names")
    for name in value:
        if not TRITON_NAME.match(name):
            raise RoutesError(f"{where}: {name!r} is not a model name (letters, digits, '-', '_', '.')")
    return tuple(value)


def parse_epoch(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RoutesError(f"{where}: a whole number, 0 or more")
    return value


@dataclass(frozen=True)
class RouteTable:
    service: str
    champion: Version | None = None
    candidate: Version | None = None
    weights: dict[str, float] = field(default_factory=dict)  # version name -> weight
    shadow: str | None = None  # the version answered requests are copied to
    shadow_fraction: float = 0.0
    release: str | None = None  # the run that holds the candidate's routes
    expires_at: float | None = None  # when that hold lapses: the champion alone again
    updated_at: float = 0.0
    owner: Owner | None = None  # the release that owns the service (deploys .. promotes), independent of the routes
    last_epoch: int = 0  # the last fencing epoch an owner was given: each new owner gets the next (never reused)
    rollout: Rollout | None = None  # the candidate's rollout: the release's plan, the controller's status (rollout.py)

    def __post_init__(self) -> None:
        routed = [(self.version(name), weight) for name, weight in self.weights.items() if weight > 0]
        object.__setattr__(self, "_routed", [version for version, _ in routed if version is not None])
        object.__setattr__(self, "_cumulative", list(accumulate(weight for _, weight in routed)))

    def versions(self) -> list[Version]:
        return [v for v in (self.champion, self.candidate) if v is not None]

    def models(self) -> set[str]:
        """The Triton models the table's versions need: each one's own and the model that answers it."""
        return {name for version in self.versions() for name in (version.name, version.model)}

    def wanted(self, now: float) -> set[str]:
        """The Triton models the service needs loaded: the table's (`models`) and what a live owner declared it
        loads; anything else of the service is a leftover."""
        return self.models() | (self.owner.declared(now) if self.owner else set())

    def version(self, name: str) -> Version | None:
        return next((v for v in self.versions() if v.name == name), None)

    def draw(self, rng: random.Random) -> Version | None:
        """A request's version, drawn by weight; None where nothing is routed."""
        routed: list[Version] = self._routed  # type: ignore[attr-defined]
        if len(routed) <= 1:
            return routed[0] if routed else None
        return rng.choices(routed, cum_weights=self._cumulative)[0]  # type: ignore[attr-defined]

    def routed(self) -> list[Version]:
        """The versions that get a share of the requests."""
        return list(self._routed)  # type: ignore[attr-defined]

    def shadow_version(self) -> Version | None:
        return self.version(self.shadow) if self.shadow and self.shadow_fraction > 0 else None

    def describe(self) -> str:
        """The routes as MODEL=WEIGHT pairs (capture records and logs read this)."""
        return ",".join(f"{name}={weight:g}" for name, weight in self.weights.items() if weight > 0)

    def champion_alone(self, why: str = "the champion serves alone", now: float = 0.0) -> RouteTable:
        """The champion serving every request: no candidate, no copy, no release holding the routes (the service's
        owner stays: its ownership has an expiry of its own); a rollout under way ends rolled back, for `why`."""
        weights = {self.champion.name: 100.0} if self.champion else {}
        rollout = self.rollout.ended("rolled_back", why, now) if self.rollout and self.rollout.active else self.rollout
        return replace(
            self,
            candidate=None,
            weights=weights,
            shadow=None,
            shadow_fraction=0.0,
            release=None,
            expires_at=None,
            rollout=rollout,
        )

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def lapsed(self, now: float) -> RouteTable | None:
        """The champion alone where a release's hold on a candidate or a copy lapsed by `now`; None where it holds
        (read again under the table's lock: a renewal that landed since the last look keeps the routes)."""
        held = self.candidate is not None or self.shadow is not None
        if not held or not self.expired(now):
            return None
        return self.champion_alone(f"release {self.release} stopped renewing its hold on the routes", now)

    def as_json(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items()}
        return {"record_version": RECORD_VERSION, **data}

    @classmethod
    def of(cls, data: Any) -> RouteTable:
        """A table from its JSON (the record, or a control request's whole table), checked."""
        if not isinstance(data, dict) or not isinstance(data.get("service"), str):
            raise RoutesError("service: required")
        champion = Version.of(data["champion"], "champion") if data.get("champion") else None
        candidate = Version.of(data["candidate"], "candidate") if data.get("candidate") else None
        table = cls(
            data["service"],
            champion,
            candidate,
            weights=parse_weights(data.get("weights", {})),
            shadow=data.get("shadow") or None,
            shadow_fraction=float(data.get("shadow_fraction") or 0.0),
            release=data.get("release") or None,
            expires_at=float(data["expires_at"]) if data.get("expires_at") is not None else None,
            updated_at=float(data.get("updated_at") or 0.0),
            owner=Owner.of(data["owner"]) if data.get("owner") else None,
            last_epoch=parse_epoch(data.get("last_epoch", 0), "last_epoch"),
            rollout=parse_rollout(data.get("rollout")),
        )
        table.check()
        return table

    def check(self) -> None:
        names = [v.name for v in self.versions()]
        if len(set(names)) != len(names):
            raise RoutesError(f"candidate: {names[0]} is the champion already")
        for name in self.weights:
            if name not in names:
                raise RoutesError(f"weights: {name} is neither the champion nor the candidate")
        if self.champion is not None and not self.routed():
            raise RoutesError("weights: at least one version needs a positive weight")
        if self.shadow is not None:
            if self.shadow not in names:
                raise RoutesError(f"shadow: {self.shadow} is neither the champion nor the candidate")
            if not 0 < self.shadow_fraction <= 1:
                raise RoutesError("shadow_fraction: must be in (0, 1]")
        if self.rollout is not None and self.rollout.active and self.rollout.candidate not in names:
            raise RoutesError(f"rollout.candidate: {self.rollout.candidate} is not in the table")


def parse_rollout(data: Any) -> Rollout | None:
    try:
        return Rollout.of(data) if data else None
    except RolloutError as exc:
        raise RoutesError(str(exc)) from None


def parse_weights(data: Any) -> dict[str, float]:
    if not isinstance(data, dict):
        raise RoutesError("weights: an object of version name -> weight")
    weights = {}
    for name, weight in data.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight <= 100:
            raise RoutesError(f"weights.{name}: a number from 0 to 100")
        weights[str(name)] = float(weight)
    return weights


def record_path(home: Path, service: str) -> Path:
    """Where `llmops serve` for this LLMOPS_HOME keeps the service's deployment record."""
    return home / "serving" / f"{service}.json"


def recorded_digests(home: Path) -> dict[str, set[str]]:
    """Every store object a deployment record of this home names, with why: `llmops serve` loads the champion and the
    candidate again from these at its next start, whether or not the registry still lists their versions. A record
    that cannot be read is an error (read_record): nothing may be collected on a guess."""
    live: dict[str, set[str]] = {}
    folder = home / "serving"
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        table = read_record(path) if not path.name.startswith(".") else None
        for role, version in (("champion", table.champion), ("candidate", table.candidate)) if table else ():
            if version is None:
                continue
            for stage, digest in dict(version.source.get("artifacts") or {}).items():
                live.setdefault(str(digest), set()).add(
                    f"deployment record {path.name}: {role} {version.name} ({stage})"
                )
    return live


def records_file(folder: Path, model: str) -> Path:
    """Where the gateway writes a shadow window's copies of `model` and the shadow stage reads them."""
    return folder / f"{model}.jsonl"


def read_record(path: Path) -> RouteTable | None:
    """The record at `path`; None where there is none. A record that cannot be read is an error naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        return RouteTable.of(json.loads(text))
    except (ValueError, TypeError) as exc:
        raise RoutesError(f"deployment record {path}: {exc}") from None


def write_record(path: Path, table: RouteTable) -> None:
    """The record, whole or not at all: written beside its place, flushed to disk, renamed over the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(table.as_json(), out, indent=1)
            out.flush()
            os.fsync(out.fileno())
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def amend_record(
    path: Path, table: RouteTable, change: Callable[[RouteTable], RouteTable | None]
) -> tuple[RouteTable, RouteTable | None]:
    """`table` with the owner (and the last epoch given) the record at `path` holds now, and what `change` makes of it
    (written to the record unless None), under a file lock: every gateway of a home shares the record, its owner and
    its epochs (an epoch one gateway gave is never given again by another)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        shared = read_record(path)
        if shared is not None and shared.service == table.service:
            current = replace(table, owner=shared.owner, last_epoch=max(table.last_epoch, shared.last_epoch))
        else:
            current = replace(table, owner=None)
        changed = change(current)
        if changed is not None:
            write_record(path, changed)
        return current, changed
