"""The Triton behind the gateway, over its HTTP generate API (httpx on aiohttp), and how its failures reach clients.

Triton answers a model's refusal (bad input, a prompt over the context) with 400: that goes back as it is.
A Triton that cannot be reached, does not know the service's model (it is loading it again after a restart:
the gateway checked the name) or fails is 503 with Retry-After, one that does not answer in time 504, one
whose answer breaks off 502, so a client can tell its mistakes from the service's. A 5xx never carries
Triton's or the model's own message (paths, library errors): that goes to the log under the request id the
client gets. The transport can be given (httpx.MockTransport in the unit tests).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx
import orjson
from httpx_aiohttp import AiohttpTransport

from tasks.serving.gateway.access import ERROR_LOG, current
from tasks.serving.gateway.protocol import RequestError

# httpx's API on aiohttp's connections (httpx-aiohttp, the openai SDK's own aiohttp option): httpx's default
# transport parses HTTP in pure Python (h11), which a profile of the gateway found in 49% of its busy samples at
# concurrency 1; aiohttp's parser is C (benchmarks/gateway_overhead.py, one run: 0.88x -> 0.91x of Triton's
# requests/s at concurrency 1, 0.30x -> 0.53x at 32).
# Tests give a transport of their own (httpx.MockTransport).
TIMEOUT = httpx.Timeout(300, connect=5)  # a long answer on a CPU takes minutes; a Triton that is there answers at once
JSON = {"content-type": "application/json"}
TIMEOUTS = TIMEOUT.as_dict()  # the form a transport reads them in (request.extensions["timeout"])


# Triton's words for a model it is (re)loading: "Request for unknown model: 'x' has no available versions",
# "... is not ready"; with the name checked here, the service's model is only ever not loaded *yet*.
NOT_LOADED = re.compile(r"unknown model|not ready|no available versions|not loaded", re.IGNORECASE)
# A full queue (serve.max_queue_size): the python model's batcher says so with 503 itself; the router's refusal
# comes as 400, because Triton 2.51 drops a Python-backend error's code on a decoupled model's response.
BUSY = re.compile(r"Exceeds maximum queue size|requests in flight; retry shortly")
RETRY_AFTER_S = 2  # Triton restarts with backoff from 1 s; a retry sooner would only find it down again


def server_fault(status: int, detail: str) -> RequestError:
    """A 5xx for the client, with its request id; what went wrong (Triton's own words) only in the log."""
    request_id = current().id
    ERROR_LOG.warning("request %s: model server fault (%s): %s", request_id, status, detail[:2000])
    if status == 503:
        message = f"the model server is not available; try again shortly (request id {request_id})"
        return RequestError(503, message, code="service_unavailable", retry_after=RETRY_AFTER_S)
    return RequestError(status, f"the model server failed to answer (request id {request_id})", code="server_error")


def upstream_error(response: httpx.Response) -> RequestError:
    """Triton's refusal (400) as it is; its not knowing the service's model, or its own fault, a 503."""
    message = upstream_message(response)
    if BUSY.search(message):
        return RequestError(503, "the service is at its limit of requests; retry shortly", retry_after=1)
    if response.status_code == 400 and not NOT_LOADED.search(message):
        return RequestError(400, message)
    return server_fault(503, f"HTTP {response.status_code}: {message}")


def upstream_message(response: httpx.Response) -> str:
    try:
        return str(response.json().get("error", response.text))
    except ValueError:
        return response.text[:300]


class Triton:
    """The generate calls of one served model (the service's router model)."""

    def __init__(self, url: str, model: str, transport: httpx.AsyncBaseTransport | None = None):
        self.url, self.model = url, model
        self.transport = transport or AiohttpTransport()
        self.client = httpx.AsyncClient(base_url=url, timeout=TIMEOUT, transport=self.transport)
        self.urls: dict[str, httpx.URL] = {}  # the /v2 paths forwarded (two: generate and generate_stream)

    def unreachable(self, exc: httpx.HTTPError) -> RequestError:
        """The error a client gets when Triton could not be asked or did not answer."""
        # httpx-aiohttp 0.2.0 maps every aiohttp.ClientConnectionError, a refused or dropped connection included,
        # to ConnectTimeout (httpx_aiohttp/transport.py, AIOHTTP_EXC_MAP): Triton is not there either way
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            return server_fault(503, f"not reachable: {exc}")
        if isinstance(exc, httpx.TimeoutException):
            return RequestError(504, "the model server did not answer in time", code="timeout")
        return server_fault(502, f"its answer broke off: {type(exc).__name__}: {exc}")

    async def ready(self) -> bool:
        try:
            response = await self.client.get(f"/v2/models/{self.model}/ready", timeout=5)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def generate(self, inputs: dict[str, Any]) -> str:
        return str((await self.generate_outputs(inputs))["text_output"])

    async def generate_outputs(self, inputs: dict[str, Any], model: str | None = None) -> dict[str, Any]:
        """Triton's answer: text_output, and the other outputs the model sent (logprobs). `model`: a version the
        request pinned; the service's by default."""
        try:
            response = await self.client.post(f"/v2/models/{model or self.model}/generate", json=inputs)
        except httpx.HTTPError as exc:
            raise self.unreachable(exc) from None
        if response.status_code != 200:
            raise upstream_error(response)
        return dict(response.json())

    async def generate_stream(self, inputs: dict[str, Any]) -> AsyncGenerator[str, None]:
        """The text pieces of Triton's SSE stream (generate_stream_outputs' text_output)."""
        events = self.generate_stream_outputs(inputs)
        try:
            async for event in events:
                yield str(event.get("text_output", ""))
        finally:
            await events.aclose()

    async def generate_stream_outputs(
        self, inputs: dict[str, Any], model: str | None = None
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The events of Triton's SSE stream, each with its outputs. Any failure, before the first event or after,
        raises RequestError: an error event of Triton's, a broken connection, an event that is not JSON."""
        request = self.client.build_request(
            "POST", f"/v2/models/{model or self.model}/generate_stream", json={**inputs, "stream": True}
        )
        try:
            response = await self.client.send(request, stream=True)
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

    async def send(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """A /v2 request straight to the transport, its answer's body not yet read.

        Not through AsyncClient.send: its layers (auth, redirects, cookies, URL merging) do nothing for a POST to
        Triton and were a sixth of the gateway's CPU per request at concurrency 32 (py-spy of
        benchmarks/gateway_overhead.py). Its timeouts go as AsyncClient would hand them over."""
        url = self.urls.get(path)
        if url is None:
            url = self.urls[path] = httpx.URL(self.url + path)
        request = httpx.Request("POST", url, content=orjson.dumps(body), headers=JSON, extensions={"timeout": TIMEOUTS})
        return await self.transport.handle_async_request(request)

    async def forward(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """Triton's answer to a /v2 request, read whole."""
        try:
            response = await self.send(path, body)
            await response.aread()  # closes it, the connection back in the pool
        except httpx.HTTPError as exc:
            raise self.unreachable(exc) from None
        return response

    async def forward_stream(self, path: str, body: dict[str, Any]) -> tuple[httpx.Response, AsyncIterator[bytes]]:
        """Triton's answer to a /v2 streaming request: the response (status, headers) and its bytes, relayed as
        they come; a connection that breaks off ends the stream with an error event in Triton's shape."""
        try:
            response = await self.send(path, body)
            if response.status_code != 200:
                await response.aread()
                raise upstream_error(response)
        except httpx.HTTPError as exc:
            raise self.unreachable(exc) from None

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_bytes():  # decoded, should Triton compress
                    yield chunk
            except httpx.HTTPError as exc:
                yield f"data: {json.dumps({'error': self.unreachable(exc).message})}\n\n".encode()
            finally:
                await response.aclose()

        return response, relay()

    async def aclose(self) -> None:
        await self.client.aclose()
