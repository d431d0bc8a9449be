"""Where captured exchanges and their feedback are kept: JSONL objects partitioned by kind, service and hour (UTC),
Hive-style, so Athena, Spark or DuckDB read them as a table as well:

    LOCATION/exchanges/service=NAME/date=2026-11-25/hour=03/WRITER-SEQ.jsonl
    LOCATION/feedback/service=NAME/date=2026-11-25/hour=03/WRITER-SEQ.jsonl

LOCATION is serve.capture.location, by default `capture/` in the artifact store (a folder, file:// or s3://;
tasks/data/objects.py: each object written whole, once). Retention deletes whole hours.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from tasks.data.objects import LocalLocation, Location, S3Location, local_root
from tasks.platform.errors import BadInput

KINDS = ("exchanges", "feedback")


def hour_of(at: float) -> datetime:
    return datetime.fromtimestamp(at, UTC).replace(minute=0, second=0, microsecond=0)


def partition(kind: str, service: str, hour: datetime) -> str:
    return f"{kind}/service={service}/date={hour:%Y-%m-%d}/hour={hour:%H}"


def parse_hour(key: str) -> datetime | None:
    """The hour of a partition key (…/date=YYYY-MM-DD/hour=HH/…), None for a key of another shape."""
    parts = dict(p.split("=", 1) for p in key.split("/") if p.startswith(("date=", "hour=")))
    try:
        return datetime.strptime(f"{parts['date']} {parts['hour']}", "%Y-%m-%d %H").replace(tzinfo=UTC)
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True)
class StoredObject:
    key: str  # relative to the location
    hour: datetime


class ExchangeLog(Location):
    """The partitions of one capture location."""

    def write(self, kind: str, service: str, hour: datetime, name: str, records: list[dict]) -> str:
        key = f"{partition(kind, service, hour)}/{name}.jsonl"
        self.put(key, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        return key

    def objects(self, kind: str, service: str, since: datetime | None = None) -> list[StoredObject]:
        """The objects of a kind and service, oldest hour first, from `since`'s hour on."""
        found = []
        for key in self.keys(f"{kind}/service={service}/"):
            hour = parse_hour(key)
            if hour is not None and key.endswith(".jsonl") and (since is None or hour >= hour_of(since.timestamp())):
                found.append(StoredObject(key, hour))
        return sorted(found, key=lambda o: (o.hour, o.key))

    def records(self, objects: list[StoredObject]) -> Iterator[tuple[str, dict]]:
        for stored in objects:
            for number, line in enumerate(self.get(stored.key).splitlines(), 1):
                if line.strip():
                    try:
                        yield stored.key, json.loads(line)
                    except ValueError as exc:
                        raise BadInput(f"{self.uri}/{stored.key}:{number}: not JSON ({exc})") from None

    def expire(self, service: str, retention: timedelta, now: datetime) -> int:
        """Delete the service's partitions older than `retention`; how many objects went."""
        old = [
            o.key
            for kind in KINDS
            for o in self.objects(kind, service)
            if o.hour + timedelta(hours=1) <= now - retention
        ]
        if old:
            self.delete(old)
        return len(old)


class LocalExchangeLog(ExchangeLog, LocalLocation):
    """A capture location in a folder."""


class S3ExchangeLog(ExchangeLog, S3Location):
    """A capture location under an s3:// prefix."""


def open_exchange_log(location: str) -> ExchangeLog:
    """The capture location: s3://bucket/prefix, file:// or a folder."""
    if location.startswith("s3://"):
        return S3ExchangeLog(location)
    return LocalExchangeLog(local_root(location))


def default_location(store_uri: str) -> str:
    """serve.capture.location's default: capture/ in the artifact store."""
    return f"{store_uri.rstrip('/')}/capture"
