"""What tune_serving wins: the candidate at the settings it chose against the profile's own, side by side.

For each model (--models: cpu-tiny, the merged model of an `llmops run`; compute, the serving benchmark's ~23M
Qwen2, compute-bound on a CPU), one Triton serves it with the python backend at cpu-tiny's serving settings, and
tune_serving's search (tasks/tune_serving.py: Optuna's TPE over max_batch_size, max_queue_delay_us and
instance_count, goodput under the gate's TTFT objective, measured by genai-perf) picks settings. Then both
settings are measured again in alternating rounds (profile, tuned; tuned, profile; ...), each a fresh load of the
model and one genai-perf run at the profile's highest concurrency: goodput, TTFT p99 and requests/s, the median of
--rounds runs each, and tuned against the profile's.

    .venv/bin/python benchmarks/tune_serving.py [--home LLMOPS_HOME] [--models cpu-tiny,compute] [--trials 8]
        [--rounds 3] [--concurrency 8] [--requests 64] [--set serve.max_batch_size=2]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from serving_batching import compute_model, merged_model  # this script's folder is first on sys.path

from flows.cli.common import add_overrides_flag
from tasks.deploy_canary import Deployment
from tasks.load.genai_perf import GenaiPerf, goodput_of
from tasks.platform.config import load_profile
from tasks.serving.champion import triton_launch
from tasks.serving.models import MergedVersion, install_model
from tasks.serving.server import TritonServer
from tasks.tune_serving import defaults, load, search

MODELS = {"cpu-tiny": merged_model, "compute": compute_model}


def measure_settings(profile, deployment, settings, out: Path, label: str) -> dict[str, float]:
    load(profile, deployment, settings)
    concurrency = max(profile.bench.concurrency)
    genai_perf = GenaiPerf(deployment.triton.grpc_url or "", profile.bench, out, goodput=profile.goodput_objectives())
    level = genai_perf.measure(deployment.candidate, concurrency, label)
    goodput = goodput_of(out / f"{deployment.candidate.name}-c{concurrency}{label}")
    return {"goodput": goodput, "ttft_p99": level.ttft_p99_ms, "req_s": level.requests_per_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", type=Path, help="LLMOPS_HOME with a cpu-tiny run (else one is made)")
    parser.add_argument("--models", default="cpu-tiny,compute")
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8, help="the load's concurrency (bench.concurrency)")
    parser.add_argument("--requests", type=int, default=64, help="requests per genai-perf run (bench.request_count)")
    add_overrides_flag(parser, "a profile override: the settings the search starts from (e.g. serve.max_batch_size=2)")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="llmops-tune-bench-"))
    home = (args.home or scratch / "home").resolve()
    overrides = [f"tune.trials={args.trials}", f"bench.concurrency=[{args.concurrency}]"]
    profile = load_profile("cpu-tiny", [*overrides, f"bench.request_count={args.requests}", *args.overrides])
    rows = {}
    try:
        for name in args.models.split(","):
            model_dir = MODELS[name](home).resolve()
            launcher, env = triton_launch(profile, home)
            server = TritonServer.start(scratch / name, None, launcher=launcher, extra_env=env)
            try:
                served = MergedVersion(version="1", name="svc-v1", model_dir=model_dir, artifact_sha256=f"bench-{name}")
                install_model(server.client, profile, served)
                deployment = Deployment(server.client, "svc", served, None)
                print(f"bench: {name}: searching ({args.trials} trials) ...", flush=True)
                tuned = search(profile, deployment, scratch / name / "search")
                print(f"bench: {name}: chose {tuned.settings} (profile: {defaults(profile)})", flush=True)
                measured: dict[str, list[dict]] = {"profile": [], "tuned": []}
                for round_index in range(args.rounds):
                    order = ["profile", "tuned"] if round_index % 2 == 0 else ["tuned", "profile"]
                    for which in order:
                        settings = defaults(profile) if which == "profile" else tuned.settings
                        out = scratch / name / "rounds"
                        label = f"-{which}-{round_index}"
                        measured[which].append(measure_settings(profile, deployment, settings, out, label))
                rows[name] = (tuned, measured)
            finally:
                server.stop()
        print_table(args, profile, rows)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def print_table(args, profile, rows) -> None:
    print(
        f"\n{profile.serve.backend} backend on Triton, {args.requests} streaming requests per run at concurrency {args.concurrency} "
        f"({profile.bench.input_tokens} prompt tokens, {profile.bench.output_tokens} generated), goodput objective "
        f"{profile.goodput_objectives()}; median of {args.rounds} runs per row\n"
    )
    print(f"{'model':9} {'settings':8} {'values':58} {'goodput/s':>10} {'TTFT p99':>9} {'req/s':>7} {'vs profile':>10}")
    for name, (tuned, measured) in rows.items():
        medians = {
            which: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            for which, runs in measured.items()
        }
        for which, settings in (("profile", defaults(profile)), ("tuned", tuned.settings)):
            row, base = medians[which], medians["profile"]
            versus = f"{row['goodput'] / base['goodput']:.2f}x" if base["goodput"] else "-"
            print(
                f"{name:9} {which:8} {str(settings):58} {row['goodput']:10.1f} {row['ttft_p99']:9.1f} "
                f"{row['req_s']:7.1f} {versus:>10}"
            )
        print(f"{'':9} trials: " + ", ".join(f"{t.settings} {t.goodput_per_s:.1f}/s" for t in tuned.trials))


if __name__ == "__main__":
    main()
