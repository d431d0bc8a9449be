"""How much each client may ask of the gateway: requests per second, tokens per minute and requests in flight
per API key, so that one client cannot take the model server from the others (issues 22, 38, 41).

Requests per second and tokens per minute are token buckets. An answer's tokens are reserved at admission, its
`max_tokens` (the profile's default where the request gives none), before the model starts on it: a key's budget
cannot be overdrawn by many long answers admitted at once. Once the answer is done the reservation is settled
against what it used (prompt + completion where counted): the unused part comes back, a prompt the reservation
did not cover is charged as a debt the key's next requests wait out. A failed or abandoned answer is charged only
what it produced. The cap in flight per key keeps one key's long generations from holding every place in flight.

Our own small buckets rather than a library: `limits` (the usual choice) is not in this environment, and a
settlement that may go into debt fits a bucket allowed below zero. Time is the event loop's, one thread, no lock.
Every refusal names the setting that refused it, so that whoever reads a 429 knows what to raise.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tasks.runtime.gateway.protocol import RequestError

# A bucket of one request refuses a client that paces itself at exactly its rate whenever its clock runs a little
# early (a third of such a client's requests at 10/s, docs/benchmarks.md); two forgive up to one interval of jitter.
MIN_BURST = 2.0
IN_FLIGHT_RETRY_S = 1  # a place in flight frees when some answer ends: no clock says when, so "soon"


@dataclass
class TokenBucket:
    """`rate` per second refilling up to `burst`; `level` may go below 0 (a debt) where a cost is charged late."""

    rate: float
    burst: float
    level: float = math.nan
    stamp: float = 0.0

    def refill(self, now: float) -> None:
        if math.isnan(self.level):
            self.level, self.stamp = self.burst, now
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_s(self, cost: float, now: float) -> float:
        """Seconds until `cost` can be taken; 0 where it can be now."""
        self.refill(now)
        return 0.0 if self.level >= cost else (cost - self.level) / self.rate

    def take(self, cost: float, now: float) -> None:
        """Take `cost` (a negative one gives back, never above the bucket's size)."""
        self.refill(now)
        self.level = min(self.burst, self.level - cost)


@dataclass
class Hold:
    """An admitted request's claim on its key's limits: a place in flight, and the tokens reserved for its answer.
    Released once, when the request ends however it ends (tasks/runtime/gateway/access.py's Guard)."""

    limits: ClientLimits
    client: str
    reserved: int = 0
    released: bool = False

    def reserve(self, tokens: int) -> None:
        self.limits.reserve(self, tokens)

    def release(self, used: int) -> None:
        self.limits.release(self, used)


def refused(setting: str, value: float, unit: str, wait_s: float) -> RequestError:
    """A 429 naming the setting that refused it; Retry-After is whole seconds, the message says the exact wait."""
    return RequestError(
        429,
        f"rate limit: serve.limits.{setting} = {value:g} {unit}; retry after {max(wait_s, 0.1):.1f} s",
        code="rate_limit_exceeded",
        retry_after=max(1, math.ceil(wait_s)),
    )


@dataclass
class ClientLimits:
    """The buckets and requests in flight of each client by name; a limit of 0 is no limit."""

    requests_per_second: float
    tokens_per_minute: int
    burst_s: float = 1.0  # the request bucket holds this many seconds of the rate (at least MIN_BURST requests)
    max_in_flight_per_key: int = 0
    clock: Callable[[], float] = time.monotonic
    requests: dict[str, TokenBucket] = field(default_factory=dict)
    tokens: dict[str, TokenBucket] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)

    def summary(self, max_in_flight: int, keyed: bool) -> str:
        """The limits in force, in one line (`llmops serve` prints it at start); `max_in_flight` is the cap of all
        keys together (access.py's Guard), `keyed` whether clients have keys (else all are one, "anonymous")."""

        def number(value: float) -> str:
            return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"

        def said(value: float, unit: str) -> str:
            return f"{number(value)} {unit}" if value else f"no {unit} limit"

        burst = f" (bursts of {number(max(MIN_BURST, self.requests_per_second * self.burst_s))})"
        return (
            f"limits per {'API key' if keyed else 'client (no keys: all clients are one)'}: "
            f"{said(self.requests_per_second, 'requests/s')}{burst if self.requests_per_second else ''}, "
            f"{said(self.tokens_per_minute, 'tokens/min')}"
            f"{' (max_tokens reserved at admission)' if self.tokens_per_minute else ''}, "
            f"{said(self.max_in_flight_per_key, 'requests in flight')}; "
            f"all together: {said(max_in_flight, 'requests in flight')} "
            "(serve.limits.*; 0 turns one off: --set serve.limits.requests_per_second=0)"
        )

    def admit(self, client: str) -> Hold:
        """Admit one request of `client` (its place in flight and its request counted), or refuse it with 429."""
        now = self.clock()
        if self.max_in_flight_per_key and self.in_flight.get(client, 0) >= self.max_in_flight_per_key:
            raise refused("max_in_flight_per_key", self.max_in_flight_per_key, "per key", IN_FLIGHT_RETRY_S)
        bucket = None
        if self.requests_per_second:
            rate = self.requests_per_second
            bucket = self.requests.setdefault(client, TokenBucket(rate, burst=max(MIN_BURST, rate * self.burst_s)))
            if (wait := bucket.wait_s(1, now)) > 0:
                raise refused("requests_per_second", rate, "per key", wait)
        if self.tokens_per_minute and (wait := self.token_bucket(client).wait_s(0, now)) > 0:  # in debt: no answer
            raise refused("tokens_per_minute", self.tokens_per_minute, "per key", wait)
        if bucket is not None:
            bucket.take(1, now)
        self.in_flight[client] = self.in_flight.get(client, 0) + 1
        return Hold(self, client)

    def token_bucket(self, client: str) -> TokenBucket:
        budget = self.tokens_per_minute
        return self.tokens.setdefault(client, TokenBucket(budget / 60, burst=budget))

    def reserve(self, hold: Hold, tokens: int) -> None:
        """Take the answer's `tokens` (its max_tokens) from the key's budget before it is generated, or refuse it
        with 429. An answer larger than the whole minute's budget waits for a full bucket and takes all of it."""
        if not self.tokens_per_minute or tokens <= 0:
            return
        now, cost = self.clock(), min(tokens, self.tokens_per_minute)
        bucket = self.token_bucket(hold.client)
        if (wait := bucket.wait_s(cost, now)) > 0:
            raise refused("tokens_per_minute", self.tokens_per_minute, "per key", wait)
        bucket.take(cost, now)
        hold.reserved += cost

    def release(self, hold: Hold, used: int) -> None:
        """The request ended having used `used` tokens: its place in flight frees, its reservation is settled."""
        if hold.released:
            return
        hold.released = True
        left = self.in_flight.get(hold.client, 0) - 1
        if left > 0:
            self.in_flight[hold.client] = left
        else:
            self.in_flight.pop(hold.client, None)
        if self.tokens_per_minute and (hold.reserved or used):
            self.token_bucket(hold.client).take(max(used, 0) - hold.reserved, self.clock())
