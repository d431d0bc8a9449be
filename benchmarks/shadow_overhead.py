"""What a shadow window costs the clients: the same load through the gateway with and without the copies.

One Triton serves the cpu-tiny merged model twice (`svc-a`, the champion, and `svc-b`, the candidate) of the service
`svc`, and the gateway of `llmops serve` (tasks/runtime/gateway/) runs in front of it, in a process of its
own as under `llmops serve`. At each concurrency the same streaming OpenAI client sends the same chat requests through
the gateway in rounds, the modes in turn and in reverse order the next round: without shadow (what serves today), and
with a quarter and with every answered request copied to `svc-b` (canary.shadow_fraction 0.25 and 1.0), as a
release's shadow stage turns it on (the gateway's control API). Prints requests/s, TTFT p50/p99 and request latency p50/p99 side by side, p99 against the run
without shadow, and the copies the gateway recorded (the check that they happened).

The copies start after each answer is complete and run on the same 2 cores as everything else: what they can cost
clients is CPU taken from the requests that follow, which the later requests' latencies show.

    .venv/bin/python benchmarks/shadow_overhead.py [--home LLMOPS_HOME] [--concurrency 1,8] [--requests 128]
        [--rounds 2]
"""

from __future__ import annotations

import argparse
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from gateway_process import cpu_tiny_bench, routes, start_gateway
from serving_batching import (  # this script's folder is first on sys.path
    Endpoint,
    Timed,
    install,
    int_list,
    percentile,
    prompts,
    python_serve,
    serving_values,
    stream,
    triton_model,
)

from tasks.control.contract import records_file
from tasks.platform.ports import free_port
from tasks.serving.service import ServiceControl

TOKENS = 8  # cpu-tiny's bench.output_tokens
MODES = {"without shadow": None, "shadow 25%": ("svc-b", 0.25), "shadow 100%": ("svc-b", 1.0)}


def chat_text(event: dict) -> str:
    return "".join(choice.get("delta", {}).get("content") or "" for choice in event.get("choices", []))


def measure(endpoint: Endpoint, concurrency: int, requests: int) -> dict:
    texts = prompts(requests)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(timeout=600, limits=limits) as client:
        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            timed: list[Timed] = list(pool.map(lambda text: stream(client, endpoint, text, TOKENS), texts))
        seconds = time.perf_counter() - started
    ttft = [(t.chunks[0] - t.sent) * 1000 for t in timed if t.chunks]
    latency = [(t.chunks[-1] - t.sent) * 1000 for t in timed if t.chunks]
    return {
        "req_s": len(timed) / seconds,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "latency_p50": percentile(latency, 50),
        "latency_p99": percentile(latency, 99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", type=Path, help="LLMOPS_HOME with a cpu-tiny run (else one is made)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 8])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds per concurrency (each: both modes)")
    args = parser.parse_args()
    scratch, bench, profile = cpu_tiny_bench(args.home, TOKENS, args.concurrency, args.requests, "llmops-shadow-bench-")
    model_dir = bench.model_dir
    try:
        template, values = serving_values(profile, model_dir)
        with triton_model(bench, python_serve(bench), "svc-a") as server:
            triton = server.client
            install(triton, template, "svc-b", values)
            records, port, control_port, key = scratch / "shadow", free_port(), free_port(), "bench-control-key"
            gateway = start_gateway(
                port,
                scratch / "access.log",
                triton_url=triton.url,
                service="svc",
                context_tokens=512,
                shadow_records=records,
                table=routes("svc", {"svc-a": 100, "svc-b": 0}),
                control_key=key,
                control_port=control_port,
            )
            control = ServiceControl(f"http://127.0.0.1:{control_port}", key)
            endpoint = Endpoint(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                lambda text, n: {"messages": [{"role": "user", "content": text}], "max_tokens": n, "stream": True},
                chat_text,
            )
            results: dict[tuple[str, int], list[dict]] = {}
            copied: dict[tuple[str, int], int] = {}
            for concurrency in args.concurrency:
                for round_index in range(args.rounds):
                    order = list(MODES) if round_index % 2 == 0 else list(reversed(MODES))
                    for mode in order:
                        if MODES[mode]:
                            control.start_shadow(*MODES[mode], release="bench", lease_s=3600)
                        else:
                            control.stop_shadow()
                        with httpx.Client(timeout=600) as client:
                            stream(client, endpoint, prompts(1)[0], TOKENS)  # warm-up
                        before = count_records(records)
                        print(f"bench: {mode} at concurrency {concurrency}, round {round_index + 1} ...", flush=True)
                        results.setdefault((mode, concurrency), []).append(
                            measure(endpoint, concurrency, args.requests)
                        )
                        if MODES[mode]:
                            time.sleep(1)  # the last copies finish after their answers
                            key = (mode, concurrency)
                            copied[key] = copied.get(key, 0) + count_records(records) - before
            gateway.terminate()
            gateway.wait(30)
        print_table(args, results, copied)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def count_records(folder: Path) -> int:
    path = records_file(folder, "svc-b")
    return len(path.read_text().splitlines()) if path.is_file() else 0


def print_table(
    args: argparse.Namespace, results: dict[tuple[str, int], list[dict]], copied: dict[tuple[str, int], int]
) -> None:
    def median_of(rows: list[dict]) -> dict:
        return {key: percentile([r[key] for r in rows], 50) for key in rows[0]}

    print(
        f"\ncpu-tiny merged model as champion and candidate, the gateway in front routing between them; {args.requests} "
        f"streaming chat requests of up to {TOKENS} tokens per run, median of {args.rounds} runs per cell\n"
    )
    header = f"{'concurrency':>11}  {'mode':16} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'lat p50':>8}"
    print(header + f" {'lat p99':>8} {'p99 vs without':>15} {'copies':>7}")
    for concurrency in args.concurrency:
        base = median_of(results[("without shadow", concurrency)])
        for mode in MODES:
            row = median_of(results[(mode, concurrency)])
            print(
                f"{concurrency:>11}  {mode:16} {row['req_s']:7.1f} {row['ttft_p50']:9.1f} {row['ttft_p99']:9.1f} "
                f"{row['latency_p50']:8.1f} {row['latency_p99']:8.1f} {row['latency_p99'] / base['latency_p99']:14.2f}x "
                f"{copied.get((mode, concurrency), 0):7d}"
            )


if __name__ == "__main__":
    main()
