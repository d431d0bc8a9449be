"""How long the first request waits once `llmops serve` scaled to zero (serve.autoscale min_replicas 0), per engine,
beside the same request to a replica that stays up (what a service without scale to zero answers).

For each engine (--engines, serve.backend with merged versions): `llmops serve` starts for --home (a home with a
champion: `make run` makes one) with serve.autoscale {min_replicas: 0, max_replicas: 1, scale_down_window_s: 3};
--rounds times it waits until no tritonserver runs under it, then sends one chat completion through the gateway's /v1
with the `openai` SDK (no retries) and times it (cold), and one more at once (warm: the replica that just started).
Prints per engine: the cold answers' median and worst, the warm ones' median, and the bound the gateway holds a
request for (serve.autoscale.cold_start_timeout_s).

    .venv/bin/python benchmarks/cold_start.py [--home .llmops] [--artifacts STORE] [--engines python,vllm] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.autoscale_step import start_serve  # noqa: E402

ZERO = "{min_replicas: 0, max_replicas: 1, scale_up_window_s: 1, scale_down_window_s: 3, sample_every_s: 0.5}"
BOUND_S = 300.0  # serve.autoscale.cold_start_timeout_s's default, which ZERO keeps


def tritons_under(pid: int) -> int:
    import psutil

    return sum(1 for p in psutil.Process(pid).children(recursive=True) if p.name() == "tritonserver")


def timed_answer(client, service: str) -> float:
    started = time.monotonic()
    answer = client.chat.completions.create(
        model=service, messages=[{"role": "user", "content": "What is the opposite of hot?"}], max_tokens=4
    )
    if not answer.choices or answer.choices[0].message.content is None:
        raise SystemExit(f"cold-start: no answer: {answer}")
    return time.monotonic() - started


def measure(home: Path, profile: str, engine: str, rounds: int, artifacts: str | None) -> dict:
    import openai

    log = home / f"cold-start-{engine}.log"
    backend = ["--set", f"serve.backend={engine}", "--set", "serve.lora=merged"]
    process, state = start_serve(home, profile, log, ZERO, artifacts, *backend)
    client = openai.OpenAI(base_url=f"{state['gateway_url']}/v1", api_key="none", max_retries=0, timeout=BOUND_S + 30)
    cold, warm = [], []
    try:
        for _ in range(rounds):
            deadline = time.monotonic() + 120
            while tritons_under(process.pid):
                if time.monotonic() > deadline or process.poll() is not None:
                    raise SystemExit(f"cold-start: {engine}: never scaled to zero: {log.read_text()[-2000:]}")
                time.sleep(0.2)
            cold.append(timed_answer(client, state["service"]))
            warm.append(timed_answer(client, state["service"]))
            print(f"cold-start: {engine}: cold {cold[-1]:.2f} s, warm {warm[-1]:.3f} s", flush=True)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(60)
    return {
        "engine": engine,
        "cold_p50": statistics.median(cold),
        "cold_max": max(cold),
        "warm_p50": statistics.median(warm),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("LLMOPS_HOME", ".llmops")))
    parser.add_argument("--profile", default="cpu-tiny")
    parser.add_argument("--artifacts", help="the artifact store the champion is in (default: the home's)")
    parser.add_argument("--engines", default="python,vllm", help="serve.backend values, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"cold-start: {args.profile} at {args.home}; {args.rounds} rounds; serve.autoscale {ZERO}", flush=True)
    rows = [measure(args.home, args.profile, e, args.rounds, args.artifacts) for e in args.engines.split(",")]
    print(f"\n{'engine':<8} {'cold p50 s':>10} {'cold max s':>10} {'warm p50 s':>10} {'bound s':>8}")
    for row in rows:
        print(
            f"{row['engine']:<8} {row['cold_p50']:>10.2f} {row['cold_max']:>10.2f} {row['warm_p50']:>10.3f} "
            f"{BOUND_S:>8.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
