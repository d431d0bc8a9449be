"""benchmark: genai-perf against Triton, champion and candidate under the same load.

genai-perf drives perf_analyzer in kserve mode (TensorRT-LLM-style inputs, gRPC streaming) with
synthetic prompts of `bench.input_tokens` tokens and exactly `bench.output_tokens` output tokens,
counted with the model's own tokenizer from its local folder (no hub). One run per concurrency
level; each level's `profile_export_genai_perf.json` is parsed into flat metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.platform.config import BenchSection
from tasks.platform.errors import BadInput, CheckFailed
from tasks.platform.stage_cache import RunContext, logger
from tasks.serving.client import parse_metric

if TYPE_CHECKING:
    from tasks.deploy_canary import Deployment

# (genai-perf key, statistic) -> our metric name; latencies in ms, throughputs per second.
METRICS = {
    ("time_to_first_token", "p50"): "ttft_p50_ms",
    ("time_to_first_token", "p90"): "ttft_p90_ms",
    ("time_to_first_token", "p99"): "ttft_p99_ms",
    ("inter_token_latency", "avg"): "itl_avg_ms",
    ("inter_token_latency", "p99"): "itl_p99_ms",
    ("request_latency", "p50"): "latency_p50_ms",
    ("request_latency", "p90"): "latency_p90_ms",
    ("request_latency", "p99"): "latency_p99_ms",
    ("output_token_throughput", "avg"): "output_tokens_per_s",
    ("request_throughput", "avg"): "requests_per_s",
    ("request_count", "avg"): "request_count",
}


def parse_profile_export(path: Path) -> dict[str, float]:
    """Flat metrics from genai-perf's JSON export; a missing or malformed file is a clear error."""
    if not path.is_file():
        raise CheckFailed(f"benchmark: genai-perf wrote no {path.name} (looked in {path.parent})")
    try:
        data = json.loads(path.read_text())
        return {name: float(data[key][stat]) for (key, stat), name in METRICS.items()}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CheckFailed(f"benchmark: {path}: malformed genai-perf export ({type(exc).__name__}: {exc})") from None


def genai_perf_command(
    model: str, grpc_url: str, tokenizer_dir: Path, cfg: BenchSection, concurrency: int, artifact_dir: Path
) -> list[str]:
    return [
        str(Path(sys.executable).parent / "genai-perf"),
        "profile",
        "-m",
        model,
        "--endpoint-type",
        "kserve",
        "--backend",
        "tensorrtllm",
        "--streaming",
        "-u",
        grpc_url,
        "--tokenizer",
        str(tokenizer_dir),
        "--synthetic-input-tokens-mean",
        str(cfg.input_tokens),
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(cfg.output_tokens),
        "--output-tokens-mean-deterministic",
        "--concurrency",
        str(concurrency),
        "--request-count",
        str(cfg.request_count),
        "--warmup-request-count",
        str(cfg.warmup_request_count),
        "--artifact-dir",
        str(artifact_dir),
    ]


def run_genai_perf(model: str, grpc_url: str, tokenizer_dir: Path, cfg: BenchSection, out_dir: Path) -> dict:
    """{concurrency: metrics} for one model; genai-perf's own files are kept under out_dir."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    results = {}
    for level in cfg.concurrency:
        artifact_dir = out_dir / f"{model}-c{level}"
        command = genai_perf_command(model, grpc_url, tokenizer_dir, cfg, level, artifact_dir)
        logger().info(f"benchmark: {model} at concurrency {level} ({cfg.request_count} requests)")
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise CheckFailed(f"benchmark: genai-perf on {model} exited with {done.returncode}: {tail[0][:300]}")
        exports = sorted(artifact_dir.rglob("profile_export_genai_perf.json"))
        results[level] = parse_profile_export(
            exports[0] if exports else artifact_dir / "profile_export_genai_perf.json"
        )
    return results


def summarize(results: dict[int, dict]) -> dict[str, float]:
    """What the gate reads: worst p99s over the levels, throughput at the highest concurrency."""
    top = results[max(results)]
    return {
        "latency_p99_ms": max(r["latency_p99_ms"] for r in results.values()),
        "ttft_p99_ms": max(r["ttft_p99_ms"] for r in results.values()),
        "output_tokens_per_s": top["output_tokens_per_s"],
        "requests_per_s": top["requests_per_s"],
    }


def flat_metrics(role: str, results: dict[int, dict]) -> dict[str, float]:
    return {f"{role}_c{level}_{name}": value for level, metrics in results.items() for name, value in metrics.items()}


def plot(results_by_role: dict[str, dict[int, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for role, results in results_by_role.items():
        levels = sorted(results)
        axes[0].plot(levels, [results[c]["latency_p99_ms"] for c in levels], marker="o", label=f"{role} p99")
        axes[0].plot(
            levels, [results[c]["ttft_p99_ms"] for c in levels], marker="x", linestyle="--", label=f"{role} TTFT p99"
        )
        axes[1].plot(levels, [results[c]["output_tokens_per_s"] for c in levels], marker="o", label=role)
    axes[0].set(xlabel="concurrency", ylabel="ms", title="latency")
    axes[1].set(xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def check_tokenizer(folder: Path) -> None:
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise BadInput(f"benchmark: no tokenizer in {folder}")


def benchmark(ctx: RunContext, deployment: Deployment) -> dict:
    """genai-perf on the candidate and, when one serves, the champion; same load for both."""
    cfg = ctx.profile.bench
    out_dir = ctx.home / "work" / "benchmark" / ctx.tracker.run_id
    out_dir.mkdir(parents=True, exist_ok=True)
    roles = {"candidate": deployment.candidate}
    if deployment.champion is not None:
        roles["champion"] = deployment.champion
    grpc_url = deployment.triton.grpc_url
    if grpc_url is None:
        raise CheckFailed(
            f"benchmark: Triton at {deployment.triton.url} has no gRPC endpoint for genai-perf "
            "(give --triton-grpc-url or LLMOPS_TRITON_GRPC_URL)"
        )
    levels, summary = {}, {}
    for role, served in roles.items():
        check_tokenizer(served.model_dir)
        before = deployment.triton.metrics()
        levels[role] = run_genai_perf(served.name, grpc_url, served.model_dir, cfg, out_dir)
        after = deployment.triton.metrics()
        failures = parse_metric(after, "nv_inference_request_failure", served.name) - parse_metric(
            before, "nv_inference_request_failure", served.name
        )
        successes = parse_metric(after, "nv_inference_request_success", served.name) - parse_metric(
            before, "nv_inference_request_success", served.name
        )
        summary[role] = {
            **summarize(levels[role]),
            "error_rate": failures / (failures + successes) if failures + successes else 1.0,
        }
        ctx.tracker.log_metrics(
            "benchmark", {**flat_metrics(role, levels[role]), **{f"{role}_{k}": v for k, v in summary[role].items()}}
        )
    plot(levels, out_dir / "latency_throughput.png")
    ctx.tracker.log_file(out_dir / "latency_throughput.png", "benchmark")
    ctx.tracker.log_json(
        "benchmark.json",
        {"levels": {r: {str(c): m for c, m in v.items()} for r, v in levels.items()}, "summary": summary},
    )
    logger().info(
        "benchmark: "
        + "; ".join(
            f"{role} p99 {s['latency_p99_ms']:.1f} ms, TTFT p99 {s['ttft_p99_ms']:.1f} ms, "
            f"{s['output_tokens_per_s']:.0f} tok/s, errors {s['error_rate']:.2%}"
            for role, s in summary.items()
        )
    )
    return summary
