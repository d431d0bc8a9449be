"""What a candidate's load costs the champion's clients: Triton's model load over HTTP (what tritonclient.http's
load_model and a curl to /v2/repository/models/NAME/load do, and what this project did) against over gRPC (what the
pipeline does now, tasks/serving/grpc_loads.py), side by side in one run.

One Triton (the binary `llmops serve` runs) serves `champion`, a Python-backend model that answers at once; the
client is a gateway's: one aiohttp session whose keep-alive connections were opened while Triton was idle, at
`--concurrency` requests in a closed loop. After `--warmup` seconds, `candidate` (a Python-backend model whose
initialize takes `--load-s` seconds, as a real model's weights take) is loaded, then unloaded; the champion's
requests answered while it loads are compared: p50, p99, the slowest, and how many took over a second.

    .venv/bin/python benchmarks/load_stall.py [--concurrency 4] [--load-s 8] [--warmup 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.serving.server import TritonServer  # noqa: E402

CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "x", data_type: TYPE_FP32, dims: [ 1 ] }} ]
output [ {{ name: "y", data_type: TYPE_FP32, dims: [ 1 ] }} ]
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
"""
MODEL = """import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        time.sleep({load_s})

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("y", pb_utils.get_input_tensor_by_name(r, "x").as_numpy())])
            for r in requests
        ]
"""
BODY = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1.0]}]}


def write_models(repository: Path, load_s: float) -> None:
    for name, seconds in (("champion", 0), ("candidate", load_s)):
        (repository / name / "1").mkdir(parents=True)
        (repository / name / "config.pbtxt").write_text(CONFIG.format(name=name))
        (repository / name / "1" / "model.py").write_text(MODEL.format(load_s=seconds))


async def clients(url: str, concurrency: int, stop: threading.Event) -> list[tuple[float, float]]:
    """(sent at, seconds) of every champion request until `stop`, on one session's pooled connections."""
    import aiohttp

    answered: list[tuple[float, float]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def client() -> None:
            while not stop.is_set():
                sent = time.monotonic()
                async with session.post(f"{url}/v2/models/champion/infer", json=BODY) as response:
                    await response.read()
                    assert response.status == 200, response.status
                answered.append((sent, time.monotonic() - sent))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return answered


def measure(server: TritonServer, over: str, args) -> dict[str, float]:
    """One load of the candidate over `over` ("http" or "grpc") while the clients run."""
    client = server.client if over == "grpc" else dataclasses.replace(server.client, grpc_url=None)
    stop = threading.Event()
    results: list[list[tuple[float, float]]] = []
    loop = threading.Thread(
        target=lambda: results.append(asyncio.run(clients(server.client.url, args.concurrency, stop)))
    )
    loop.start()
    time.sleep(args.warmup)
    started = time.monotonic()
    client.load("candidate", timeout=args.load_s + 60)
    ended = time.monotonic()
    time.sleep(0.5)
    stop.set()
    loop.join()
    client.unload("candidate")
    during = sorted(seconds * 1000 for sent, seconds in results[0] if started <= sent <= ended)
    return {
        "load_s": ended - started,
        "requests": len(during),
        "p50_ms": statistics.median(during),
        "p99_ms": statistics.quantiles(during, n=100)[98] if len(during) > 1 else during[0],
        "max_ms": during[-1],
        "over_1s": sum(ms > 1000 for ms in during),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--load-s", type=float, default=8)
    parser.add_argument("--warmup", type=float, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="load-stall-") as home:
        write_models(Path(home) / "triton" / "repository", args.load_s)
        server = TritonServer.start(Path(home))
        try:
            server.client.load("champion")
            rows = []
            for round_ in range(args.rounds):
                for over in ("http", "grpc") if round_ % 2 == 0 else ("grpc", "http"):
                    rows.append((round_ + 1, over, measure(server, over, args)))
        finally:
            server.kill()
    print(f"\nthe champion's requests while the candidate loads ({args.concurrency} clients, load {args.load_s:g} s)")
    print(
        f"{'round':>5}  {'load over':<9}  {'load s':>6}  {'requests':>8}  {'p50 ms':>7}  {'p99 ms':>8}  {'max ms':>8}  >1 s"
    )
    for round_, over, row in rows:
        print(
            f"{round_:>5}  {over:<9}  {row['load_s']:>6.1f}  {row['requests']:>8}  {row['p50_ms']:>7.1f}  "
            f"{row['p99_ms']:>8.1f}  {row['max_ms']:>8.1f}  {row['over_1s']}"
        )


if __name__ == "__main__":
    main()
