"""The release DAG as a Prefect flow.

    prepare_data -> base_model -> train -> evaluate -> merge -> quantize [-> build_engine] -> register
      -> deploy_canary (Triton) [-> tune_serving (Optuna + genai-perf)] [-> shadow (live traffic copied)] -> benchmark (genai-perf) -> gate [-> approve (a person)]
      -> promote | rollback

Each stage is a cached, retried Prefect task (tasks/platform/stage_cache.py); the flow only wires them.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow, get_run_logger, runtime
from prefect.exceptions import Pause

from tasks.approve import Approval, approve, refuse_unverified_approval
from tasks.base_model import base_model
from tasks.benchmark import benchmark, require_load_tool
from tasks.build_engine import build_engine
from tasks.deploy_canary import Deployment, deploy_canary
from tasks.evaluate import evaluate, judged_as
from tasks.gate import gate
from tasks.merge import merge
from tasks.platform.config import Profile, ProfileName, check_api_profile, load_profile
from tasks.platform.decisions import forget_waiting, suspended_release
from tasks.platform.errors import CheckFailed
from tasks.platform.project import llmops_home
from tasks.platform.quiet import quiet_libraries
from tasks.platform.run_policy import check_profile_locations, check_release_parameters
from tasks.platform.stage_cache import RunContext, StageResult, logger, stage_task
from tasks.platform.stores import default_services, open_store, refuse_a_local_store_for_a_tracking_server
from tasks.platform.tracking import Tracker, default_tracking_uri, end_failed, end_run, resume_run, start_run
from tasks.platform.unused_imports import PIPELINE, leave_out
from tasks.prepare_data import DatasetMetrics, prepare_data
from tasks.quality.checks import GateReport
from tasks.quantize import quantize
from tasks.register import Registered, register
from tasks.reporting.evidence import GATE_REPORT, release_folder
from tasks.reporting.publish import write_report
from tasks.rollout import rollout
from tasks.runtime.standalone import open_service
from tasks.serving.champion import is_champion
from tasks.serving.client import TritonTarget
from tasks.serving.ownership import serving_lock
from tasks.serving.service import Service
from tasks.shadow import refuse_shadow_without_gateway, shadow
from tasks.train import train
from tasks.tune_serving import tune_serving


@dataclass
class ReleaseResult:
    stages: list[StageResult]
    registered: Registered
    tracker: Tracker
    outcome: str = "not deployed"
    gate_report: GateReport | None = None
    gate_report_path: Path | None = None
    approval: Approval | None = None
    serving: list[ServingStep] = field(default_factory=list)  # deploy_canary, tune_serving, shadow, benchmark
    report_path: Path | None = None  # the release report (HTML), beside the gate report


@dataclass
class ServingStep:
    """A serving stage of the run as the final table shows it: never cached (it measures what is live)."""

    stage: str
    seconds: float
    headline: str


def serving_stage(steps: list[ServingStep], fn, config: Profile):
    """`stage_task(fn, config)` whose wall time and headline (its result's `headline()`) are kept for the table."""
    run = stage_task(fenced(fn), config)

    def timed(*args):
        started = time.perf_counter()
        result = run(*args)
        headline = result.headline() if hasattr(result, "headline") else ""
        steps.append(ServingStep(fn.__name__, time.perf_counter() - started, headline))
        return result

    return timed


def fenced(fn):
    """Stage `fn`, which refuses to start once the release lost its service, and ends as LostService (unretried, exit
    6) where it fails after the release lost it: whatever else it met (its candidate unloaded under its benchmark),
    the service being another's is why the release ends."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        control = next(a.control for a in (*args, *kwargs.values()) if isinstance(a, Deployment | Service))
        control.refuse_if_lost()
        try:
            return fn(*args, **kwargs)
        except Exception:
            control.confirm_owner()
            raise

    return run


def open_context(profile: Profile, tracking_uri: str | None, artifacts: str | None) -> RunContext:
    tracking_uri, artifacts = default_services(tracking_uri, artifacts)
    home = llmops_home()
    refuse_a_local_store_for_a_tracking_server(tracking_uri, artifacts, home)  # a worker's run, before MLflow's
    waiting = suspended_release(home, str(runtime.flow_run.id or ""))
    if waiting is not None and waiting.get("mlflow_run_id"):  # started again by its decision: the same MLflow run
        tracker = resume_run(tracking_uri or default_tracking_uri(home), waiting["mlflow_run_id"])
        return RunContext(profile, open_store(artifacts, home), tracker, home)
    # A local store keeps its artifacts under LLMOPS_HOME; a tracking server decides for itself.
    artifact_root = None if tracking_uri else home / "mlartifacts"
    tracker = start_run(
        tracking_uri or default_tracking_uri(home),
        artifact_root,
        f"release-{profile.name}",
        tags={
            "profile.name": profile.name,
            "profile.digest": profile.digest,
            "prefect.flow_run_id": str(runtime.flow_run.id or ""),
        },
    )
    tracker.log_params("profile", profile.model_dump(mode="json"))
    return RunContext(profile, open_store(artifacts, home), tracker, home)


def open_serving_context(profile: Profile, tracking_uri: str | None, artifacts: str | None) -> RunContext:
    """What `llmops serve` needs: the store and the registry, no tracking run."""
    tracking_uri, artifacts = default_services(tracking_uri, artifacts)
    home = llmops_home()
    return RunContext(
        profile, open_store(artifacts, home), Tracker(tracking_uri or default_tracking_uri(home), "", ""), home
    )


@flow(name="release", log_prints=True)
def release(
    profile: ProfileName = "cpu-tiny",
    data_source: str | None = None,
    eval_data: str | None = None,
    overrides: list[str] | None = None,
    tracking_uri: str | None = None,
    artifacts: str | None = None,
    triton_url: str | None = None,
    triton_repository: str | None = None,
    triton_grpc_url: str | None = None,
    triton_metrics_url: str | None = None,
) -> ReleaseResult:
    """Data -> (Q)LoRA adapter -> evaluated, merged, quantized candidate -> canary on Triton -> gate -> promote | rollback.

    Args:
        profile: run profile, one of profiles/ (a YAML path too, where the flow is called directly; a run started
            through the API takes one under LLMOPS_PROFILES_DIR only: docs/security.md).
        data_source: dataset file, folder or s3:// URI; empty: the profile's data.source.
        eval_data: the held-out set the candidate is scored on (file, folder or s3:// URI); empty: the profile's
            data.eval_source with its own data, a hash split of data_source otherwise (the profile's curated set
            where data_source holds harvested records); "profile": the profile's data.eval_source whatever the data.
        overrides: profile overrides as key=value, e.g. train.learning_rate=1e-4 or serve.deploy=false. Every
            setting with its type, default and meaning: docs/reference/profiles.md, or `llmops profiles show NAME`.
            Settings that run code (executables, environments, images, pass-through arguments) come only from
            profile files and are refused here.
        tracking_uri: MLflow tracking URI; empty: MLFLOW_TRACKING_URI of the worker, else sqlite under LLMOPS_HOME.
        artifacts: artifact store, a folder or s3://bucket/prefix; empty: LLMOPS_ARTIFACTS, else LLMOPS_HOME/store.
        triton_url: a running Triton to roll out on (HTTP URL), behind a temporary gateway of the run's own; empty:
            LLMOPS_TRITON_URL, else the service `llmops serve` runs for this LLMOPS_HOME, else a temporary Triton
            and gateway. Through the API, only the worker's LLMOPS_TRITON_URL or one of its LLMOPS_TRITON_URLS (the
            operator's allow-list).
        triton_repository: that Triton's model repository folder on a filesystem this machine shares; empty: models
            are sent with their load requests (no shared filesystem).
        triton_grpc_url: that Triton's gRPC endpoint (host:port), for genai-perf; or LLMOPS_TRITON_GRPC_URL.
        triton_metrics_url: that Triton's Prometheus metrics URL, for the canary's live checks; or
            LLMOPS_TRITON_METRICS_URL.
    """
    quiet_libraries()  # a worker's flow run does not go through the CLI, which does these too
    leave_out(PIPELINE)
    if runtime.deployment.id:  # started through the Prefect API (UI, schedule, retrain): shipped profiles only
        check_api_profile(profile)
        check_release_parameters(
            data_source, eval_data, tracking_uri, artifacts, triton_url, triton_repository, triton_grpc_url,
            triton_metrics_url,
        )  # fmt: skip
    config = load_profile(profile, overrides or [], data_source, eval_data)
    refuse_before_training(profile, config, data_source, eval_data)
    target = TritonTarget.from_options(
        triton_url, triton_grpc_url, triton_metrics_url, triton_repository, from_api=bool(runtime.deployment.id)
    )
    ctx = open_context(config, tracking_uri, artifacts)
    served: Service | None = None
    deployment: Deployment | None = None
    report: GateReport | None = None
    approval: Approval | None = None
    steps: list[ServingStep] = []
    stages: list[StageResult] = []
    report_path: Path | None = None
    try:
        refuse_shadow_without_gateway(config, target, ctx.home)  # before training, not after it
        require_load_tool(config)
        dataset = stage_task(prepare_data, config)(ctx)
        base = stage_task(base_model, config)(ctx, dataset)
        stages = [dataset, base]  # as they finish: a release that fails later reports what it made
        ctx.profile = config = judged_as(ctx, dataset, base)  # evaluate.metric, max_new_tokens: auto -> the data's
        adapter = stage_task(train, config)(ctx, dataset, base)
        stages.append(adapter)
        evaluation = stage_task(evaluate, config)(ctx, dataset, base, adapter)
        stages.append(evaluation)
        merged = stage_task(merge, config)(ctx, dataset, base, adapter)
        stages.append(merged)
        quantized = stage_task(quantize, config)(ctx, dataset, merged)
        stages.append(quantized)
        checked = None  # llmapi: the checkpoint checked on the runtime that will serve it (a gate, not an artifact)
        if config.serve.backend == "llmapi":
            checked = stage_task(build_engine, config)(ctx, dataset, evaluation, quantized)
            stages.append(checked)
        registered = stage_task(register, config)(
            ctx, quantized, stages, DatasetMetrics.of(dataset).fingerprint, str(runtime.flow_run.id or "")
        )
        record_run(ctx, stages, registered)
        if not config.serve.deploy:
            end_run(ctx.tracker, "FINISHED")
            return ReleaseResult(stages, registered, ctx.tracker)
        if target is None and is_champion(ctx, registered):
            # Nothing new to roll out: no Triton to start, no lock to take (`llmops serve` keeps serving it).
            get_run_logger().info(
                f"release: {registered.name} v{registered.version} already is the champion; nothing to roll out"
            )
            ctx.tracker.set_tags({"release.outcome": "unchanged"})
            end_run(ctx.tracker, "FINISHED")
            return ReleaseResult(stages, registered, ctx.tracker, "unchanged")

        served = open_service(ctx, target)
        # one release of a service deploys .. promotes at a time; a resumed run is the same release (its flow run)
        release_id = str(runtime.flow_run.id or ctx.tracker.run_id)
        with serving_lock(config, ctx.tracker, served, release_id, started_again(ctx)) as lock:
            deployment = serving_stage(steps, deploy_canary, config)(ctx, registered, served)
            approved, rejection = True, ""
            if not deployment.unchanged:
                report = measure(ctx, steps, deployment, [dataset, evaluation, checked])
                approved, rejection = report.passed, f"gate rejected: {report.summary()}"
                write_report(ctx, f"gate: {report.decision}", "" if report.passed else rejection, stages)
                if report.passed and needs_approval(config, dataset):  # a person's decision is never cached
                    # a run of a deployment waits without a process: suspended, the service owned (waiting) until
                    # the approval timeout; it is started again by the decision and comes back here
                    lock.wait_for_approval(config.gate.approval_timeout_s + config.canary.hold_s)
                    approval = approve(ctx, report, str(runtime.flow_run.id), can_suspend())
                    lock.decided()
                    approved, rejection = approval.approved, approval.summary()
            outcome = stage_task(fenced(rollout), config)(ctx, deployment, approved, rejection, dataset)
        report_path = write_report(ctx, outcome.replace("_", " "), rejection if outcome == "rejected" else "", stages)
    except Pause:  # suspended for approval: the MLflow run goes on when the decision starts the flow run again
        ctx.tracker.set_tags({"release.outcome": "waiting for approval"})
        raise
    except BaseException as exc:
        refused = isinstance(exc, CheckFailed)  # a check said no (evaluate's margin, merge, quantize), not a fault
        write_report(
            ctx, "refused" if refused else "failed", f"{type(exc).__name__}: {exc}".splitlines()[0][:400], stages
        )
        end_failed(ctx.tracker, exc, get_run_logger().warning)
        forget_waiting(ctx.home, str(runtime.flow_run.id or ""))  # a resumed run that failed before its decision
        raise
    finally:
        let_go(served, deployment)
    forget_waiting(ctx.home, str(runtime.flow_run.id or ""))  # a resumed run whose gate rejected on measuring again
    end_run(ctx.tracker, "FINISHED")
    gate_path = release_folder(ctx.home, ctx.tracker.run_id) / GATE_REPORT if report else None
    return ReleaseResult(stages, registered, ctx.tracker, outcome, report, gate_path, approval, steps, report_path)


def refuse_before_training(profile: str, config: Profile, data_source: str | None, eval_data: str | None) -> None:
    """What would fail the run after its training, refused before it: overrides that move its locations off the
    worker's allow-list (a run of the Prefect API), and an approval its profile file asks for with nothing to verify
    the person's decision."""
    written = load_profile(profile, [], data_source, eval_data)  # the profile file's own settings
    if runtime.deployment.id:
        check_profile_locations(config, written)
    if written.gate.approval == "required" and config.serve.deploy:
        refuse_unverified_approval(config.gate)


def let_go(served: Service | None, deployment: Deployment | None) -> None:
    """Whatever happened: the run no longer renews its hold on the routes, and what it started for itself (a Triton,
    a gateway) stops; nothing of `llmops serve`'s."""
    if deployment is not None:
        deployment.let_go()
    if served is not None:
        served.stop()


def can_suspend() -> bool:
    """Whether this flow run can wait for a person without a process: Prefect suspends a run of a deployment that is
    no subflow (prefect/server/orchestration/core_policy.py:1386-1395 at 3.7.2), and starts it again from that
    deployment. `llmops run` (no deployment), or a release someone runs as a subflow of a flow of theirs, pauses in
    its process. The service it runs on may be a Triton and gateway of the run's own: they stop with the process, and
    the run started again starts them again and loads the champion and the candidate on them (deploy_canary)."""
    return bool(runtime.deployment.id) and not runtime.flow_run.parent_flow_run_id


def needs_approval(config: Profile, dataset: StageResult) -> bool:
    """gate.approval required, or harvested and the training data holds records clients wrote (the flywheel's)."""
    harvested = (DatasetMetrics.of(dataset).harvested_records or 0) > 0
    return config.gate.approval == "required" or (config.gate.approval == "harvested" and harvested)


def measure(ctx: RunContext, steps: list[ServingStep], deployment: Deployment, inputs: list) -> GateReport:
    """The loaded candidate's serving settings searched (tune.enabled), its shadow window, the benchmark, and the
    gate's decision; `inputs`: the gate's dataset, evaluation and engine check stages. A run started again by its
    decision: the report its first process measured, where it still holds."""
    earlier = measured_before_suspension(ctx, deployment)
    if earlier is not None:
        return earlier
    config = ctx.profile
    if config.tune.enabled:  # the candidate's serving settings, searched before anything measures it
        serving_stage(steps, tune_serving, config)(ctx, deployment)
    shadowed = serving_stage(steps, shadow, config)(ctx, deployment)  # None unless canary.shadow_s
    measured = serving_stage(steps, benchmark, config)(ctx, deployment)
    return stage_task(fenced(gate), config)(ctx, deployment, measured, *inputs, shadowed)


def measured_before_suspension(ctx: RunContext, deployment: Deployment) -> GateReport | None:
    """A run started again by its decision: the gate report its first process measured, the one the person read and
    decided on, where it measured this candidate against this champion (the service was owned all along, so no other
    release moved either). Measuring again could decide otherwise than what was approved, and takes minutes."""
    if not started_again(ctx):
        return None
    path = release_folder(ctx.home, ctx.tracker.run_id) / GATE_REPORT
    report = GateReport.read(path) if path.is_file() else None
    champion = deployment.champion.version if deployment.champion else None
    measured = (deployment.candidate.version, champion, deployment.candidate.artifact_sha256)
    if report is None or (report.candidate_version, report.champion_version, report.served_artifact) != measured:
        logger().info("gate: no report of this candidate against this champion from before the suspension; measuring")
        return None
    logger().info(f"gate: {report.decision.upper()} as measured before the suspension (report {path})")
    return report


def started_again(ctx: RunContext) -> bool:
    """This flow run suspended for approval earlier and its decision started it again (tasks/approve.py)."""
    return suspended_release(ctx.home, str(runtime.flow_run.id or "")) is not None


def record_run(ctx: RunContext, stages: list[StageResult], registered: Registered) -> None:
    """Every artifact of the run, reachable from the MLflow run and from the Prefect UI. A run started again by its
    decision recorded them in its first process: here every stage is a cache hit, which is not what ran."""
    from prefect.artifacts import create_table_artifact

    if started_again(ctx):
        return

    ctx.tracker.log_json(
        "artifacts.json", {s.stage: {"uri": s.artifact.uri, "sha256": s.artifact.digest} for s in stages}
    )
    ctx.tracker.set_tags(
        {
            "registered_model": registered.name,
            "registered_version": registered.version,
            **{f"stage.{s.stage}": "cached" if s.cached else "ran" for s in stages},
        }
    )
    create_table_artifact(
        key="release-summary",
        table=[
            {
                "stage": s.stage,
                "result": "cached" if s.cached else "ran",
                "seconds": round(s.seconds, 1),
                "metric": s.headline,
                "artifact": s.artifact.uri,
            }
            for s in stages
        ],
        description=f"{registered.name} version {registered.version}; MLflow run {ctx.tracker.run_id}",
    )
