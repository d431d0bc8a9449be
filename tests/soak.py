"""A soak of a service's gateway: closed loops of clients sending mixed OpenAI streaming chat and Triton /v2 generate
requests, a share of the streaming ones hanging up after the first chunk, each request with a client deadline. It
counts what a client would notice: requests that hung (no answer within the deadline), 5xx answers, and the rest by
status. Used by tests/integration/test_attach.py (CI-sized) and benchmarks/soak.py (minutes, several runs).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

QUESTION = "What is the opposite of hot?"


@dataclass
class Soaked:
    seconds: float = 0.0
    statuses: Counter = field(default_factory=Counter)  # status, or "hung" / "refused connection"
    hung_up: int = 0  # streams the client left after the first chunk, on purpose
    latencies_ms: list[float] = field(default_factory=list)
    unadvised: int = 0  # 503s without a Retry-After: a client would not know when to come back
    # with `record`: each request's (time.monotonic() of its end, status, the version that answered: x-llmops-version)
    events: list[tuple[float, object, str | None]] = field(default_factory=list)
    record: bool = False

    @property
    def failed(self) -> int:
        """5xx answers but a 503 that says when to retry (a replica down for a moment), and hung requests."""
        return (
            self.hung
            + sum(
                n for status, n in self.statuses.items() if isinstance(status, int) and status >= 500 and status != 503
            )
            + self.unadvised
        )

    @property
    def hung(self) -> int:
        return self.statuses["hung"]

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if isinstance(status, int) and status >= 500)

    def summary(self) -> str:
        answered = sorted(self.latencies_ms)
        p99 = answered[int(0.99 * (len(answered) - 1))] if answered else float("nan")
        total = sum(self.statuses.values())
        return (
            f"{total} requests in {self.seconds:.0f}s ({total / max(self.seconds, 1e-9):.1f}/s): "
            f"{dict(self.statuses)}, {self.hung_up} hung up on purpose, p99 {p99:.0f} ms"
            + (f", {self.unadvised} 503s without Retry-After" if self.unadvised else "")
        )


async def one_request(
    session: aiohttp.ClientSession, gateway: str, service: str, rng: random.Random, hangup_share: float, result: Soaked
) -> None:
    streaming = rng.random() < 0.5
    started = time.perf_counter()
    status: int | str
    if streaming:
        path = "/v1/chat/completions"
        body = {"model": service, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, "stream": True}
    else:
        path, body = f"/v2/models/{service}/generate", {"text_input": QUESTION, "max_tokens": 8}
    try:
        async with session.post(f"{gateway}{path}", data=json.dumps(body)) as response:
            if streaming and response.status == 200 and rng.random() < hangup_share:
                await response.content.readline()  # the first chunk, then the client goes away
                response.close()
                result.hung_up += 1
                return
            await response.read()
            status, version = response.status, response.headers.get("x-llmops-version")
            if status == 503 and "Retry-After" not in response.headers:
                result.unadvised += 1
    except TimeoutError:
        status, version = "hung", None
    except aiohttp.ClientConnectionError:
        status, version = "refused connection", None
    except aiohttp.ClientPayloadError:  # the answer broke off (the gateway's process died under it)
        status, version = "broken off", None
    result.statuses[status] += 1
    if result.record:
        result.events.append((time.monotonic(), status, version))
    if status == 200:
        result.latencies_ms.append((time.perf_counter() - started) * 1000)


async def soak(
    gateway: str,
    service: str,
    concurrency: int,
    seconds: float,
    headers: dict[str, str] | None = None,
    hangup_share: float = 0.1,
    deadline_s: float = 20,
    during: Callable[[], Awaitable[None]] | None = None,
    seed: int = 0,
    record: bool = False,
    stop: Callable[[], bool] = lambda: False,
    into: Soaked | None = None,
) -> Soaked:
    """`concurrency` clients in closed loops for `seconds` (or until `stop()`); `during`: run meanwhile (a canary
    ramp, a fault); `record`: keep each request's events; `into`: the result to count in as it goes (another thread
    reads it meanwhile)."""
    result, stop_at = into or Soaked(record=record), time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=deadline_s)
    connector = aiohttp.TCPConnector(limit=0, ssl=False)
    headers = {"Content-Type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:

        async def client(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() < stop_at and not stop():
                await one_request(session, gateway, service, rng, hangup_share, result)

        started = time.monotonic()
        work = [client(index) for index in range(concurrency)]
        await asyncio.gather(*work, *([during()] if during else []))
        result.seconds = time.monotonic() - started
    return result


def kill_replica(state: dict, index: int) -> int:
    """SIGKILL for replica `index` of the `llmops serve` that published `state` (its server.json): the tritonserver
    process listening on that replica's HTTP port; its pid. The serve's watch starts it again."""
    import psutil

    port = state["replicas"][index]["url"].rsplit(":", 1)[1]
    for process in psutil.Process(int(state["pid"])).children(recursive=True):
        try:
            if process.name() == "tritonserver" and f"--http-port={port}" in process.cmdline():
                process.kill()
                return process.pid
        except psutil.NoSuchProcess:
            continue
    raise LookupError(f"no tritonserver of replica {index} ({state['replicas'][index]['url']}) under the serve")
