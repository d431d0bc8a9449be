"""Shadow traffic: a copy of the service's requests goes to the candidate once each answer reached its client.

The release's shadow stage (tasks/shadow.py) sets the route table's shadow (a version and a fraction) through the
control API of `llmops serve` (tasks/runtime/gateway/control.py); from the next answered request on, the gateway
sends FRACTION of them again, with the same generate inputs, to that version. Each copy leaves a record in
`records/VERSION.jsonl` (the inputs, both answers, both latencies, or the copy's error), which the stage scores, and
counts on /metrics, labelled with the version (copies, errors, dropped, both latencies) for dashboards.

A copy never delays nor changes a client's answer: it starts after the answer is complete, in a task of its own,
at most `max_in_flight` at a time (more are dropped, recorded and counted), and its failures are recorded, never
raised. A request whose client opted out of capture (`X-LLMOps-Capture: off`) is not copied, and a record's prompt,
history and both answers are redacted (tasks/data/redact.py, the capture's rules) before they reach the disk; the
stage deletes the records once it scored them.

Why in the gateway and not in Triton: copies made inside Triton 2.51's Python backend (from the BLS router model
this project once had) crashed its stub (std::length_error from custom-metric increments, numpy object-array
refcount aborts on BYTES tensors, a malloc fastbin abort). The gateway is the service's proxy, where Istio and nginx
put their mirrors. Requests sent to Triton directly, and streamed /v2 requests (relayed as bytes), are not copied.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from tasks.control.contract import RouteTable, Version, records_file
from tasks.data.redact import Redactor
from tasks.runtime.gateway.access import current
from tasks.runtime.gateway.protocol import RequestError
from tasks.runtime.gateway.stops import cut_at_stop
from tasks.runtime.gateway.upstream import Answer
from tasks.runtime.gateway.work import Pools

LOG = logging.getLogger("llmops.gateway")
RECORDED_INPUTS = ("text_input", "chat_history", "max_tokens", "temperature", "random_seed")


class ShadowMetrics:
    def __init__(self, registry: CollectorRegistry):
        def counter(name: str, text: str) -> Counter:
            return Counter(f"llmops_shadow_{name}", text, ["model"], registry=registry)

        self.requests = counter("requests", "Copies of answered requests sent to the shadowed model, finished.")
        self.errors = counter("errors", "Copies the shadowed model failed (error status, no answer).")
        self.dropped = counter("dropped", "Copies not sent: too many already in flight.")
        self.primary_seconds = counter("primary_seconds", "Latency of the clients' answers of the answered copies.")
        self.shadow_seconds = counter("shadow_seconds", "Latency of the shadowed model's answers to the copies.")

    def start(self, model: str) -> None:
        """Every counter of `model` at 0 (a series Prometheus sees from its start, not from its first increment)."""
        for counter in (self.requests, self.errors, self.dropped, self.primary_seconds, self.shadow_seconds):
            counter.labels(model)


class Shadow:
    """The copies of one gateway: the version they go to (the route table's shadow), the copies in flight, their
    records."""

    def __init__(
        self,
        generate: Callable[[Version, dict[str, Any]], Awaitable[str]],
        registry: CollectorRegistry,
        records: Path | None = None,
        max_in_flight: int = 16,
        redactor: Redactor | None = None,
        pools: Pools | None = None,
    ):
        self.generate, self.records, self.max_in_flight = generate, records, max_in_flight
        self.pools = pools or Pools()
        self.redactor = redactor or Redactor()
        self.metrics = ShadowMetrics(registry)
        self.target: tuple[Version, float] | None = None
        self.in_flight: set[asyncio.Task] = set()
        self.random = random.Random()

    def follow(self, table: RouteTable) -> None:
        """Copy as `table` says from the next answered request on."""
        version = table.shadow_version()
        target = (version, table.shadow_fraction) if version is not None else None
        if target != self.target:
            if target is not None:
                self.metrics.start(target[0].name)
            LOG.info("shadow: %s", f"{target[1]:.0%} of answered requests to {target[0].name}" if target else "off")
            self.target = target

    def copy(self, inputs: Mapping[str, Any], answer: str, stop: list[str], primary_s: float) -> None:
        """Maybe send `inputs` again to the shadowed model, after the client got `answer` in `primary_s`."""
        target = self.target
        if target is None or not current().capture or self.random.random() >= target[1]:
            return
        version = target[0]
        if len(self.in_flight) >= self.max_in_flight:
            self.metrics.dropped.labels(version.name).inc()
            self.record(version.name, {"dropped": True})
            return
        task = asyncio.create_task(self.ask(version, dict(inputs), answer, stop, primary_s, current().id))
        self.in_flight.add(task)
        task.add_done_callback(self.in_flight.discard)

    def copy_answer(self, inputs: Mapping[str, Any], answer: Answer, primary_s: float) -> None:
        """`copy` for a /v2 generate answer, relayed as Triton sent it."""
        if self.target is not None:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                self.copy(inputs, str(answer.json()["text_output"]), [], primary_s)

    async def ask(
        self, version: Version, inputs: dict[str, Any], answer: str, stop: list[str], primary_s: float, request_id: str
    ) -> None:
        started = time.perf_counter()
        text, error, model = None, None, version.name
        try:
            copied = await self.generate(version, {**inputs, "stream": False})
            text = cut_at_stop(copied, stop)[0]  # as the client's was cut
        except RequestError as exc:
            error = f"HTTP {exc.status}: {exc.message}"[:200]
        shadow_s = time.perf_counter() - started
        fields = {
            "request_id": request_id,  # the client's X-Request-Id: its captured exchange, where capture keeps it
            "inputs": {name: inputs[name] for name in RECORDED_INPUTS if name in inputs},
            "champion": answer,
            "candidate": text,
            "error": error,
            "champion_s": round(primary_s, 6),
            "candidate_s": round(shadow_s, 6),
        }
        self.record(model, await self.pools.answer(self.redacted, fields))  # the rule set scans: off the event loop
        self.metrics.requests.labels(model).inc()  # counted once recorded: a count is a record to read
        if text is None:
            self.metrics.errors.labels(model).inc()
        else:
            self.metrics.primary_seconds.labels(model).inc(primary_s)
            self.metrics.shadow_seconds.labels(model).inc(shadow_s)

    def redacted(self, fields: dict[str, Any]) -> dict[str, Any]:
        """A record's live text (prompt, history, both answers) through the capture's redaction rules. Both answers
        go through the same rules, so a secret both repeat stays equal in both and agreement is scored alike."""
        clean = dict(fields)
        inputs = dict(clean["inputs"])
        for name in ("text_input", "chat_history"):
            if isinstance(inputs.get(name), str):
                inputs[name] = self.redactor.redact(inputs[name])[0]
        clean["inputs"] = inputs
        for name in ("champion", "candidate"):
            if isinstance(clean.get(name), str):
                clean[name] = self.redactor.redact(clean[name])[0]
        return clean

    def record(self, model: str, fields: dict[str, Any]) -> None:
        """One line in the model's records file (mode 600: live prompts and answers). A line is a few hundred
        bytes written with O_APPEND, so lines of concurrent copies never interleave."""
        if self.records is None:
            return
        line = json.dumps({"at": time.time(), **fields}, ensure_ascii=False) + "\n"
        try:
            self.records.mkdir(parents=True, exist_ok=True)
            fd = os.open(records_file(self.records, model), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "a", encoding="utf-8") as out:
                out.write(line)
        except OSError as exc:
            LOG.warning("shadow: record for %s not written: %s", model, exc)

    async def aclose(self) -> None:
        for task in list(self.in_flight):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self.in_flight, return_exceptions=True)
