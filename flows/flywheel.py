"""The data flywheel: what the service served, and how clients judged it, becomes the next release's data.

    harvest (captured exchanges + feedback -> a training set, tasks/data/harvest.py)
      -> enough new records? -> push to the watched data location (llmops.data.landed)
      -> the retrain deployment starts a release run -> the gate, as for any new data

`llmops data harvest` runs the first step by hand; the `flywheel` deployment (infra/prefect.yaml) runs all of it on
a schedule. Each run is an MLflow run of the experiment `llm-flywheel`: the counts as metrics, the report and the
captured objects read (the dataset's lineage) as artifacts, and the dataset's URI as a tag.
"""

from __future__ import annotations

import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, runtime, task
from prefect.cache_policies import NO_CACHE

from flows.harvest import Harvested, describe, harvest_dataset
from flows.release import default_services, llmops_home
from tasks.data.harvest import MinRating
from tasks.platform.config import Profile, ProfileName, check_api_profile, load_profile
from tasks.platform.tracking import default_tracking_uri

FLYWHEEL_EXPERIMENT = "llm-flywheel"


# Not cached: each run reads what was captured since; retried, as the store may be down for a moment
@task(name="harvest", retries=2, retry_delay_seconds=10, cache_policy=NO_CACHE)
def harvest_task(config: Profile, since: datetime, out: str, min_rating: MinRating) -> Harvested:
    return harvest_dataset(config, since, out, min_rating)


@task(name="push_data", retries=2, retry_delay_seconds=10, cache_policy=NO_CACHE)
def push_task(source: str, destination: str) -> str:
    from flows.deploy import push_data

    return push_data(source, destination)


def track(harvested: Harvested, parameters: dict[str, Any], pushed_to: str | None) -> None:
    """The harvest as an MLflow run (counts, report, lineage, where its dataset went) and a Prefect artifact."""
    import mlflow
    from prefect.artifacts import create_markdown_artifact

    tracking_uri, _ = default_services(None, None)
    mlflow.set_tracking_uri(tracking_uri or default_tracking_uri(llmops_home()))
    mlflow.set_experiment(FLYWHEEL_EXPERIMENT)
    with mlflow.start_run(run_name=f"harvest-{harvested.report['service']}"):
        mlflow.log_params(parameters)
        mlflow.log_metrics({f"harvest.{k}": v for k, v in harvested.report["counts"].items()})
        mlflow.log_dict(harvested.report, "harvest_report.json")
        mlflow.set_tags(
            {
                "harvest.dataset": pushed_to or "",  # empty: not pushed (too few records)
                "harvest.pushed": str(pushed_to is not None).lower(),
                "prefect.flow_run_id": str(runtime.flow_run.id or ""),
            }
        )
    create_markdown_artifact(f"```\n{describe(harvested)}\n```", key="harvest", description="What the harvest kept")


@flow(name="flywheel", log_prints=True)
def flywheel(
    profile: ProfileName = "cpu-tiny",
    data_destination: str = "s3://datasets/sft/",
    since_hours: float = 24,
    min_rating: MinRating = "good",
    min_new_records: int = 20,
) -> str:
    """Harvest the service's captured exchanges; push them as new data when there are enough.

    Args:
        profile: profile of the service (its registry.model_name, serve.capture.location, data settings).
        data_destination: the data location the retrain deployment watches; also the previous training data.
        since_hours: exchanges of the last hours to harvest (records already in the data are dropped).
        min_rating: good: corrected and well-rated answers only; none: unrated answers too.
        min_new_records: fewer new records than this are not pushed (no retrain for a handful).
    """
    log = get_run_logger()
    if runtime.deployment.id:
        check_api_profile(profile)
    config = load_profile(profile, [], data_destination)
    since = datetime.now(UTC) - timedelta(hours=since_hours)
    with tempfile.TemporaryDirectory(prefix="llmops-harvest-") as folder:
        harvested = harvest_task(config, since, folder, min_rating)
        log.info(describe(harvested))
        parameters = {"profile": profile, "since_hours": since_hours, "min_rating": min_rating}
        if harvested.uri is None or harvested.records < min_new_records:
            track(harvested, parameters, None)
            message = f"{harvested.records} new records, fewer than min_new_records {min_new_records}: nothing pushed"
            log.info(message)
            return message
        pushed = push_task(harvested.uri, data_destination)
        track(harvested, parameters, f"{data_destination.rstrip('/')}/{Path(harvested.uri).name}")
    message = f"{harvested.records} new records: {pushed}"
    log.info(message)
    return message
