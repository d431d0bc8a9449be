"""gate: promote or reject the candidate on thresholds from the profile.

Absolute checks on the candidate (p99 request latency, p99 TTFT, error rate, quantization accuracy
delta) and, when a champion serves, checks relative to it (throughput ratio, task-metric drop).
The decision, with each check's value, threshold and verdict, is written as JSON and markdown.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tasks.config import GateSection
from tasks.stage import RunContext, StageResult, logger

REJECTED_EXIT_CODE = 10  # `llmops gate` / `llmops run` when the gate rejects the candidate


@dataclass
class Check:
    name: str
    value: float | None
    threshold: float
    comparison: str  # "<=" or ">="
    passed: bool


@dataclass
class GateReport:
    model: str
    candidate_version: str
    champion_version: str | None
    passed: bool
    checks: list[Check] = field(default_factory=list)

    @property
    def decision(self) -> str:
        return "promote" if self.passed else "reject"

    def summary(self) -> str:
        failed = [f"{c.name} {c.value if c.value is None else round(c.value, 4)} (needs {c.comparison} {c.threshold:g})"
                  for c in self.checks if not c.passed]
        return "; ".join(failed) or "all checks pass"

    def as_dict(self) -> dict:
        return {**asdict(self), "decision": self.decision}

    def markdown(self) -> str:
        lines = [f"# Gate: {self.decision.upper()} {self.model} v{self.candidate_version}", "",
                 f"Champion: {'v' + self.champion_version if self.champion_version else 'none (first release)'}", "",
                 "| check | value | threshold | verdict |", "|---|---|---|---|"]
        for c in self.checks:
            value = "n/a" if c.value is None else f"{c.value:.4g}"
            lines.append(f"| {c.name} | {value} | {c.comparison} {c.threshold:g} | {'pass' if c.passed else 'FAIL'} |")
        return "\n".join(lines) + "\n"

    def write(self, folder: Path) -> tuple[Path, Path]:
        folder.mkdir(parents=True, exist_ok=True)
        json_path, md_path = folder / "gate_report.json", folder / "gate_report.md"
        json_path.write_text(json.dumps(self.as_dict(), indent=2))
        md_path.write_text(self.markdown())
        return json_path, md_path


def at_most(name: str, value: float | None, threshold: float) -> Check:
    return Check(name, value, threshold, "<=", value is not None and value <= threshold)


def at_least(name: str, value: float | None, threshold: float) -> Check:
    return Check(name, value, threshold, ">=", value is not None and value >= threshold)


def decide(cfg: GateSection, model: str, candidate_version: str, champion_version: str | None,
           candidate: dict[str, float], champion: dict[str, float] | None) -> GateReport:
    """`candidate`/`champion`: latency_p99_ms, ttft_p99_ms, output_tokens_per_s, error_rate,
    exact_match (task metric) and, for the candidate, quantization_accuracy_drop."""
    checks = []
    if cfg.p99_request_latency_ms is not None:
        checks.append(at_most("p99 request latency (ms)", candidate["latency_p99_ms"], cfg.p99_request_latency_ms))
    if cfg.p99_time_to_first_token_ms is not None:
        checks.append(at_most("p99 time to first token (ms)", candidate["ttft_p99_ms"], cfg.p99_time_to_first_token_ms))
    if cfg.min_requests_per_s is not None:
        checks.append(at_least("request throughput (req/s)", candidate.get("requests_per_s"), cfg.min_requests_per_s))
    checks.append(at_most("error rate", candidate["error_rate"], cfg.max_error_rate))
    checks.append(at_most("quantization accuracy drop", candidate["quantization_accuracy_drop"],
                          cfg.max_quantization_accuracy_drop))
    if champion is not None:
        if cfg.min_throughput_ratio is not None:
            ratio = candidate["output_tokens_per_s"] / champion["output_tokens_per_s"] if champion["output_tokens_per_s"] else None
            checks.append(at_least("throughput ratio vs champion", ratio, cfg.min_throughput_ratio))
        checks.append(at_most("task metric drop vs champion", champion["exact_match"] - candidate["exact_match"],
                              cfg.max_task_metric_drop))
    return GateReport(model, candidate_version, champion_version, all(c.passed for c in checks), checks)


def champion_exact_match(ctx: RunContext, deployment, data: StageResult) -> float:
    """The champion scored on this run's eval split: the same questions the candidate answered."""
    from tasks.data import eval_conversations
    from tasks.evaluate import exact_match, generate_answers, load_model, load_tokenizer

    cfg = ctx.profile.evaluate
    conversations = eval_conversations(ctx, data, cfg.max_samples)
    model_dir = deployment.champion.model_dir
    answers = generate_answers(load_model(model_dir), load_tokenizer(model_dir), conversations, cfg.max_new_tokens)
    return exact_match(answers, conversations)


def gate(ctx: RunContext, deployment, bench: dict, data: StageResult, evaluation: StageResult,
         quantized: StageResult) -> GateReport:
    candidate = {**bench["candidate"], "exact_match": evaluation.metrics["candidate_exact_match"],
                 "quantization_accuracy_drop": quantized.metrics["accuracy_drop"]}
    champion = None
    if deployment.champion is not None:
        champion = {**bench["champion"], "exact_match": champion_exact_match(ctx, deployment, data)}
    report = decide(ctx.profile.gate, deployment.service, deployment.candidate.version,
                    deployment.champion.version if deployment.champion else None, candidate, champion)
    json_path, md_path = report.write(ctx.home / "work" / "gate" / ctx.tracker.run_id)
    publish(ctx, report, json_path, md_path)
    logger().info(f"gate: {report.decision.upper()} ({sum(c.passed for c in report.checks)}/{len(report.checks)} "
                  f"checks pass); report {json_path}")
    return report


def publish(ctx: RunContext, report: GateReport, json_path: Path, md_path: Path) -> None:
    """The decision in MLflow (run artifacts, metrics, version tags) and in the Prefect UI."""
    from prefect.artifacts import create_markdown_artifact

    ctx.tracker.log_file(json_path, "gate")
    ctx.tracker.log_file(md_path, "gate")
    ctx.tracker.log_metrics("gate", {"passed": float(report.passed), "checks_failed": sum(not c.passed for c in report.checks)})
    ctx.tracker.set_tags({"gate.decision": report.decision})
    client, name = ctx.tracker.client, ctx.profile.registry.model_name
    client.set_model_version_tag(name, report.candidate_version, "gate.decision", report.decision)
    client.set_model_version_tag(name, report.candidate_version, "gate.run_id", ctx.tracker.run_id)
    create_markdown_artifact(key="gate-report", markdown=report.markdown(),
                             description=f"{report.decision}: {report.model} v{report.candidate_version}")
