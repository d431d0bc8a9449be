"""The gateway's routes (Starlette): health probes, OpenAI's /v1 and Triton's /v2 generate API, each behind the API-key
check, the client's limits, the body cap and JSON only, errors in its API's shape; /metrics apart (metrics_app).
The service's name draws a version from the route table (tasks/control/contract.py; control.py changes it)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tasks.control.contract import RouteTable, Version, amend_record, read_record
from tasks.platform.config.serving import HealthSection
from tasks.runtime.gateway.access import (
    ERROR_LOG,
    GatewayMetrics,
    Guard,
    current,
    openai_error,
    read_body,
    reserve_tokens,
    shaped_error,
    triton_error,
)
from tasks.runtime.gateway.auth import KeyRing
from tasks.runtime.gateway.capture import OPT_OUT_HEADER, Capture, CaptureSettings
from tasks.runtime.gateway.limits import ClientLimits
from tasks.runtime.gateway.openai_fields import Engine
from tasks.runtime.gateway.probes import Prober, Recover
from tasks.runtime.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    FeedbackRequest,
    FeedbackResponse,
    GenerateRequest,
    RequestError,
    parse,
)
from tasks.runtime.gateway.replicas import Replicas
from tasks.runtime.gateway.reply import answered_by
from tasks.runtime.gateway.serving import OpenAIServing, bounded_max_tokens, conversation
from tasks.runtime.gateway.shadow import Shadow
from tasks.runtime.gateway.upstream import Answer, TritonUpstream
from tasks.runtime.gateway.work import Pools
from tasks.runtime.rollouts import RolloutController


@dataclass
class GatewayConfig:
    triton_url: str  # the (first) Triton replica
    service: str  # the name clients call; the route table says which version answers
    context_tokens: int  # the model's context (max_position_embeddings)
    default_max_tokens: int = 64
    max_body_bytes: int = 1 << 20
    api_keys: Mapping[str, str] | KeyRing = field(default_factory=dict)  # key -> client; empty: no key needed
    tokenizer_dir: Path | None = None
    apply_chat_template: bool = True  # as the served model does (serve.apply_chat_template)
    requests_per_second: float = 0  # per client (API key); 0: no limit (serve.limits)
    request_burst_s: float = 1.0  # seconds of that rate a client may send at once (serve.limits.burst_s)
    tokens_per_minute: int = 0  # per client; 0: no limit
    max_in_flight: int = 0  # requests being answered, all clients together; 0: no limit
    max_in_flight_per_key: int = 0  # requests being answered per client; 0: no limit
    shadow_records: Path | None = None  # where each copy's record goes (tasks/shadow.py scores them); None: nowhere
    record: Path | None = None  # the route table's deployment record (tasks/control/contract.py); None: in memory
    table: RouteTable | None = None  # the table to start with where no record holds one
    control_key: str | None = None  # the key of the control API (control.py); None: the gateway has none
    # serve.health: deadlines, probes (off unless given: probe_interval_s 0) and `recover` (probes.py)
    health: HealthSection = field(default_factory=lambda: HealthSection(probe_interval_s=0))
    recover: Recover | None = None  # what loads a Triton model again; None: no recovery
    # which of the table's versions the probes judge; None: all. A release's own service probes only what its release
    # loaded: the champion its fresh Triton has yet to load is not a fault to recover (tasks/runtime/standalone.py)
    probed: Callable[[Version], bool] | None = None
    more_replicas: list[str] = field(default_factory=list)  # the other Tritons' URLs: every version is on each
    capture: CaptureSettings | None = None  # serve.capture: exchanges and feedback kept; None: neither
    backend: Engine = "python"  # serve.backend: the engine whose fields /v1 honours (openai_fields.py)
    version_pinning: bool = False  # serve.version_pinning: a /v1 request may name a live version (GET /v1/models)


class Gateway:
    def __init__(self, config: GatewayConfig, transport: httpx.AsyncBaseTransport | None = None):
        self.config = config
        health = config.health
        self.metrics, self.pools = GatewayMetrics(), Pools()  # pools by kind: no answer waits behind a restart
        connect = functools.partial(TritonUpstream, transport=transport, first_byte_s=health.first_byte_s, between_chunks_s=health.between_chunks_s)  # fmt: skip
        tritons = [connect(url) for url in [config.triton_url, *config.more_replicas]]
        self.triton = Replicas(tritons, self.metrics.registry, health.probe_interval_s > 0, connect, config.service)
        self.prober = Prober(
            self.triton,
            self.metrics.registry,
            health,
            lambda: self.judged(self.table.versions()),
            lambda: self.judged(self.table.routed()),
            config.recover,
            self.pools,
        )
        self.shadow = Shadow(
            self.triton.generate,
            self.metrics.registry,
            config.shadow_records,
            redactor=config.capture.redactor if config.capture else None,
            pools=self.pools,
        )
        self.rollouts = RolloutController(lambda: self.table, self.amend, self.metrics, self.triton)
        self.random = random.Random()
        self.table = RouteTable(config.service)
        self.table_lock = asyncio.Lock()
        self.adopt(self.starting_table())
        self.capture = Capture(config.capture, self.metrics.registry, self.pools) if config.capture else None
        self.openai = OpenAIServing(
            self.triton,
            config.service,
            config.context_tokens,
            config.default_max_tokens,
            config.tokenizer_dir,
            config.apply_chat_template,
            self.shadow,
            self.capture,
            self.draw,
            self.metrics,
            lambda: self.table,
            config.backend,
            config.version_pinning,
            self.pools,
        )
        self.keys = config.api_keys if isinstance(config.api_keys, KeyRing) else KeyRing.fixed(config.api_keys)
        self.limits = ClientLimits(
            config.requests_per_second, config.tokens_per_minute, config.request_burst_s, config.max_in_flight_per_key
        )

    # --- the route table ------------------------------------------------------------------------------------

    def judged(self, versions: list[Version]) -> list[Version]:
        """The versions the probes judge (GatewayConfig.probed)."""
        probed = self.config.probed
        return versions if probed is None else [v for v in versions if probed(v)]

    def starting_table(self) -> RouteTable:
        """The record's table with the champion alone (a candidate, a copy and a release's hold belong to the gateway's
        earlier life, whose Triton may no longer hold the candidate); without a record, the configured table."""
        config = self.config
        recorded = read_record(config.record) if config.record is not None else None
        if recorded is None:
            return config.table or RouteTable(config.service)
        if recorded.service != config.service:
            raise ValueError(f"deployment record {config.record}: it is the record of {recorded.service}")
        if recorded.candidate is not None or recorded.shadow is not None:
            ERROR_LOG.warning(
                "routes: %s had a candidate when its gateway stopped; the champion serves alone", recorded.service
            )
            why = "the service started again during the rollout: its Tritons start with the champion alone"
            return recorded.champion_alone(why, time.time())
        return recorded

    def adopt(self, table: RouteTable) -> None:
        """Route by `table` from the next request on (its record written first, under the home's lock: amend_record)."""
        if self.config.record is not None:
            table, _ = amend_record(self.config.record, table, lambda current: current)
        self.table = table
        self.shadow.follow(table)
        for version in table.versions():
            self.metrics.start_version(version.name)

    async def change(self, table: RouteTable) -> None:
        """`adopt`, one change at a time, the record written off the event loop."""
        await self.amend(lambda _: table)

    async def amend(self, change: Callable[[RouteTable], RouteTable | None]) -> RouteTable:
        """The table `change` makes of the current one, adopted as `change` does, with no other change in between
        (a read, a check and a write as one); None from `change`: nothing changes. The table after.

        The service's owner is read from the record on disk first, under a file lock: every gateway of this
        LLMOPS_HOME (`llmops serve`'s, and the temporary ones of releases on their own Triton) shares the record,
        so a release that gave the service up through one gateway frees it for a release queued at another."""
        async with self.table_lock:
            if self.config.record is None:
                current, table = self.table, change(self.table)
            else:
                current, table = await self.pools.answer(amend_record, self.config.record, self.table, change)
            if table is None:
                self.table = current  # the owner as the record has it now
                return current
            self.table = table
            self.shadow.follow(table)
            for version in table.versions():
                self.metrics.start_version(version.name)
            return table

    def draw(self) -> Version:
        """The version that answers a request for the service's name."""
        version = self.table.draw(self.random)
        if version is None:
            raise RequestError(503, f"no version of {self.config.service} is served yet; retry shortly", retry_after=5)
        return version

    def version_named(self, name: str, pinned: bool) -> Version:
        """The version a /v2 request names: the service (drawn by weight), or where `pinned`, one version itself."""
        if name == self.config.service:
            return self.draw()
        version = self.table.version(name) if pinned else None
        if version is None:
            raise RequestError(404, f"model {name!r} is not served here; the service is {self.config.service!r}")
        return version

    def authorize(self, request: Request) -> str:
        """The client's name, noted for the access log and metrics, once its key and its rate allow it."""
        client = self.keys.authorize(request.headers.get("authorization"))
        current().client = client
        current().capture = request.headers.get(OPT_OUT_HEADER, "").strip().lower() != "off"
        current().hold = self.limits.admit(client)
        return client

    async def body(self, request: Request) -> bytes:
        return await read_body(request, self.config.max_body_bytes)

    async def live(self, request: Request) -> Response:
        return JSONResponse({"status": "live"})

    async def ready(self, request: Request) -> Response:
        """Ready while every routed version answers its probes (without probes: its model is ready on Triton)."""
        routed = self.table.routed()
        if self.prober.enabled:
            ready = await self.prober.ready()
        else:
            ready = bool(routed) and all(await asyncio.gather(*(self.triton.version_ready(v) for v in routed)))
        return JSONResponse({"status": "ready" if ready else "not ready"}, status_code=200 if ready else 503)

    async def prometheus(self, request: Request) -> Response:
        """The per-client counters, for Prometheus: no key needed, none shown (clients by name only)."""
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    def metrics_app(self) -> Starlette:
        """GET /metrics on a listener of its own (serve.listen.gateway_metrics_*, loopback by default): it names
        clients, so the clients' listener, open to whoever holds a key or to anyone without keys, does not serve it."""
        return Starlette(routes=[Route("/metrics", self.prometheus)])

    async def not_routed(self, request: Request, exc: Exception) -> Response:
        """Starlette's 404 (no such path) and 405 (wrong method), in the API's own shape."""
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        if status == 405:
            response = shaped_error(request.url.path, RequestError(405, f"method {request.method} is not allowed"))
            response.headers.update(getattr(exc, "headers", None) or {})  # Allow: the methods that are
            return response
        return shaped_error(request.url.path, RequestError(status, f"no route {request.url.path} here"))

    async def models(self, request: Request) -> Response:
        try:
            self.authorize(request)
        except RequestError as error:
            return openai_error(error)
        return JSONResponse(self.openai.models())

    async def chat_completions(self, request: Request) -> Response:
        return await self.openai_route(request, lambda body: self.openai.chat(parse(ChatCompletionRequest, body)))

    async def completions(self, request: Request) -> Response:
        return await self.openai_route(request, lambda body: self.openai.completion(parse(CompletionRequest, body)))

    async def openai_route(self, request: Request, answer: Callable[[bytes], Awaitable[Response]]) -> Response:
        try:
            self.authorize(request)
            return await answer(await self.body(request))
        except RequestError as error:
            return openai_error(error)

    async def feedback(self, request: Request) -> Response:
        """A client's rating of an answer it got, kept next to the captured exchanges (serve.capture)."""
        try:
            client = self.authorize(request)
            if self.capture is None:
                raise RequestError(404, "feedback is not collected by this service (serve.capture.enabled is false)")
            judged = parse(FeedbackRequest, await self.body(request))
            record = {"at": time.time(), "client": client, **judged.model_dump(exclude_none=True)}
            if not self.capture.feedback(record):
                raise RequestError(503, "feedback is not being kept right now; retry shortly", retry_after=5)
        except RequestError as error:
            return openai_error(error)
        return JSONResponse(FeedbackResponse(id=judged.id).model_dump())

    async def triton_generate(self, request: Request) -> Response:
        """Triton's own generate / generate_stream for the service name, with keys and limits."""
        try:
            self.authorize(request)
            return await self.generate_v2(request, pinned=False)
        except RequestError as error:
            return triton_error(error)

    async def generate_v2(self, request: Request, pinned: bool) -> Response:
        """A /v2 generate[_stream] request answered by its version (`pinned`: a version may be named itself)."""
        streaming = request.url.path.endswith("_stream")
        version = self.version_named(request.path_params["model"], pinned)
        generate = parse(GenerateRequest, await self.body(request))
        body = generate.model_dump(exclude_none=True)
        body["max_tokens"] = bounded_max_tokens(
            generate.max_tokens, "max_tokens", self.config.context_tokens, self.config.default_max_tokens
        )
        if generate.min_length is not None:
            bounded_max_tokens(generate.min_length, "min_length", body["max_tokens"], 0)
        reserve_tokens(body["max_tokens"])
        started = time.perf_counter()
        if not streaming:
            try:
                answer = await self.triton.forward(version, body)
            except RequestError as error:
                self.metrics.observe(version.name, error.status, time.perf_counter() - started)
                raise
            self.metrics.observe(version.name, 200, time.perf_counter() - started)
            current().tokens = body["max_tokens"]  # Triton counts none: the budget stands for them
            self.shadow.copy_answer(body, answer, time.perf_counter() - started)
            self.keep_generate(generate, answer, started)
            return Response(answer.content, answer.status_code, answered_by(version.name), answer.content_type)

        def ended(whole: bool) -> None:
            self.metrics.observe(version.name, 200 if whole else 502, time.perf_counter() - started, streamed=True)

        try:
            upstream, chunks = await self.triton.forward_stream(version, body, ended)
        except RequestError as error:
            self.metrics.observe(version.name, error.status, time.perf_counter() - started)
            raise
        self.metrics.first_token(version.name, time.perf_counter() - started)  # Triton's stream began
        current().tokens = body["max_tokens"]  # a stream passed through is not counted: its budget is charged
        media_type = upstream.headers.get("content-type", "text/event-stream")
        return StreamingResponse(chunks, upstream.status_code, answered_by(version.name), media_type)

    def keep_generate(self, generate: GenerateRequest, answer: Answer, started: float) -> None:
        """A /v2 generate exchange, for capture; its id is the request id the client got (X-Request-Id)."""
        request = current()
        if self.capture is None or not request.capture:
            if self.capture is not None:
                self.capture.opted_out()
            return
        with contextlib.suppress(ValueError, KeyError, TypeError):
            self.capture.exchange(
                {
                    "id": request.id,
                    "request_id": request.id,
                    "at": time.time(),
                    "client": request.client,
                    "api": "generate",
                    "routes": self.table.describe(),
                    "messages": conversation(generate),
                    "answer": str(answer.json()["text_output"]),
                    "latency_s": round(time.perf_counter() - started, 6),
                }
            )

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        controller = asyncio.create_task(self.rollouts.run())
        prober = asyncio.create_task(self.prober.run()) if self.prober.enabled else None
        writer = asyncio.create_task(self.capture.run()) if self.capture is not None else None
        yield
        controller.cancel()
        if prober is not None:
            prober.cancel()
        if writer is not None:  # what is buffered is written before the gateway ends
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
        await self.shadow.aclose()
        await self.triton.aclose()
        self.pools.close()

    def app(self) -> Starlette:
        routes = [  # the inference routes first: Starlette tries each route's pattern in turn
            Route("/v2/models/{model}/generate", self.triton_generate, methods=["POST"]),
            Route("/v2/models/{model}/generate_stream", self.triton_generate, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models),
            Route("/v1/feedback", self.feedback, methods=["POST"]),
            Route("/health/live", self.live),
            Route("/health/ready", self.ready),
        ]
        guard = Middleware(Guard, routes=routes, metrics=self.metrics, max_in_flight=self.config.max_in_flight)
        app = Starlette(
            routes=routes,
            middleware=[guard],
            exception_handlers={HTTPException: self.not_routed},
            lifespan=self.lifespan,
        )
        app.state.gateway = self  # where its /metrics listener (metrics_app) and tests find it
        return app
