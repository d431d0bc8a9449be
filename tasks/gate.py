"""gate: promote or reject the candidate on thresholds from the profile, on what users will get.

- Serving: p99 request latency, p99 TTFT, request rate and error rate of the candidate (genai-perf);
  with a champion, the throughput ratio (and optionally the p99 latency ratio) on its interval over the
  benchmark's interleaved rounds: pass when the interval clears the threshold, fail when it is entirely
  past it, inconclusive (which rejects, saying so) when the rounds up to bench.max_rounds could not tell.
- Task quality, scored where users are served (tasks/serving/served_scoring.py): the eval split goes through
  the candidate's and the champion's served models on Triton. The task-metric drop vs the champion
  uses those served scores; the serving parity check compares the candidate served with the same
  model offline (evaluate), which catches a chat template, tokenizer or stop-token mismatch; a probe
  the model answers in a few tokens offline must stop before max_tokens when served. With
  gate.quality_on_interval the checks use the paired bootstrap bound (at evaluate.confidence), not the point value.
- Served = measured: the artifact Triton loaded for the candidate (read back from the server) must
  be the registered artifact that promotion will serve; on the llmapi path the checkpoint's
  accuracy drop on TensorRT-LLM (build_engine) from the merged model is checked as well (on CPU the merged model is what serves).
The decision, with each check's value, interval, threshold and verdict, is written as JSON and markdown.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from tasks.build_engine import EngineMetrics
from tasks.platform.config import GateSection
from tasks.platform.stage_cache import RunContext, StageResult, logger
from tasks.quality.checks import Check, GateReport, at_least, at_most, interval_check, ratio_check
from tasks.quality.judge import JudgeVerdict, judge_checks, judge_served
from tasks.quality.pairwise import Compared, PairwiseVerdict, compare_served, pairwise_checks
from tasks.quality.stats import Difference
from tasks.reporting.evidence import release_folder
from tasks.shadow import shadow_checks

ANSWERS_TABLE = "eval/served_answers_table.json"  # the run's per-example table in MLflow

if TYPE_CHECKING:
    from tasks.benchmark import BenchmarkResult, Comparison, ServingSummary
    from tasks.deploy_canary import Deployment
    from tasks.quality.chat import Conversation
    from tasks.shadow import ShadowResult


@dataclass
class Quality:
    """Task-quality evidence from the served models, for `decide`."""

    metric: str
    parity: Difference  # offline minus served score of the candidate: positive = served is worse
    drop_vs_champion: Difference | None  # champion minus candidate, both served: positive = candidate is worse
    probe_tokens: int | None  # tokens of the served answer to the stop probe (None: no short-answer probe)
    max_tokens: int
    served_artifact: str  # what promotion serves (the registered version's artifact)
    measured_artifact: str  # what Triton loaded for the candidate, read back from the server
    judge: JudgeVerdict | PairwiseVerdict | None = None  # evaluate.judge's grades, or its comparisons (pairwise)


def decide(
    cfg: GateSection,
    model: str,
    candidate_version: str,
    champion_version: str | None,
    candidate: ServingSummary,
    comparison: Comparison | None,
    quality: Quality | None = None,
    quantization_accuracy_drop: float | None = None,
    shadowed: ShadowResult | None = None,
) -> GateReport:
    """The benchmark's summary of `candidate` and its `comparison` with the champion (None without one),
    the served `quality`, and the quantized artifact's accuracy drop (None where the quantized artifact is
    not what serves)."""
    checks = serving_checks(cfg, candidate)
    if quantization_accuracy_drop is not None:
        checks.append(
            at_most("quantization accuracy drop", quantization_accuracy_drop, cfg.max_quantization_accuracy_drop)
        )
    if quality is not None:
        checks += served_quality_checks(cfg, quality)
    if comparison is not None:
        checks += comparison_checks(cfg, comparison)
    if shadowed is not None:
        checks += shadow_checks(cfg, shadowed)
    if quality is not None and isinstance(quality.judge, JudgeVerdict):
        checks += judge_checks(cfg, quality.judge)
    elif quality is not None and isinstance(quality.judge, PairwiseVerdict):
        checks += pairwise_checks(cfg, quality.judge)
    if champion_version is not None and quality is not None and quality.drop_vs_champion is not None:
        checks.append(
            at_most(
                f"task metric drop vs champion ({quality.metric}, served)",
                quality.drop_vs_champion.value,
                cfg.max_task_metric_drop,
                quality.drop_vs_champion,
            )
        )
    return GateReport(
        model,
        candidate_version,
        champion_version,
        all(c.passed for c in checks),
        checks,
        quality.metric if quality else "",
        quality.served_artifact if quality else "",
        quality.measured_artifact if quality else "",
    )


def serving_checks(cfg: GateSection, candidate: ServingSummary) -> list[Check]:
    """The candidate's own latency, rate and errors under the benchmark's load; on the interval of its runs'
    mean where the benchmark measured several (AIPerf), else on the value."""
    checks = []
    wanted: list[tuple[str, str, float | None, Literal[">=", "<="]]] = [
        ("p99 request latency (ms)", "latency_p99_ms", cfg.p99_request_latency_ms, "<="),
        ("p99 time to first token (ms)", "ttft_p99_ms", cfg.p99_time_to_first_token_ms, "<="),
        ("request throughput (req/s)", "requests_per_s", cfg.min_requests_per_s, ">="),
    ]
    for name, statistic, threshold, comparison in wanted:
        if threshold is None:
            continue
        interval = candidate.intervals.get(statistic)
        if interval is not None:
            checks.append(interval_check(name, interval, threshold, comparison, interval.samples))
        elif comparison == "<=":
            checks.append(at_most(name, getattr(candidate, statistic), threshold))
        else:
            checks.append(at_least(name, getattr(candidate, statistic), threshold))
    checks.append(at_most("error rate", candidate.error_rate, cfg.max_error_rate))
    return checks


def served_quality_checks(cfg: GateSection, quality: Quality) -> list[Check]:
    """What is served is what was measured, and answers as it did offline."""
    checks = [
        at_least(
            "served artifact is the measured artifact", float(quality.served_artifact == quality.measured_artifact), 1
        ),
        at_most(
            f"serving parity: {quality.metric} drop served vs offline",
            quality.parity.value,
            cfg.max_serving_parity_drop,
            quality.parity,
        ),
    ]
    if quality.probe_tokens is not None:
        checks.append(at_most("served stop probe: answer tokens", quality.probe_tokens, quality.max_tokens - 1))
    return checks


def comparison_checks(cfg: GateSection, comparison: Comparison) -> list[Check]:
    """Candidate/champion ratios over the benchmark's rounds, each decided on its interval."""
    checks = []
    if cfg.min_throughput_ratio is not None:
        checks.append(
            ratio_check("throughput ratio vs champion", comparison.throughput, cfg.min_throughput_ratio, ">=")
        )
    if cfg.max_latency_ratio is not None:
        checks.append(ratio_check("p99 latency ratio vs champion", comparison.latency_p99, cfg.max_latency_ratio, "<="))
    if cfg.min_goodput_ratio is not None:
        if comparison.goodput is None:  # no objectives, or a champion that met none: nothing to compare with
            checks.append(
                Check("goodput ratio vs champion", None, cfg.min_goodput_ratio, ">=", False, inconclusive=True)
            )
        else:
            checks.append(ratio_check("goodput ratio vs champion", comparison.goodput, cfg.min_goodput_ratio, ">="))
    return checks


def measured_artifact(deployment: Deployment) -> str:
    """The artifact the first replica (where the benchmark measured) loaded for the candidate, as the service read it
    from the configuration Triton reports when it loaded it."""
    return str(deployment.loaded[0].get("artifact_sha256") or "") if deployment.loaded else ""


def score_quality(
    ctx: RunContext, deployment: Deployment, data: StageResult, evaluation: StageResult, folder: Path
) -> Quality:
    """Score the eval split through the served candidate and champion; write their answers next to the report."""
    from tasks.data.splits import eval_conversations, require_samples
    from tasks.quality.metrics import answer_metric
    from tasks.quality.models import load_tokenizer
    from tasks.quality.scoring import gain, gate_comparison, offline_scores
    from tasks.serving.predict import engine_batch
    from tasks.serving.served_scoring import SERVED_ANSWERS_FILE, score_served, stop_probe

    cfg = ctx.profile.evaluate
    conversations = eval_conversations(ctx, data, cfg.max_samples)
    require_samples(len(conversations), cfg, "gate")
    metric = answer_metric(cfg.metric)
    offline = offline_scores(ctx, evaluation)["samples"]
    offline_metric = [s["scores"]["candidate"][metric] for s in offline]
    served, max_tokens = deployment.control, cfg.answer_tokens  # through the gateway, each version by name
    tokenizer = load_tokenizer(deployment.candidate.model_dir)
    batch = engine_batch(ctx.profile)  # as many in flight as the engine batches (the candidate's settings)
    candidate = score_served(served, deployment.candidate.name, conversations, max_tokens, tokenizer, batch)
    champion = deployment.champion and score_served(
        served,
        deployment.champion.name,
        conversations,
        max_tokens,
        load_tokenizer(deployment.champion.model_dir),
        batch,
    )
    metric_cfg = gate_comparison(ctx.profile, metric)
    parity = gain(offline_metric, candidate.per_sample[metric], metric_cfg)
    drop = gain(champion.per_sample[metric], candidate.per_sample[metric], metric_cfg) if champion else None
    probe = stop_probe([s["candidate"] for s in offline], tokenizer, max_tokens)
    examples = [
        {
            "prompt": c[:-1],
            "expected": c[-1]["content"],
            "offline": o["candidate"],
            "served": candidate.answers[i],
            "served_tokens": candidate.answer_tokens[i],
            "scores": {
                "offline": o["scores"]["candidate"],
                "served": {m: v[i] for m, v in candidate.per_sample.items()},
            },
            **(
                {
                    "champion_served": champion.answers[i],
                    "champion_scores": {m: v[i] for m, v in champion.per_sample.items()},
                }
                if champion
                else {}
            ),
        }
        for i, (c, o) in enumerate(zip(conversations, offline, strict=True))
    ]
    judged = judge_answers(ctx, conversations, candidate.answers, champion.answers if champion else None, offline)
    add_grades(examples, judged)
    (folder / SERVED_ANSWERS_FILE).write_text(json.dumps(examples, indent=1, ensure_ascii=False))
    log_answers_table(ctx, examples)
    ctx.tracker.log_file(folder / SERVED_ANSWERS_FILE, "gate")
    served_means = {f"served_candidate_{m}": sum(v) / len(v) for m, v in candidate.per_sample.items()}
    if champion:
        served_means |= {f"served_champion_{m}": sum(v) / len(v) for m, v in champion.per_sample.items()}
    ctx.tracker.log_metrics("gate", served_means)
    logger().info(
        f"gate: served {metric} candidate {served_means[f'served_candidate_{metric}']:.3f}"
        + (f", champion {served_means[f'served_champion_{metric}']:.3f}" if champion else "")
        + f"; offline candidate {sum(offline_metric) / len(offline_metric):.3f}"
    )
    return Quality(
        metric,
        parity,
        drop,
        candidate.answer_tokens[probe] if probe is not None else None,
        max_tokens,
        deployment.candidate.artifact_sha256,
        measured_artifact(deployment),
        judged,
    )


def judge_answers(
    ctx: RunContext,
    conversations: list[Conversation],
    candidate: list[str],
    champion: list[str] | None,
    offline: list[dict],
) -> JudgeVerdict | PairwiseVerdict | None:
    """evaluate.judge's verdict on the served answers: each graded, or (pairwise) the candidate's compared with the
    champion's, or with the base model's offline answers where there is no champion yet."""
    questions, references = [c[-2]["content"] for c in conversations], [c[-1]["content"] for c in conversations]
    judge = ctx.profile.evaluate.judge
    if judge is None or not judge.pairwise:
        return judge_served(ctx, questions, references, candidate, champion)
    if champion is not None:
        return compare_served(ctx, Compared(questions, references, candidate, champion), "champion")
    return compare_served(ctx, Compared(questions, references, candidate, [s["base"] for s in offline]), "base")


def add_grades(examples: list[dict], judged: JudgeVerdict | PairwiseVerdict | None) -> None:
    """Each example's judge scores (None: no grade) with its other scores; pairwise, the candidate's points and the
    judge's two replies."""
    if isinstance(judged, PairwiseVerdict):
        for example, outcome, replies in zip(examples, judged.outcomes, judged.replies, strict=True):
            example["scores"]["served"]["judge_win"] = outcome
            example["judge_replies"] = {"candidate_first": replies[0], "candidate_second": replies[1]}
        return
    if judged is None:
        return
    for i, example in enumerate(examples):
        example["scores"]["served"]["judge"] = judged.candidate.scores[i]
        if judged.champion is not None:
            example["champion_scores"]["judge"] = judged.champion.scores[i]


def log_answers_table(ctx: RunContext, examples: list[dict]) -> None:
    """The eval split as served, one row per example (its prompt, reference, both versions' answers and every
    metric), as an MLflow table (mlflow.log_table's artifact, which MLflow's UI shows and compares across runs;
    the split itself is the run's `eval` dataset input, prepare_data)."""
    rows: dict[str, list] = {"prompt": [], "reference": [], "candidate": [], "champion": [], "candidate_offline": []}
    for example in examples:
        rows["prompt"].append(example["prompt"][-1]["content"])
        rows["reference"].append(example["expected"])
        rows["candidate"].append(example["served"])
        rows["champion"].append(example.get("champion_served"))
        rows["candidate_offline"].append(example["offline"])
        scored = {f"candidate_{m}": v for m, v in example["scores"]["served"].items()}
        scored |= {f"champion_{m}": v for m, v in example.get("champion_scores", {}).items()}
        for name, value in scored.items():
            rows.setdefault(name, []).append(value)
    ctx.tracker.client.log_table(ctx.tracker.run_id, rows, ANSWERS_TABLE)


def gate(
    ctx: RunContext,
    deployment: Deployment,
    bench: BenchmarkResult,
    data: StageResult,
    evaluation: StageResult,
    checked: StageResult | None,
    shadowed: ShadowResult | None = None,
) -> GateReport:
    folder = release_folder(ctx.home, ctx.tracker.run_id)
    folder.mkdir(parents=True, exist_ok=True)
    quality = score_quality(ctx, deployment, data, evaluation, folder)
    report = decide(
        ctx.profile.gate,
        deployment.service,
        deployment.candidate.version,
        deployment.champion.version if deployment.champion else None,
        bench.candidate.summary,
        bench.comparison,
        quality,
        serving_accuracy_drop(checked),
        shadowed,
    )
    json_path, md_path = report.write(folder)
    publish(ctx, report, json_path, md_path)
    logger().info(
        f"gate: {report.decision.upper()} ({sum(c.passed for c in report.checks)}/{len(report.checks)} "
        f"checks pass); report {json_path}"
    )
    return report


def serving_accuracy_drop(checked: StageResult | None) -> float | None:
    """The quantized checkpoint's accuracy drop on the runtime that serves it (build_engine's check, llmapi only).
    On CPU the merged model serves (docs/design.md: "What serves on CPU"); the ONNX numbers are informational."""
    return EngineMetrics.of(checked).accuracy_drop if checked is not None else None


def publish(ctx: RunContext, report: GateReport, json_path: Path, md_path: Path) -> None:
    """The decision in MLflow (run artifacts, metrics, version tags) and in the Prefect UI."""
    from prefect.artifacts import create_markdown_artifact

    ctx.tracker.log_file(json_path, "gate")
    ctx.tracker.log_file(md_path, "gate")
    ctx.tracker.log_metrics(
        "gate", {"passed": float(report.passed), "checks_failed": sum(not c.passed for c in report.checks)}
    )
    ctx.tracker.set_tags({"gate.decision": report.decision})
    client, name = ctx.tracker.client, ctx.profile.registry.model_name
    client.set_model_version_tag(name, report.candidate_version, "gate.decision", report.decision)
    client.set_model_version_tag(name, report.candidate_version, "gate.run_id", ctx.tracker.run_id)
    client.update_model_version(name, report.candidate_version, description=report.description())
    create_markdown_artifact(
        key="gate-report",
        markdown=report.markdown(),
        description=f"{report.decision}: {report.model} v{report.candidate_version}",
    )
