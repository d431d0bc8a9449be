"""How much each client may ask of the gateway: requests per second and tokens per minute per API key, each a
token bucket, so that one client cannot take the model server from the others (issue 22).

Our own small bucket rather than a library: `limits` (the usual choice) is not in this environment, and a
token budget is charged after the answer, when its tokens are known, which a bucket allowed into debt fits:
a client over its budget waits until the debt has refilled. Time is the event loop's, one thread, no lock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tasks.serving.gateway.protocol import RequestError

# A bucket of one request refuses a client that paces itself at exactly its rate whenever its clock runs a little
# early (a third of such a client's requests at 10/s, docs/benchmarks.md); two forgive up to one interval of jitter.
MIN_BURST = 2.0


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
        self.refill(now)
        self.level -= cost


@dataclass
class ClientLimits:
    """The buckets of each client by name; a limit of 0 is no limit."""

    requests_per_second: float
    tokens_per_minute: int
    burst_s: float = 1.0  # the request bucket holds this many seconds of the rate (at least MIN_BURST requests)
    clock: Callable[[], float] = time.monotonic
    requests: dict[str, TokenBucket] = field(default_factory=dict)
    tokens: dict[str, TokenBucket] = field(default_factory=dict)

    def admit(self, client: str) -> None:
        """Count one request of `client`, or refuse it with 429 and the seconds to wait (Retry-After)."""
        now = self.clock()
        waits = []
        if self.requests_per_second:
            rate = self.requests_per_second
            bucket = self.requests.setdefault(client, TokenBucket(rate, burst=max(MIN_BURST, rate * self.burst_s)))
            waits.append(("requests per second", rate, bucket.wait_s(1, now)))
        if self.tokens_per_minute:
            budget = self.tokens_per_minute
            tokens = self.tokens.setdefault(client, TokenBucket(budget / 60, burst=budget))
            waits.append(("tokens per minute", budget, tokens.wait_s(1, now)))
        for what, limit, wait in waits:
            if wait > 0:
                raise RequestError(
                    429,
                    f"rate limit of {limit:g} {what} for this API key reached; retry after {math.ceil(wait)} s",
                    code="rate_limit_exceeded",
                    retry_after=math.ceil(wait),
                )
        if self.requests_per_second:
            self.requests[client].take(1, now)

    def charge_tokens(self, client: str, tokens: int) -> None:
        """The tokens an answer used, counted once it is known; the next request waits while in debt."""
        if self.tokens_per_minute and tokens > 0:
            budget = self.tokens_per_minute
            self.tokens.setdefault(client, TokenBucket(budget / 60, burst=budget)).take(tokens, self.clock())
