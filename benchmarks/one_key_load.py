"""A first load test as a new user runs it: one API key, a closed loop of chat completions at each concurrency,
against a running `llmops serve`. Prints per concurrency what was sent, answered (200) and refused (429, with the
setting each refusal names), requests/s, and the tokens per minute the key used (usage.total_tokens): what
serve.limits' defaults must leave room for (issue 41).

    .venv/bin/python benchmarks/one_key_load.py URL [--key KEY] [--concurrency 8,32] [--requests 320]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from collections import Counter

import aiohttp

QUESTION = [{"role": "user", "content": "What is the opposite of hot?"}]


async def closed_loop(url: str, key: str | None, concurrency: int, requests: int) -> tuple[float, Counter, int]:
    statuses: Counter = Counter()
    tokens, left = 0, requests
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal tokens, left
        while left > 0:
            left -= 1
            async with session.post(f"{url}/v1/chat/completions", json={"messages": QUESTION}) as answer:
                body = await answer.json()
                if answer.status == 200:
                    statuses[200] += 1
                    tokens += body["usage"]["total_tokens"]
                else:
                    setting = re.search(r"serve\.limits\.\w+", str(body))
                    statuses[f"{answer.status} {setting.group(0) if setting else ''}".strip()] += 1

    started = time.perf_counter()
    async with aiohttp.ClientSession(headers=headers) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return time.perf_counter() - started, statuses, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the gateway, e.g. http://127.0.0.1:8080")
    parser.add_argument("--key", help="the API key (none: a gateway without keys)")
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--requests", type=int, default=320)
    args = parser.parse_args()
    print("| concurrency | sent | 200 | refused | req/s | tokens/min used |")
    print("|---|---|---|---|---|---|")
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        seconds, statuses, tokens = asyncio.run(closed_loop(args.url, args.key, concurrency, args.requests))
        refused = ", ".join(f"{n} x {what}" for what, n in statuses.items() if what != 200) or "0"
        print(
            f"| {concurrency} | {sum(statuses.values())} | {statuses[200]} | {refused} | "
            f"{statuses[200] / seconds:.1f} | {tokens / seconds * 60:,.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
