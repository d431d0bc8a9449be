"""A soak of a running `llmops serve`: does any request hang, or fail with a 5xx, over minutes of load?

Closed loops of clients (tests/soak.py) send mixed OpenAI streaming chat and Triton /v2 generate requests (8 tokens)
through the gateway, a tenth of the streaming ones hanging up after the first chunk, each request with a 20 s client
deadline; at each concurrency, --runs runs of --minutes each, then (with --ramp) the same while the control API walks
a second name of the champion's model 10 -> 50 -> 100 % and back (the routes change under load; no model loads),
and with --kill-replica N, replica N's tritonserver SIGKILLed at the ramp's first step (the serve starts it again).
Prints per run what the clients got: hung requests, failures (5xx but a 503 with Retry-After), every status, p99.

    llmops serve --set serve.limits.requests_per_second=0 --set serve.limits.tokens_per_minute=0 &
    .venv/bin/python benchmarks/soak.py [--home LLMOPS_HOME] [--concurrency 8,32] [--minutes 10] [--runs 3]
        [--ramp] [--kill-replica 1] [--api-key-env LLMOPS_SOAK_KEY]

The service is the one `llmops serve` publishes for --home (its server.json; the control key from
$LLMOPS_HOME/serving/control.key). An API key, where the gateway needs one, comes from the environment variable
--api-key-env names, never the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tasks.control.contract import RouteTable, Version  # noqa: E402
from tasks.serving.service import ServiceControl  # noqa: E402
from tests.soak import kill_replica, soak  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", type=Path, default=Path(os.environ.get("LLMOPS_HOME", ".llmops")))
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[8, 32])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ramp", action="store_true", help="also soak through a canary ramp of the routes")
    parser.add_argument("--kill-replica", type=int, help="SIGKILL this replica (0, 1, ...) at each ramp's first step")
    parser.add_argument("--api-key-env", help="the environment variable holding an API key for the gateway")
    args = parser.parse_args()
    state = json.loads((args.home / "triton" / "server.json").read_text())
    service = state["service"]
    control = ServiceControl(state["control_url"], (args.home / "serving" / "control.key").read_text().strip())
    headers = {"Authorization": f"Bearer {os.environ[args.api_key_env]}"} if args.api_key_env else {}
    seconds = args.minutes * 60
    rows = []
    for ramped in (False, True) if args.ramp else (False,):
        for concurrency in args.concurrency:
            for run in range(args.runs):
                kill = (lambda: kill_replica(state, args.kill_replica)) if args.kill_replica is not None else None
                during = ramp(control, service, seconds, kill) if ramped else None
                soaked = asyncio.run(
                    soak(state["gateway_url"], service, concurrency, seconds, headers, during=during, seed=run)
                )
                label = f"{'ramp' if ramped else 'steady'} c={concurrency} run {run + 1}"
                print(f"{label}: hung {soaked.hung}, failed {soaked.failed}; {soaked.summary()}", flush=True)
                rows.append((label, soaked.hung, soaked.failed, soaked.statuses[503]))
                if ramped and kill is not None:
                    wait_for_replicas(state, 300)
    print("\nrun                      hung  failed   503")
    for label, hung, failed, unavailable in rows:
        print(f"{label:24} {hung:5d} {failed:7d} {unavailable:5d}")


def wait_for_replicas(state: dict, timeout_s: float) -> None:
    """Every replica ready again (a killed one started again by the serve) before the next run."""
    import time

    import requests

    deadline = time.monotonic() + timeout_s
    for replica in state["replicas"]:
        while not ready(requests, replica["url"]):
            if time.monotonic() > deadline:
                raise SystemExit(f"replica {replica['url']} not ready {timeout_s:.0f}s after the run")
            time.sleep(1)


def ready(requests, url: str) -> bool:
    try:
        return requests.get(f"{url}/v2/health/ready", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def ramp(control: ServiceControl, service: str, seconds: float, kill=None):
    """The routes walk another name of the champion's model 10 -> 50 -> 100 % over the run, then back; `kill` at the
    first step."""
    routes = control.table()
    assert routes.champion is not None
    champion = routes.champion
    alias = Version(f"{service}-v9999", champion.model, champion.adapter)

    async def walk() -> None:
        step = seconds / 4
        for weight in (10, 50, 100):
            await asyncio.sleep(step)
            if kill is not None and weight == 10:
                kill()
            table = RouteTable(service, champion, alias, {champion.name: 100.0 - weight, alias.name: float(weight)})
            await asyncio.to_thread(control.put_table, RouteTable.of({**table.as_json(), "release": "soak"}), 600)
        await asyncio.sleep(step)
        await asyncio.to_thread(control.put_table, routes)

    return walk


if __name__ == "__main__":
    main()
