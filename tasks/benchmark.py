"""benchmark: a load generator against Triton, champion and candidate under the same load.

The tool is bench.tool: genai-perf (one run per measurement, Triton's gRPC stream;
tasks/load/genai_perf.py) or AIPerf (bench.profile_runs runs per measurement, Triton's HTTP stream;
tasks/load/aiperf.py). Both count goodput where the profile has latency objectives
(Profile.goodput_objectives).

Every level below the highest is measured once per model. With a champion, the highest level is measured in
rounds of paired single runs (one for genai-perf, bench.profile_runs for AIPerf), the two models in turn and in
alternating order (champion, candidate; candidate, champion; ...), so drift of a shared machine hits both models
alike; each pair gives a candidate/champion ratio and the gate reads their interval (tasks/quality/stats.py). While
a check the gate decides on an interval straddles its threshold, rounds continue up to bench.max_rounds. With AIPerf, the
candidate's own latency and rate checks are decided on the interval of its runs' mean as well (its runs at the level
concerned), and count among those.

Why the ratio is of requests/s and not of genai-perf's output tokens/s: genai-perf counts output
tokens by re-tokenizing the streamed text, and two models generating the same 8 tokens count 10 to
14 (a replacement character for a partial byte sequence tokenizes into several): the token ratio
carried up to 17% of text, not speed. Every request generates exactly `output_tokens`, so requests/s
times `output_tokens` is the throughput in generated tokens.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from tasks.load.genai_perf import GenaiPerf, check_tokenizer
from tasks.load.load_level import LoadLevel, LoadTool
from tasks.platform.config import BenchSection
from tasks.platform.errors import CheckFailed
from tasks.platform.stage_cache import RunContext, logger
from tasks.quality.stats import Decides, MeanInterval, RatioInterval, mean_interval, ratio_interval
from tasks.serving.client import parse_metric

if TYPE_CHECKING:
    from tasks.deploy_canary import Deployment
    from tasks.platform.config import Profile
    from tasks.serving.models import Served


@dataclass
class ServingSummary:
    """What the gate reads of one model: worst p99s over the levels, throughput and goodput at the highest
    concurrency (the runs' median there), and the share of its requests Triton counted as failed. With several
    runs per level (AIPerf), `intervals` holds the interval of each checked statistic's mean over the runs at the
    level that gave its value."""

    latency_p99_ms: float
    ttft_p99_ms: float
    output_tokens_per_s: float  # generated tokens: requests/s times bench.output_tokens
    requests_per_s: float
    error_rate: float
    goodput_per_s: float = 0.0
    intervals: dict[str, MeanInterval] = field(default_factory=dict)

    @classmethod
    def of(
        cls, runs: dict[int, list[LoadLevel]], error_rate: float, output_tokens: int, confidence: float | None = None
    ) -> ServingSummary:
        """`runs`: every run per concurrency level; with `confidence`, intervals where a level has 2+ runs."""
        levels = {concurrency: LoadLevel.median(measured) for concurrency, measured in runs.items()}
        top = max(levels)
        worst_latency = max(levels, key=lambda c: levels[c].latency_p99_ms)
        worst_ttft = max(levels, key=lambda c: levels[c].ttft_p99_ms)
        summary = cls(
            latency_p99_ms=levels[worst_latency].latency_p99_ms,
            ttft_p99_ms=levels[worst_ttft].ttft_p99_ms,
            output_tokens_per_s=levels[top].requests_per_s * output_tokens,
            requests_per_s=levels[top].requests_per_s,
            error_rate=error_rate,
            goodput_per_s=levels[top].goodput_per_s,
        )
        if confidence is not None:
            at = {
                "latency_p99_ms": worst_latency,
                "ttft_p99_ms": worst_ttft,
                "requests_per_s": top,
                "goodput_per_s": top,
            }
            for name, concurrency in at.items():
                if len(runs[concurrency]) > 1:
                    summary.intervals[name] = mean_interval([getattr(r, name) for r in runs[concurrency]], confidence)
        return summary

    def as_mlflow(self, role: str) -> dict[str, float]:
        """`<role>_<statistic>`, and `<role>_<statistic>_low|_high` of its interval where it has one."""
        metrics = {f"{role}_{name}": value for name, value in asdict(self).items() if name != "intervals"}
        for name, interval in self.intervals.items():
            if interval.low is not None and interval.high is not None:
                metrics |= {f"{role}_{name}_low": interval.low, f"{role}_{name}_high": interval.high}
        return metrics

    def describe(self) -> str:
        return (
            f"p99 {self.latency_p99_ms:.1f} ms, TTFT p99 {self.ttft_p99_ms:.1f} ms, "
            f"{self.requests_per_s:.1f} req/s ({self.output_tokens_per_s:.0f} tok/s)"
            + (f", goodput {self.goodput_per_s:.1f}/s" if self.goodput_per_s else "")
            + f", errors {self.error_rate:.2%}"
        )


@dataclass
class RoleBenchmark:
    """One model (the candidate or the champion) under each concurrency level (the median of its runs there), and
    its summary; at the highest level, every run in the order measured (`rounds`)."""

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
        return per_level | self.summary.as_mlflow(role)


@dataclass
class Comparison:
    """Candidate/champion ratios at the highest concurrency, one per paired run, with intervals."""

    concurrency: int
    throughput: RatioInterval  # of requests/s (each request generates exactly bench.output_tokens)
    latency_p99: RatioInterval
    ttft_p99: RatioInterval
    planned_rounds: int  # bench.rounds; more were measured while a check on an interval was undecided
    goodput: RatioInterval | None = None  # None without latency objectives, or where the champion met none

    @classmethod
    def of(cls, pairs: list[tuple[LoadLevel, LoadLevel]], concurrency: int, cfg: BenchSection) -> Comparison:
        """`pairs`: (champion, candidate) per paired run."""

        def ratios(metric: str) -> RatioInterval:
            values = [getattr(candidate, metric) / getattr(champion, metric) for champion, candidate in pairs]
            return ratio_interval(values, cfg.confidence)

        goodput = None
        if all(champion.goodput_per_s > 0 for champion, _ in pairs):
            # A candidate run that met no objective counts at a millionth of its champion's goodput (a ratio's
            # logarithm needs a positive value): far below any threshold, and it fails the check.
            goodput = ratio_interval([max(c.goodput_per_s / ch.goodput_per_s, 1e-6) for ch, c in pairs], cfg.confidence)
        return cls(
            concurrency,
            ratios("requests_per_s"),
            ratios("latency_p99_ms"),
            ratios("ttft_p99_ms"),
            cfg.rounds,
            goodput,
        )

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
            *([("goodput", self.goodput)] if self.goodput is not None else []),
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
            f"{self.rounds} paired run{'s' if self.rounds > 1 else ''} at concurrency {self.concurrency})"
        )


@dataclass
class BenchmarkResult:
    """Champion and candidate under the same load, and their comparison; no champion on a first release."""

    candidate: RoleBenchmark
    champion: RoleBenchmark | None = None
    comparison: Comparison | None = None

    def headline(self) -> str:
        candidate = self.candidate.summary
        return f"candidate p99 {candidate.latency_p99_ms:.1f} ms, {candidate.requests_per_s:.1f} req/s" + (
            f" (champion {self.champion.summary.requests_per_s:.1f})" if self.champion else ""
        )

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


def require_load_tool(profile: Profile) -> None:
    """A release that will benchmark with AIPerf has it: refused before training, not after it (BadInput)."""
    if profile.serve.deploy and profile.bench.tool == "aiperf":
        from tasks.load.aiperf import aiperf_executable

        aiperf_executable(profile.bench)


def load_tool(ctx: RunContext, deployment: Deployment, out_dir: Path) -> LoadTool:
    """bench.tool against this run's Triton, counting goodput under the profile's latency objectives."""
    cfg, objectives = ctx.profile.bench, ctx.profile.goodput_objectives()
    if cfg.tool == "aiperf":
        from tasks.load.aiperf import AIPerf, aiperf_executable

        return AIPerf(deployment.triton.url, cfg, out_dir, aiperf_executable(cfg), goodput=objectives)
    grpc_url = deployment.triton.grpc_url
    if grpc_url is None:
        raise CheckFailed(
            f"benchmark: Triton at {deployment.triton.url} has no gRPC endpoint for genai-perf "
            "(give --triton-grpc-url or LLMOPS_TRITON_GRPC_URL)"
        )
    return GenaiPerf(
        grpc_url, cfg, out_dir, prompts_cache=ctx.home / "cache" / "genai-perf-prompts", goodput=objectives
    )


def benchmark(ctx: RunContext, deployment: Deployment) -> BenchmarkResult:
    """bench.tool on the candidate and, when one serves, the champion, interleaved; same load for both."""
    cfg = ctx.profile.bench
    out_dir = ctx.home / "work" / "benchmark" / ctx.tracker.run_id
    out_dir.mkdir(parents=True, exist_ok=True)
    champion, candidate = deployment.champion, deployment.candidate
    models = [champion, candidate] if champion is not None else [candidate]
    for served in models:
        check_tokenizer(served.model_dir)
    tool = load_tool(ctx, deployment, out_dir)
    counters_before = deployment.triton.metrics()
    *lower, top = sorted(set(cfg.concurrency))
    runs: dict[str, dict[int, list[LoadLevel]]] = {served.name: {} for served in models}
    for concurrency in lower:  # also the warm-up: both models, the same requests, before any round
        for served in models:
            logger().info(
                f"benchmark: {served.name} at concurrency {concurrency} ({cfg.tool}, {cfg.request_count} requests)"
            )
            runs[served.name][concurrency] = tool.measure_runs(served, concurrency)
    comparison = None
    if champion is None:
        logger().info(f"benchmark: {candidate.name} at concurrency {top} ({cfg.tool}, {cfg.request_count} requests)")
        runs[candidate.name][top] = tool.measure_runs(candidate, top)
    else:
        rounds, comparison = compare_in_rounds(tool, champion, candidate, top, ctx.profile)
        for served in models:
            runs[served.name][top] = rounds[served.name]
    counters_after = deployment.triton.metrics()
    confidence = cfg.confidence if cfg.tool == "aiperf" else None  # genai-perf's checks stay on the median

    def role(served: Served) -> RoleBenchmark:
        measured = runs[served.name]
        error_rate = failed_share(counters_before, counters_after, served.answered_by[0])
        summary = ServingSummary.of(measured, error_rate, cfg.output_tokens, confidence)
        levels = {concurrency: LoadLevel.median(level_runs) for concurrency, level_runs in measured.items()}
        return RoleBenchmark(levels, summary, measured[top])

    result = BenchmarkResult(role(candidate), role(champion) if champion is not None else None, comparison)
    for name, measured in result.roles.items():
        ctx.tracker.log_metrics("benchmark", measured.as_mlflow(name))
    if comparison is not None:
        ctx.tracker.log_metrics("benchmark", comparison.as_mlflow())
    ctx.tracker.set_tags({"bench.tool": cfg.tool})
    plot(result, out_dir / "latency_throughput.png")
    ctx.tracker.log_file(out_dir / "latency_throughput.png", "benchmark")
    (out_dir / "benchmark.json").write_text(json.dumps(result.as_json(), indent=2))
    ctx.tracker.log_json("benchmark.json", result.as_json())
    logger().info(
        "benchmark: " + "; ".join(f"{role} {measured.summary.describe()}" for role, measured in result.roles.items())
    )
    return result


def compare_in_rounds(
    tool: LoadTool, champion: Served, candidate: Served, concurrency: int, profile: Profile
) -> tuple[dict[str, list[LoadLevel]], Comparison]:
    """bench.rounds rounds at `concurrency`; then one more at a time while a gate check decided on an interval
    straddles its threshold (`undecided_checks`), up to bench.max_rounds. A round is tool.runs_per_round pairs of single runs, the two
    models in turn and the first of each pair alternating (champion, candidate, then candidate, champion, ...), so a
    pair's runs are neighbours in time and whatever else the machine does falls on both alike."""
    cfg = profile.bench
    rounds: dict[str, list[LoadLevel]] = {champion.name: [], candidate.name: []}
    per_round = tool.runs_per_round
    number = 0
    while True:
        number += 1
        for run in range(per_round):
            pair = (number - 1) * per_round + run
            order = (champion, candidate) if pair % 2 == 0 else (candidate, champion)
            label = f"-round{number}" + (f"-run{run + 1}" if per_round > 1 else "")
            logger().info(
                f"benchmark: round {number}{f' run {run + 1}/{per_round}' if per_round > 1 else ''} at concurrency "
                f"{concurrency}: {order[0].name}, then {order[1].name} ({cfg.tool}, {cfg.request_count} requests each)"
            )
            for served in order:
                rounds[served.name].append(tool.measure(served, concurrency, label))
        if number < cfg.rounds:
            continue
        comparison = Comparison.of(
            list(zip(rounds[champion.name], rounds[candidate.name], strict=True)), concurrency, cfg
        )
        undecided = undecided_checks(comparison, rounds[candidate.name], profile)
        logger().info(
            f"benchmark: round {number}: {comparison.describe()}"
            + (f"; undecided: {', '.join(undecided)}" if undecided else "")
        )
        if not undecided or number >= cfg.max_rounds:
            return rounds, comparison
        logger().info(f"benchmark: one more round (at most {cfg.max_rounds})")


def undecided_checks(comparison: Comparison, candidate_runs: list[LoadLevel], profile: Profile) -> list[str]:
    """The gate's checks decided on an interval (tasks/gate.py) whose interval these rounds leave straddling the
    threshold, each as `setting threshold (interval)`: one more round may decide them. The candidate/champion ratios
    always; with AIPerf, the candidate's own latency and rate at this level too (the gate decides those on the
    interval of its runs' mean)."""
    gate, cfg = profile.gate, profile.bench
    estimates: list[tuple[str, Decides | None, float | None, Literal[">=", "<="]]] = [
        ("gate.min_throughput_ratio", comparison.throughput, gate.min_throughput_ratio, ">="),
        ("gate.max_latency_ratio", comparison.latency_p99, gate.max_latency_ratio, "<="),
        ("gate.min_goodput_ratio", comparison.goodput, gate.min_goodput_ratio, ">="),
    ]
    if cfg.tool == "aiperf" and len(candidate_runs) > 1:
        own: list[tuple[str, str, float | None, Literal[">=", "<="]]] = [
            ("gate.p99_request_latency_ms", "latency_p99_ms", gate.p99_request_latency_ms, "<="),
            ("gate.p99_time_to_first_token_ms", "ttft_p99_ms", gate.p99_time_to_first_token_ms, "<="),
            ("gate.min_requests_per_s", "requests_per_s", gate.min_requests_per_s, ">="),
        ]
        for setting, statistic, threshold, direction in own:
            mean = mean_interval([getattr(run, statistic) for run in candidate_runs], cfg.confidence)
            estimates.append((setting, mean, threshold, direction))
    undecided = []
    for setting, estimate, threshold, direction in estimates:
        if estimate is None or threshold is None or estimate.verdict(threshold, direction) != "inconclusive":
            continue
        interval = estimate.interval()
        undecided.append(
            f"{setting} {threshold:g}" + (f" ({interval[0]:.3g}..{interval[1]:.3g})" if interval is not None else "")
        )
    return undecided


def failed_share(before: str, after: str, model: str) -> float:
    """The share of `model`'s requests Triton counted as failed between two reads of its metrics."""

    def delta(metric: str) -> float:
        return parse_metric(after, metric, model) - parse_metric(before, metric, model)

    failures, successes = delta("nv_inference_request_failure"), delta("nv_inference_request_success")
    return failures / (failures + successes) if failures + successes else 1.0
