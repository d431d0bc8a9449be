"""The gateway's routes (Starlette): health probes, /metrics, OpenAI's /v1 and Triton's /v2 generate API, each
behind the API-key check, the client's rate limits, the body cap and JSON only, and each answering errors
(unknown paths and wrong methods too) in its own API's shape."""

from __future__ import annotations

import asyncio
import contextlib
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

from tasks.serving.gateway.access import GatewayMetrics, Guard, current, openai_error, shaped_error, triton_error
from tasks.serving.gateway.auth import KeyRing, authorize
from tasks.serving.gateway.capture import OPT_OUT_HEADER, Capture, CaptureSettings
from tasks.serving.gateway.limits import ClientLimits
from tasks.serving.gateway.openai_fields import Engine
from tasks.serving.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    FeedbackRequest,
    FeedbackResponse,
    GenerateRequest,
    RequestError,
    parse,
)
from tasks.serving.gateway.serving import OpenAIServing, bounded_max_tokens, conversation
from tasks.serving.gateway.shadow import Shadow
from tasks.serving.gateway.upstream import Triton, upstream_error


@dataclass
class GatewayConfig:
    triton_url: str
    service: str  # the router model: the name clients call
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
    # Shadow copies (tasks/serving/gateway/shadow.py): how often the router's `shadow` parameter is read (0: never,
    # no copies), with Triton's control key as it is now (it changes when Triton restarts).
    shadow_poll_s: float = 0
    control_key: Callable[[], str | None] = lambda: None
    shadow_records: Path | None = None  # where each copy's record goes (tasks/shadow.py scores them); None: nowhere
    capture: CaptureSettings | None = None  # serve.capture: exchanges and feedback kept; None: neither
    backend: Engine = "python"  # serve.backend: the engine whose fields /v1 honours (openai_fields.py)
    version_pinning: bool = False  # serve.version_pinning: a /v1 request may name a live version (GET /v1/models)


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


class Gateway:
    def __init__(self, config: GatewayConfig, transport: httpx.AsyncBaseTransport | None = None):
        self.config = config
        self.triton = Triton(config.triton_url, config.service, transport)
        self.metrics = GatewayMetrics()
        self.shadow = Shadow(
            self.triton.client, config.service, self.metrics.registry, config.control_key, config.shadow_records
        )
        self.capture = Capture(config.capture, self.metrics.registry) if config.capture else None
        tokenizer = None
        if config.tokenizer_dir is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_dir)
        self.openai = OpenAIServing(
            self.triton,
            config.context_tokens,
            config.default_max_tokens,
            tokenizer,
            config.apply_chat_template,
            self.shadow,
            self.capture,
            config.backend,
            config.version_pinning,
        )
        self.keys = config.api_keys if isinstance(config.api_keys, KeyRing) else KeyRing.fixed(config.api_keys)
        self.limits = ClientLimits(config.requests_per_second, config.tokens_per_minute, config.request_burst_s)

    def authorize(self, request: Request) -> str:
        """The client's name, noted for the access log and metrics, once its key and its rate allow it."""
        client = authorize(self.keys.current(), request.headers.get("authorization"))
        current().client = client
        current().capture = request.headers.get(OPT_OUT_HEADER, "").strip().lower() != "off"
        self.limits.admit(client)
        return client

    async def body(self, request: Request) -> bytes:
        return await read_body(request, self.config.max_body_bytes)

    async def live(self, request: Request) -> Response:
        return JSONResponse({"status": "live"})

    async def ready(self, request: Request) -> Response:
        """Ready when the service name answers on Triton (the router and the model behind it are loaded)."""
        ready = await self.triton.ready()
        return JSONResponse({"status": "ready" if ready else "not ready"}, status_code=200 if ready else 503)

    async def prometheus(self, request: Request) -> Response:
        """The per-client counters, for Prometheus: no key needed, none shown (clients by name only)."""
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

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
        model = {"id": self.config.service, "object": "model", "created": 0, "owned_by": "llmops"}
        versions = [{**model, "id": name, "parent": self.config.service} for name in self.openai.versions()]
        return JSONResponse({"object": "list", "data": [model, *versions]})

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
        name, streaming = request.path_params["model"], request.url.path.endswith("_stream")
        try:
            self.authorize(request)
            if name != self.config.service:
                raise RequestError(404, f"model {name!r} is not served here; the service is {self.config.service!r}")
            generate = parse(GenerateRequest, await self.body(request))
            body = generate.model_dump(exclude_none=True)
            body["max_tokens"] = bounded_max_tokens(
                generate.max_tokens, "max_tokens", self.config.context_tokens, self.config.default_max_tokens
            )
            if generate.min_length is not None:
                bounded_max_tokens(generate.min_length, "min_length", body["max_tokens"], 0)
            current().tokens = body["max_tokens"]  # Triton counts none: the budget stands for them
            path = f"/v2/models/{name}/{'generate_stream' if streaming else 'generate'}"
            if not streaming:
                started = time.perf_counter()
                answer = await self.triton.forward(path, body)
                if answer.status_code != 200:
                    raise upstream_error(answer)
                self.shadow.copy_answer(body, answer, time.perf_counter() - started)
                self.keep_generate(generate, answer, started)
                media_type = answer.headers.get("content-type", "application/json")
                return Response(answer.content, status_code=answer.status_code, media_type=media_type)
            upstream, chunks = await self.triton.forward_stream(path, body)
        except RequestError as error:
            return triton_error(error)
        media_type = upstream.headers.get("content-type", "text/event-stream")
        return StreamingResponse(chunks, status_code=upstream.status_code, media_type=media_type)

    def keep_generate(self, generate: GenerateRequest, answer: httpx.Response, started: float) -> None:
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
                    "routes": self.shadow.routes,
                    "messages": conversation(generate),
                    "answer": str(answer.json()["text_output"]),
                    "latency_s": round(time.perf_counter() - started, 6),
                }
            )

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        watcher = (
            asyncio.create_task(self.shadow.watch(self.config.shadow_poll_s)) if self.config.shadow_poll_s else None
        )
        writer = asyncio.create_task(self.capture.run()) if self.capture is not None else None
        yield
        if watcher is not None:
            watcher.cancel()
        if writer is not None:  # what is buffered is written before the gateway ends
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
        await self.shadow.aclose()
        await self.triton.aclose()

    def app(self) -> Starlette:
        routes = [
            Route("/health/live", self.live),
            Route("/health/ready", self.ready),
            Route("/metrics", self.prometheus),
            Route("/v1/models", self.models),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/feedback", self.feedback, methods=["POST"]),
            Route("/v2/models/{model}/generate", self.triton_generate, methods=["POST"]),
            Route("/v2/models/{model}/generate_stream", self.triton_generate, methods=["POST"]),
        ]
        guard = Middleware(
            Guard, routes=routes, limits=self.limits, metrics=self.metrics, max_in_flight=self.config.max_in_flight
        )
        return Starlette(
            routes=routes,
            middleware=[guard],
            exception_handlers={HTTPException: self.not_routed},
            lifespan=self.lifespan,
        )
