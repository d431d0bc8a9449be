"""A step load against `llmops serve`, one fixed replica against serve.autoscale, side by side.

For each mode, `llmops serve` starts for --home (a home with a champion: `make run` makes one), without rate limits;
closed loops of clients (tests/soak.py, the soak's client: mixed /v1 streaming chat and /v2 generate, 8 tokens, a
tenth of the streams hung up on purpose, a 20 s deadline) step through --steps (concurrency:seconds, in order, no
pause between them), while the gateway's /metrics is read every second. Prints per mode and step: requests, failed
(5xx but a 503 with Retry-After, and hung), requests/s, latency p50 and p99 of the answered ones, the time to first
token's p99 (the gateway's histogram over the step, interpolated within its buckets as Prometheus' histogram_quantile
does), and the replicas in the gateway's pool (least..most during the step).

    .venv/bin/python benchmarks/autoscale_step.py [--home .llmops] [--artifacts STORE] [--steps 2:60,32:120,2:90]
        [--autoscale "{min_replicas: 1, max_replicas: 3, target: 4, scale_up_window_s: 10, scale_down_window_s: 30}"]
        [--mode fixed|autoscale]  (both unless one is named)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.soak import soak  # noqa: E402

LLMOPS = ROOT / ".venv" / "bin" / "llmops"
POLICY = "{min_replicas: 1, max_replicas: 3, target: 4, scale_up_window_s: 10, scale_down_window_s: 30}"


def start_serve(
    home: Path, profile: str, log: Path, autoscale: str | None, artifacts: str | None, *more: str
) -> tuple[subprocess.Popen, dict]:
    """`llmops serve` for `home` on free ports without rate limits (`more`: further --set pairs); once published."""
    ports = [f"--{name}=0" for name in ("port", "control-port", "triton-http-port", "triton-grpc-port")]
    ports += ["--metrics-port=0", "--gateway-metrics-port=0"]
    settings = ["--set", "serve.limits.requests_per_second=0", "--set", "serve.limits.tokens_per_minute=0"]
    settings += ["--set", "serve.limits.max_in_flight=0", *more]
    if autoscale:
        settings += ["--set", f"serve.autoscale={autoscale}"]
    if artifacts:
        settings += ["--artifacts", artifacts]
    published = home / "triton" / "server.json"
    published.unlink(missing_ok=True)
    with open(log, "w") as out:
        process = subprocess.Popen(
            [str(LLMOPS), "serve", "--profile", profile, *ports, *settings],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            env={**os.environ, "LLMOPS_HOME": str(home)},
        )  # fmt: skip
    deadline = time.monotonic() + 300
    while not published.is_file():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"autoscale-step: llmops serve did not start: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    return process, json.loads(published.read_text())


def pool_size(metrics_url: str) -> int:
    """Replicas in the gateway's pool: its llmops_gateway_replica_up gauges."""
    import requests

    lines = requests.get(f"{metrics_url}/metrics", timeout=5).text.splitlines()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in lines if line.startswith("llmops_gateway_replica_up{"))


def first_token_buckets(metrics_url: str) -> dict[float, float]:
    """The gateway's time-to-first-token histogram, all versions together: upper bound (s) -> cumulative count."""
    import requests

    buckets: dict[float, float] = {}
    for line in requests.get(f"{metrics_url}/metrics", timeout=5).text.splitlines():
        if line.startswith("llmops_gateway_time_to_first_token_seconds_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            upper = float("inf") if bound == "+Inf" else float(bound)
            buckets[upper] = buckets.get(upper, 0.0) + float(line.rsplit(" ", 1)[1])
    return buckets


def histogram_quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float:
    """Prometheus' histogram_quantile over the counts added between two scrapes (linear within a bucket), in ms."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return float("nan")
    rank, lower, below = q * counts[-1], 0.0, 0.0
    for upper, cumulative in zip(bounds, counts, strict=True):
        if cumulative >= rank:
            if upper == float("inf"):
                return lower * 1000
            return (lower + (upper - lower) * (rank - below) / max(cumulative - below, 1e-9)) * 1000
        lower, below = upper, cumulative
    return float("nan")


async def step(state: dict, concurrency: int, seconds: float) -> dict:
    seen: list[int] = []
    before = await asyncio.to_thread(first_token_buckets, state["gateway_metrics_url"])

    async def watch() -> None:
        stop_at = time.monotonic() + seconds
        while time.monotonic() < stop_at:
            seen.append(await asyncio.to_thread(pool_size, state["gateway_metrics_url"]))
            await asyncio.sleep(1)

    soaked = await soak(state["gateway_url"], state["service"], concurrency, seconds, during=watch)
    after = await asyncio.to_thread(first_token_buckets, state["gateway_metrics_url"])
    answered = sorted(soaked.latencies_ms)

    def quantile(q: float) -> float:
        return answered[int(q * (len(answered) - 1))] if answered else float("nan")

    total = sum(soaked.statuses.values())
    return {
        "concurrency": concurrency,
        "requests": total,
        "failed": soaked.failed,
        "per_s": total / max(soaked.seconds, 1e-9),
        "p50_ms": quantile(0.5),
        "p99_ms": quantile(0.99),
        "ttft_p99_ms": histogram_quantile(0.99, before, after),
        "replicas": f"{min(seen, default=0)}..{max(seen, default=0)}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("LLMOPS_HOME", ".llmops")))
    parser.add_argument("--profile", default="cpu-tiny")
    parser.add_argument("--steps", default="2:60,32:120,2:90", help="concurrency:seconds, in order")
    parser.add_argument("--autoscale", default=POLICY, help="serve.autoscale of the second mode")
    parser.add_argument("--artifacts", help="the artifact store the champion is in (default: the home's)")
    parser.add_argument("--mode", action="append", choices=["fixed", "autoscale"], help="one mode (default: both)")
    args = parser.parse_args(argv)
    steps = [(int(c), float(s)) for c, s in (item.split(":") for item in args.steps.split(","))]
    print(f"autoscale-step: {args.profile} at {args.home}; steps {args.steps}; autoscale {args.autoscale}", flush=True)
    rows = []
    modes = {"fixed": ("fixed 1", None), "autoscale": ("autoscale", args.autoscale)}
    for mode, autoscale in (modes[name] for name in args.mode or modes):
        log = args.home / f"autoscale-step-{mode[:5]}.log"
        process, state = start_serve(args.home, args.profile, log, autoscale, args.artifacts)
        try:
            for concurrency, seconds in steps:
                found = asyncio.run(step(state, concurrency, seconds))
                rows.append({"mode": mode, **found})
                print(f"autoscale-step: {mode} c={concurrency}: {found}", flush=True)
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(60)
    print(
        f"\n{'mode':<10} {'clients':>7} {'requests':>8} {'failed':>6} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'TTFT p99':>8} {'replicas':>8}"
    )
    for row in rows:
        print(
            f"{row['mode']:<10} {row['concurrency']:>7} {row['requests']:>8} {row['failed']:>6} {row['per_s']:>7.1f} "
            f"{row['p50_ms']:>7.0f} {row['p99_ms']:>7.0f} {row['ttft_p99_ms']:>8.0f} {row['replicas']:>8}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
