"""Shadow traffic: a copy of the service's requests goes to the candidate once each answer reached its client.

The release's shadow stage (tasks/shadow.py) loads the service's router with a `shadow` parameter, MODEL=FRACTION
(infra/triton/router/config.pbtxt). The gateway reads that parameter from Triton's model-configuration API every
`poll_s` and, while it is set, sends FRACTION of the answered requests again, with the same generate inputs, to
MODEL directly. Each copy leaves a record in `records/MODEL.jsonl` (the inputs, both answers, both latencies, or
the copy's error), which the stage scores, and counts on /metrics, labelled with MODEL (copies, errors, dropped,
both latencies) for dashboards.

A copy never delays nor changes a client's answer: it starts after the answer is complete, in a task of its own,
at most `max_in_flight` at a time (more are dropped, recorded and counted), and its failures are recorded, never
raised.

Why in the gateway and not in the router model: copies made inside Triton 2.51's Python backend, from the router's
worker threads, crashed its stub (std::length_error from custom-metric increments, numpy object-array refcount
aborts on BYTES tensors, a malloc fastbin abort). The gateway is the service's proxy, where Istio and nginx put
their mirrors. Requests sent to Triton directly, and streamed /v2 requests (relayed as bytes), are not copied.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter

from tasks.serving.client import CONTROL_HEADER
from tasks.serving.gateway.stops import cut_at_stop

LOG = logging.getLogger("llmops.gateway")
RECORDED_INPUTS = ("text_input", "chat_history", "max_tokens", "temperature", "random_seed")


@dataclass(frozen=True)
class ShadowTarget:
    model: str
    fraction: float


def parse_shadow(text: str) -> ShadowTarget | None:
    """The router's `shadow` parameter: empty (no copies) or MODEL=FRACTION; anything else is no copies."""
    model, _, fraction = text.strip().partition("=")
    try:
        share = float(fraction)
    except ValueError:
        return None
    return ShadowTarget(model.strip(), share) if model.strip() and 0 < share <= 1 else None


def records_file(folder: Path, model: str) -> Path:
    return folder / f"{model}.jsonl"


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
    """The copies of one gateway: the target read from the router, the copies in flight, their records."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        service: str,
        registry: CollectorRegistry,
        control_key: Callable[[], str | None],
        records: Path | None = None,
        max_in_flight: int = 16,
    ):
        self.client, self.service, self.control_key = client, service, control_key
        self.records, self.max_in_flight = records, max_in_flight
        self.metrics = ShadowMetrics(registry)
        self.target: ShadowTarget | None = None
        self.routes = ""  # the router's routes as last read (MODEL=WEIGHT,...): which versions answer, for capture
        self.in_flight: set[asyncio.Task] = set()
        self.random = random.Random()

    async def read_target(self) -> ShadowTarget | None:
        """The router's shadow parameter now; while Triton cannot say (it restarts), the last one known."""
        key = self.control_key()
        try:
            response = await self.client.get(
                f"/v2/models/{self.service}/config", headers={CONTROL_HEADER: key} if key else {}, timeout=5
            )
        except httpx.HTTPError:
            return self.target
        if response.status_code != 200:
            return None if response.status_code == 400 else self.target  # 400: the router is not loaded
        parameters = response.json().get("parameters", {})
        self.routes = parameters.get("routes", {}).get("string_value", self.routes)
        return parse_shadow(parameters.get("shadow", {}).get("string_value", ""))

    async def watch(self, poll_s: float) -> None:
        """Follow the router's shadow parameter until cancelled."""
        while True:
            target = await self.read_target()
            if target != self.target:
                if target is not None:
                    self.metrics.start(target.model)
                state = f"{target.fraction:.0%} of answered requests to {target.model}" if target else "off"
                LOG.info("shadow: %s", state)
                self.target = target
            await asyncio.sleep(poll_s)

    def copy(self, inputs: Mapping[str, Any], answer: str, stop: list[str], primary_s: float) -> None:
        """Maybe send `inputs` again to the shadowed model, after the client got `answer` in `primary_s`."""
        target = self.target
        if target is None or self.random.random() >= target.fraction:
            return
        if len(self.in_flight) >= self.max_in_flight:
            self.metrics.dropped.labels(target.model).inc()
            self.record(target.model, {"dropped": True})
            return
        task = asyncio.create_task(self.ask(target.model, dict(inputs), answer, stop, primary_s))
        self.in_flight.add(task)
        task.add_done_callback(self.in_flight.discard)

    def copy_answer(self, inputs: Mapping[str, Any], answer: httpx.Response, primary_s: float) -> None:
        """`copy` for a /v2 generate answer, relayed as Triton sent it."""
        if self.target is not None:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                self.copy(inputs, str(answer.json()["text_output"]), [], primary_s)

    async def ask(self, model: str, inputs: dict[str, Any], answer: str, stop: list[str], primary_s: float) -> None:
        started = time.perf_counter()
        text, error = None, None
        try:
            response = await self.client.post(f"/v2/models/{model}/generate", json={**inputs, "stream": False})
            if response.status_code == 200:
                text = cut_at_stop(str(response.json()["text_output"]), stop)[0]  # as the client's was cut
            else:
                error = f"HTTP {response.status_code}: {response.text[:200]}"
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:200]
        shadow_s = time.perf_counter() - started
        self.metrics.requests.labels(model).inc()
        if text is None:
            self.metrics.errors.labels(model).inc()
        else:
            self.metrics.primary_seconds.labels(model).inc(primary_s)
            self.metrics.shadow_seconds.labels(model).inc(shadow_s)
        self.record(
            model,
            {
                "inputs": {name: inputs[name] for name in RECORDED_INPUTS if name in inputs},
                "champion": answer,
                "candidate": text,
                "error": error,
                "champion_s": round(primary_s, 6),
                "candidate_s": round(shadow_s, 6),
            },
        )

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
