"""The release DAG as a Prefect flow.

    prepare_data -> base_model -> train -> evaluate -> merge -> quantize -> register
      -> deploy_canary (Triton) -> benchmark (genai-perf) -> gate -> promote | rollback

Each stage is a cached, retried Prefect task (tasks/stage.py); the flow only wires them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from prefect import flow, runtime

from tasks import base_model, bench, canary, data, evaluate, gate, merge, quantize, registry, train
from tasks.config import Profile, load_profile
from tasks.stage import RunContext, StageResult, stage_task
from tasks.store import open_store
from tasks.tracking import Tracker, default_tracking_uri, end_run, start_run


@dataclass
class ReleaseResult:
    stages: list[StageResult]
    registered: registry.Registered
    tracker: Tracker
    outcome: str = "not deployed"
    gate_report: gate.GateReport | None = None
    gate_report_path: Path | None = None


def llmops_home() -> Path:
    return Path(os.environ.get("LLMOPS_HOME", ".llmops")).resolve()


def open_context(profile: Profile, tracking_uri: str | None, artifacts: str | None) -> RunContext:
    home = llmops_home()
    # A local store keeps its artifacts under LLMOPS_HOME; a tracking server decides for itself.
    artifact_root = None if tracking_uri else home / "mlartifacts"
    tracker = start_run(
        tracking_uri or default_tracking_uri(home), artifact_root, f"release-{profile.name}",
        tags={"profile.name": profile.name, "profile.digest": profile.digest,
              "prefect.flow_run_id": str(runtime.flow_run.id or "")},
    )
    tracker.log_params("profile", profile.model_dump(mode="json"))
    return RunContext(profile, open_store(artifacts, home), tracker, home)


def open_serving_context(profile: Profile, tracking_uri: str | None, artifacts: str | None) -> RunContext:
    """What `llmops serve` needs: the store and the registry, no tracking run."""
    home = llmops_home()
    return RunContext(profile, open_store(artifacts, home), Tracker(tracking_uri or default_tracking_uri(home), "", ""), home)


@flow(name="release", log_prints=True)
def release(profile: str = "cpu-tiny", data_source: str | None = None, overrides: list[str] | None = None,
            tracking_uri: str | None = None, artifacts: str | None = None, triton_url: str | None = None,
            triton_repository: str | None = None) -> ReleaseResult:
    """Data -> (Q)LoRA adapter -> evaluated, merged, quantized candidate -> canary on Triton -> gate -> promote | rollback."""
    config = load_profile(profile, overrides or [], data_source)
    ctx = open_context(config, tracking_uri, artifacts)
    triton, started_here, report = None, False, None
    try:
        dataset = stage_task(data.prepare_data, config)(ctx)
        base = stage_task(base_model.base_model, config)(ctx, dataset)
        adapter = stage_task(train.train, config)(ctx, dataset, base)
        evaluation = stage_task(evaluate.evaluate, config)(ctx, dataset, base, adapter)
        merged = stage_task(merge.merge, config)(ctx, dataset, base, adapter)
        quantized = stage_task(quantize.quantize, config)(ctx, dataset, merged)
        stages = [dataset, base, adapter, evaluation, merged, quantized]
        registered = stage_task(registry.register, config)(
            ctx, quantized, stages, dataset.metrics["fingerprint"], str(runtime.flow_run.id or ""))
        record_run(ctx, stages, registered)
        if not config.serve.deploy:
            end_run(ctx.tracker, "FINISHED")
            return ReleaseResult(stages, registered, ctx.tracker)

        triton, started_here = canary.open_triton(ctx, triton_url, triton_repository)
        deployment = stage_task(canary.deploy_canary, config)(ctx, registered, triton)
        if not deployment.unchanged:
            measured = stage_task(bench.benchmark, config)(ctx, deployment)
            report = stage_task(gate.gate, config)(ctx, deployment, measured, dataset, evaluation, quantized)
        outcome = stage_task(canary.rollout, config)(
            ctx, deployment, report.passed if report else True, report.summary() if report else "", dataset)
    except BaseException as exc:
        ctx.tracker.set_tags({"error": f"{type(exc).__name__}: {exc}"[:5000]})
        end_run(ctx.tracker, "FAILED")
        raise
    finally:
        if triton is not None and started_here:
            triton.stop()
    end_run(ctx.tracker, "FINISHED")
    report_path = ctx.home / "work" / "gate" / ctx.tracker.run_id / "gate_report.json" if report else None
    return ReleaseResult(stages, registered, ctx.tracker, outcome, report, report_path)


def record_run(ctx: RunContext, stages: list[StageResult], registered: registry.Registered) -> None:
    """Every artifact of the run, reachable from the MLflow run and from the Prefect UI."""
    from prefect.artifacts import create_table_artifact

    ctx.tracker.log_json("artifacts.json", {s.stage: {"uri": s.artifact.uri, "sha256": s.artifact.digest} for s in stages})
    ctx.tracker.set_tags({"registered_model": registered.name, "registered_version": registered.version,
                          **{f"stage.{s.stage}": "cached" if s.cached else "ran" for s in stages}})
    create_table_artifact(
        key="release-summary",
        table=[{"stage": s.stage, "result": "cached" if s.cached else "ran", "seconds": round(s.seconds, 1),
                "metric": s.headline, "artifact": s.artifact.uri} for s in stages],
        description=f"{registered.name} version {registered.version}; MLflow run {ctx.tracker.run_id}",
    )
