"""The data flywheel: what the service served, and how clients judged it, becomes the next release's data, once a
person or rules no single client can game vouch for it.

    harvest (captured exchanges + feedback -> a training set, tasks/data/harvest.py)
      -> enough new records? -> the dataset and its report land in the pending location
      -> flywheel.review person: the run waits for an approval (the Prefect form or `llmops approve`), as a release
         does; rules: admitted unreviewed when they hold, else it waits for a person too
      -> approved: pushed to the watched data location (llmops.data.landed) -> retrain -> a release run, which waits
         for an approval of its own (gate.approval harvested); rejected or no decision: deleted from pending

`llmops data harvest` runs the first step by hand; the `flywheel` deployment (infra/prefect.yaml) runs all of it on
a schedule. Each run is an MLflow run of the experiment `llm-flywheel`: the counts and client shares as metrics, the
report and the captured objects read (the dataset's lineage) as artifacts, the decision and the dataset's URI as
tags.
"""

from __future__ import annotations

import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, runtime, task
from prefect.cache_policies import NO_CACHE

from flows.harvest import FLYWHEEL_EXPERIMENT, Harvested, describe, harvest_dataset, review_markdown
from tasks.approve import Approval, DecisionPolicy, run_creator, wait_for_decision
from tasks.data.forget import expire_harvested, harvested_in
from tasks.data.harvest import MinRating, admission_refusals
from tasks.data.objects import open_location, same_or_inside
from tasks.platform.config import PROFILE_EXAM, Profile, ProfileName, check_api_profile, load_profile
from tasks.platform.errors import BadInput
from tasks.platform.project import llmops_home
from tasks.platform.run_policy import refuse_unlisted_location
from tasks.platform.stores import default_services
from tasks.platform.tracking import default_tracking_uri, ensure_experiment


def refuse_unsafe_locations(config: Profile, data_destination: str, pending_destination: str) -> None:
    """A flywheel needs a curated exam that harvests never enter, and a pending location retraining never reads. A
    preference profile's exam is its data's held-out prompts, which a harvested pair never enters (its prompt hashed
    there leaves it out: tasks/data/preferences.py); an SFT profile names one apart (data.eval_source)."""
    if config.train.stage == "sft" and config.data.eval_source is None:
        raise BadInput(
            f"profile {config.name}: the flywheel needs data.eval_source, a curated held-out set: without one the "
            "release's eval split would be drawn from data clients wrote"
        )
    if config.data.eval_source is not None and (
        same_or_inside(config.data.eval_source, data_destination)
        or same_or_inside(config.data.eval_source, pending_destination)
    ):
        raise BadInput(
            f"data.eval_source {config.data.eval_source}: inside (or holding) where harvests land "
            f"({data_destination}, {pending_destination}); the held-out set must be curated apart"
        )
    if same_or_inside(pending_destination, data_destination):
        raise BadInput(
            f"pending_destination {pending_destination}: inside (or holding) data_destination {data_destination}, "
            "which retraining watches: an unreviewed harvest would start a release"
        )


# Not cached: each run reads what was captured since; retried, as the store may be down for a moment
@task(name="harvest", retries=2, retry_delay_seconds=10, cache_policy=NO_CACHE)
def harvest_task(config: Profile, since: datetime, out: str, min_rating: MinRating) -> Harvested:
    trusted = frozenset(config.serve.capture.trusted_clients) if config.flywheel.review == "rules" else None
    pairs = config.train.stage != "sft"  # a DPO profile's next data: pairs (kto is refused there)
    harvested = harvest_dataset(config, since, out, min_rating, trusted=trusted, pairs=pairs)
    if harvested.uri is not None:
        import json

        open_location(out).put(report_key(harvested.uri), json.dumps(harvested.report, indent=1, ensure_ascii=False))
    return harvested


def report_key(dataset_uri: str) -> str:
    """The report's object beside its pending dataset (harvest-X.jsonl -> harvest-X.report.json)."""
    return Path(dataset_uri).name.removesuffix(".jsonl") + ".report.json"


@task(name="push_data", retries=2, retry_delay_seconds=10, cache_policy=NO_CACHE)
def push_task(pending_destination: str, dataset_uri: str, sha256: str, destination: str) -> str:
    """The reviewed dataset, exactly the bytes approved, from the pending location to where retraining watches."""
    import hashlib

    from flows.deploy import push_data

    name = Path(dataset_uri).name
    text = open_location(pending_destination).get(name)
    if hashlib.sha256(text.encode()).hexdigest() != sha256:
        raise BadInput(f"pending dataset {dataset_uri}: its content changed after the review; nothing pushed")
    with tempfile.TemporaryDirectory(prefix="llmops-harvest-") as folder:
        (Path(folder) / name).write_text(text, encoding="utf-8")
        return push_data(str(Path(folder) / name), destination)


def drop_pending(pending_destination: str, dataset_uri: str) -> None:
    name = Path(dataset_uri).name
    open_location(pending_destination).delete([name, report_key(dataset_uri)])


def track(harvested: Harvested, parameters: dict[str, Any], decision: str, pushed_to: str | None, by: str) -> None:
    """The harvest as an MLflow run (counts, shares, report, lineage, decision) and a Prefect artifact; neither
    holds users' text (the corrections shown to the reviewer stay in the pending report and the run's form), so a
    deletion request (tasks/data/forget.py) need not reach them."""
    import mlflow
    from prefect.artifacts import create_markdown_artifact

    tracking_uri, _ = default_services(None, None)
    home = llmops_home()
    uri = tracking_uri or default_tracking_uri(home)
    # a local tracking store keeps the artifacts under LLMOPS_HOME, as the release's runs do (open_context)
    ensure_experiment(uri, FLYWHEEL_EXPERIMENT, None if tracking_uri else home / "mlartifacts")
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(FLYWHEEL_EXPERIMENT)
    report = harvested.report
    with mlflow.start_run(run_name=f"harvest-{report['service']}"):
        mlflow.log_params(parameters)
        mlflow.log_metrics({f"harvest.{k}": v for k, v in report["counts"].items()})
        mlflow.log_metrics(
            {
                "harvest.distinct_clients": report["distinct_clients"],
                "harvest.largest_client_share": report["largest_client_share"],
            }
        )
        mlflow.log_dict({k: v for k, v in report.items() if k != "corrections"}, "harvest_report.json")
        mlflow.set_tags(
            {
                "harvest.dataset": pushed_to or "",  # empty: not pushed
                "harvest.pushed": str(pushed_to is not None).lower(),
                "harvest.decision": decision,
                "harvest.decided_by": by,
                "prefect.flow_run_id": str(runtime.flow_run.id or ""),
            }
        )
    summary = review_markdown(harvested, samples=False)
    create_markdown_artifact(summary, key="harvest", description="What the harvest kept")


def review(config: Profile, harvested: Harvested, log) -> tuple[bool, str, str]:
    """(admitted, decision, by): by the review rules where the profile opts in and they hold, else by a person."""
    if config.flywheel.review == "rules":
        refusals = admission_refusals(harvested.report, config.flywheel.max_client_share, config.flywheel.min_clients)
        if not refusals:
            log.info("flywheel: the review rules admit the harvest unreviewed")
            return True, "admitted", "flywheel.review rules"
        log.warning(f"flywheel: auto-push refused ({'; '.join(refusals)}); a person decides")
    subject = {
        "kind": "harvest",
        "model": harvested.report["service"],
        "dataset": harvested.uri,
        "artifact_sha256": harvested.report["sha256"],
        "records": harvested.records,
    }
    log.info(
        f"flywheel: {harvested.records} records wait in {harvested.uri} for a person: the Resume form on this run's "
        f"page in the Prefect UI, or `llmops approve {runtime.flow_run.id} --reason ...` / `llmops reject ...`"
    )
    # the form shows no user's text: Prefect keeps a run's form for as long as the run, where neither capture
    # retention nor `llmops data forget` reaches; the corrections are in the pending report, which both reach
    where = f"{harvested.uri.rsplit('/', 1)[0]}/{report_key(harvested.uri)}" if harvested.uri else "-"
    form = review_markdown(harvested, samples=False) + (
        f"\n\nThe corrections beside the answers they replace are in the pending report `{where}` (its `corrections`)."
    )
    approval: Approval = wait_for_decision(
        llmops_home(),
        str(runtime.flow_run.id),
        form,
        config.gate.approval_timeout_s,
        subject,
        DecisionPolicy.of(config.gate, run_creator()),
    )
    log.info(f"flywheel: harvest {approval.summary()}")
    return approval.approved, "approved" if approval.approved else "rejected", approval.decided_by


@flow(name="flywheel", log_prints=True)
def flywheel(
    profile: ProfileName = "cpu-tiny",
    data_destination: str = "s3://datasets/sft/",
    pending_destination: str = "s3://datasets/pending/",
    since_hours: float = 24,
    min_rating: MinRating = "good",
    min_new_records: int = 20,
) -> str:
    """Harvest the service's captured exchanges into the pending location; push them as new data once approved.

    Args:
        profile: profile of the service (its registry.model_name, serve.capture, flywheel and data settings); an SFT
            profile must name a curated held-out set (data.eval_source); a DPO profile harvests preference pairs,
            held out from its data's eval split.
        data_destination: the data location the retrain deployment watches; also the previous training data.
        pending_destination: where a harvest and its report wait for review; never inside data_destination.
        since_hours: exchanges of the last hours to harvest (records already in the data are dropped).
        min_rating: good: corrected and well-rated answers only; none: unrated answers too.
        min_new_records: fewer new records than this are not proposed (no review, no retrain for a handful).
    """
    log = get_run_logger()
    if runtime.deployment.id:
        check_api_profile(profile)
        refuse_unlisted_location("data_destination", data_destination)
        refuse_unlisted_location("pending_destination", pending_destination)
    preference = load_profile(profile).train.stage != "sft"  # its exam: its own pairs' held-out prompts
    config = load_profile(profile, [], data_destination, None if preference else PROFILE_EXAM)  # as retrain's runs
    refuse_unsafe_locations(config, data_destination, pending_destination)
    expired = expire_harvested(
        harvested_in(data_destination) + harvested_in(pending_destination),
        timedelta(days=config.serve.capture.retention_days),
        datetime.now(UTC),
    )
    if expired.harvested:
        log.info(expired.describe(f"retention ({config.serve.capture.retention_days:g} days)"))
    since = datetime.now(UTC) - timedelta(hours=since_hours)
    harvested = harvest_task(config, since, pending_destination, min_rating)
    log.info(describe(harvested))
    parameters = {"profile": profile, "since_hours": since_hours, "min_rating": min_rating}
    if harvested.uri is None or harvested.records < min_new_records:
        if harvested.uri is not None:
            drop_pending(pending_destination, harvested.uri)
        track(harvested, parameters, "too few", None, "")
        message = f"{harvested.records} new records, fewer than min_new_records {min_new_records}: nothing pushed"
        log.info(message)
        return message
    admitted, decision, by = review(config, harvested, log)
    if not admitted:
        drop_pending(pending_destination, harvested.uri)
        track(harvested, parameters, decision, None, by)
        message = (
            f"{harvested.records} new records {decision} by {by}: deleted from {pending_destination}, nothing pushed"
        )
        log.info(message)
        return message
    pushed = push_task(pending_destination, harvested.uri, harvested.report["sha256"], data_destination)
    drop_pending(pending_destination, harvested.uri)
    track(harvested, parameters, decision, f"{data_destination.rstrip('/')}/{Path(harvested.uri).name}", by)
    message = f"{harvested.records} new records ({decision} by {by}): {pushed}"
    log.info(message)
    return message
