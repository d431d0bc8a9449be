"""Scheduled scoring as a flow (infra/prefect.yaml: `predict`): a dataset answered by a released version of the
running service, its answers written to an output location, local or S3; `llmops predict` does the same from a
terminal (flows/cli/predict.py). The API key comes from the worker's environment (OPENAI_API_KEY), never from a
parameter."""

from __future__ import annotations

import tempfile
from pathlib import Path

from prefect import flow, get_run_logger, runtime

from flows.cli.predict import errors_beside, outcome, run_predict
from tasks.platform.config import check_api_profile, load_profile
from tasks.platform.run_policy import refuse_unlisted_endpoint, refuse_unlisted_location


@flow(name="predict", log_prints=True)
def predict(
    data_source: str,
    output: str,
    version: str = "champion",
    profile: str = "cpu-tiny",
    concurrency: int | None = None,
    service_url: str | None = None,
) -> str:
    """Answer a dataset with a released version of the running service and write the answers, in input order.

    Args:
        data_source: the dataset: a file, a folder or an S3 key/prefix of what prepare_data reads, or a text file of
            one prompt a line.
        output: where the answers go (JSONL): a local path or s3://bucket/key. Rows not answered go beside it
            (NAME.errors.jsonl); a rerun answers only the rows not already there.
        version: champion, challenger or a version number of the profile's model.
        profile: the profile the service was released with.
        concurrency: requests in flight (default: what the version's engine batches).
        service_url: the service's gateway (default: the `llmops serve` of the worker's LLMOPS_HOME).

    Through the Prefect API, service_url must be on the worker's LLMOPS_RUN_SERVICES, and data_source and output
    inside its LLMOPS_RUN_LOCATIONS (tasks/platform/run_policy.py), before the key is read or a row is sent.
    """
    if runtime.deployment.id:  # started through the Prefect API: nothing it names is taken on trust
        check_api_profile(profile)
        refuse_unlisted_endpoint("service_url", service_url, "service")
        refuse_unlisted_location("data_source", data_source)
        refuse_unlisted_location("output", output)
    served = load_profile(profile)
    if not output.startswith("s3://"):
        local = Path(output)
        summary = run_predict(served, data_source, local, errors_beside(local), version, concurrency, None, service_url)
        return report(summary)
    with tempfile.TemporaryDirectory(prefix="llmops-predict-") as work:
        local = Path(work) / Path(output).name
        fetch(output, local)  # what an earlier run answered is not asked again
        try:
            summary = run_predict(
                served, data_source, local, errors_beside(local), version, concurrency, None, service_url
            )
        finally:
            upload(local, output)
            upload(errors_beside(local), output.removesuffix(".jsonl") + ".errors.jsonl")
        return report(summary)


def report(summary) -> str:
    get_run_logger().info(summary.describe())
    return outcome(summary)  # rows not answered fail the run, after every other row is written


def fetch(uri: str, local: Path) -> None:
    from botocore.exceptions import ClientError

    from tasks.platform.store import s3_client, split_s3_uri

    bucket, key = split_s3_uri(uri)
    try:
        s3_client().download_file(bucket, key, str(local))
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey"):
            raise


def upload(local: Path, uri: str) -> None:
    """`local` to `uri`; no such file (no rows failed): the object is deleted."""
    from tasks.platform.store import s3_client, split_s3_uri

    bucket, key = split_s3_uri(uri)
    if local.is_file():
        s3_client().upload_file(str(local), bucket, key)
    else:
        s3_client().delete_object(Bucket=bucket, Key=key)
