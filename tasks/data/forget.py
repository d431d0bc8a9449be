"""What users' data the flywheel keeps goes when it must: a client's deletion request reaches its captured
exchanges, its feedback and every harvested record made of them; harvested records past serve.capture's retention
go like the captured hours they came from.

Harvested datasets are found through the lineage already recorded: the datasets the flywheel pushed (its MLflow
runs' `harvest.dataset` tags) and the ones waiting for review (their pending records in $LLMOPS_HOME/approvals).
Each harvested record names its client and time (tasks/data/harvest.py); curated records are never touched, and a
file is rewritten whole (or deleted once nothing is left), so a reader sees the old file or the new one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from tasks.data.exchanges import KINDS, ExchangeLog
from tasks.data.objects import Location, local_root, open_location
from tasks.data.records import HARVESTED


@dataclass
class Forgotten:
    exchanges: int = 0
    feedback: int = 0
    harvested: int = 0
    datasets: list[str] = field(default_factory=list)  # the harvested datasets rewritten or deleted

    def describe(self, who: str) -> str:
        return (
            f"{who}: {self.exchanges} captured exchanges, {self.feedback} feedback records and {self.harvested} "
            f"harvested records removed ({len(self.datasets)} datasets rewritten{': ' if self.datasets else ''}"
            f"{', '.join(self.datasets)})"
        )


def rewrite(location: Location, key: str, drop: Callable[[dict], bool]) -> int:
    """Rewrite one JSONL object without the records `drop` picks; how many went (0: the object is untouched)."""
    lines = location.get(key).splitlines()
    kept = [line for line in lines if not (line.strip() and drop(json.loads(line)))]
    gone = sum(1 for line in lines if line.strip()) - sum(1 for line in kept if line.strip())
    if gone and any(line.strip() for line in kept):
        location.put(key, "".join(line + "\n" for line in kept))
    elif gone:
        location.delete([key])
    return gone


def forget_captured(log: ExchangeLog, service: str, client: str, found: Forgotten) -> None:
    for kind in KINDS:
        for stored in log.objects(kind, service):
            gone = rewrite(log, stored.key, lambda r: r.get("client") == client)
            if kind == "exchanges":
                found.exchanges += gone
            else:
                found.feedback += gone


def split_uri(uri: str) -> tuple[str, str]:
    """(the location holding it, its key) of a dataset's URI: s3://bucket/prefix/name, file:// or a path."""
    if uri.startswith("s3://"):
        parent, _, name = uri.rpartition("/")
        return parent, name
    path = local_root(uri)
    return str(path.parent), path.name


def rewrite_harvested(dataset_uri: str, drop: Callable[[dict], bool], found: Forgotten) -> None:
    """One harvested dataset without the harvested records `drop` picks (their `harvested` origin)."""
    parent, key = split_uri(dataset_uri)
    location = open_location(parent)
    if key not in location.keys(""):
        return  # already gone (rejected, expired, or removed by hand)
    gone = rewrite(location, key, lambda r: HARVESTED in r and drop(r[HARVESTED]))
    if gone:
        found.harvested += gone
        found.datasets.append(dataset_uri)


def forget_client(
    log: ExchangeLog | None, service: str, client: str, datasets: list[str], found: Forgotten | None = None
) -> Forgotten:
    """A deletion request: `client`'s captured exchanges and feedback of `service`, and its records in `datasets`."""
    found = found or Forgotten()
    if log is not None:
        forget_captured(log, service, client, found)
    for uri in dict.fromkeys(datasets):
        rewrite_harvested(uri, lambda origin: origin.get("client") == client, found)
    return found


def expire_harvested(datasets: list[str], retention: timedelta, now: datetime) -> Forgotten:
    """Harvested records whose exchange is older than `retention` leave `datasets` (records without a time, made
    before harvests recorded one, stay)."""
    found, limit = Forgotten(), (now - retention).timestamp()
    for uri in dict.fromkeys(datasets):
        rewrite_harvested(uri, lambda origin: float(origin.get("at", limit)) < limit, found)
    return found


def harvested_in(location: str) -> list[str]:
    """The harvested datasets (harvest-*.jsonl) directly in a location, as URIs (paths for a folder)."""
    place = open_location(location)
    names = [k for k in place.keys("") if "/" not in k and k.startswith("harvest-") and k.endswith(".jsonl")]
    if location.startswith("s3://"):
        return [place.uri_of(name) for name in names]
    return [str(local_root(location) / name) for name in names]
