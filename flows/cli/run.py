"""`llmops run`: the release flow on a profile, with its summary table.

Bad input (profile, machine, local data, Triton options) fails before anything is created; only then
is Prefect's API server started and the pipeline imported, side by side.
"""

from __future__ import annotations

import argparse
import os

from flows.cli.common import EXIT_CODES, RUN_SERVICES, Rejected, add_overrides_flag
from tasks.platform.prefect_api import TemporaryPrefectAPI
from tasks.platform.project import llmops_home

EPILOG = (
    EXIT_CODES
    + """
examples:
  llmops run                                         # embedded default: cpu-tiny, no server needed
  llmops run --set train.learning_rate=1e-3 --set evaluate.max_new_tokens=4
  llmops run --data s3://datasets/sft/ --artifacts s3://artifacts/llmops --tracking-uri http://127.0.0.1:5000
  (S3 endpoint/credentials: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...; Prefect server: PREFECT_API_URL)"""
)


def register(commands) -> None:
    run = commands.add_parser(
        "run",
        help="run the release flow on a profile",
        description="Run the release DAG. Stages whose inputs did not change are cache hits.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "--profile", default="cpu-tiny", help="profile name in profiles/ or a YAML path (default: cpu-tiny)"
    )
    run.add_argument("--data", help="dataset file, folder or s3:// URI (overrides data.source)")
    run.add_argument(
        "--eval-data",
        metavar="PATH|s3://|profile",
        help="the held-out set the candidate is scored on (data.eval_source); default: the profile's with its own "
        "data, a hash split of --data's records with other data; 'profile': the profile's whatever --data brings",
    )
    add_overrides_flag(run, "override a profile value, e.g. train.learning_rate=1e-4 (repeatable)")
    run.add_argument("--tracking-uri", help="MLflow tracking URI (default: sqlite under $LLMOPS_HOME)")
    run.add_argument("--artifacts", help="artifact store: folder or s3://bucket/prefix (default: $LLMOPS_HOME/store)")
    add_triton_flags(run)
    run.set_defaults(handler=command_run)


def add_triton_flags(run: argparse.ArgumentParser) -> None:
    run.add_argument(
        "--triton-url",
        help="attach to a running Triton (HTTP URL; or LLMOPS_TRITON_URL) instead of the one `llmops serve` runs or a "
        "temporary one; its control key: only one given for it (--triton-control-key-file), never this home's",
    )
    run.add_argument(
        "--triton-control-key-file",
        metavar="PATH",
        help="with --triton-url: the file holding that Triton's control key (or LLMOPS_TRITON_CONTROL_KEY_FILE; "
        "LLMOPS_TRITON_CONTROL_KEY gives the key itself); without one its model-control API refuses the run",
    )
    run.add_argument(
        "--allow-plain-http",
        action="store_true",
        help="with --triton-url: allow an http:// URL to another machine, which sends the control key in clear "
        "(or LLMOPS_TRITON_ALLOW_PLAIN_HTTP=1); loopback and https:// need no flag",
    )
    run.add_argument("--triton-grpc-url", help="that Triton's gRPC endpoint, host:port (or LLMOPS_TRITON_GRPC_URL)")
    run.add_argument(
        "--triton-metrics-url",
        help="that Triton's metrics URL, http://host:port/metrics (or LLMOPS_TRITON_METRICS_URL)",
    )
    run.add_argument(
        "--serve-control-url",
        help="with --triton-url: the control API of the `llmops serve` in front of that Triton (or "
        "LLMOPS_SERVE_CONTROL_URL): the release routes the service there; without it, through a temporary gateway",
    )
    run.add_argument(
        "--serve-control-key-file",
        metavar="PATH",
        help="with --serve-control-url: the file holding that serve's control key (or LLMOPS_SERVE_CONTROL_KEY_FILE)",
    )
    run.add_argument(
        "--triton-repository",
        help="that Triton's model repository folder, when this machine shares it "
        "(or LLMOPS_TRITON_REPOSITORY); without it, models are sent with their load requests",
    )


def command_run(args) -> str:
    take_attach_options(args)
    check_inputs(args)
    home = llmops_home()
    home.mkdir(parents=True, exist_ok=True)
    if not os.environ.get("PREFECT_API_URL"):
        api = TemporaryPrefectAPI(home / "prefect" / "temporary-api.log")
        RUN_SERVICES.append(api)
        os.environ["PREFECT_API_URL"] = api.url
    # While the API server starts: import Prefect, the pipeline, and what the first stage needs (MLflow and its
    # dataset inputs, about 3 s together), instead of after it.
    import mlflow.data.pandas_dataset  # noqa: F401

    from flows.release import release

    for service in RUN_SERVICES:
        service.wait_healthy(float(os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"]))
    result = release(
        profile=args.profile,
        data_source=args.data,
        eval_data=args.eval_data,
        overrides=args.overrides,
        tracking_uri=args.tracking_uri,
        artifacts=args.artifacts,
        triton_url=args.triton_url,
        triton_repository=args.triton_repository,
        triton_grpc_url=args.triton_grpc_url,
        triton_metrics_url=args.triton_metrics_url,
    )
    if result.outcome in ("rejected", "rolled_back"):
        report, approval = result.gate_report, result.approval
        if report is not None and not report.passed:
            reason = report.summary()
        elif approval is not None and not approval.approved:
            reason = approval.summary()
        else:
            reason = "canary breach (see the log)"
        raise Rejected(summary(result), f"candidate {result.outcome.replace('_', ' ')}: {reason}")
    return summary(result)


def check_inputs(args) -> None:
    """Bad input fails here, before anything is created: profile, machine, local data, stores, Triton options."""
    from tasks.platform.config import check_machine, load_profile, local_stages
    from tasks.training.memory_plan import memory_plan

    profile = load_profile(args.profile, args.overrides, args.data, args.eval_data)
    memory_plan(profile)  # a layout that cannot fit is refused before anything is created
    check_machine(profile, local_stages(profile))
    validate_local_data(profile)
    from tasks.platform.stores import default_services, refuse_a_local_store_for_a_tracking_server
    from tasks.serving.client import TritonTarget

    refuse_a_local_store_for_a_tracking_server(*default_services(args.tracking_uri, args.artifacts), llmops_home())

    TritonTarget.from_options(args.triton_url, args.triton_grpc_url, args.triton_metrics_url, args.triton_repository)


def take_attach_options(args) -> None:
    """The attach key and the plain-HTTP consent go to the release flow through this process's environment, not
    its parameters: a run parameter from the Prefect API must not pick a file to read or a URL to send it to."""
    from pathlib import Path

    from tasks.serving.client import ALLOW_PLAIN_HTTP_ENV, ATTACH_KEY_FILE_ENV, SERVE_KEY_FILE_ENV, SERVE_URL_ENV

    if args.triton_control_key_file:
        os.environ[ATTACH_KEY_FILE_ENV] = str(Path(args.triton_control_key_file).resolve())
    if args.serve_control_url:
        os.environ[SERVE_URL_ENV] = args.serve_control_url
    if args.serve_control_key_file:
        os.environ[SERVE_KEY_FILE_ENV] = str(Path(args.serve_control_key_file).resolve())
    if args.allow_plain_http:
        os.environ[ALLOW_PLAIN_HTTP_ENV] = "1"


def validate_local_data(profile) -> None:
    """Bad local data, and an eval split too small to decide on, fail here, in a second or two, before Prefect's API
    server or any stage starts. (Data on S3 is validated by prepare_data, which retries S3 faults.)"""
    from tasks.prepare_data import read_dataset, refuse_too_few_samples

    data = profile.data
    sources = [data.source, data.eval_source, data.harvest_eval_source]
    if not any(source and source.startswith("s3://") for source in sources):
        refuse_too_few_samples(read_dataset(data, profile.train.stage), profile.evaluate)


def summary(result) -> str:
    """The stage table, then where to find the MLflow run, the model and the gate report."""
    table = summary_table(summary_rows(result))
    return "\n".join(
        [
            "",
            *table,
            "",
            f"MLflow run: {result.tracker.url()}",
            f"model: models:/{result.registered.name}/{result.registered.version}  source {result.registered.source}",
            *([f"gate report: {result.gate_report_path}"] if result.gate_report_path else []),
        ]
    )


def summary_rows(result) -> list[tuple[str, str, str, str]]:
    rows = [(s.stage, "cached" if s.cached else "ran", f"{s.seconds:.1f}", s.headline) for s in result.stages]
    rows.append(
        (
            "register",
            "reused" if result.registered.reused else "new",
            "",
            f"{result.registered.name} v{result.registered.version}",
        )
    )
    rows += [(step.stage, "ran", f"{step.seconds:.1f}", step.headline[:60]) for step in result.serving]
    if result.gate_report is not None:
        rows.append(("gate", result.gate_report.decision, "", result.gate_report.summary()[:60]))
    rows.append(("rollout", result.outcome, "", ""))
    if result.report_path is not None:
        rows.append(("report", "written", "", str(result.report_path)))
    return rows


def summary_table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    header = ("stage", "result", "seconds", "key metric")
    widths = [max(len(r[i]) for r in [*rows, header]) for i in range(4)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    table = [line.format(*header), line.format(*("-" * w for w in widths))]
    return table + [line.format(*row).rstrip() for row in rows]
