"""Where the gateway's blocking work runs: bounded thread pools by kind of work, so that what an answer waits for
never queues behind a minute-long job (asyncio.to_thread shares one default pool, min(32, cores + 4) threads: six
here, which six replica restarts or recoveries at once would hold for minutes, every /v1 answer's token count
waiting behind them).

- answers (4 threads): work a request or a control write waits for: the token counts of every /v1 answer (one at a
  time in any case: the tokenizer's lock), a shadow copy's redaction, the deployment record's locked write. Four:
  a token count, a redaction and a record write at once with one to spare; on 2 cores more would only contend.
- capture (1): the capture buffer's flushes and its retention, sequential by nature; a slow store delays only them.
- jobs (2): minute-long work: a replica started again for a release, a model recovered by the probes. Two at once
  (two replicas); a third waits behind them, never in front of an answer.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

ANSWER_THREADS, CAPTURE_THREADS, JOB_THREADS = 4, 1, 2

P = ParamSpec("P")
R = TypeVar("R")


class Pools:
    def __init__(self) -> None:
        self.open()

    def open(self) -> None:
        """Fresh pools: their threads start with the first work given them."""
        self.answers = ThreadPoolExecutor(ANSWER_THREADS, thread_name_prefix="gateway-answers")
        self.capture = ThreadPoolExecutor(CAPTURE_THREADS, thread_name_prefix="gateway-capture")
        self.jobs = ThreadPoolExecutor(JOB_THREADS, thread_name_prefix="gateway-jobs")

    async def answer(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        return await run_in(self.answers, fn, *args, **kwargs)

    async def captured(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        return await run_in(self.capture, fn, *args, **kwargs)

    async def job(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        return await run_in(self.jobs, fn, *args, **kwargs)

    def close(self) -> None:
        """The threads end once their work is done (a restart is not cut); a gateway whose app starts again (a test's
        second client) gets fresh pools."""
        for pool in (self.answers, self.capture, self.jobs):
            pool.shutdown(wait=False, cancel_futures=True)
        self.open()


async def run_in(pool: ThreadPoolExecutor, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """`fn` in `pool`, with the caller's context variables (the request's, for the access and fault logs), as
    asyncio.to_thread runs it in the default pool."""
    context = contextvars.copy_context()
    call = functools.partial(context.run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(pool, call)
