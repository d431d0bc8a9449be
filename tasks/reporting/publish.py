"""Write a release's report beside its gate report, log it to its MLflow run and link it from its Prefect run. Never
fails the release: a report that cannot be written is said in one line."""

from __future__ import annotations

from pathlib import Path

from tasks.platform.stage_cache import RunContext, StageResult, logger
from tasks.reporting.evidence import REPORT_FILE, StageRecord, gather, release_folder
from tasks.reporting.page import render


def stage_records(stages: list[StageResult]) -> list[StageRecord]:
    return [StageRecord(s.stage, s.artifact.uri, s.artifact.digest, s.cached, dict(s.metrics)) for s in stages]


def write_report(ctx: RunContext, outcome: str, reason: str, stages: list[StageResult]) -> Path | None:
    """The report of this release as it stands (`outcome`, and `reason` where it did not promote); its path, or
    None where it could not be written."""
    try:
        evidence = gather(
            ctx.home, ctx.tracker.run_id, ctx.profile.registry.model_name, outcome, reason, stage_records(stages)
        )
        path = release_folder(ctx.home, ctx.tracker.run_id) / REPORT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(evidence), encoding="utf-8")
        if tracking_answers(ctx.tracker.tracking_uri):
            ctx.tracker.log_file(path, "report")
        else:  # a release failing on an MLflow outage would wait out MLflow's retries for nothing
            logger().warning(f"release report: MLflow at {ctx.tracker.tracking_uri} does not answer; not logged there")
        link(ctx, path, evidence.outcome)
    except Exception as exc:  # the release's outcome stands whatever its report meets
        logger().warning(f"release report: not written ({type(exc).__name__}: {exc})")
        return None
    logger().info(f"release report: {path}")
    return path


def tracking_answers(tracking_uri: str) -> bool:
    """A tracking server answers its health check within 2 s (a local store always does)."""
    if not tracking_uri.startswith("http"):
        return True
    import requests

    try:
        return requests.get(f"{tracking_uri.rstrip('/')}/health", timeout=2).ok
    except requests.RequestException:
        return False


def link(ctx: RunContext, path: Path, outcome: str) -> None:
    """The Prefect run's artifact: where the page is on the worker and in the MLflow run."""
    from prefect.artifacts import create_markdown_artifact

    run = ctx.tracker.url()
    mlflow_run = f"[{ctx.tracker.run_id}]({run})" if run.startswith("http") else f"`{run}`"
    create_markdown_artifact(
        key="release-report",
        markdown=(
            f"# Release report: {outcome}\n\nOn the worker: `{path}`\n\n"
            f"In MLflow: run {mlflow_run}, artifact `report/{REPORT_FILE}`\n"
        ),
        description=f"release report ({outcome})",
    )
