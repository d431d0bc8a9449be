"""What the gateway costs its clients, and what a burst over one key's rate limit costs the others.

One Triton serves the cpu-tiny merged model as version `svc-a`; the gateway of `llmops serve` runs in front in a
process of its own (benchmarks/gateway_process.py), with a route table that sends the service `svc` to `svc-a`, API
keys, every limit switched on (requests/s and tokens/min per key, requests in flight), its probes and its access
log written, as `llmops serve` runs it. The client is one asyncio process (aiohttp), the same for every row.

1. overhead: the same non-streaming requests (8 tokens each, forced with min_length) direct to the version's own
   Triton model (`/v2/models/svc-a/generate`) and to the service through the gateway (`/v2/models/svc/generate`),
   at each concurrency (closed loop), in rounds that alternate which goes first. The limits are set far above the load, so that they are checked on every request but refuse none.
   Prints requests/s, latency p50/p99 and the gateway's requests/s as a share of Triton's; `bare` is
   benchmarks/bare_proxy.py, a Python proxy that only relays (uvicorn and aiohttp, none of the gateway's checks,
   log or counters): the floor of what a Python hop costs here, under the gateway's own. Also the
   CPU time per answered request (user + system, from /proc through psutil) of Triton's process tree (server and
   model stubs), of the gateway's process and of the client: on a machine whose cores are all busy, a
   gateway's CPU is taken from Triton's.
2. burst: two keys, each limited to --rate requests/s. For --seconds, both send at their rate (the baseline); then
   for as long, `steady` sends at its rate while `bursty` sends 10 times its rate. Prints per key and phase what was
   sent, answered (200) and refused (429), and the answered requests' p50/p99, with p99 against the baseline; once
   with the default bucket (serve.limits.burst_s 1: one second of the rate at once) and once with 0.1.

`--apart` runs the overhead part with the model server's compute apart from the hop's, as where the model's work is
on a GPU and the gateway has cores of its own: Triton's processes (server and model stubs) on CPU 0 alone, the client
and the gateway (or the bare relay) on CPU 1, for every path alike (the direct path's client is on CPU 1 too). The
gateway then shares its core with the client, not with Triton. `--set` serves the model with other settings than
cpu-tiny's (`serve.max_queue_delay_us=0`: Triton batches only what is already queued, so when requests arrive
matters less to what a request costs).

    .venv/bin/python benchmarks/gateway_overhead.py [--home LLMOPS_HOME] [--concurrency 1,8,32] [--requests 256]
        [--rounds 2] [--rate 10] [--seconds 20] [--apart] [--set serve.KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil
from gateway_process import cpu_tiny_bench, routes, start_bare_proxy, start_gateway  # this script's folder: sys.path[0]
from serving_batching import int_list, percentile, prompts, python_serve, triton_model

from flows.cli.common import add_overrides_flag
from tasks.platform.config import load_profile
from tasks.platform.errors import BadInput
from tasks.platform.ports import free_port

TOKENS = 8  # cpu-tiny's bench.output_tokens
KEYS = {"steady": "bench-steady-key-0123456789abcdef", "bursty": "bench-bursty-key-0123456789abcdef"}
BURST = 10  # times the key's rate
BURST_S = (1.0, 0.1)  # serve.limits.burst_s: the default, and a bucket of its smallest size (2 requests) at 10/s
PATHS = ("Triton", "gateway", "bare")  # bare: benchmarks/bare_proxy.py, a relay with none of the gateway's work


@dataclass
class Run:
    """One overhead run: its seconds, what it got, and the CPU seconds each process group spent meanwhile."""

    seconds: float
    sent: Sent
    cpu_s: dict[str, float]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds so far of a process and its descendants (this process: itself only, its children
    being Triton and the gateways)."""
    root = psutil.Process(pid)
    total = 0.0
    for process in [root] if pid == os.getpid() else [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def pin(pid: int, cores: list[int] | None) -> None:
    """Every thread of a process and its descendants (this process: itself only) on `cores`; None: on every core
    again. Applied before each run: Triton starts a model's stub processes when it loads it."""
    cores = cores if cores is not None else list(range(psutil.cpu_count() or 1))
    root = psutil.Process(pid)
    for process in [root] if pid == os.getpid() else [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            for thread in process.threads():  # each thread's own: sched_setaffinity of a pid sets one thread's
                os.sched_setaffinity(thread.id, cores)


def measured(groups: dict[str, int], url: str, key: str | None, concurrency: int, requests: int) -> Run:
    """closed_loop, with the CPU each group of processes (name: root pid) spent during it."""
    before = {name: cpu_seconds(pid) for name, pid in groups.items()}
    seconds, sent = asyncio.run(closed_loop(url, key, concurrency, requests))
    return Run(seconds, sent, {name: cpu_seconds(pid) - before[name] for name, pid in groups.items()})


@dataclass
class Sent:
    statuses: Counter[int] = field(default_factory=Counter)
    answered_ms: list[float] = field(default_factory=list)  # latency of the 200s

    def row(self) -> dict:
        return {
            "sent": sum(self.statuses.values()),
            "200": self.statuses[200],
            "429": self.statuses[429],
            "other": sum(n for status, n in self.statuses.items() if status not in (200, 429)),
            "p50": percentile(self.answered_ms, 50),
            "p99": percentile(self.answered_ms, 99),
        }


async def send(session: aiohttp.ClientSession, url: str, text: str, key: str | None, sent: Sent) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"text_input": text, "max_tokens": TOKENS, "min_length": TOKENS}
    started = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as response:
            await response.read()
            status = response.status
    except aiohttp.ClientError:
        status = 0
    sent.statuses[status] += 1
    if status == 200:
        sent.answered_ms.append((time.perf_counter() - started) * 1000)


async def closed_loop(url: str, key: str | None, concurrency: int, requests: int) -> tuple[float, Sent]:
    """`requests` requests from `concurrency` workers, each sending its next once answered; (seconds, results)."""
    texts, sent = prompts(requests), Sent()
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        await send(session, url, texts[0], key, Sent())  # warm-up: a connection and the model's first answer
        queue = iter(texts)

        async def worker() -> None:
            for text in queue:
                await send(session, url, text, key, sent)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started, sent


async def paced(session: aiohttp.ClientSession, url: str, key: str, per_s: float, seconds: float) -> Sent:
    """An open loop: a request every 1/per_s seconds for `seconds`, whether or not the last was answered."""
    sent, tasks, texts = Sent(), [], prompts(int(per_s * seconds) + 1)
    started = time.perf_counter()
    for index, text in enumerate(texts):
        await asyncio.sleep(max(0.0, started + index / per_s - time.perf_counter()))
        tasks.append(asyncio.create_task(send(session, url, text, key, sent)))
    await asyncio.gather(*tasks)
    return sent


async def burst_phases(url: str, rate: float, seconds: float) -> dict[str, dict[str, Sent]]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        await send(session, url, "warm-up", KEYS["steady"], Sent())
        await asyncio.sleep(1)  # the warm-up's token back in the bucket
        phases = {}
        for phase, bursty_rate in (("baseline", rate), ("burst", rate * BURST)):
            print(f"bench: burst, {phase} ({seconds:g} s) ...", flush=True)
            steady, bursty = await asyncio.gather(
                paced(session, url, KEYS["steady"], rate, seconds),
                paced(session, url, KEYS["bursty"], bursty_rate, seconds),
            )
            phases[phase] = {"steady": steady, "bursty": bursty}
            await asyncio.sleep(2)  # both buckets full again
        return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", type=Path, help="LLMOPS_HOME with a cpu-tiny run (else one is made)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=256, help="requests per overhead run")
    parser.add_argument("--rounds", type=int, default=2, help="overhead runs per concurrency and path")
    parser.add_argument("--rate", type=float, default=10, help="each key's requests/s limit in the burst part")
    parser.add_argument("--seconds", type=float, default=20, help="length of each burst phase")
    parser.add_argument(
        "--apart", action="store_true", help="overhead runs with Triton on CPU 0 alone, client and gateway on CPU 1"
    )
    add_overrides_flag(parser, "a serving setting of the model's Triton (e.g. serve.max_queue_delay_us=0)")
    args = parser.parse_args()
    if args.apart and (psutil.cpu_count() or 1) < 2:
        parser.error("--apart needs 2 CPUs")
    try:  # a wrong setting named before anything starts
        load_profile("cpu-tiny", args.overrides)
    except BadInput as error:
        parser.error(str(error))
    scratch, bench, profile = cpu_tiny_bench(
        args.home, TOKENS, args.concurrency, args.requests, "llmops-gateway-bench-"
    )
    try:
        with triton_model(bench, [*python_serve(bench), *args.overrides], "svc-a") as server:
            triton = server.client
            health = profile.serve.health.model_dump()  # deadlines and probes as `llmops serve` runs them
            common = {"triton_url": triton.url, "service": "svc", "context_tokens": 512, "health": health}
            common["table"] = routes("svc", {"svc-a": 100})
            keys = {key: name for name, key in KEYS.items()}
            port = free_port()
            gateway = start_gateway(
                port,
                scratch / "access.log",
                **common,
                api_keys=keys,
                requests_per_second=100_000,
                tokens_per_minute=100_000_000,
                max_in_flight=256,
            )
            bare_port = free_port()
            bare = start_bare_proxy(bare_port, triton.url)
            paths = {
                "Triton": (f"{triton.url}/v2/models/svc-a/generate", None, None),
                "gateway": (f"http://127.0.0.1:{port}/v2/models/svc/generate", KEYS["steady"], gateway.pid),
                "bare": (f"http://127.0.0.1:{bare_port}/v2/models/svc-a/generate", None, bare.pid),
            }
            overhead = overhead_runs(args, server.process.pid, paths)
            for process in (gateway, bare):
                process.terminate()
                process.wait(30)
            for pid in (server.process.pid, os.getpid()):
                pin(pid, None)
            phases = {}
            for burst_s in BURST_S:
                port = free_port()
                gateway = start_gateway(
                    port,
                    scratch / f"access-burst-{burst_s}.log",
                    **common,
                    api_keys=keys,
                    requests_per_second=args.rate,
                    request_burst_s=burst_s,
                )
                url = f"http://127.0.0.1:{port}/v2/models/svc/generate"
                phases[burst_s] = asyncio.run(burst_phases(url, args.rate, args.seconds))
                gateway.terminate()
                gateway.wait(30)
        print_overhead(args, overhead)
        print_burst(args, phases)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def overhead_runs(
    args: argparse.Namespace, triton_pid: int, paths: dict[str, tuple[str, str | None, int | None]]
) -> dict[tuple[str, int], list[Run]]:
    """args.rounds runs per path and concurrency, the paths in turn and in reverse order the next round."""
    overhead: dict[tuple[str, int], list[Run]] = {}
    for concurrency in args.concurrency:
        for round_index in range(args.rounds):
            for path in list(paths) if round_index % 2 == 0 else list(reversed(paths)):  # ABC, CBA, ...
                print(f"bench: {path} at concurrency {concurrency}, round {round_index + 1} ...", flush=True)
                url, key, hop_pid = paths[path]
                groups = {"Triton": triton_pid, "client": os.getpid()}
                if hop_pid is not None:
                    groups["gateway"] = hop_pid
                if args.apart:
                    pin(triton_pid, [0])
                    for _, _, pid in paths.values():
                        pin(pid if pid is not None else os.getpid(), [1])
                run = measured(groups, url, key, concurrency, args.requests)
                overhead.setdefault((path, concurrency), []).append(run)
    return overhead


def print_overhead(args: argparse.Namespace, results: dict[tuple[str, int], list[Run]]) -> None:
    print(
        f"\n1. overhead: cpu-tiny's version model direct and the service through the gateway, {args.requests} "
        f"non-streaming generate requests of {TOKENS} "
        f"tokens per run, median of {args.rounds} runs per cell; CPU ms per answered request by process group"
        f"{'; Triton on CPU 0 alone, client and gateway on CPU 1 (--apart)' if args.apart else ''}"
        f"{'; the model served with ' + ', '.join(args.overrides) if args.overrides else ''}\n"
    )
    print(
        f"{'concurrency':>11}  {'path':8} {'req/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'failed':>6} "
        f"{'req/s vs Triton':>16} {'CPU Triton':>10} {'gateway':>8} {'client':>7}"
    )
    for concurrency in args.concurrency:
        cells = {}
        for path in PATHS:
            runs = results[(path, concurrency)]
            rows = [run.sent.row() for run in runs]

            def cpu_ms(group: str, runs: list[Run] = runs) -> float | None:
                shares = [
                    1000 * run.cpu_s[group] / max(run.sent.statuses[200], 1) for run in runs if group in run.cpu_s
                ]
                return percentile(shares, 50) if shares else None

            cells[path] = {
                "req_s": percentile([run.sent.statuses[200] / run.seconds for run in runs], 50),
                "p50": percentile([r["p50"] for r in rows if r["p50"] is not None], 50),
                "p99": percentile([r["p99"] for r in rows if r["p99"] is not None], 50),
                "failed": sum(r["sent"] - r["200"] for r in rows),
                "cpu": [cpu_ms(group) for group in ("Triton", "gateway", "client")],
            }
        for path, cell in cells.items():
            share = cell["req_s"] / cells["Triton"]["req_s"]
            cpu = " ".join(
                f"{'-' if ms is None else f'{ms:.2f}':>{width}}"
                for ms, width in zip(cell["cpu"], (10, 8, 7), strict=True)
            )
            print(
                f"{concurrency:>11}  {path:8} {cell['req_s']:7.1f} {cell['p50']:8.1f} {cell['p99']:8.1f} "
                f"{cell['failed']:6d} {share:15.2f}x {cpu}"
            )


def print_burst(args: argparse.Namespace, by_burst_s: dict[float, dict[str, dict[str, Sent]]]) -> None:
    print(
        f"\n2. burst: two keys limited to {args.rate:g} requests/s each through the gateway; {args.seconds:g} s "
        f"with both at their rate, then {args.seconds:g} s with `bursty` at {BURST}x its rate; per "
        "serve.limits.burst_s (the key's bucket: seconds of its rate it may send at once)\n"
    )
    print(
        f"{'burst_s':>7} {'phase':9} {'key':7} {'sent':>5} {'200':>5} {'429':>5} {'other':>5} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'p99 vs baseline':>16}"
    )
    for burst_s, phases in by_burst_s.items():
        for phase in ("baseline", "burst"):
            for key in ("steady", "bursty"):
                row, base = phases[phase][key].row(), phases["baseline"][key].row()
                against = row["p99"] / base["p99"] if row["p99"] and base["p99"] else float("nan")
                print(
                    f"{burst_s:7g} {phase:9} {key:7} {row['sent']:5d} {row['200']:5d} {row['429']:5d} "
                    f"{row['other']:5d} {row['p50'] or float('nan'):8.1f} {row['p99'] or float('nan'):8.1f} "
                    f"{against:15.2f}x"
                )


if __name__ == "__main__":
    main()
