"""Capture: the exchanges the gateway serves, and the feedback clients give on them, kept for the next release's
data (serve.capture; `llmops data harvest` reads them).

On a request's path a record is only sampled and appended to a bounded buffer: no I/O, no redaction. Every
`flush_s` a task of its own takes what the buffer holds, redacts it (tasks/data/redact.py) and writes it, in a
worker thread, to the hour's partition (tasks/data/exchanges.py). A store that is down or slow costs records,
never a request: past `max_pending` records are dropped, and a failed write drops its batch; both are counted
(llmops_capture_dropped_total, with the reason) and logged, and nothing is retried without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from tasks.data.exchanges import ExchangeLog, hour_of
from tasks.data.redact import Redactor
from tasks.runtime.gateway.work import Pools

LOG = logging.getLogger("llmops.gateway")
OPT_OUT_HEADER = "x-llmops-capture"  # "off": this request is not kept
REDACTED_FIELDS = ("messages", "answer", "correction", "comment")


@dataclass
class CaptureSettings:
    log: ExchangeLog
    service: str
    sample_rate: float = 1.0
    redactor: Redactor = field(default_factory=Redactor)
    retention: timedelta = timedelta(days=30)
    flush_s: float = 2.0
    max_pending: int = 10_000


class CaptureMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.kept = Counter(
            "llmops_capture_records", "Records written to the capture location.", ["kind"], registry=registry
        )
        self.dropped = Counter(
            "llmops_capture_dropped",
            "Records not written: the buffer was full, or the store refused the write.",
            ["kind", "reason"],
            registry=registry,
        )
        self.redacted = Counter("llmops_capture_redacted", "Values replaced by redaction.", registry=registry)
        self.opted_out = Counter(
            "llmops_capture_opted_out", "Requests the client asked not to keep.", registry=registry
        )
        for kind in ("exchanges", "feedback"):
            self.kept.labels(kind)
            for reason in ("buffer_full", "store_error"):
                self.dropped.labels(kind, reason)


class Capture:
    """The buffer, the writer task and the counters of one gateway."""

    def __init__(self, settings: CaptureSettings, registry: CollectorRegistry, pools: Pools | None = None):
        self.settings = settings
        self.pools = pools or Pools()
        self.metrics = CaptureMetrics(registry)
        self.pending: deque[tuple[str, dict[str, Any]]] = deque()
        self.random = random.Random()
        self.writer = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # object names unique across gateway processes
        self.sequence = 0
        self.expired_at = 0.0

    def keep(self, kind: str, record: dict[str, Any]) -> bool:
        """Buffer one record (request path: no I/O). False where it was dropped (buffer full)."""
        if len(self.pending) >= self.settings.max_pending:
            self.metrics.dropped.labels(kind, "buffer_full").inc()
            return False
        self.pending.append((kind, record))
        return True

    def exchange(self, record: dict[str, Any]) -> None:
        if self.random.random() < self.settings.sample_rate:
            self.keep("exchanges", record)

    def feedback(self, record: dict[str, Any]) -> bool:
        return self.keep("feedback", record)

    def opted_out(self) -> None:
        self.metrics.opted_out.inc()

    def redact(self, record: dict[str, Any]) -> dict[str, Any]:
        redactor, clean = self.settings.redactor, dict(record)
        for name in REDACTED_FIELDS:
            value = clean.get(name)
            if isinstance(value, str):
                clean[name], count = redactor.redact(value)
                self.metrics.redacted.inc(count)
            elif isinstance(value, list):  # messages
                turns = []
                for turn in value:
                    content, count = redactor.redact(str(turn.get("content", "")))
                    self.metrics.redacted.inc(count)
                    turns.append({**turn, "content": content})
                clean[name] = turns
        return clean

    def write(self, batch: list[tuple[str, dict[str, Any]]]) -> None:
        """Redact and write one batch, one object per kind and hour (in a worker thread)."""
        groups: dict[tuple[str, datetime], list[dict[str, Any]]] = {}
        for kind, record in batch:
            groups.setdefault((kind, hour_of(record["at"])), []).append(self.redact(record))
        for (kind, hour), records in groups.items():
            self.sequence += 1
            try:
                self.settings.log.write(
                    kind, self.settings.service, hour, f"{self.writer}-{self.sequence:06d}", records
                )
            except Exception as exc:  # any store fault (boto3, OS): the batch is lost, the gateway serves on
                self.metrics.dropped.labels(kind, "store_error").inc(len(records))
                LOG.warning("capture: %d %s records dropped: %s: %s", len(records), kind, type(exc).__name__, exc)
                continue
            self.metrics.kept.labels(kind).inc(len(records))

    def expire(self) -> None:
        """Delete partitions past retention, at most once an hour."""
        if time.time() - self.expired_at < 3600:
            return
        self.expired_at = time.time()
        try:
            gone = self.settings.log.expire(self.settings.service, self.settings.retention, datetime.now(UTC))
        except Exception as exc:
            LOG.warning("capture: retention not applied: %s: %s", type(exc).__name__, exc)
            return
        if gone:
            LOG.info("capture: %d objects past retention (%s) deleted", gone, self.settings.retention)

    async def flush(self) -> None:
        batch = [self.pending.popleft() for _ in range(len(self.pending))]
        if batch:
            await self.pools.captured(self.write, batch)

    async def run(self) -> None:
        """Write what is buffered every flush_s, until cancelled (then once more)."""
        try:
            while True:
                await self.pools.captured(self.expire)
                await asyncio.sleep(self.settings.flush_s)
                await self.flush()
        finally:
            with contextlib.suppress(Exception):
                await self.flush()

    def dropped_total(self) -> int:
        return int(sum(s.value for m in self.metrics.dropped.collect() for s in m.samples if s.name.endswith("_total")))
