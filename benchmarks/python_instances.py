"""One instance of the Python-backend model or two: throughput and its spread from batch to batch.

One Triton serves cpu-tiny's merged model (infra/triton/llm, one torch thread per instance) with
serve.instance_count 1, then 2. A closed loop of `concurrency` streaming clients (aiohttp, this process) sends
--batches batches of --requests requests each to /v2/models/NAME/generate_stream (8 tokens forced with
min_length); per batch it prints requests/s and, from Triton's own counters, the mean time a request waited in
Triton's queue and the mean compute time per request (nv_inference_queue_duration_us,
nv_inference_compute_infer_duration_us). Then per configuration: the median, lowest and highest batch.

With one instance, a request waited 12 to 50 ms in Triton's queue in front of an instance that computed for 6 to 13
ms, and that wait (in steps of about 2 ms) changed from batch to batch; with two, it is the batcher's own delay
(serve.max_queue_delay_us, 2 ms). The wait is not the batcher's delay (0 made it longer) nor a busy CPU (the cores
were 75% idle); what inside Triton's Python backend holds the single instance between two executes is not found.

    .venv/bin/python benchmarks/python_instances.py [--home LLMOPS_HOME] [--concurrency 1,4] [--requests 256]
        [--batches 6]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import time
from pathlib import Path

import aiohttp
from gateway_process import cpu_tiny_bench  # this script's folder is first on sys.path
from serving_batching import int_list, prompts, triton_model

from tasks.serving.client import parse_metric

TOKENS = 8
NAME = "svc-a"
COUNTERS = ("nv_inference_request_success", "nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us")
INSTANCES = (1, 2)


async def batch(url: str, concurrency: int, requests: int) -> float:
    """`requests` streaming requests from `concurrency` workers (closed loop); requests/s."""
    texts, sent = prompts(requests), 0
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            nonlocal sent
            while sent < requests:
                text, sent = texts[sent], sent + 1
                body = {"text_input": text, "max_tokens": TOKENS, "min_length": TOKENS, "stream": True}
                async with session.post(url, json=body) as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"Triton answered {response.status}")

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return requests / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", type=Path, help="LLMOPS_HOME with a cpu-tiny run (else one is made)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 4])
    parser.add_argument("--requests", type=int, default=256, help="requests per batch")
    parser.add_argument("--batches", type=int, default=6, help="batches per configuration and concurrency")
    args = parser.parse_args()
    scratch, bench, _ = cpu_tiny_bench(args.home, TOKENS, args.concurrency, args.requests, "llmops-instances-")
    rows = []
    try:
        for instances in INSTANCES:
            label = f"{instances} instance{'s' if instances > 1 else ''}"
            overrides = ["serve.max_batch_size=32", "serve.torch_threads=1", f"serve.instance_count={instances}"]
            with triton_model(bench, overrides, NAME) as server:
                url = f"{server.client.url}/v2/models/{NAME}/generate_stream"
                asyncio.run(batch(url, 1, 8))  # warm-up
                for concurrency in args.concurrency:
                    rates = []
                    for index in range(args.batches):
                        before = server.client.metrics()
                        rate = asyncio.run(batch(url, concurrency, args.requests))
                        after = server.client.metrics()
                        done, queue_us, infer_us = (
                            parse_metric(after, m, NAME) - parse_metric(before, m, NAME) for m in COUNTERS
                        )
                        print(
                            f"{label}, concurrency {concurrency}, batch {index + 1}: {rate:6.1f} req/s, queue "
                            f"{queue_us / done / 1000:5.1f} ms, compute {infer_us / done / 1000:5.1f} ms per request",
                            flush=True,
                        )
                        rates.append(rate)
                    rows.append((label, concurrency, rates))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n{args.batches} batches of {args.requests} streaming requests of {TOKENS} tokens per cell\n")
    print(f"{'instances':20} {'concurrency':>11} {'median req/s':>13} {'lowest':>8} {'highest':>8} {'high/low':>9}")
    for label, concurrency, rates in rows:
        print(
            f"{label:20} {concurrency:11d} {statistics.median(rates):13.1f} {min(rates):8.1f} {max(rates):8.1f} "
            f"{max(rates) / min(rates):8.2f}x"
        )


if __name__ == "__main__":
    main()
