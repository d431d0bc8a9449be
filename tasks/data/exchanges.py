"""Where captured exchanges and their feedback are kept: JSONL objects partitioned by kind, service and hour (UTC),
Hive-style, so Athena, Spark or DuckDB read them as a table as well:

    LOCATION/exchanges/service=NAME/date=2026-11-25/hour=03/WRITER-SEQ.jsonl
    LOCATION/feedback/service=NAME/date=2026-11-25/hour=03/WRITER-SEQ.jsonl

LOCATION is serve.capture.location, by default `capture/` in the artifact store (a folder, file:// or s3://). Each
object is written whole, once (a local one through a temporary file renamed in), so a reader never sees half of
one. Retention deletes whole hours.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlparse

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


class ExchangeLog:
    """The partitions of one capture location."""

    uri: str

    def put(self, key: str, text: str) -> None:
        raise NotImplementedError

    def keys(self, prefix: str) -> list[str]:
        raise NotImplementedError

    def get(self, key: str) -> str:
        raise NotImplementedError

    def delete(self, keys: list[str]) -> None:
        raise NotImplementedError

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


class LocalExchangeLog(ExchangeLog):
    def __init__(self, root: Path):
        self.root = root
        self.uri = root.as_uri()

    def put(self, key: str, text: str) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")  # mode 600: live prompts and answers
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temporary, path)

    def keys(self, prefix: str) -> list[str]:
        folder = self.root / prefix
        if not folder.is_dir():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in folder.rglob("*.jsonl") if p.is_file())

    def get(self, key: str) -> str:
        return (self.root / key).read_text(encoding="utf-8")

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            (self.root / key).unlink(missing_ok=True)
            folder = (self.root / key).parent  # the hour's folder, once empty
            if folder.is_dir() and not any(folder.iterdir()):
                shutil.rmtree(folder, ignore_errors=True)


class S3ExchangeLog(ExchangeLog):
    def __init__(self, uri: str):
        from tasks.platform.store import s3_client, split_s3_uri

        self.bucket, self.prefix = split_s3_uri(uri)
        self.uri = uri.rstrip("/")
        self.client = s3_client()

    def _key(self, key: str) -> str:
        return f"{self.prefix.rstrip('/')}/{key}" if self.prefix else key

    def put(self, key: str, text: str) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=text.encode())

    def keys(self, prefix: str) -> list[str]:
        full = self._key(prefix)
        found = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
            found += [o["Key"][len(full) - len(prefix) :] for o in page.get("Contents", [])]
        return sorted(found)

    def get(self, key: str) -> str:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read().decode()

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):  # S3's DeleteObjects takes 1000 keys at most
            batch = [{"Key": self._key(k)} for k in keys[start : start + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})


def open_exchange_log(location: str) -> ExchangeLog:
    """The capture location: s3://bucket/prefix, file:// or a folder."""
    if location.startswith("s3://"):
        return S3ExchangeLog(location)
    if "://" in location and not location.startswith("file://"):
        raise BadInput(f"capture location {location}: expected a folder, file:// or s3:// URI")
    return LocalExchangeLog(Path(urlparse(location).path if location.startswith("file://") else location))


def default_location(store_uri: str) -> str:
    """serve.capture.location's default: capture/ in the artifact store."""
    return f"{store_uri.rstrip('/')}/capture"
