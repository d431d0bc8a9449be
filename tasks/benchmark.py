"""benchmark: genai-perf against Triton, champion and candidate under the same load.

genai-perf drives perf_analyzer in kserve mode (TensorRT-LLM-style inputs, gRPC streaming) with
synthetic prompts of `bench.input_tokens` tokens and exactly `bench.output_tokens` output tokens,
counted with the model's own tokenizer from its local folder (no hub). One run per concurrency
level; each level's `profile_export_genai_perf.json` is parsed into a LoadLevel, and each role's levels
are summarized into what the gate reads (RoleBenchmark.summary).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.platform.child_env import child_env
from tasks.platform.config import BenchSection
from tasks.platform.errors import BadInput, CheckFailed
from tasks.platform.stage_cache import RunContext, logger
from tasks.serving.client import parse_metric

if TYPE_CHECKING:
    from tasks.deploy_canary import Deployment
    from tasks.serving.models import Served

# (genai-perf key, statistic) -> LoadLevel's field; latencies in ms, throughputs per second.
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


@dataclass
class LoadLevel:
    """What genai-perf measured for one model at one concurrency level."""

    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    itl_avg_ms: float
    itl_p99_ms: float
    latency_p50_ms: float
    latency_p90_ms: float
    latency_p99_ms: float
    output_tokens_per_s: float
    requests_per_s: float
    request_count: float


@dataclass
class ServingSummary:
    """What the gate reads of one model: worst p99s over the levels, throughput at the highest
    concurrency, and the share of its requests Triton counted as failed during the benchmark."""

    latency_p99_ms: float
    ttft_p99_ms: float
    output_tokens_per_s: float
    requests_per_s: float
    error_rate: float

    @classmethod
    def of(cls, levels: dict[int, LoadLevel], error_rate: float) -> ServingSummary:
        top = levels[max(levels)]
        return cls(
            latency_p99_ms=max(level.latency_p99_ms for level in levels.values()),
            ttft_p99_ms=max(level.ttft_p99_ms for level in levels.values()),
            output_tokens_per_s=top.output_tokens_per_s,
            requests_per_s=top.requests_per_s,
            error_rate=error_rate,
        )

    def describe(self) -> str:
        return (
            f"p99 {self.latency_p99_ms:.1f} ms, TTFT p99 {self.ttft_p99_ms:.1f} ms, "
            f"{self.output_tokens_per_s:.0f} tok/s, errors {self.error_rate:.2%}"
        )


@dataclass
class RoleBenchmark:
    """One model (the candidate or the champion) under each concurrency level, and its summary."""

    levels: dict[int, LoadLevel]
    summary: ServingSummary

    def as_mlflow(self, role: str) -> dict[str, float]:
        """`<role>_c<level>_<metric>` per level, `<role>_<metric>` of the summary."""
        per_level = {
            f"{role}_c{concurrency}_{name}": value
            for concurrency, level in self.levels.items()
            for name, value in asdict(level).items()
        }
        return per_level | {f"{role}_{name}": value for name, value in asdict(self.summary).items()}


@dataclass
class BenchmarkResult:
    """Champion and candidate under the same load; no champion on a first release."""

    candidate: RoleBenchmark
    champion: RoleBenchmark | None = None

    @property
    def roles(self) -> dict[str, RoleBenchmark]:
        return {"candidate": self.candidate} | ({"champion": self.champion} if self.champion else {})

    def as_json(self) -> dict:
        """benchmark.json: {"levels": {role: {concurrency: metrics}}, "summary": {role: summary}}."""
        return {
            "levels": {
                role: {str(c): asdict(level) for c, level in measured.levels.items()}
                for role, measured in self.roles.items()
            },
            "summary": {role: asdict(measured.summary) for role, measured in self.roles.items()},
        }


def parse_profile_export(path: Path) -> LoadLevel:
    """genai-perf's JSON export at one level; a missing or malformed file is a clear error."""
    if not path.is_file():
        raise CheckFailed(f"benchmark: genai-perf wrote no {path.name} (looked in {path.parent})")
    try:
        data = json.loads(path.read_text())
        return LoadLevel(**{name: float(data[key][stat]) for (key, stat), name in METRICS.items()})
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


def run_genai_perf(
    model: str, grpc_url: str, tokenizer_dir: Path, cfg: BenchSection, out_dir: Path
) -> dict[int, LoadLevel]:
    """{concurrency: what genai-perf measured} for one model; genai-perf's own files are kept under out_dir."""
    env = child_env(  # genai-perf needs none of this process's secrets
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        }
    )
    results: dict[int, LoadLevel] = {}
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


def plot(result: BenchmarkResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for role, measured in result.roles.items():
        levels = sorted(measured.levels)
        at = [measured.levels[c] for c in levels]
        axes[0].plot(levels, [m.latency_p99_ms for m in at], marker="o", label=f"{role} p99")
        axes[0].plot(levels, [m.ttft_p99_ms for m in at], marker="x", linestyle="--", label=f"{role} TTFT p99")
        axes[1].plot(levels, [m.output_tokens_per_s for m in at], marker="o", label=role)
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


def benchmark(ctx: RunContext, deployment: Deployment) -> BenchmarkResult:
    """genai-perf on the candidate and, when one serves, the champion; same load for both."""
    out_dir = ctx.home / "work" / "benchmark" / ctx.tracker.run_id
    out_dir.mkdir(parents=True, exist_ok=True)
    grpc_url = deployment.triton.grpc_url
    if grpc_url is None:
        raise CheckFailed(
            f"benchmark: Triton at {deployment.triton.url} has no gRPC endpoint for genai-perf "
            "(give --triton-grpc-url or LLMOPS_TRITON_GRPC_URL)"
        )
    candidate = measure(ctx, deployment, deployment.candidate, grpc_url, out_dir)
    ctx.tracker.log_metrics("benchmark", candidate.as_mlflow("candidate"))
    champion = None
    if deployment.champion is not None:
        champion = measure(ctx, deployment, deployment.champion, grpc_url, out_dir)
        ctx.tracker.log_metrics("benchmark", champion.as_mlflow("champion"))
    result = BenchmarkResult(candidate, champion)
    plot(result, out_dir / "latency_throughput.png")
    ctx.tracker.log_file(out_dir / "latency_throughput.png", "benchmark")
    ctx.tracker.log_json("benchmark.json", result.as_json())
    logger().info(
        "benchmark: " + "; ".join(f"{role} {measured.summary.describe()}" for role, measured in result.roles.items())
    )
    return result


def measure(ctx: RunContext, deployment: Deployment, served: Served, grpc_url: str, out_dir: Path) -> RoleBenchmark:
    """genai-perf at every level on one served model, with its error rate from Triton's counters."""
    check_tokenizer(served.model_dir)
    before = deployment.triton.metrics()
    levels = run_genai_perf(served.name, grpc_url, served.model_dir, ctx.profile.bench, out_dir)
    after = deployment.triton.metrics()

    def delta(metric: str) -> float:
        return parse_metric(after, metric, served.name) - parse_metric(before, metric, served.name)

    failures, successes = delta("nv_inference_request_failure"), delta("nv_inference_request_success")
    error_rate = failures / (failures + successes) if failures + successes else 1.0
    return RoleBenchmark(levels, ServingSummary.of(levels, error_rate))
