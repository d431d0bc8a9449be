"""The gateway's listeners under uvicorn, on one event loop in a thread of this process: the clients' listener of
`llmops serve` and its control listener, or the control listener alone (the temporary gateway of `llmops run`)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette

from tasks.platform.errors import BadInput
from tasks.runtime.gateway.app import Gateway


@dataclass
class Listener:
    app: Starlette
    host: str
    port: int
    tls_cert: str | None = None
    tls_key: str | None = None


class RunningGateway:
    """A gateway's uvicorn servers sharing one event loop in a daemon thread."""

    def __init__(self, listeners: list[Listener], gateway: Gateway, name: str = "gateway"):
        import uvicorn

        self.servers = [
            uvicorn.Server(
                uvicorn.Config(
                    listener.app,
                    host=listener.host,
                    port=listener.port,
                    ssl_certfile=listener.tls_cert,
                    ssl_keyfile=listener.tls_key,
                    log_level="warning",
                    # No logging.config.dictConfig of uvicorn's: it would replace the handlers of the process it
                    # starts in (a release's Prefect run logging), and it deadlocked with Prefect's API log handler,
                    # whose flush it waits for while a Prefect thread waits for the logging lock it holds
                    log_config=None,
                    access_log=False,  # requests carry keys in headers; uvicorn's access log prints none, but stays off
                    lifespan="on",
                )
            )
            for listener in listeners
        ]
        self.listeners, self.gateway = listeners, gateway
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self.run, name=name, daemon=True)

    def run(self) -> None:
        # uvicorn's own choice of loop (uvloop where installed), as `uvicorn.run` makes it; `asyncio.run` would give
        # the standard library's loop, whose selector and transports are Python: under
        # `llmops serve` that cost the gateway 1.37 ms of CPU per request at concurrency 1 against 1.02 on uvloop
        with asyncio.Runner(loop_factory=self.servers[0].config.get_loop_factory()) as runner:
            runner.run(self.serve())

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await asyncio.gather(*(server.serve() for server in self.servers))

    def call(self, work: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
        """Run `work` on the gateway's event loop from another thread, and wait for it."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout)

    def start(self, timeout: float = 30) -> RunningGateway:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not all(server.started for server in self.servers):
            if not self.thread.is_alive() or time.monotonic() > deadline:
                where = ", ".join(f"{listener.host}:{listener.port}" for listener in self.listeners)
                self.stop()
                raise BadInput(f"gateway on {where}: did not start (see the lines above)")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(15)
