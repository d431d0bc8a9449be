"""`llmops`: the command line of the release pipeline.

Exit codes: tasks/platform/errors.py's EXIT_CODES (also in --help and the README). The last line of a failed command is one `llmops: error: ...` line naming what to fix.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
from pathlib import Path

from tasks.platform.errors import REJECTED_EXIT_CODE, exit_codes_text
from tasks.platform.prefect_api import TemporaryPrefectAPI

EXIT_CODES = exit_codes_text()


# `llmops serve` flags that set serve.listen.* (flag, key, type, help)
SERVE_LISTEN_FLAGS = (
    ("--host", "host", str, "gateway bind address (default 127.0.0.1)"),
    ("--port", "port", int, "gateway port (default 8080; 0: any free port)"),
    ("--triton-host", "triton_host", str, "Triton's bind address (default 127.0.0.1)"),
    ("--triton-http-port", "triton_http_port", int, "Triton HTTP port (default 8000)"),
    ("--triton-grpc-port", "triton_grpc_port", int, "Triton gRPC port (default 8001)"),
    ("--metrics-port", "triton_metrics_port", int, "Triton's Prometheus metrics port (default 8002)"),
    ("--tls-cert", "tls_cert", str, "PEM certificate: the gateway speaks HTTPS"),
    ("--tls-key", "tls_key", str, "PEM private key of --tls-cert"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmops",
        description="Release pipeline for fine-tuned LLMs: data -> (Q)LoRA -> merge -> quantize -> Triton canary -> gate -> promote | rollback.",
        epilog=EXIT_CODES + "\nstate lives in $LLMOPS_HOME (default ./.llmops); a fresh folder is a fresh start.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        help="run the release flow on a profile",
        description="Run the release DAG. Stages whose inputs did not change are cache hits.",
        epilog=EXIT_CODES
        + """
examples:
  llmops run                                         # embedded default: cpu-tiny, no server needed
  llmops run --set train.learning_rate=1e-3 --set evaluate.max_new_tokens=4
  llmops run --data s3://datasets/sft/ --artifacts s3://artifacts/llmops --tracking-uri http://127.0.0.1:5000
  (S3 endpoint/credentials: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...; Prefect server: PREFECT_API_URL)""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "--profile", default="cpu-tiny", help="profile name in profiles/ or a YAML path (default: cpu-tiny)"
    )
    run.add_argument("--data", help="dataset file, folder or s3:// URI (overrides data.source)")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a profile value, e.g. train.learning_rate=1e-4 (repeatable)",
    )
    run.add_argument("--tracking-uri", help="MLflow tracking URI (default: sqlite under $LLMOPS_HOME)")
    run.add_argument("--artifacts", help="artifact store: folder or s3://bucket/prefix (default: $LLMOPS_HOME/store)")
    run.add_argument(
        "--triton-url",
        help="attach to a running Triton (HTTP URL; or LLMOPS_TRITON_URL) instead of the one `llmops serve` runs or a "
        "temporary one; its control key: LLMOPS_TRITON_CONTROL_KEY",
    )
    run.add_argument("--triton-grpc-url", help="that Triton's gRPC endpoint, host:port (or LLMOPS_TRITON_GRPC_URL)")
    run.add_argument(
        "--triton-metrics-url",
        help="that Triton's metrics URL, http://host:port/metrics (or LLMOPS_TRITON_METRICS_URL)",
    )
    run.add_argument(
        "--triton-repository",
        help="that Triton's model repository folder, when this machine shares it "
        "(or LLMOPS_TRITON_REPOSITORY); without it, models are sent with their load requests",
    )

    serve = commands.add_parser(
        "serve",
        help="serve the champion (Triton + an OpenAI-compatible gateway) until stopped",
        description="Serve the registered champion: Triton with the champion behind the router (the service "
        "name), and the gateway clients call (OpenAI-compatible /v1 and Triton's /v2/models/NAME/generate, with "
        "API keys, TLS and request limits). Triton is restarted with backoff if it dies. `llmops run` with the "
        "same LLMOPS_HOME rolls candidates out on this server. API keys: LLMOPS_API_KEYS_FILE (one a line) or "
        "LLMOPS_API_KEYS (comma-separated); needed when --host is not a loopback address.",
        epilog="""examples:
  llmops serve &                         # gateway :8080, Triton :8000 (HTTP) :8001 (gRPC) :8002 (metrics)
  curl -s localhost:8080/health/ready
  curl -s localhost:8080/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"messages": [{"role": "user", "content": "hot"}], "max_tokens": 8}'
  LLMOPS_API_KEYS_FILE=/etc/llmops/api-keys llmops serve --host 0.0.0.0 --tls-cert c.pem --tls-key k.pem""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--profile", default="cpu-tiny", help="profile name or YAML path (default: cpu-tiny)")
    serve.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a profile value (repeatable)",
    )
    serve.add_argument("--tracking-uri", help="MLflow tracking URI (default: sqlite under $LLMOPS_HOME)")
    serve.add_argument("--artifacts", help="artifact store: folder or s3://bucket/prefix (default: $LLMOPS_HOME/store)")
    for flag, key, kind, text in SERVE_LISTEN_FLAGS:
        serve.add_argument(flag, dest=key, type=kind, help=f"{text} (serve.listen.{key})")

    gate = commands.add_parser(
        "gate",
        help="read a gate report; exit 0 on promote, 10 on reject (for release pipelines)",
        description="Print a gate report written by `llmops run` and exit with its decision: 0 promote, 10 reject.",
        epilog="example (a CI/CD step):\n  llmops gate .llmops/work/gate/<mlflow-run-id>/gate_report.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gate.add_argument("report", help="gate_report.json path (printed by llmops run)")

    stack = commands.add_parser(
        "stack",
        help="start, inspect or stop the local stack (Prefect server + worker, MLflow, S3)",
        description="A local stack on 127.0.0.1: an S3 server (rclone), an MLflow server (S3 artifacts), "
        "a Prefect server and a process worker on the llmops-cpu pool; Prefect and MLflow keep their "
        "databases in sqlite files, or on a PostgreSQL server the stack starts (--db postgres). State, logs "
        "and data live in $LLMOPS_HOME/stack.",
        epilog="""examples:
  llmops stack up                       # default ports: Prefect 4200, MLflow 5000, S3 9000
  llmops stack up --db postgres         # Prefect and MLflow on PostgreSQL (port 5432), as in production
  eval "$(llmops stack env)"            # point llmops, prefect, mlflow and boto3 at it
  llmops deploy                         # register the deployments of infra/prefect.yaml
  llmops stack status
  llmops stack down                     # the worker first, then the servers""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    stack_actions = stack.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = stack_actions.add_parser(
        "up",
        help="start every service that is not running",
        description="Start the services that are not running; idempotent.",
    )
    up.add_argument(
        "--db",
        choices=("sqlite", "postgres"),
        help="the database of Prefect's server and MLflow's tracking store (default: last used, else sqlite); "
        "postgres runs Debian's PostgreSQL on 127.0.0.1 with its data under the stack's folder",
    )
    for service in ("prefect", "mlflow", "s3", "postgres"):
        up.add_argument(
            f"--{service}-port",
            type=int,
            metavar="PORT",
            help=f"port for {service} on 127.0.0.1 (0: any free port; default: last used, else the usual)",
        )
    stack_actions.add_parser(
        "status", help="show what runs where", description="Show each service, its PID, URL and log."
    )
    stack_actions.add_parser(
        "env",
        help="print shell exports for the stack",
        description='Print `export` lines; use as: eval "$(llmops stack env)".',
    )
    stack_actions.add_parser(
        "down",
        help="stop the stack (worker first)",
        description="Stop every service by PID, the worker before the Prefect server.",
    )

    deploy = commands.add_parser(
        "deploy",
        help="register infra/prefect.yaml's deployments with the Prefect server",
        description="Create the work pools (llmops-cpu: process; the GPU pool: kubernetes, with "
        "infra/work-pools/kubernetes-gpu.json) when missing, then run `prefect deploy --all` on "
        "infra/prefect.yaml against PREFECT_API_URL (or the local stack).",
        epilog="""examples:
  llmops deploy                               # against the local stack, or PREFECT_API_URL when set
  llmops deploy --gpu-pool llmops-cpu         # one machine: heavy stages on the process pool too""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    deploy.add_argument(
        "--gpu-pool",
        default="llmops-gpu",
        help="work pool for the heavy stages (train, quantize, build_engine); default llmops-gpu",
    )

    data = commands.add_parser(
        "data",
        help="push a dataset to a watched data location (starts a retrain)",
        description="Upload a dataset file or folder to a data location (s3:// prefix or folder) and emit the "
        "`llmops.data.landed` event, which the retrain deployment's trigger reacts to.",
        epilog="example:\n  llmops data push profiles/data/antonyms.jsonl s3://datasets/sft/",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    data_actions = data.add_subparsers(dest="action", required=True, metavar="ACTION")
    push = data_actions.add_parser(
        "push",
        help="upload a dataset and emit llmops.data.landed",
        description="Upload SOURCE (file or folder) under DESTINATION and emit the event.",
    )
    push.add_argument("source", help="local dataset file or folder")
    push.add_argument("destination", help="s3://bucket/prefix/ or a folder: the location a retrain deployment watches")
    validate = data_actions.add_parser(
        "validate",
        help="check a dataset and print what prepare_data would see",
        description="Read, validate, clean and split a dataset the way prepare_data does, without running anything: "
        "records read, duplicates and empty answers dropped, train/eval counts, fingerprint. Bad data "
        "exits 2 with the first error, naming the file, line and field.",
        epilog="examples:\n  llmops data validate profiles/data/antonyms.jsonl\n"
        "  llmops data validate my_qa.json --format alpaca --eval-source held_out.jsonl\n"
        "  llmops data validate s3://datasets/sft/ --profile cpu-tiny-qa-zh",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    validate.add_argument("source", help="dataset file, folder or s3:// URI")
    validate.add_argument(
        "--format",
        choices=["auto", "alpaca", "sharegpt", "openai"],
        help="record format (default: the profile's data.format, usually auto)",
    )
    validate.add_argument("--eval-source", help="a fixed held-out set (file, folder or s3://), as data.eval_source")
    validate.add_argument(
        "--profile",
        default="cpu-tiny",
        help="profile whose data settings (eval_fraction, split_salt) apply (default: cpu-tiny)",
    )

    profiles = commands.add_parser(
        "profiles", help="list, show or validate profiles", description="Inspect the run profiles in profiles/."
    )
    actions = profiles.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("list", help="list the available profiles", description="List profiles with their descriptions.")
    for action, text in (
        ("show", "print a profile with every default filled in"),
        ("validate", "check a profile (and overrides) without running anything"),
    ):
        sub = actions.add_parser(action, help=text, description=text.capitalize() + ".")
        sub.add_argument("profile", help="profile name or YAML path")
        sub.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a profile value (repeatable)",
        )
    return parser


def prepare_environment(home: Path) -> None:
    """Keep Prefect's and MLflow's local state under $LLMOPS_HOME; must run before Prefect is imported."""
    os.environ["LLMOPS_HOME"] = str(home)
    os.environ.setdefault("PREFECT_HOME", str(home / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def summary(result) -> str:
    rows = [(s.stage, "cached" if s.cached else "ran", f"{s.seconds:.1f}", s.headline) for s in result.stages]
    rows.append(
        (
            "register",
            "reused" if result.registered.reused else "new",
            "",
            f"{result.registered.name} v{result.registered.version}",
        )
    )
    if result.gate_report is not None:
        rows.append(("gate", result.gate_report.decision, "", result.gate_report.summary()[:60]))
    rows.append(("rollout", result.outcome, "", ""))
    widths = [max(len(r[i]) for r in rows + [("stage", "result", "seconds", "key metric")]) for i in range(4)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    table = [line.format("stage", "result", "seconds", "key metric"), line.format(*("-" * w for w in widths))]
    table += [line.format(*row).rstrip() for row in rows]
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


def command_run(args) -> str:
    from tasks.platform.config import check_machine, load_profile, local_stages

    profile = load_profile(args.profile, args.overrides, args.data)  # bad input fails before anything is created
    check_machine(profile, local_stages(profile))
    validate_local_data(profile)
    from tasks.serving.client import TritonTarget

    TritonTarget.from_options(args.triton_url, args.triton_grpc_url, args.triton_metrics_url, args.triton_repository)
    home = Path(os.environ["LLMOPS_HOME"])
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
        overrides=args.overrides,
        tracking_uri=args.tracking_uri,
        artifacts=args.artifacts,
        triton_url=args.triton_url,
        triton_repository=args.triton_repository,
        triton_grpc_url=args.triton_grpc_url,
        triton_metrics_url=args.triton_metrics_url,
    )
    if result.outcome in ("rejected", "rolled_back"):
        report = result.gate_report
        reason = report.summary() if report is not None and not report.passed else "canary breach (see the log)"
        raise Rejected(summary(result), f"candidate {result.outcome.replace('_', ' ')}: {reason}")
    return summary(result)


def validate_local_data(profile) -> None:
    """Bad local data fails here, in a second or two, before Prefect's API server or any stage starts.
    (Data on S3 is validated by prepare_data, which retries S3 faults.)"""
    from tasks.data.records import read_data

    sources = [profile.data.source, profile.data.eval_source]
    if not any(source and source.startswith("s3://") for source in sources):
        read_data(profile.data)


RUN_SERVICES: list = []  # what command_run started for this process alone; stopped when main returns


class Rejected(Exception):
    """Not an error of the run: the gate or the canary said no. Exit 10, after the summary."""

    exit_code = REJECTED_EXIT_CODE

    def __init__(self, table: str, message: str):
        self.table = table
        super().__init__(message)


def command_serve(args) -> None:
    from tasks.platform.config import check_machine, load_profile

    listen = [
        f"serve.listen.{key}={getattr(args, key)}"
        for _, key, _, _ in SERVE_LISTEN_FLAGS
        if getattr(args, key) is not None
    ]
    profile = load_profile(args.profile, [*args.overrides, *listen])
    check_machine(profile, ["serve"])
    home = Path(os.environ["LLMOPS_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    from flows.serve import serve

    serve(profile, home, args.tracking_uri, args.artifacts)


def command_gate(args) -> str:
    import json as jsonlib

    from tasks.platform.errors import BadInput

    path = Path(args.report)
    try:
        report = jsonlib.loads(path.read_text())
        decision, checks = report["decision"], report["checks"]
    except FileNotFoundError:
        raise BadInput(f"gate report {path}: not found") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise BadInput(f"gate report {path}: not a gate report ({type(exc).__name__}: {exc})") from None
    lines = [f"gate: {decision} {report['model']} v{report['candidate_version']} ({path})"]
    lines += [
        f"  {'pass' if c['passed'] else 'FAIL'}  {c['name']}: {c['value']} {c['comparison']} {c['threshold']}"
        for c in checks
    ]
    if decision != "promote":
        failed = "; ".join(c["name"] for c in checks if not c["passed"])
        raise Rejected("\n".join(lines), f"gate rejected {report['model']} v{report['candidate_version']}: {failed}")
    return "\n".join(lines)


def command_stack(args) -> str | None:
    from tasks.platform.local_stack import Stack

    stack = Stack(Path(os.environ["LLMOPS_HOME"]))
    if args.action == "up":
        state = stack.up(
            {
                "prefect": args.prefect_port,
                "mlflow": args.mlflow_port,
                "s3": args.s3_port,
                "postgres": args.postgres_port,
            },
            say=lambda line: print(line, flush=True),
            db=args.db,
        )
        env = stack.client_env(state)
        return "\n".join(
            [
                f"Prefect UI:  {env['PREFECT_API_URL'].removesuffix('/api')}",
                f"MLflow UI:   {env['MLFLOW_TRACKING_URI']}",
                f"S3:          {env['AWS_ENDPOINT_URL']}",
                f"database:    {state['db']}"
                + (f" (PostgreSQL on 127.0.0.1:{state['ports']['postgres']})" if state["db"] == "postgres" else ""),
                'use it:      eval "$(llmops stack env)"; llmops deploy',
            ]
        )
    if args.action == "down":
        stack.down(say=lambda line: print(line, flush=True))
        return None
    if args.action == "env":
        import shlex

        from tasks.platform.local_stack import require_running

        return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in require_running(stack.home).items())
    rows = stack.status()
    if not rows:
        return f"stack: not started (state folder {stack.root}); run `llmops stack up`"
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in rows[0]}
    lines = ["  ".join(k.ljust(widths[k]) for k in rows[0])]
    lines += ["  ".join(str(r[k]).ljust(widths[k]) for k in r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def prefect_api_env() -> dict:
    """PREFECT_API_URL from the environment, else the local stack's; a clear error without either."""
    if os.environ.get("PREFECT_API_URL"):
        return {}
    from tasks.platform.local_stack import require_running

    return require_running(Path(os.environ["LLMOPS_HOME"]))


def command_deploy(args) -> str:
    from flows.deploy import deploy

    os.environ.update(prefect_api_env())
    return deploy(args.gpu_pool, say=lambda line: print(line, flush=True))


def command_data(args) -> str:
    if args.action == "validate":
        return validate_data(args)
    from flows.deploy import push_data

    os.environ.update(prefect_api_env())
    return push_data(args.source, args.destination)


def validate_data(args) -> str:
    from tasks.data.records import read_data
    from tasks.platform.config import load_profile

    overrides = [f"data.eval_source={args.eval_source}"] if args.eval_source else []
    overrides += [f"data.format={args.format}"] if args.format else []
    cfg = load_profile(args.profile, overrides, args.source).data
    data = read_data(cfg)
    stats = data.stats
    lines = [
        f"data {cfg.source}: valid ({cfg.format} format)",
        f"  records read           {stats['records_read']}",
        f"  duplicates dropped     {stats['duplicates_dropped']}",
        f"  empty answers dropped  {stats['empty_answers_dropped']}",
        f"  train / eval           {stats['train_records']} / {stats['eval_records']}"
        + (
            f"  (eval: data.eval_source {cfg.eval_source}, {stats['eval_overlap_dropped']} overlapping records "
            "left out of training)"
            if cfg.eval_source
            else f"  (data.eval_fraction {cfg.eval_fraction})"
        ),
        f"  fingerprint            {data.fingerprint}",
    ]
    return "\n".join(lines)


def command_profiles(args) -> None:
    from tasks.platform.config import available_profiles, describe_profile, load_profile

    if args.action == "list":
        for name in available_profiles():
            profile = load_profile(name)
            print(f"{name:28} {profile.hardware.accelerator:5} {profile.description}")
    elif args.action == "show":
        print(describe_profile(load_profile(args.profile, args.overrides)), end="")
    else:
        profile = load_profile(args.profile, args.overrides)
        print(f"profile {profile.name}: valid (digest {profile.digest[:12]})")


def stop_prefect_services() -> None:
    """Flush Prefect's log/event queues and stop its temporary API server now, not at interpreter
    exit, so that nothing Prefect prints comes after our last line."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)
    server_module = sys.modules.get("prefect.server.api.server")  # importing it costs seconds: only if Prefect did
    for server in list(server_module.SubprocessASGIServer._instances.values()) if server_module else []:
        server.stop()


def describe_failure(exc: BaseException) -> tuple[int, str]:
    from tasks.platform.errors import LlmopsError, is_transient

    if isinstance(exc, LlmopsError):
        return exc.exit_code, str(exc)
    if is_transient(exc):
        return 4, f"unreachable after retries: {type(exc).__name__}: {exc}"
    return 1, f"{type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prepare_environment(Path(os.environ.get("LLMOPS_HOME", ".llmops")).resolve())
    epilogue = None
    try:
        commands = {
            "run": command_run,
            "profiles": command_profiles,
            "serve": command_serve,
            "gate": command_gate,
            "stack": command_stack,
            "deploy": command_deploy,
            "data": command_data,
        }
        epilogue = commands[args.command](args)
        code, message = 0, None
    except KeyboardInterrupt:
        code, message = 130, "interrupted"
    except Rejected as exc:
        code, message, epilogue = exc.exit_code, str(exc), exc.table
    except Exception as exc:
        code, message = describe_failure(exc)
    stop_prefect_services()
    while RUN_SERVICES:
        RUN_SERVICES.pop().stop()
    if epilogue and code in (0, Rejected.exit_code):
        print(epilogue)
    sys.stdout.flush()
    if message:
        print(f"llmops: {'rejected' if code == Rejected.exit_code else 'error'}: {message}", file=sys.stderr)
    return code


def entry() -> None:
    """The `llmops` console command: main(), then a quick exit. The interpreter's teardown of what a run
    imports (torch, transformers, MLflow, Prefect) takes about a second on its own, a tenth of a cached
    rerun; what must happen at exit (the atexit hooks, flushed streams, closed log handlers) is done
    first, then the process ends without the teardown."""
    code = main()
    atexit._run_exitfuncs()  # CPython's exit hooks, now rather than during teardown
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
