"""What capture (serve.capture) costs the clients: the same load through the gateway with capture off and on.

One Triton serves the cpu-tiny merged model as version `svc-a` of the service `svc`; three gateways of `llmops serve`
(tasks/runtime/gateway/) run in front of it, each in a process of its own as under `llmops serve`: capture off
(what serves today), capture on (every exchange kept, redacted, written to a local capture folder every 2 s), and
capture on with its store down (the capture location is a file, so every write fails and its batch is dropped).
At each concurrency the same streaming OpenAI client sends the same chat requests (each carrying an e-mail address
and a phone number, so redaction has work) through each gateway in rounds, in turn and in reverse order the next
round. Prints requests/s, TTFT and request latency p50/p99 side by side, p99 against capture off, and what each
gateway kept and dropped (its /metrics: the check that capture happened).

    .venv/bin/python benchmarks/capture_overhead.py [--home LLMOPS_HOME] [--concurrency 1,8,32] [--requests 256]
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
    int_list,
    percentile,
    prompts,
    python_serve,
    stream,
    triton_model,
)

from tasks.platform.ports import free_port

TOKENS = 8  # cpu-tiny's bench.output_tokens
MODES = ("capture off", "capture on", "store down")


def chat_text(event: dict) -> str:
    return "".join(choice.get("delta", {}).get("content") or "" for choice in event.get("choices", []))


def measure(endpoint: Endpoint, concurrency: int, requests: int) -> dict:
    texts = [f"{text} (reply to jane.doe@example.com or +1 415 555 2671)" for text in prompts(requests)]
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


def counters(port: int) -> dict[str, float]:
    """The gateway's capture counters: records kept and dropped, values redacted."""
    totals = {"kept": 0.0, "dropped": 0.0, "redacted": 0.0}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        for name, key in (("records", "kept"), ("dropped", "dropped"), ("redacted", "redacted")):
            if line.startswith(f"llmops_capture_{name}_total"):
                totals[key] += float(line.rsplit(" ", 1)[1])
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", type=Path, help="LLMOPS_HOME with a cpu-tiny run (else one is made)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="rounds per concurrency (each: every mode)")
    args = parser.parse_args()
    scratch, bench, profile = cpu_tiny_bench(args.home, TOKENS, args.concurrency, args.requests, "llmops-capture-")
    try:
        with triton_model(bench, python_serve(bench), "svc-a") as server:
            triton = server.client
            common = {"triton_url": triton.url, "service": "svc", "context_tokens": 512}
            common["table"] = routes("svc", {"svc-a": 100})
            down = scratch / "store-down"
            down.write_text("a file where the capture folder should be: every write fails")
            locations = {"capture on": scratch / "capture", "store down": down}
            ports, gateways = {}, []
            for mode in MODES:
                ports[mode] = free_port()
                capture = {"location": str(locations[mode]), "flush_s": 2.0} if mode in locations else None
                log = scratch / f"access-{mode.replace(' ', '-')}.log"
                gateways.append(start_gateway(ports[mode], log, **common, capture=capture))
            try:  # the gateways stop however the load ends (a failed request raises)
                results: dict[tuple[str, int], list[dict]] = {}
                for concurrency in args.concurrency:
                    for round_index in range(args.rounds):
                        for mode in MODES if round_index % 2 == 0 else tuple(reversed(MODES)):
                            endpoint = Endpoint(
                                f"http://127.0.0.1:{ports[mode]}/v1/chat/completions",
                                lambda text, n: {
                                    "messages": [{"role": "user", "content": text}],
                                    "max_tokens": n,
                                    "stream": True,
                                },
                                chat_text,
                            )
                            print(
                                f"bench: {mode} at concurrency {concurrency}, round {round_index + 1} ...", flush=True
                            )
                            results.setdefault((mode, concurrency), []).append(
                                measure(endpoint, concurrency, args.requests)
                            )
                time.sleep(3)  # the last flush
                kept = {mode: counters(ports[mode]) for mode in MODES}
            finally:
                for gateway in gateways:
                    gateway.terminate()
                    gateway.wait(30)
        print_table(args, results, kept)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def print_table(args: argparse.Namespace, results: dict[tuple[str, int], list[dict]], kept: dict) -> None:
    def median_of(rows: list[dict]) -> dict:
        return {key: percentile([r[key] for r in rows], 50) for key in rows[0]}

    print(
        f"\ncpu-tiny merged model, the gateway in front; {args.requests} streaming chat requests of "
        f"up to {TOKENS} tokens per run, median of {args.rounds} runs per cell\n"
    )
    header = f"{'concurrency':>11}  {'mode':12} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'lat p50':>8}"
    print(header + f" {'lat p99':>8} {'p99 vs off':>11}")
    for concurrency in args.concurrency:
        base = median_of(results[("capture off", concurrency)])
        for mode in MODES:
            row = median_of(results[(mode, concurrency)])
            print(
                f"{concurrency:>11}  {mode:12} {row['req_s']:7.1f} {row['ttft_p50']:9.1f} {row['ttft_p99']:9.1f} "
                f"{row['latency_p50']:8.1f} {row['latency_p99']:8.1f} {row['latency_p99'] / base['latency_p99']:10.2f}x"
            )
    print("\nwhat each gateway's /metrics says it kept, dropped and redacted (all runs and warm-ups):")
    for mode, totals in kept.items():
        print(
            f"  {mode:12} kept {totals['kept']:.0f}, dropped {totals['dropped']:.0f}, redacted {totals['redacted']:.0f}"
        )


if __name__ == "__main__":
    main()
