"""What every request to the gateway passes through and leaves behind: a request id, the cap on requests in
flight overall (503), errors in the caller's API's shape whatever failed (a 500 says only its request id; the
traceback goes to the log), one structured access-log line (client, route, status, tokens, latency; never the
prompt nor the key) and the per-client Prometheus counters of /metrics.

The route handlers fill in the RequestRecord of the request (the client authorize() named, the tokens the
answer used); a contextvar carries it, as a streamed answer ends in a task of its own.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import secrets
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tasks.runtime.gateway.limits import Hold
from tasks.runtime.gateway.protocol import ErrorResponse, RequestError

ACCESS_LOG = logging.getLogger("llmops.gateway.access")
ERROR_LOG = logging.getLogger("llmops.gateway")
GUARDED = ("/v1/", "/v2/")  # the API routes: probes and /metrics are neither capped nor counted per client
QUIET = ("/health/", "/metrics")  # polled every few seconds by probes and Prometheus: no access-log line
OUTCOMES = ("ok", "refused", "failed")  # of a request a version answered (llmops_gateway_version_requests_total)


@dataclass
class RequestRecord:
    id: str = field(default_factory=lambda: secrets.token_hex(8))  # 16 hex digits
    client: str = "-"  # the name authorize() gave; "-" before (or without) a key check
    tokens: int = 0  # what the answer used: prompt + completion where counted, else its budget; set once it is done
    produced: int = 0  # pieces of a streamed answer sent so far: what an abandoned or failed stream is charged
    hold: Hold | None = None  # the client's place in flight and reserved tokens (limits.py), once admitted
    capture: bool = True  # false: the client asked that this exchange is not kept (X-LLMOps-Capture: off)


CURRENT = contextvars.ContextVar[RequestRecord]("gateway_request")
PROBE_CLIENT = "probe"  # the client of the gateway's own synthetic requests (probes.py)


def current() -> RequestRecord:
    """The record of the request being answered (a fresh one outside a request: unit tests of parts)."""
    try:
        return CURRENT.get()
    except LookupError:
        return RequestRecord()


def reserve_tokens(tokens: int) -> None:
    """Reserve the answer's `tokens` (its max_tokens) from the client's budget before it is generated (429 where
    the budget lacks them); settled against what it used when the request ends."""
    hold = current().hold
    if hold is not None:
        hold.reserve(tokens)


def openai_error(error: RequestError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else {}
    if error.retry_after is not None:
        headers["Retry-After"] = str(error.retry_after)
    return JSONResponse(ErrorResponse.of(error).model_dump(), status_code=error.status, headers=headers)


def triton_error(error: RequestError) -> JSONResponse:
    """Triton's own error shape, {"error": "..."}, for the /v2 routes."""
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
    return JSONResponse({"error": error.message}, status_code=error.status, headers=headers)


def shaped_error(path: str, error: RequestError) -> JSONResponse:
    """The error in the shape of the API `path` belongs to: Triton's on /v2, OpenAI's elsewhere."""
    return triton_error(error) if path.startswith("/v2/") else openai_error(error)


class GatewayMetrics:
    """Per-client counters in a registry of their own (one gateway, one registry: tests stay apart)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "llmops_gateway_requests",
            "Requests answered by the gateway, by client (API key name), route and HTTP status.",
            ["client", "route", "status"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "llmops_gateway_tokens",
            "Tokens of the answered requests by client (prompt + completion where counted, else the budget).",
            ["client"],
            registry=self.registry,
        )
        self.version_requests = Counter(
            "llmops_gateway_version_requests",
            "Requests the gateway sent to each served version, by outcome: ok (answered), refused (the model refused "
            "the request, 4xx) or failed (the model server failed, broke off or did not answer in time).",
            ["version", "outcome"],
            registry=self.registry,
        )
        self.version_seconds = Counter(
            "llmops_gateway_version_seconds",
            "Seconds from sending to the last byte of each version's answered requests.",
            ["version"],
            registry=self.registry,
        )
        self.first_tokens = Histogram(
            "llmops_gateway_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token (a whole answer's: to the answer), by version.",
            ["version"],
            # fine where TTFT objectives sit (tens to hundreds of ms): a quantile is interpolated within its bucket
            buckets=(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=self.registry,
        )
        # the same times, the newest last, for serve.autoscale's ttft_p90 signal (tasks/runtime/autoscale.py)
        self.recent_first_tokens: deque[tuple[float, float]] = deque(maxlen=20_000)
        self.leases_expired = Counter(
            "llmops_gateway_leases_expired",
            "Releases whose hold on the routes lapsed (the champion then served alone).",
            registry=self.registry,
        )

    def start_version(self, version: str) -> None:
        """Every counter of `version` at 0 (a series Prometheus sees from its start, not from its first increment)."""
        for outcome in OUTCOMES:
            self.version_requests.labels(version, outcome)
        self.version_seconds.labels(version)

    def observe(self, version: str, status: int, seconds: float, streamed: bool = False) -> None:
        """One request of `version` ended with `status` (what the gateway answered, or would have) after `seconds`;
        a whole answer's first token is the answer (a stream's is said by first_token)."""
        outcome = "ok" if status == 200 else "refused" if 400 <= status < 500 else "failed"
        self.version_requests.labels(version, outcome).inc()
        if outcome == "ok":
            self.version_seconds.labels(version).inc(seconds)
            if not streamed:
                self.first_token(version, seconds)

    def first_token(self, version: str, seconds: float) -> None:
        self.first_tokens.labels(version).observe(seconds)
        self.recent_first_tokens.append((time.monotonic(), seconds))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Guard:
    """The ASGI middleware around the routes (inside Starlette's own error middleware, which it pre-empts)."""

    def __init__(
        self,
        app: ASGIApp,
        routes: Sequence[BaseRoute],
        metrics: GatewayMetrics,
        max_in_flight: int,
    ):
        self.app, self.routes, self.metrics = app, routes, metrics
        self.max_in_flight, self.in_flight = max_in_flight, 0
        # a path's route, matched once: matching every route's pattern on every request was a few % of the
        # gateway's CPU; bounded, as clients choose the paths
        self.route = functools.lru_cache(maxsize=1024)(self.match_route)

    def match_route(self, path: str) -> str:
        """The template of the route `path` goes to (bounded label values: never the raw path)."""
        scope = {"type": "http", "path": path, "root_path": "", "method": "GET"}
        for route in self.routes:
            if route.matches(scope)[0] != Match.NONE:
                return str(getattr(route, "path", "other"))
        return "unmatched"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record, path, started = RequestRecord(), scope["path"], time.perf_counter()
        guarded = path.startswith(GUARDED)
        token = CURRENT.set(record)
        status = 0

        async def noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if guarded:  # the id a client quotes: in feedback on a /v2 answer, or asking about a failure
                    message["headers"] = [*message.get("headers", []), (b"x-request-id", record.id.encode())]
            await send(message)

        try:
            if guarded and self.max_in_flight and self.in_flight >= self.max_in_flight:
                busy = RequestError(
                    503,
                    f"the service is at its limit of requests in flight: serve.limits.max_in_flight = "
                    f"{self.max_in_flight} for all keys together; retry after 1 s",
                    retry_after=1,
                )
                return await shaped_error(path, busy)(scope, receive, noting_status)
            self.in_flight += guarded
            try:
                await self.app(scope, receive, noting_status)
            finally:
                self.in_flight -= guarded
        except Exception:
            ERROR_LOG.exception("request %s %s %s failed", record.id, scope["method"], path)
            if not status:  # else the answer was on its way: the connection just ends
                failed = RequestError(500, f"internal error; request id {record.id}", code="internal_error")
                await shaped_error(path, failed)(scope, receive, noting_status)
        finally:
            CURRENT.reset(token)
            self.account(scope, record, status or 500, started)

    def account(self, scope: Scope, record: RequestRecord, status: int, started: float) -> None:
        route = self.route(scope["path"])
        if record.hold is not None:
            record.hold.release(record.tokens or record.produced)
        if record.client != "-":
            self.metrics.tokens.labels(record.client).inc(record.tokens or record.produced)
        self.metrics.requests.labels(record.client, route, str(status)).inc()
        if str(scope["path"]).startswith(QUIET) or not ACCESS_LOG.isEnabledFor(logging.INFO):
            return
        line = {
            "request_id": record.id,
            "client": record.client,
            "method": scope["method"],
            "route": route,
            "status": status,
            "tokens": record.tokens,
            "latency_ms": round((time.perf_counter() - started) * 1000, 1),
        }
        ACCESS_LOG.info(orjson.dumps(line).decode())


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's JSON body, refused before it is read whole where it is not JSON or over the cap.

    A declared length over the cap is refused at once; a chunked body (no length) is counted as it comes."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise RequestError(415, "Content-Type must be application/json")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise RequestError(413, f"request body of {declared} bytes is over the limit of {max_bytes}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise RequestError(413, f"request body is over the limit of {max_bytes} bytes")
    return bytes(body)
