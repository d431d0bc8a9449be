"""The least a proxy in Python does in front of Triton: the floor under the gateway's cost in
benchmarks/gateway_overhead.py.

A raw ASGI app on uvicorn with the gateway's options (uvloop, httptools, no access log) that relays each POST's body
as it came to the same path on Triton, through one aiohttp session (the client the gateway's httpx transport drives),
and Triton's answer back as it came: no keys, limits, checks, parsing, log or counters. What it costs is what any
Python hop costs on this machine; what the gateway costs above it is its own.

    .venv/bin/python benchmarks/bare_proxy.py PORT TRITON_URL
"""

from __future__ import annotations

import sys
from typing import Any

import aiohttp
import uvicorn


class BareProxy:
    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await self.lifespan(receive, send)
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if scope["path"] == "/health/live":
            status, answer = 200, b'{"status": "live"}'
        else:
            assert self.session is not None
            headers = {"content-type": "application/json"}
            async with self.session.post(self.upstream + scope["path"], data=body, headers=headers) as response:
                status, answer = response.status, await response.read()
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
        )
        await send({"type": "http.response.body", "body": answer})

    async def lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100))  # httpx-aiohttp's
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.session is not None:
                    await self.session.close()
                return await send({"type": "lifespan.shutdown.complete"})


if __name__ == "__main__":
    port, upstream = int(sys.argv[1]), sys.argv[2]
    uvicorn.run(BareProxy(upstream), host="127.0.0.1", port=port, log_level="warning", access_log=False)
