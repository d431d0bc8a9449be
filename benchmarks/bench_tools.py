"""genai-perf against AIPerf (bench.tool) on the same served model: what each measures, how much its runs spread,
and what a run costs.

One Triton serves the cpu-tiny merged model with the python backend at cpu-tiny's own serving settings. At each
concurrency, in --rounds rounds (the tools in turn, the order reversed every round), the benchmark stage's own
drivers measure it: tasks/load/genai_perf.py (one run, gRPC stream, `--endpoint-type kserve`) and
tasks/load/aiperf.py (bench.profile_runs runs, Triton's HTTP stream through AIPerf's template endpoint), with
the same bench settings (prompt and output tokens, request count, warm-up) and cpu-tiny's goodput objective.
Prints per tool and concurrency: the median of its runs for req/s, goodput, TTFT p50/p99, ITL and request
latency p99, the spread of req/s over the runs (min..max and coefficient of variation), and wall seconds per run
(the tool's start-up included). genai-perf twice: as the benchmark stage runs it (each run forked from one process
that imported it once, tasks/runners/genai_perf_fork.py) and as a user runs its CLI, a new process per run.

    .venv/bin/python benchmarks/bench_tools.py [--home LLMOPS_HOME] [--concurrency 1,4] [--rounds 3]
        [--requests 128]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from gateway_process import cpu_tiny_bench
from serving_batching import int_list  # this script's folder is first on sys.path

from tasks.load.aiperf import AIPerf, aiperf_executable
from tasks.load.genai_perf import ForkedRuns, GenaiPerf, runner_env
from tasks.load.load_level import LoadLevel, LoadTool
from tasks.platform.config import load_profile
from tasks.serving.champion import triton_launch
from tasks.serving.models import MergedVersion, install_model
from tasks.serving.server import TritonServer

TOOLS = ("genai-perf", "genai-perf CLI", "aiperf")


class ProcessPerRun(ForkedRuns):
    """The baseline: `genai-perf profile ...` as a new process for every run, as its CLI is used."""

    def run(self, command: list[str], output: Path, timeout_s: float = 900) -> int:
        with open(output, "w") as out, open(f"{output}.err", "w") as err:
            return subprocess.run(command, stdout=out, stderr=err, env=self.env, timeout=timeout_s).returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", type=Path, help="LLMOPS_HOME with a cpu-tiny run (else one is made)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=128, help="requests per run (bench.request_count)")
    args = parser.parse_args()
    scratch, bench, _ = cpu_tiny_bench(args.home, 8, args.concurrency, args.requests, "llmops-bench-tools-")
    profile = load_profile("cpu-tiny", [f"bench.request_count={args.requests}"])
    try:
        launcher, env = triton_launch(profile, bench.home)
        server = TritonServer.start(scratch / "triton", None, launcher=launcher, extra_env=env)
        try:
            served = MergedVersion(version="1", name="svc-v1", model_dir=bench.model_dir, artifact_sha256="bench-tools")
            install_model(server.client, profile, served)
            objectives = profile.goodput_objectives()
            tools: dict[str, LoadTool] = {
                "genai-perf": GenaiPerf(server.client.grpc_url or "", profile.bench, scratch / "g", goodput=objectives),
                "genai-perf CLI": GenaiPerf(
                    server.client.grpc_url or "",
                    profile.bench,
                    scratch / "c",
                    goodput=objectives,
                    forked=ProcessPerRun(runner_env(), scratch / "c.log"),
                ),
                "aiperf": AIPerf(
                    server.client.url, profile.bench, scratch / "a", aiperf_executable(profile.bench), objectives
                ),
            }
            runs: dict[tuple[str, int], list[LoadLevel]] = {}
            seconds: dict[tuple[str, int], float] = {}
            for concurrency in args.concurrency:
                for round_index in range(args.rounds):
                    for tool in TOOLS if round_index % 2 == 0 else tuple(reversed(TOOLS)):
                        print(f"bench: {tool} at concurrency {concurrency}, round {round_index + 1} ...", flush=True)
                        started = time.perf_counter()
                        measured = tools[tool].measure_runs(served, concurrency, f"-{round_index}")
                        seconds[(tool, concurrency)] = seconds.get((tool, concurrency), 0) + (
                            time.perf_counter() - started
                        )
                        runs.setdefault((tool, concurrency), []).extend(measured)
        finally:
            server.stop()
        print_table(args, profile, runs, seconds)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def print_table(args, profile, runs: dict[tuple[str, int], list[LoadLevel]], seconds) -> None:
    print(
        f"\ncpu-tiny merged model, python backend on Triton; {args.requests} streaming requests per run "
        f"({profile.bench.input_tokens} prompt tokens, exactly {profile.bench.output_tokens} generated); goodput "
        f"objective {profile.goodput_objectives()}; {args.rounds} rounds, genai-perf 1 run and AIPerf "
        f"{profile.bench.profile_runs} runs a round; medians over the runs\n"
    )
    header = (
        f"{'conc':>4} {'tool':14} {'runs':>4} {'req/s':>7} {'req/s min..max':>15} {'CV':>6} {'goodput':>8} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL avg':>8} {'lat p99':>8} {'s/run':>6}"
    )
    print(header + "\n" + "-" * len(header))
    for concurrency in args.concurrency:
        for tool in TOOLS:
            measured = runs[(tool, concurrency)]

            def median(name: str, measured: list[LoadLevel] = measured) -> float:
                return statistics.median(getattr(level, name) for level in measured)

            rates = [level.requests_per_s for level in measured]
            spread = statistics.stdev(rates) / statistics.mean(rates) if len(rates) > 1 else 0.0
            print(
                f"{concurrency:>4} {tool:14} {len(measured):>4} {median('requests_per_s'):>7.1f} "
                f"{min(rates):>7.1f}..{max(rates):<7.1f} {spread:>6.1%} {median('goodput_per_s'):>8.1f} "
                f"{median('ttft_p50_ms'):>9.1f} {median('ttft_p99_ms'):>9.1f} {median('itl_avg_ms'):>8.2f} "
                f"{median('latency_p99_ms'):>8.1f} {seconds[(tool, concurrency)] / len(measured):>6.1f}"
            )


if __name__ == "__main__":
    main()
