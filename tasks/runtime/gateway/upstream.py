"""The Triton behind the gateway, over its HTTP generate API (httpx on aiohttp), and how its failures reach clients.

Each call names the served version it goes to (tasks/control/contract.py: its Triton model, and the adapter that
model is asked for). Triton answers a model's refusal (bad input, a prompt over the context) with 400: that goes
back as it is. A Triton that cannot be reached, does not know the version's model (it is loading it again after a
restart: the gateway routes only to versions it was told are loaded), whose model's process died ("Stub process
... is not healthy"), that fails or whose answer breaks off is 503 with Retry-After, one that does not answer in
time 504, so a client can tell its mistakes from the service's. "In time" is two deadlines (serve.health):
the first byte of the answer within `first_byte_s` (a whole answer, where it does not stream), each next chunk
within `between_chunks_s`: no request waits on a model that stopped answering longer than that. A 5xx never carries
Triton's or the model's own message (paths, library errors): that goes to the log under the request id the
client gets. The transport can be given (httpx.MockTransport in the unit tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import orjson
from httpx_aiohttp import AiohttpTransport
from httpx_aiohttp.transport import map_aiohttp_exceptions

from tasks.control.contract import Version
from tasks.runtime.gateway.access import ERROR_LOG, PROBE_CLIENT, current
from tasks.runtime.gateway.protocol import RequestError

# httpx's API on aiohttp's connections (httpx-aiohttp, the openai SDK's own aiohttp option): httpx's default
# transport parses HTTP in pure Python (h11), which a profile of the gateway found in 49% of its busy samples at
# concurrency 1; aiohttp's parser is C (benchmarks/gateway_overhead.py, one run: 0.88x -> 0.91x of Triton's
# requests/s at concurrency 1, 0.30x -> 0.53x at 32).
# A generate request answered whole (/v2, and /v1's) goes on the transport's aiohttp session itself
# (Triton.post_on_aiohttp), a streamed one straight to the transport (Triton.send). Tests give a transport of their
# own (httpx.MockTransport), which every call then goes through.
FIRST_BYTE_S, BETWEEN_CHUNKS_S = 120.0, 30.0  # serve.health's defaults
JSON = {"content-type": "application/json"}


def chunk_timeouts(between_chunks_s: float) -> httpx.Timeout:
    """httpx's timeouts: a Triton that is there accepts at once; each read waits at most `between_chunks_s`."""
    return httpx.Timeout(between_chunks_s, connect=5)


# Triton's words for a model it is (re)loading: "Request for unknown model: 'x' has no available versions",
# "... is not ready", and the base engine's for an adapter not (yet, or no longer) registered: "adapter 'x' is not
# loaded on ...". The gateway routes only to versions a release loaded: such a model is only not loaded *yet*.
NOT_LOADED = re.compile(r"unknown model|not ready|no available versions|not loaded|is not healthy", re.IGNORECASE)
# One model instance's process died (its stub SIGKILLed, out of memory): Triton 2.51 starts none again and fails each
# request it hands that instance with these words, while the model stays READY and its other instances answer.
DEAD_INSTANCE = re.compile(r"Stub process '[^']*' is not healthy")
# A full queue (serve.max_queue_size): the python model's batcher says so with 503 itself; a decoupled model's
# refusal comes as 400, because Triton 2.51 drops a Python-backend error's code on a decoupled model's response.
BUSY = re.compile(r"Exceeds maximum queue size")
RETRY_AFTER_S = 2  # Triton restarts with backoff from 1 s; a retry sooner would only find it down again


@dataclass(frozen=True, slots=True)
class Answer:
    """Triton's answer to a request, read whole: what the gateway relays and reads of it."""

    status_code: int
    content: bytes
    content_type: str = "application/json"

    def json(self) -> Any:
        return orjson.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")


class Unanswered(RequestError):
    """A 503 for a request this Triton did not start answering (nothing reached the client yet): it could not be
    reached (`down`), or the version's model is not (or no longer) loaded there. Another replica may answer it."""

    def __init__(self, message: str, down: bool, dead_instance: bool = False):
        super().__init__(503, message, code="service_unavailable", retry_after=RETRY_AFTER_S)
        self.down, self.dead_instance = down, dead_instance  # dead_instance: DEAD_INSTANCE's words


def server_fault(status: int, detail: str, down: bool | None = None) -> RequestError:
    """A 5xx for the client, with its request id; what went wrong (Triton's own words) only in the log. `down`: a
    503 of a request not started (Unanswered), the Triton unreachable (True) or the model not loaded (False, or one
    of its instances dead: DEAD_INSTANCE)."""
    record = current()
    request_id = record.id
    # a probe's fault is the prober's to say, once where its version's state changes (probes.py), not once a probe:
    # a version a release has yet to load on its own Triton failed every probe with a warning (issue 73)
    said = ERROR_LOG.debug if record.client == PROBE_CLIENT else ERROR_LOG.warning
    said("request %s: model server fault (%s): %s", request_id, status, detail[:2000])
    if status == 503:
        message = f"the model server is not available; try again shortly (request id {request_id})"
        if down is not None:
            error: RequestError = Unanswered(message, down, dead_instance=DEAD_INSTANCE.search(detail) is not None)
        else:
            error = RequestError(503, message, code="service_unavailable", retry_after=RETRY_AFTER_S)
    else:
        error = RequestError(
            status, f"the model server failed to answer (request id {request_id})", code="server_error"
        )
    error.detail = detail[:300]
    return error


def upstream_error(response: httpx.Response | Answer) -> RequestError:
    """Triton's refusal (400) as it is; its not knowing the service's model, or its own fault, a 503."""
    message = upstream_message(response)
    if BUSY.search(message):
        return RequestError(503, "the service is at its limit of requests; retry shortly", retry_after=1)
    if response.status_code == 400 and not NOT_LOADED.search(message):
        return RequestError(400, message)
    return server_fault(
        503, f"HTTP {response.status_code}: {message}", down=False if NOT_LOADED.search(message) else None
    )


def upstream_message(response: httpx.Response | Answer) -> str:
    try:
        return str(response.json().get("error", response.text))
    except ValueError:
        return response.text[:300]


class TritonUpstream:
    """The generate calls of the served versions on one Triton."""

    def __init__(
        self,
        url: str,
        transport: httpx.AsyncBaseTransport | None = None,
        first_byte_s: float = FIRST_BYTE_S,
        between_chunks_s: float = BETWEEN_CHUNKS_S,
    ):
        self.url, self.first_byte_s = url, first_byte_s
        self.transport: httpx.AsyncBaseTransport
        self.aiohttp: AiohttpTransport | None  # None: a transport given (a test's)
        if transport is None:
            self.transport = self.aiohttp = AiohttpTransport()
        else:
            self.transport, self.aiohttp = transport, None
        self.timeout = chunk_timeouts(between_chunks_s)
        self.timeouts = self.timeout.as_dict()  # the form a transport reads them in (request.extensions["timeout"])
        # the same, as httpx-aiohttp 0.2.0 hands them to aiohttp (httpx_aiohttp/transport.py, handle_async_request)
        # A whole answer has serve.health.first_byte_s (first_byte): no read deadline of its own, which would end it
        # at between_chunks_s and say it was the first byte's (aiohttp's read timeout is a TimeoutError too)
        self.whole_answer_timeout = aiohttp.ClientTimeout(
            sock_connect=self.timeouts["connect"], connect=self.timeouts["pool"]
        )
        self.client = httpx.AsyncClient(base_url=url, timeout=self.timeout, transport=self.transport)
        self.urls: dict[str, str] = {}  # the /v2 URLs forwarded to (generate and generate_stream per model)

    def unreachable(self, exc: httpx.HTTPError) -> RequestError:
        """The error a client gets when Triton could not be asked or did not answer."""
        # httpx-aiohttp 0.2.0 maps every aiohttp.ClientConnectionError, a refused or dropped connection included,
        # to ConnectTimeout (httpx_aiohttp/transport.py, AIOHTTP_EXC_MAP): Triton is not there either way
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            return server_fault(503, f"{self.url} not reachable: {exc}", down=True)
        if isinstance(exc, httpx.TimeoutException):
            return RequestError(504, "the model server did not answer in time", code="timeout")
        return server_fault(503, f"{self.url}: its answer broke off: {type(exc).__name__}: {exc}")

    async def ready(self, model: str) -> bool:
        try:
            response = await self.client.get(f"/v2/models/{model}/ready", timeout=5)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def version_ready(self, version: Version) -> bool:
        """The version's model is ready (and, for an adapter, the version's own model that registered it)."""
        return await self.ready(version.model) and (version.adapter is None or await self.ready(version.name))

    @contextlib.asynccontextmanager
    async def first_byte(self) -> AsyncIterator[None]:
        """Within serve.health.first_byte_s, or 504."""
        try:
            async with asyncio.timeout(self.first_byte_s):
                yield
        except TimeoutError:
            ERROR_LOG.warning("request %s: no answer within %ss", current().id, self.first_byte_s)
            raise RequestError(504, "the model server did not answer in time", code="timeout") from None

    async def generate(self, version: Version, inputs: dict[str, Any]) -> str:
        return str((await self.generate_outputs(version, inputs))["text_output"])

    async def generate_outputs(self, version: Version, inputs: dict[str, Any]) -> dict[str, Any]:
        """Triton's answer: text_output, and the other outputs the model sent (logprobs)."""
        return dict((await self.forward(version, inputs)).json())

    def generate_stream(self, version: Version, inputs: dict[str, Any]) -> AsyncGenerator[str, None]:
        """The text pieces of Triton's SSE stream (generate_stream_outputs' text_output)."""
        return text_pieces(self.generate_stream_outputs(version, inputs))

    async def generate_stream_outputs(
        self, version: Version, inputs: dict[str, Any]
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The events of Triton's SSE stream, each with its outputs. Any failure, before the first event or after,
        raises RequestError: an error event of Triton's, a broken connection, an event that is not JSON."""
        try:
            response = await self.send(version, True, {**inputs, "stream": True})
        except httpx.HTTPError as exc:
            raise self.unreachable(exc) from None
        try:
            if response.status_code != 200:
                await response.aread()
                raise upstream_error(response)
            async for event in self.events(response):
                if "error" in event:
                    raise server_fault(502, f"error event: {event['error']}")
                yield event
        except httpx.HTTPError as exc:
            raise self.unreachable(exc) from None
        finally:
            await response.aclose()

    @staticmethod
    async def events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            try:
                yield json.loads(line[5:])
            except ValueError:
                raise server_fault(502, f"an event that is not JSON: {line[:200]!r}") from None

    def url_of(self, version: Version, streaming: bool) -> str:
        path = f"{version.model}/{'generate_stream' if streaming else 'generate'}"
        url = self.urls.get(path)
        if url is None:
            url = self.urls[path] = f"{self.url}/v2/models/{path}"
        return url

    async def send(self, version: Version, streaming: bool, body: dict[str, Any]) -> httpx.Response:
        """A /v2 request straight to the transport, its answer's body not yet read.

        Not through AsyncClient.send: its layers (auth, redirects, cookies, URL merging) do nothing for a POST to
        Triton and were a sixth of the gateway's CPU per request at concurrency 32 (py-spy of
        benchmarks/gateway_overhead.py). Its timeouts go as AsyncClient would hand them over."""
        content = orjson.dumps(version.inputs(body))
        request = httpx.Request(
            "POST",
            self.url_of(version, streaming),
            content=content,
            headers=JSON,
            extensions={"timeout": self.timeouts},
        )
        async with self.first_byte():
            return await self.transport.handle_async_request(request)

    async def forward(self, version: Version, body: dict[str, Any]) -> Answer:
        """Triton's answer to a generate request, read whole; a refusal or fault raised as RequestError."""
        try:
            if self.aiohttp is not None:
                response = await self.post_on_aiohttp(self.aiohttp, version, body)
            else:
                given = await self.send(version, False, body)
                await given.aread()  # closes it, the connection back in the pool
                content_type = given.headers.get("content-type", "application/json")
                response = Answer(given.status_code, given.content, content_type)
        except httpx.HTTPError as exc:
            raise self.unreachable(exc) from None
        if response.status_code != 200:
            raise upstream_error(response)
        return response

    async def post_on_aiohttp(self, transport: AiohttpTransport, version: Version, body: dict[str, Any]) -> Answer:
        """A generate request on the transport's aiohttp session itself, its answer read whole; aiohttp's errors
        as httpx's, as the transport maps them.

        Not through the transport's handle_async_request: httpx's request object, and the response stream it reads
        through, were a tenth of the gateway's CPU per request (0.557 -> 0.488 ms at concurrency 8, 0.488 -> 0.439
        at 32: medians of 4 paired runs of the gateway of benchmarks/gateway_overhead.py, Triton apart), and the
        httpx.Response it was read into, with two smaller changes made with it, another tenth (0.508 -> 0.459 and
        0.449 -> 0.410)."""
        if not isinstance(transport.client, aiohttp.ClientSession):
            transport.client = transport.get_client()  # made on first use, in the loop, as the transport does
        content = orjson.dumps(version.inputs(body))
        with map_aiohttp_exceptions():
            async with (
                self.first_byte(),
                transport.client.post(
                    self.url_of(version, False),
                    data=content,
                    headers=JSON,
                    timeout=self.whole_answer_timeout,
                    allow_redirects=False,
                ) as answer,
            ):
                return Answer(
                    answer.status, await answer.read(), answer.headers.get("content-type", "application/json")
                )

    async def forward_stream(
        self, version: Version, body: dict[str, Any], ended: Callable[[bool], None] = lambda ok: None
    ) -> tuple[httpx.Response, AsyncIterator[bytes]]:
        """Triton's answer to a /v2 streaming request: the response (status, headers) and its bytes, relayed as
        they come; a connection that breaks off ends the stream with an error event in Triton's shape. `ended`
        hears whether the relay ended whole (True) or broke off (False)."""
        try:
            response = await self.send(version, True, body)
            if response.status_code != 200:
                await response.aread()
                raise upstream_error(response)
        except httpx.HTTPError as exc:
            raise self.unreachable(exc) from None

        async def relay() -> AsyncIterator[bytes]:
            whole = False
            try:
                async for chunk in response.aiter_bytes():  # decoded, should Triton compress
                    yield chunk
                whole = True
            except httpx.HTTPError as exc:
                yield f"data: {json.dumps({'error': self.unreachable(exc).message})}\n\n".encode()
            finally:
                ended(whole)
                await response.aclose()

        return response, relay()

    async def aclose(self) -> None:
        await self.client.aclose()


async def text_pieces(events: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[str, None]:
    """The text_output of each event, the events closed whatever happens."""
    try:
        async for event in events:
            yield str(event.get("text_output", ""))
    finally:
        await events.aclose()
