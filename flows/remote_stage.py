"""One heavy stage as its own flow run, deployed on the pool that has the hardware for it.

The release flow starts it with Prefect's `run_deployment` when the profile places a stage there
(`run.remote_stages: {train: run-stage/gpu}`), waits, and reads the result from the shared
artifact store. Metrics go to the release's MLflow run. The profile comes whole as a parameter; its
settings that run code are checked against this worker's profile file of the same name.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from prefect import flow

from tasks.build_engine import build_engine
from tasks.evaluate import evaluate
from tasks.merge import merge
from tasks.platform.config import Profile, check_machine, check_received_profile
from tasks.platform.project import llmops_home
from tasks.platform.run_policy import refuse_unlisted_location, refuse_unlisted_tracking
from tasks.platform.stage_cache import RunContext, StageResult
from tasks.platform.stores import open_store
from tasks.platform.tracking import Tracker
from tasks.quantize import quantize
from tasks.train import train

STAGE_FUNCTIONS: dict[str, Callable[..., StageResult]] = {
    "train": train,
    "evaluate": evaluate,
    "merge": merge,
    "quantize": quantize,
    "build_engine": build_engine,
}


@flow(name="run-stage", log_prints=True)
def run_stage(
    stage: str,
    profile: dict,
    artifacts: str,
    tracking_uri: str,
    mlflow_run_id: str,
    experiment_id: str,
    inputs: list[dict],
) -> dict:
    """Run one heavy stage of a release run.

    Args:
        stage: the stage to run (train, evaluate, merge, quantize, build_engine).
        profile: the release run's validated profile, in full; its settings that run code must equal those of
            the profile file of its name on this worker (anyone who reaches the Prefect API can start this flow).
        artifacts: the artifact store the release run uses (s3:// for a cluster).
        tracking_uri: the MLflow tracking server.
        mlflow_run_id: the release run's MLflow run; the stage's metrics go there.
        experiment_id: that run's experiment.
        inputs: the upstream stage results (artifact digests and URIs) the stage takes.
    """
    if stage not in STAGE_FUNCTIONS:
        raise ValueError(f"stage {stage!r}: not a heavy stage (one of {', '.join(STAGE_FUNCTIONS)})")
    config = Profile.model_validate(profile)
    check_received_profile(config)
    # always started through the API (by a release run, or by anyone with the login): MLflow's login and the store's
    # credentials go only where the worker's own settings or its allow-list say (tasks/platform/run_policy.py)
    refuse_unlisted_tracking("tracking_uri", tracking_uri, os.environ.get("MLFLOW_TRACKING_URI"))
    refuse_unlisted_location("artifacts", artifacts, [os.environ.get("LLMOPS_ARTIFACTS")])
    check_machine(config, [stage])
    ctx = RunContext(
        config, open_store(artifacts, llmops_home()), Tracker(tracking_uri, mlflow_run_id, experiment_id), llmops_home()
    )
    result = STAGE_FUNCTIONS[stage](ctx, *[StageResult.from_dict(i) for i in inputs])
    return result.as_dict()
