"""The Triton behind the gateway, over its HTTP generate API (httpx), and how its failures reach clients.

Triton answers a model's refusal (bad input, a prompt over the context) with 400: that goes back as it is.
Its own faults become 502, a Triton that cannot be reached 503 and one that does not answer in time 504,
so a client can tell its mistakes from the service's. The transport can be given (httpx.MockTransport
in the unit tests).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx

from tasks.serving.gateway.protocol import RequestError

TIMEOUT = httpx.Timeout(300, connect=5)  # a long answer on a CPU takes minutes; a Triton that is there answers at once


def upstream_status(status: int) -> int:
    """Triton answers a model's refusal (bad input, context exceeded) with 400; its own faults stay 5xx."""
    return status if status in (400, 404) else 502


def upstream_message(response: httpx.Response) -> str:
    try:
        return str(response.json().get("error", response.text))
    except ValueError:
        return response.text[:300]


class Triton:
    """The generate calls of one served model (the service's router model)."""

    def __init__(self, url: str, model: str, transport: httpx.AsyncBaseTransport | None = None):
        self.url, self.model = url, model
        self.client = httpx.AsyncClient(base_url=url, timeout=TIMEOUT, transport=transport)

    def unreachable(self, exc: httpx.HTTPError) -> RequestError:
        """The error a client gets when Triton could not be asked or did not answer."""
        if isinstance(exc, httpx.ConnectError):
            return RequestError(503, f"the model server is not reachable ({exc}); try again shortly")
        if isinstance(exc, httpx.TimeoutException):
            return RequestError(504, "the model server did not answer in time")
        return RequestError(502, f"the model server's answer broke off ({type(exc).__name__}: {exc})")

    async def ready(self) -> bool:
        try:
            response = await self.client.get(f"/v2/models/{self.model}/ready", timeout=5)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def generate(self, inputs: dict[str, Any]) -> str:
        try:
            response = await self.client.post(f"/v2/models/{self.model}/generate", json=inputs)
        except httpx.HTTPError as exc:
            raise self.unreachable(exc) from None
        if response.status_code != 200:
            raise RequestError(upstream_status(response.status_code), upstream_message(response))
        return str(response.json()["text_output"])

    async def generate_stream(self, inputs: dict[str, Any]) -> AsyncGenerator[str, None]:
        """The text pieces of Triton's SSE stream. Any failure, before the first piece or after, raises
        RequestError: an error event of Triton's, a broken connection, an event that is not JSON."""
        request = self.client.build_request(
            "POST", f"/v2/models/{self.model}/generate_stream", json={**inputs, "stream": True}
        )
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise self.unreachable(exc) from None
        try:
            if response.status_code != 200:
                await response.aread()
                raise RequestError(upstream_status(response.status_code), upstream_message(response))
            async for event in self.events(response):
                if "error" in event:
                    raise RequestError(400, str(event["error"]))
                yield str(event.get("text_output", ""))
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
                raise RequestError(502, f"the model server sent an event that is not JSON: {line[:200]!r}") from None

    async def forward(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """Triton's answer to a /v2 request, read whole."""
        try:
            return await self.client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise self.unreachable(exc) from None

    async def forward_stream(self, path: str, body: dict[str, Any]) -> tuple[httpx.Response, AsyncIterator[bytes]]:
        """Triton's answer to a /v2 streaming request: the response (status, headers) and its bytes, relayed as
        they come; a connection that breaks off ends the stream with an error event in Triton's shape."""
        try:
            response = await self.client.send(self.client.build_request("POST", path, json=body), stream=True)
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
