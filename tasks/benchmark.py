"""benchmark: genai-perf against Triton, champion and candidate under the same load.

Every level below the highest is measured once per model. With a champion, the highest level is measured in rounds, interleaved and in alternating order (champion,
candidate; candidate, champion; ...), so drift of a shared machine hits both models alike; each round
gives a candidate/champion ratio and the gate reads their interval (tasks/quality/stats.py). While
the throughput interval straddles gate.min_throughput_ratio, rounds continue up to bench.max_rounds.

Why the ratio is of requests/s and not of genai-perf's output tokens/s: genai-perf counts output
tokens by re-tokenizing the streamed text, and two models generating the same 8 tokens count 10 to
14 (a replacement character for a partial byte sequence tokenizes into several): the token ratio
carried up to 17% of text, not speed. Every request generates exactly `output_tokens`, so requests/s
times `output_tokens` is the throughput in generated tokens.

genai-perf's command line, runs and export: tasks/serving/genai_perf.py.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.platform.config import BenchSection
from tasks.platform.errors import CheckFailed
from tasks.platform.stage_cache import RunContext, logger
from tasks.quality.stats import RatioInterval, ratio_interval
from tasks.serving.client import parse_metric
from tasks.serving.genai_perf import GenaiPerf, LoadLevel, check_tokenizer

if TYPE_CHECKING:
    from tasks.deploy_canary import Deployment
    from tasks.platform.config import Profile
    from tasks.serving.models import Served


@dataclass
class ServingSummary:
    """What the gate reads of one model: worst p99s over the levels, throughput at the highest
    concurrency (the rounds' median there), and the share of its requests Triton counted as failed."""

    latency_p99_ms: float
    ttft_p99_ms: float
    output_tokens_per_s: float  # generated tokens: requests/s times bench.output_tokens
    requests_per_s: float
    error_rate: float

    @classmethod
    def of(cls, levels: dict[int, LoadLevel], error_rate: float, output_tokens: int) -> ServingSummary:
        top = levels[max(levels)]
        return cls(
            latency_p99_ms=max(level.latency_p99_ms for level in levels.values()),
            ttft_p99_ms=max(level.ttft_p99_ms for level in levels.values()),
            output_tokens_per_s=top.requests_per_s * output_tokens,
            requests_per_s=top.requests_per_s,
            error_rate=error_rate,
        )

    def describe(self) -> str:
        return (
            f"p99 {self.latency_p99_ms:.1f} ms, TTFT p99 {self.ttft_p99_ms:.1f} ms, "
            f"{self.requests_per_s:.1f} req/s ({self.output_tokens_per_s:.0f} tok/s), errors {self.error_rate:.2%}"
        )


@dataclass
class RoleBenchmark:
    """One model (the candidate or the champion) under each concurrency level, and its summary; at the
    highest level, the median of its rounds (`rounds`, in the order measured)."""

    levels: dict[int, LoadLevel]
    summary: ServingSummary
    rounds: list[LoadLevel] = field(default_factory=list)

    def as_mlflow(self, role: str) -> dict[str, float]:
        """`<role>_c<level>_<metric>` per level, `<role>_<metric>` of the summary."""
        per_level = {
            f"{role}_c{concurrency}_{name}": value
            for concurrency, level in self.levels.items()
            for name, value in asdict(level).items()
        }
        return per_level | {f"{role}_{name}": value for name, value in asdict(self.summary).items()}


@dataclass
class Comparison:
    """Candidate/champion ratios at the highest concurrency, one per interleaved round, with intervals."""

    concurrency: int
    throughput: RatioInterval  # of requests/s (each request generates exactly bench.output_tokens)
    latency_p99: RatioInterval
    ttft_p99: RatioInterval
    planned_rounds: int  # bench.rounds; more were measured when the throughput verdict was inconclusive

    @classmethod
    def of(cls, pairs: list[tuple[LoadLevel, LoadLevel]], concurrency: int, cfg: BenchSection) -> Comparison:
        """`pairs`: (champion, candidate) per round."""

        def ratios(metric: str) -> RatioInterval:
            values = [getattr(candidate, metric) / getattr(champion, metric) for champion, candidate in pairs]
            return ratio_interval(values, cfg.confidence)

        return cls(concurrency, ratios("requests_per_s"), ratios("latency_p99_ms"), ratios("ttft_p99_ms"), cfg.rounds)

    @property
    def rounds(self) -> int:
        return self.throughput.rounds

    def as_mlflow(self) -> dict[str, float]:
        """`ratio_<name>`, `ratio_<name>_low`, `ratio_<name>_high`, and `ratio_rounds`."""
        metrics = {"ratio_rounds": float(self.rounds)}
        for name, ratio in (
            ("throughput", self.throughput),
            ("latency_p99", self.latency_p99),
            ("ttft_p99", self.ttft_p99),
        ):
            metrics[f"ratio_{name}"] = ratio.value
            if ratio.low is not None and ratio.high is not None:
                metrics |= {f"ratio_{name}_low": ratio.low, f"ratio_{name}_high": ratio.high}
        return metrics

    def describe(self) -> str:
        t = self.throughput
        interval = (
            f"{t.confidence:.0%} interval {t.low:.3f}..{t.high:.3f}"
            if t.low is not None and t.high is not None
            else "no interval"
        )
        return (
            f"candidate/champion throughput {t.value:.3f} ({interval}, "
            f"{self.rounds} round{'s' if self.rounds > 1 else ''} at concurrency {self.concurrency})"
        )


@dataclass
class BenchmarkResult:
    """Champion and candidate under the same load, and their comparison; no champion on a first release."""

    candidate: RoleBenchmark
    champion: RoleBenchmark | None = None
    comparison: Comparison | None = None

    @property
    def roles(self) -> dict[str, RoleBenchmark]:
        return {"candidate": self.candidate} | ({"champion": self.champion} if self.champion else {})

    def as_json(self) -> dict:
        """benchmark.json: {"levels": {role: {concurrency: metrics}}, "summary": {role: summary},
        "rounds": {role: [metrics per round]}, "comparison": {...} or null}."""
        return {
            "levels": {
                role: {str(c): asdict(level) for c, level in measured.levels.items()}
                for role, measured in self.roles.items()
            },
            "summary": {role: asdict(measured.summary) for role, measured in self.roles.items()},
            "rounds": {role: [asdict(level) for level in measured.rounds] for role, measured in self.roles.items()},
            "comparison": asdict(self.comparison) if self.comparison else None,
        }


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


def benchmark(ctx: RunContext, deployment: Deployment) -> BenchmarkResult:
    """genai-perf on the candidate and, when one serves, the champion, interleaved; same load for both."""
    cfg = ctx.profile.bench
    out_dir = ctx.home / "work" / "benchmark" / ctx.tracker.run_id
    out_dir.mkdir(parents=True, exist_ok=True)
    grpc_url = deployment.triton.grpc_url
    if grpc_url is None:
        raise CheckFailed(
            f"benchmark: Triton at {deployment.triton.url} has no gRPC endpoint for genai-perf "
            "(give --triton-grpc-url or LLMOPS_TRITON_GRPC_URL)"
        )
    champion, candidate = deployment.champion, deployment.candidate
    models = [champion, candidate] if champion is not None else [candidate]
    for served in models:
        check_tokenizer(served.model_dir)
    genai_perf = GenaiPerf(grpc_url, cfg, out_dir, prompts_cache=ctx.home / "cache" / "genai-perf-prompts")
    counters_before = deployment.triton.metrics()
    *lower, top = sorted(set(cfg.concurrency))
    levels: dict[str, dict[int, LoadLevel]] = {served.name: {} for served in models}
    for concurrency in lower:  # also the warm-up: both models, the same requests, before any round
        for served in models:
            logger().info(f"benchmark: {served.name} at concurrency {concurrency} ({cfg.request_count} requests)")
            levels[served.name][concurrency] = genai_perf.measure(served, concurrency)
    comparison = None
    if champion is None:
        logger().info(f"benchmark: {candidate.name} at concurrency {top} ({cfg.request_count} requests)")
        rounds = {candidate.name: [genai_perf.measure(candidate, top)]}
    else:
        rounds, comparison = compare_in_rounds(genai_perf, champion, candidate, top, ctx.profile)
    counters_after = deployment.triton.metrics()

    def role(served: Served) -> RoleBenchmark:
        at = levels[served.name] | {top: LoadLevel.median(rounds[served.name])}
        error_rate = failed_share(counters_before, counters_after, served.name)
        return RoleBenchmark(at, ServingSummary.of(at, error_rate, cfg.output_tokens), rounds[served.name])

    result = BenchmarkResult(role(candidate), role(champion) if champion is not None else None, comparison)
    for name, measured in result.roles.items():
        ctx.tracker.log_metrics("benchmark", measured.as_mlflow(name))
    if comparison is not None:
        ctx.tracker.log_metrics("benchmark", comparison.as_mlflow())
    plot(result, out_dir / "latency_throughput.png")
    ctx.tracker.log_file(out_dir / "latency_throughput.png", "benchmark")
    (out_dir / "benchmark.json").write_text(json.dumps(result.as_json(), indent=2))
    ctx.tracker.log_json("benchmark.json", result.as_json())
    logger().info(
        "benchmark: " + "; ".join(f"{role} {measured.summary.describe()}" for role, measured in result.roles.items())
    )
    return result


def compare_in_rounds(
    genai_perf: GenaiPerf, champion: Served, candidate: Served, concurrency: int, profile: Profile
) -> tuple[dict[str, list[LoadLevel]], Comparison]:
    """bench.rounds rounds at `concurrency`, champion first in odd rounds and candidate first in even
    ones; then one more at a time while the throughput ratio's interval straddles
    gate.min_throughput_ratio, up to bench.max_rounds."""
    cfg, threshold = profile.bench, profile.gate.min_throughput_ratio
    rounds: dict[str, list[LoadLevel]] = {champion.name: [], candidate.name: []}
    while True:
        number = len(rounds[champion.name]) + 1
        order = (champion, candidate) if number % 2 else (candidate, champion)
        logger().info(
            f"benchmark: round {number} at concurrency {concurrency}: {order[0].name}, then {order[1].name} "
            f"({cfg.request_count} requests each)"
        )
        for served in order:
            rounds[served.name].append(genai_perf.measure(served, concurrency, f"-round{number}"))
        if number < cfg.rounds:
            continue
        comparison = Comparison.of(
            list(zip(rounds[champion.name], rounds[candidate.name], strict=True)), concurrency, cfg
        )
        undecided = threshold is not None and comparison.throughput.verdict(threshold, ">=") == "inconclusive"
        logger().info(
            f"benchmark: round {number}: {comparison.describe()}"
            + (f"; straddles gate.min_throughput_ratio {threshold:g}" if undecided else "")
        )
        if not undecided or number >= cfg.max_rounds:
            return rounds, comparison
        logger().info(f"benchmark: one more round (at most {cfg.max_rounds})")


def failed_share(before: str, after: str, model: str) -> float:
    """The share of `model`'s requests Triton counted as failed between two reads of its metrics."""

    def delta(metric: str) -> float:
        return parse_metric(after, metric, model) - parse_metric(before, metric, model)

    failures, successes = delta("nv_inference_request_failure"), delta("nv_inference_request_success")
    return failures / (failures + successes) if failures + successes else 1.0
