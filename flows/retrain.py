"""Retrain on new data: start a release run only when the data changed since the last release.

Started by Prefect, not by a loop of ours: the `retrain` deployment in infra/prefect.yaml has a
cron schedule and an event trigger (`llmops.data.landed`, emitted by `llmops data push`).

The same data never starts two release runs:
- already released: the latest registered version of the model carries this data fingerprint;
- in flight (not registered yet): the release run is created with an idempotency key made of the
  model, the profile digest, the fingerprint and the last released version, and Prefect returns
  the existing run for a key it has seen instead of creating another.
"""

from __future__ import annotations

from prefect import flow, get_run_logger, runtime
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment

from tasks.data.records import read_data
from tasks.platform.config import PROFILE_EXAM, Profile, ProfileName, check_api_profile, load_profile
from tasks.platform.project import llmops_home
from tasks.platform.run_policy import refuse_unlisted_location
from tasks.platform.stores import default_services
from tasks.platform.tracking import default_tracking_uri

RELEASE_DEPLOYMENT = "release/release"
DATA_EVENT = "llmops.data.landed"


def latest_release(tracking_uri: str, model_name: str) -> tuple[str, str] | None:
    """(version, data fingerprint) of the newest registered version, or None before the first."""
    from mlflow import MlflowClient

    versions = MlflowClient(tracking_uri).search_model_versions(f"name = '{model_name}'")
    if not versions:
        return None
    newest = max(versions, key=lambda v: int(v.version))
    return str(newest.version), newest.tags.get("data.fingerprint", "")


def data_fingerprint(config: Profile) -> tuple[str, int]:
    """The fingerprint prepare_data will compute (validated, de-duplicated records), and the record count."""
    cleaned = read_data(config.data)
    return cleaned.fingerprint, len(cleaned.train) + len(cleaned.eval)


@flow(name="retrain", log_prints=True)
def retrain(
    profile: ProfileName = "cpu-tiny",
    data_source: str = "s3://datasets/sft/",
    overrides: list[str] | None = None,
    release_deployment: str = RELEASE_DEPLOYMENT,
) -> str:
    """Look at the data location; start a release run when its data changed since the last release.

    Args:
        profile: run profile of the release, one of profiles/.
        data_source: the data location to watch: an s3:// prefix, a folder or a file.
        overrides: profile overrides passed on to the release run (key=value).
        release_deployment: the release flow's deployment, as flow-name/deployment-name.
    """
    log = get_run_logger()
    overrides = list(overrides or [])
    if runtime.deployment.id:  # started through the Prefect API: shipped profiles only (docs/security.md)
        check_api_profile(profile)
        refuse_unlisted_location("data_source", data_source)
    # New data is scored on the profile's curated exam (data.eval_source), as the release run below is
    config = load_profile(profile, overrides, data_source, PROFILE_EXAM)
    fingerprint, records = data_fingerprint(config)
    tracking_uri, _ = default_services(None, None)
    last = latest_release(tracking_uri or default_tracking_uri(llmops_home()), config.registry.model_name)
    log.info(
        f"data {data_source}: {records} records, fingerprint {fingerprint[:12]}; "
        f"last release: {f'v{last[0]} (data {last[1][:12]})' if last else 'none'}"
    )
    if last and last[1] == fingerprint:
        message = f"data unchanged since {config.registry.model_name} v{last[0]} (fingerprint {fingerprint[:12]}): no release run"
        log.info(message)
        return message
    key = f"{config.registry.model_name}:{config.digest[:16]}:{fingerprint}:after-v{last[0] if last else 0}"
    # A top-level run of the release deployment, not a subflow of this one (run_deployment links it as one by
    # default: prefect/deployments/flow_runs.py:62,145 at 3.7.2): Prefect suspends no subflow
    # (prefect/server/orchestration/core_policy.py:1386-1391), and a release that waits for approval suspends.
    run: FlowRun = run_deployment(  # type: ignore[assignment]  # a sync call returns the FlowRun
        release_deployment,
        timeout=0,
        as_subflow=False,
        idempotency_key=key,
        parameters={"profile": profile, "data_source": data_source, "eval_data": PROFILE_EXAM, "overrides": overrides},
        tags=["retrain", f"data:{fingerprint[:12]}"],
        flow_run_name=f"retrain-{fingerprint[:12]}",
    )
    message = f"release run {run.name} ({run.id}) for data {fingerprint[:12]}, state {run.state.type.value if run.state else '?'}"
    log.info(message)
    return message
